"""bench/peers.py without any server or build: the table and the gap on canned runs, the text comparison,
a peer that is not there as a skipped row (never a crash), and the load generator's reading of a streamed
text completion (serve_load.one_request over an in-memory transport)."""

import argparse
import asyncio
import importlib.util

import httpx
import pytest

from bench import peers
from bench.serve_load import PROMPTS, one_request
from neuron_moe.port import load_port
from neuron_moe.tokenizer import load_tokenizer


def run(server, tpot, ttft50, tok_s, texts, **extra):
    stats = lambda v: {"mean": v, "p50": v, "p90": v, "p99": 2 * v, "n": 8}  # noqa: E731
    return {
        "server": server,
        "output_token_throughput_per_s": tok_s,
        "ttft_ms": {**stats(ttft50), "p50": ttft50},
        "itl_ms": stats(tpot),
        "tpot_ms": stats(tpot),
        "completed": len(texts),
        "requests": len(texts),
        "failed": 0,
        "texts": texts,
        **extra,
    }


REFERENCE = {"a": " one two", "b": " three"}
SAME = [{"prompt": "a", "text": " one two"}, {"prompt": "b", "text": " three"}]


def test_texts_compared_per_request_with_the_reference():
    other = [{"prompt": "a", "text": " one two"}, {"prompt": "b", "text": " four"}]
    assert peers.compare_texts({"texts": SAME}, REFERENCE) == {"identical": 2, "of": 2, "first_difference": None}
    got = peers.compare_texts({"texts": other}, REFERENCE)
    assert (got["identical"], got["of"]) == (1, 2)
    assert got["first_difference"] == {"prompt": "b", "text": " four", "reference": " three"}


def test_table_has_each_server_and_a_skipped_one_says_why():
    runs = [
        run("llama.cpp", 2.0, 7.0, 3000.0, SAME),
        {"server": "transformers", "skipped": "transformers serve not installed here"},
        run("ours", 12.0, 22.0, 600.0, SAME[:1] + [{"prompt": "b", "text": "x"}], server_step_ms=10.0),
    ]
    for r in runs:
        if "texts" in r:
            r["texts_match"] = peers.compare_texts(r, REFERENCE)
    report = {"runs": runs, "gap": peers.gap({r["server"]: r for r in runs}, {"decode_ms": 7.5, "prefill_ms": 16.0})}
    text = peers.render(report)
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert "3000.0" in lines["llama.cpp"] and "2/2" in lines["llama.cpp"]
    assert "skipped: transformers serve not installed here" in lines["transformers"]
    assert "600.0" in lines["ours"] and "1/2" in lines["ours"]
    assert any(line.startswith("| ours") for line in peers.render(report, markdown=True).splitlines())


def test_gap_parts_add_up_to_our_client_tpot():
    by = {"llama.cpp": run("llama.cpp", 2.0, 7.0, 3000.0, SAME), "ours": run("ours", 12.0, 22.0, 600.0, SAME)}
    by["ours"]["server_step_ms"] = 10.0
    by["ours"]["engine"] = {"neuron_moe:decode_calls_total": 64.0, "neuron_moe:prefill_calls_total": 2.0}
    parts = {p["part"].strip(): p for p in peers.gap(by, {"decode_ms": 7.5, "prefill_ms": 16.0})}
    tpot = parts["client TPOT, mean (ms)"]
    assert (tpot["ours"], tpot["llama.cpp"], tpot["gap"]) == (12.0, 2.0, 10.0)
    graph = parts["our graph: decode step at the batch size"]["ours"]
    prefill = parts["our graph: prefill calls between steps"]["ours"]
    host = parts["our host work: server step - graphs"]["ours"]
    http = parts["HTTP/streaming: client TPOT - server step"]["ours"]
    assert (graph, prefill, host, http) == (7.5, 0.5, 2.0, 2.0) and graph + prefill + host + http == tpot["ours"]
    assert parts["TTFT p50 (ms)"]["gap"] == 15.0
    # a peer skipped: no gap to state
    assert peers.gap({"llama.cpp": {"server": "llama.cpp", "skipped": "x"}, "ours": by["ours"]}, None) == []


def args(**kw):
    base = dict(
        llama_server=None, gguf=None, clients=8, threads=1, checkpoint="ports/tiny-gemma4-moe", slot_positions=128
    )
    return argparse.Namespace(**{**base, **kw})


def load_args(**kw):
    base = dict(clients=8, requests=8, max_tokens=32, prompt_tokens=None, only=list(peers.SERVERS))
    return args(**{**base, "ours_args": None, "steps_args": None, **kw})


TINY = load_port("tiny-gemma4-moe")


def test_long_prompts_are_distinct_and_about_n_tokens_each():
    tokenizer = load_tokenizer(TINY, None)
    prompts = peers.long_prompts(tokenizer, 256, 40)
    ids = [tokenizer.encode(p) for p in prompts]
    # whole words up to N tokens (BOS counted): short of N by less than one word (at most 5 tokens here)
    assert all(256 - 5 <= len(i) <= 256 for i in ids), sorted(len(i) for i in ids)
    assert len({tuple(i[:16]) for i in ids}) == 40  # distinct from their first prefix-cache block on


def test_second_load_sizes_every_server_and_gives_distinct_warm_ups():
    today = load_args()
    peers.size_load(today, TINY)
    assert today.prompts == PROMPTS and today.warmup is None
    assert peers.llama_cmd(today, 1)[peers.llama_cmd(today, 1).index("-c") + 1] == "1024"  # today's command
    assert today.ours_args == peers.OURS_ARGS  # serve_load's prompts and 32 tokens fit the port's 96 positions
    assert today.steps_args == "--batch-sizes 8 --max-tokens 32 --prompt-tokens 14"

    load = load_args(clients=4, requests=2, prompt_tokens=256, max_tokens=128)
    peers.size_load(load, TINY)
    assert len(load.prompts) == 8 and len(load.warmup) == 4 and len(set(load.prompts + load.warmup)) == 12
    # the longest prompt and 128 new tokens: positions 0..longest + 126, a context of longest + 128 tokens
    assert 256 - 5 <= load.longest <= 256
    cmd = peers.llama_cmd(load, 1)
    assert cmd[cmd.index("-c") + 1] == str(4 * (load.longest + 128))
    assert load.ours_args == f"{peers.OURS_ARGS} --max-cache-len {load.longest + 127}"
    assert load.steps_args == f"--batch-sizes 8 --max-tokens 128 --prompt-tokens {TINY.static.chunk}"


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--prompt-tokens", "256", "--max-tokens", "128", "--ours-args", "--backend static --no-compile"],
            "cache positions, ours has 96: add --max-cache-len",
        ),
        (
            ["--prompt-tokens", "256", "--max-tokens", "128", "--ours-args", "--max-cache-len 300"],
            "cache positions, ours has 300: add --max-cache-len",
        ),
        (["--prompt-tokens", "500", "--max-tokens", "128"], "past the model's max_position_embeddings 512"),
        (["--prompt-tokens", "4"], "--prompt-tokens 4: shorter than the prompts' own words"),
    ],
)
def test_a_load_our_server_cannot_take_is_one_error_line(argv, message, capsys):
    assert peers.main(["--only", "ours", "--clients", "2", "--requests", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_llama_server_missing_is_a_skipped_row(tmp_path):
    row = peers.run_server("llama.cpp", args(), tmp_path)
    assert row["server"] == "llama.cpp" and "no --llama-server given" in row["skipped"]
    row = peers.run_server("llama.cpp", args(llama_server=str(tmp_path / "nope")), tmp_path)
    assert "no such file" in row["skipped"]
    exe = tmp_path / "llama-server"
    exe.write_text("")
    row = peers.run_server("llama.cpp", args(llama_server=str(exe), gguf=str(tmp_path / "x.gguf")), tmp_path)
    assert "--gguf" in row["skipped"] and "--write-gguf" in row["skipped"]


def test_transformers_serve_not_installed_is_a_skipped_row(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    row = peers.run_server("transformers", args(), tmp_path)
    assert row == {"server": "transformers", "skipped": row["skipped"]} and "accelerate missing" in row["skipped"]


def test_llama_server_command_is_the_measured_configuration():
    cmd = peers.llama_cmd(args(llama_server="/x/llama-server", gguf="/x/t.gguf"), 1234)
    joined = " ".join(cmd)
    assert joined.startswith("/x/llama-server -m /x/t.gguf")
    assert "--parallel 8" in joined and "--cont-batching" in cmd and "-t 1" in joined and "-c 1024" in joined


def sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


@pytest.mark.parametrize("done", [True, False])
def test_one_request_reads_a_streamed_text_completion(done):
    chunks = [
        '{"choices": [{"index": 0, "text": " one"}]}',
        '{"choices": [{"index": 0, "text": " two"}]}',
        '{"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 2}}',
    ] + (["[DONE]"] if done else [])
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=sse(*chunks)))

    async def go(require_done):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await one_request(client, {}, "/v1/completions", require_done)

    got = asyncio.run(go(require_done=False))
    assert got["text"] == " one two" and got["output_tokens"] == 2 and len(got["itl"]) == 1
    strict = asyncio.run(go(require_done=True))
    assert ("error" in strict) is not done


def test_write_gguf_without_the_converter_is_one_error_line(tmp_path, capsys):
    assert peers.main(["--write-gguf", str(tmp_path / "t.gguf"), "--llama-cpp-src", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --llama-cpp-src {tmp_path}: no convert_hf_to_gguf.py there"]
    assert not (tmp_path / "t.gguf").exists()
