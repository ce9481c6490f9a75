"""Our server beside its peers on the same checkpoint and the same load, one server at a time, in one run.

The servers, each started here on 127.0.0.1 and stopped before the next one starts:

- llama.cpp: `llama-server --parallel C --cont-batching -t 1 -c C*S` (C clients, S positions a slot: 128, or
  the load's longest prompt and max_tokens where that is more) on a GGUF (f32) of the same checkpoint;
- transformers: `transformers serve` (the pinned transformers; `accelerate` loads it on the CPU), without
  continuous batching: its paged cache reads a global `num_key_value_heads`, which Gemma-4's per-layer
  config does not have, so it cannot load this model (every request fails);
- ours: `neuron-moe serve` with `--ours-args` (default `--backend static --batch-size 8 --threads 1`, and
  `--max-cache-len` the load's longest request where the port's [static] max_cache_len is shorter; given
  arguments whose cache is too short are refused with the flag to add).

The load is `bench/serve_load.py`'s (its clients, request loop and metrics), sending streamed text
completions (`/v1/completions`, the prompt as is, greedy) of the same prompts to each: serve_load's 8 short
prompts (6-23 tokens; today's load: 8 clients x 8 requests of 32 tokens), or with `--prompt-tokens N` a
distinct prompt of about N tokens for every request and warm-up (a numbered window of serve_load's long
passage, then one of its prompts; at most N tokens of the port's tokenizer, BOS counted, a word short at
most), so that no request finds its prompt in a cache. The second load: 32 clients, ~256-token prompts,
128 output tokens (our cache then 383 positions, llama.cpp's 384 a slot). The texts are
compared with transformers' own greedy generation of the same prompts (`generate`, in this process):
"identical n/N" counts the requests whose streamed text equals it. A peer that is not there (no
`--llama-server`, no GGUF, `transformers serve` not installed) is a skipped row with the reason.

Then the gap to llama.cpp, in parts: our graph time per decode step at the batch size (`bench/static_steps.py`,
run here with `--steps-args`; with `--prompt-tokens`, its prefill call is of one prefill chunk, what each call
of a long prompt carries, and its decode graph over the port's [static] cache, not our server's longer one),
our server's step as it measures it (`vllm:time_per_output_token_seconds` on its /metrics: the gap between a
request's tokens, the graph call and the engine's host work), and what the clients see on top of that (the
streamed inter-token gap, TPOT: HTTP, SSE framing and the event loop).

Building llama-server (once; outside the repository, nothing of it committed) from the llama.cpp that the
PyPI package llama-cpp-python 0.3.36 vendors, and writing the GGUF with the converter it vendors
(`bench/build_llama_server.sh DIR` runs these):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d DIR
    tar xzf DIR/llama_cpp_python-0.3.36.tar.gz -C DIR
    cmake -S DIR/llama_cpp_python-0.3.36/vendor/llama.cpp -B DIR/build -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF
    nice -n 19 cmake --build DIR/build --config Release --target llama-server -j2
    python bench/peers.py --write-gguf DIR/tiny.gguf --llama-cpp-src DIR/llama_cpp_python-0.3.36/vendor/llama.cpp

The converter writes Gemma-4 with its own vocabulary type (`gemma4`, SentencePiece-like); the tiny port's
tokenizer is a byte-level BPE, so `--write-gguf` runs the converter with the vocabulary written as `gpt2`
and the pre-tokenizer `refact` (single digits, then GPT-2's split: what the port's tokenizer.json does).
The bench's extra (`pip install -e ".[bench]"`) brings `accelerate` for `transformers serve`.

    OMP_NUM_THREADS=1 python -m bench.peers --llama-server DIR/build/bin/llama-server --gguf DIR/tiny.gguf \\
        --json bench/results/peers-cpu.json
    OMP_NUM_THREADS=1 python -m bench.peers --llama-server DIR/build/bin/llama-server --gguf DIR/tiny.gguf \
        --clients 32 --prompt-tokens 256 --max-tokens 128 --json bench/results/peers-cpu-long-N.json
    python -m bench.peers --only ours --ours-args "--backend static --batch-size 8 --threads 1 --no-compile"
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness import machine, uptime
from bench.serve_load import LONG_TEXT, PROMPTS, engine_counters, run_load, start_server, summarize
from neuron_moe.port import load_port
from neuron_moe.report import check_output, table, write_json
from neuron_moe.tokenizer import load_tokenizer

SERVERS = ("llama.cpp", "transformers", "ours")
OURS_ARGS = "--backend static --batch-size 8 --threads 1"
STEPS_ARGS = "--batch-sizes 8 --max-tokens {max_tokens} --prompt-tokens {prompt_tokens}"
SLOT_POSITIONS = 128  # llama-server's context per slot at least: today's load's (-c 1024 at 8 clients)
TRANSFORMERS_NOTE = "no continuous batching: its paged cache cannot load Gemma-4 (a global num_key_value_heads)"

# Run with the converter's directory first on sys.path: Gemma-4 converted with a byte-level BPE vocabulary
CONVERT = """
import sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
import convert_hf_to_gguf
from conversion.gemma import Gemma4Model

def set_vocab(self):
    self._set_vocab_gpt2()
    self.gguf_writer.add_add_bos_token(True)

Gemma4Model.set_vocab = set_vocab
Gemma4Model.get_vocab_base_pre = lambda self, tokenizer: "refact"
convert_hf_to_gguf.main()
"""


class Skipped(Exception):
    """A peer that cannot run here; its message is the reason the table gives."""


class BadLoad(Exception):
    """A load that cannot be run as asked; its message is the one error line."""


def long_prompts(tokenizer, tokens: int, count: int) -> list[str]:
    """`count` distinct prompts of at most `tokens` tokens each, a word short at most (the port's tokenizer,
    its BOS counted: what /v1/completions feeds the model): each a numbered passage of serve_load's long
    text, from its own word on, then one of serve_load's prompts. Numbered from their first words, no two
    share a prefix cache block."""
    words = LONG_TEXT.split()
    out = []
    for i in range(count):
        body = [words[(i + j) % len(words)] for j in range(tokens)]  # every word is a token at least

        def text(k: int, i=i, body=body) -> str:
            return " ".join([f"Passage {i + 1}:", *body[:k], PROMPTS[i % len(PROMPTS)]])

        if len(tokenizer.encode(text(0))) > tokens:
            raise BadLoad(f"--prompt-tokens {tokens}: shorter than the prompts' own words ({text(0)!r})")
        lo, hi = 0, tokens  # text(lo) fits, text(hi) does not: the most words that fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if len(tokenizer.encode(text(mid))) <= tokens else (lo, mid)
        out.append(text(lo))
    return out


def load_prompts(args, tokenizer) -> tuple[list[str], list[str] | None]:
    """The load's prompts: (client c's r-th request's at c * requests + r, the warm-ups' or None). Without
    --prompt-tokens serve_load's 8 short prompts (today's load); with it, a distinct prompt for every
    request and warm-up, so that no request finds its prompt cached."""
    if args.prompt_tokens is None:
        return PROMPTS, None
    n = args.clients * args.requests
    prompts = long_prompts(tokenizer, args.prompt_tokens, n + args.clients)
    return prompts[:n], prompts[n:]


def cache_positions(args, port, longest: int) -> int:
    """The KV positions the load's longest request takes (a prompt of n tokens and max_tokens new ones
    write positions 0..n + max_tokens - 2, and every server's context counts n + max_tokens tokens);
    BadLoad past the model's max_position_embeddings."""
    need = longest + args.max_tokens - 1
    if need + 1 > port.config.max_position_embeddings:
        raise BadLoad(
            f"prompts of up to {longest} tokens and --max-tokens {args.max_tokens} take {need + 1} positions, "
            f"past the model's max_position_embeddings {port.config.max_position_embeddings}"
        )
    return need


def ours_args(args, port, need: int) -> str:
    """--ours-args, or by default OURS_ARGS with `--max-cache-len need` where the port's cache is shorter;
    BadLoad when the given arguments' cache (theirs, else the port's) cannot take the load."""
    if args.ours_args is None:
        spec = port.static_spec("bench/peers.py")
        return OURS_ARGS + (f" --max-cache-len {need}" if need > spec.max_cache_len else "")
    serve = argparse.ArgumentParser(add_help=False)
    serve.add_argument("--max-cache-len", type=int)
    have = serve.parse_known_args(shlex.split(args.ours_args))[0].max_cache_len
    have = have or port.static_spec("bench/peers.py").max_cache_len
    if have < need:
        raise BadLoad(
            f"the load takes {need} cache positions, ours has {have}: add --max-cache-len {need} to --ours-args"
        )
    return args.ours_args


def size_load(args, port) -> None:
    """The load's prompts (args.prompts, args.warmup) and every server sized to them: llama-server's
    positions a slot, our serve's arguments (--max-cache-len where needed), bench.static_steps's."""
    tokenizer = load_tokenizer(port, None)
    args.prompts, args.warmup = load_prompts(args, tokenizer)
    args.longest = max(len(tokenizer.encode(p)) for p in [*args.prompts, *(args.warmup or [])])
    need = cache_positions(args, port, args.longest)
    args.slot_positions = max(SLOT_POSITIONS, need + 1)
    if "ours" in args.only:
        args.ours_args = ours_args(args, port, need)
    if args.steps_args is None:  # a long prompt's prefill calls carry a chunk each
        steps_prompt = 14 if args.prompt_tokens is None else port.static_spec("bench/peers.py").chunk
        args.steps_args = STEPS_ARGS.format(max_tokens=args.max_tokens, prompt_tokens=steps_prompt)


def completion_body(args, prompt: str) -> tuple[str, dict]:
    """A streamed greedy text completion of `prompt`: (path, body), the same for every server."""
    return "/v1/completions", {
        "model": args.served,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, path: str, timeout_s: float, log: Path) -> None:
    """Until GET url+path answers 200; Skipped (with the log's tail) if the process exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise Skipped(f"exited {proc.returncode} before it was ready: {' | '.join(tail)}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise Skipped(f"not ready within {timeout_s:.0f} s")


def start_logged(cmd: list[str], env: dict | None, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60)


def llama_cmd(args, port: int) -> list[str]:
    return [
        str(args.llama_server),
        "-m",
        str(args.gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(args.clients),
        "--cont-batching",
        "-t",
        str(args.threads),
        "-c",
        str(args.clients * args.slot_positions),  # each slot's: its prompt and max_tokens fit
        "--no-webui",
    ]


def start_llama(args, log: Path):
    if not args.llama_server:
        raise Skipped("no --llama-server given (see the module docstring to build one)")
    if not Path(args.llama_server).is_file():
        raise Skipped(f"--llama-server {args.llama_server}: no such file")
    if not args.gguf or not Path(args.gguf).is_file():
        raise Skipped(f"--gguf {args.gguf}: no such file (--write-gguf writes one)")
    port = free_port()
    cmd = llama_cmd(args, port)
    proc = start_logged(cmd, None, log)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, "/health", 300, log)
    return proc, url, cmd


def start_transformers(args, log: Path):
    exe = Path(sys.executable).parent / "transformers"
    for module in ("transformers.cli.serve", "fastapi", "uvicorn", "openai", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise Skipped(f"transformers serve not installed here ({module} missing: pip install -e '.[bench]')")
    if not exe.is_file():
        raise Skipped(f"transformers serve not installed here (no {exe})")
    port = free_port()
    cmd = [str(exe), "serve", str(args.checkpoint), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = start_logged(cmd, env, log)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, "/health", 300, log)
    return proc, url, cmd


def start_ours(args, log: Path):
    ns = argparse.Namespace(
        model=args.model, backend="static", clients=args.clients, hostile_bytes=0, prefill_rows=None, prefill_chunk=None
    )
    extra = shlex.split(args.ours_args)
    proc, url = start_server(ns, None, extra)
    return proc, url, ["neuron-moe", "serve", "--model", args.model, *extra]


def served_name(args, server: str) -> str:
    return {"llama.cpp": "tiny", "transformers": str(args.checkpoint), "ours": args.served}[server]


def run_server(server: str, args, log_dir: Path) -> dict:
    """The load against one server, started here and stopped after; a skipped row if it cannot run."""
    log = log_dir / f"{server}.log"
    row = {"server": server}
    try:
        proc, url, cmd = {"llama.cpp": start_llama, "transformers": start_transformers, "ours": start_ours}[server](
            args, log
        )
    except Skipped as e:
        return {**row, "skipped": str(e)}
    except SystemExit as e:  # serve_load.start_server's way of saying the server did not start
        return {**row, "skipped": str(e)}
    try:
        print(f"== {server}: {shlex.join(cmd)}", flush=True)
        load = argparse.Namespace(
            served=served_name(args, server),
            clients=args.clients,
            requests=args.requests,
            max_tokens=args.max_tokens,
            sampled=False,
            long_every=0,
            api_key=None,
        )
        before = os.getloadavg()
        # transformers serve ends its stream after the usage chunk, without [DONE]
        results, duration = asyncio.run(
            run_load(url, load, completion_body, server != "transformers", args.prompts, args.warmup)
        )
        row.update(
            command=shlex.join(cmd),
            load_average_before=before,
            load_average_after=os.getloadavg(),
            **summarize(results, duration),
            texts=[{"prompt": r["prompt"], "text": r.get("text")} for r in results],
        )
        if server == "ours":
            row["engine"] = engine_counters(url)
            row["server_step_ms"] = server_step_ms(url)
        if server == "transformers":
            row["note"] = TRANSFORMERS_NOTE
    finally:
        stop(proc)
    return row


def server_step_ms(url: str) -> float | None:
    """The mean gap between a request's tokens as our server measures it (admission of a token to the next)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    found = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("vllm:time_per_output_token_seconds_")
    }
    count, total = (
        found.get("vllm:time_per_output_token_seconds_count"),
        found.get("vllm:time_per_output_token_seconds_sum"),
    )
    return 1000 * total / count if count else None


def reference_texts(args) -> dict[str, str]:
    """transformers' greedy continuation of each prompt (eager, float32, this process): the texts to match."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    texts = {}
    with torch.inference_mode():
        for prompt in dict.fromkeys(args.prompts):
            ids = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=args.max_tokens, do_sample=False)
            texts[prompt] = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    return texts


def compare_texts(row: dict, reference: dict[str, str]) -> dict:
    """How many of the row's requests streamed the reference text of their prompt; the first that did not."""
    texts = row.get("texts") or []
    same = [t for t in texts if t["text"] == reference.get(t["prompt"])]
    differs = next((t for t in texts if t["text"] != reference.get(t["prompt"])), None)
    return {
        "identical": len(same),
        "of": len(texts),
        "first_difference": differs and {**differs, "reference": reference.get(differs["prompt"])},
    }


def graph_step_ms(args) -> dict | None:
    """Our decode graph's time per step (and prefill) from bench/static_steps.py at the batch size, run here."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        cmd = [sys.executable, "-m", "bench.static_steps", *shlex.split(args.steps_args), "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        if done.returncode != 0 or not out.exists():
            print(f"bench.static_steps failed ({done.returncode}): {done.stderr.strip()[-300:]}", file=sys.stderr)
            return None
        import json

        rows = json.loads(out.read_text())["rows"]
        last = rows[-1]
        return {"command": shlex.join(cmd[1:]), "batch": last["batch"], **last}


def gap(rows: dict[str, dict], steps: dict | None) -> list[dict]:
    """The gap to llama.cpp per output token of one request, in parts where measured: our decode graph step,
    the prefill calls between steps (their count x static_steps' prefill call / decode calls), our engine's
    host work (the server's step less both), what HTTP/streaming adds (client TPOT - server step)."""
    llama, ours = rows.get("llama.cpp"), rows.get("ours")
    if not llama or not ours or "skipped" in llama or "skipped" in ours:
        return []
    lt, ot = llama["tpot_ms"]["mean"], ours["tpot_ms"]["mean"]
    server = ours.get("server_step_ms")
    graph = steps["decode_ms"] if steps else None
    engine = ours.get("engine") or {}
    decode_calls, prefill_calls = (
        engine.get("neuron_moe:decode_calls_total"),
        engine.get("neuron_moe:prefill_calls_total"),
    )
    # other rows' prefill calls fall between a row's decode steps: their graph time, spread over the steps
    prefill = prefill_calls * steps["prefill_ms"] / decode_calls if steps and decode_calls and prefill_calls else 0.0
    host = server - graph - prefill if server and graph else None
    parts = [
        {"part": "client TPOT, mean (ms)", "ours": ot, "llama.cpp": lt, "gap": ot - lt},
        {"part": "  our graph: decode step at the batch size", "ours": graph},
        {"part": "  our graph: prefill calls between steps", "ours": prefill if graph else None},
        {"part": "  our host work: server step - graphs", "ours": host},
        {"part": "  HTTP/streaming: client TPOT - server step", "ours": ot - server if server else None},
        {
            "part": "TTFT p50 (ms)",
            "ours": ours["ttft_ms"]["p50"],
            "llama.cpp": llama["ttft_ms"]["p50"],
            "gap": ours["ttft_ms"]["p50"] - llama["ttft_ms"]["p50"],
        },
        {"part": "  our prefill graph (one call)", "ours": steps.get("prefill_ms") if steps else None},
    ]
    return parts


def summary_rows(rows: list[dict]) -> list[dict]:
    """One line per server for the table; a skipped server says why."""
    out = []
    for r in rows:
        if "skipped" in r:
            out.append({"server": r["server"], "note": f"skipped: {r['skipped']}"})
            continue
        texts = r.get("texts_match") or {}
        out.append(
            {
                "server": r["server"],
                "tok_s": r["output_token_throughput_per_s"],
                "ttft50": r["ttft_ms"]["p50"],
                "ttft99": r["ttft_ms"]["p99"],
                "itl50": r["itl_ms"]["p50"],
                "itl99": r["itl_ms"]["p99"],
                "tpot": r["tpot_ms"]["mean"],
                "ok": f"{r['completed']}/{r['requests']}",
                "same": f"{texts['identical']}/{texts['of']}" if texts else "-",
                "note": r.get("note", ""),
            }
        )
    return out


SUMMARY_COLUMNS = [
    ("server", "server"),
    ("tok_s", "output tok/s", "{:.1f}"),
    ("ttft50", "TTFT p50 ms", "{:.1f}"),
    ("ttft99", "TTFT p99 ms", "{:.1f}"),
    ("itl50", "ITL p50 ms", "{:.2f}"),
    ("itl99", "ITL p99 ms", "{:.2f}"),
    ("tpot", "TPOT mean ms", "{:.2f}"),
    ("ok", "completed"),
    ("same", "texts identical"),
    ("note", "note"),
]
GAP_COLUMNS = [
    ("part", "per output token"),
    ("ours", "ours", "{:.2f}"),
    ("llama.cpp", "llama.cpp", "{:.2f}"),
    ("gap", "gap", "{:.2f}"),
]


def render(report: dict, markdown: bool = False) -> str:
    lines = [table(summary_rows(report["runs"]), SUMMARY_COLUMNS, markdown=markdown)]
    if report.get("gap"):
        lines += ["", table(report["gap"], GAP_COLUMNS, markdown=markdown)]
    return "\n".join(lines)


def write_gguf(args) -> int:
    """The port's checkpoint as an f32 GGUF through the converter llama.cpp vendors (see the docstring)."""
    src = Path(args.llama_cpp_src or "")
    if not (src / "convert_hf_to_gguf.py").is_file():
        print(f"error: --llama-cpp-src {args.llama_cpp_src}: no convert_hf_to_gguf.py there", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-c", CONVERT, str(src), str(args.checkpoint), "--outtype", "f32"]
    return subprocess.run([*cmd, "--outfile", str(args.write_gguf)]).returncode


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-gemma4-moe", help="the port (its checkpoint is what every server loads)")
    p.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary (none: skipped)")
    p.add_argument("--gguf", metavar="PATH", help="the port's checkpoint as GGUF, for llama-server")
    p.add_argument("--write-gguf", metavar="PATH", help="write that GGUF with --llama-cpp-src's converter, and exit")
    p.add_argument("--llama-cpp-src", metavar="DIR", help="llama.cpp's source (the sdist's vendor/llama.cpp)")
    p.add_argument(
        "--ours-args",
        help=f"our serve's arguments (default: {OURS_ARGS!r}, and --max-cache-len the load's longest request "
        "where the port's cache is shorter)",
    )
    p.add_argument(
        "--steps-args",
        help="bench.static_steps's arguments for the graph part of the gap ('' to skip; default: "
        f"{STEPS_ARGS.format(max_tokens='M', prompt_tokens='P')!r}, M --max-tokens, P 14, or with "
        "--prompt-tokens the port's prefill chunk)",
    )
    p.add_argument("--only", nargs="+", choices=SERVERS, default=list(SERVERS), help="run only these servers")
    p.add_argument("--threads", type=int, default=1, help="the peers' threads (llama-server -t, OMP_NUM_THREADS)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=8, help="requests per client (default 8)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--prompt-tokens",
        type=int,
        metavar="N",
        help="a distinct prompt of about N tokens for every request (default: serve_load's 8 short prompts)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    port = load_port(args.model)
    if port.checkpoint is None:
        print(f"error: --model {args.model}: the port has no checkpoint to give the peers", file=sys.stderr)
        return 2
    args.checkpoint, args.served = port.checkpoint, port.name
    if args.write_gguf:
        return write_gguf(args)
    if args.json:
        check_output(args.json)
    try:
        size_load(args, port)
    except BadLoad as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    host = machine()
    reference = reference_texts(args)
    runs = []
    with tempfile.TemporaryDirectory() as logs:
        for server in SERVERS:
            if server in args.only:
                runs.append(run_server(server, args, Path(logs)))
    for r in runs:
        if "texts" in r:
            r["texts_match"] = compare_texts(r, reference)
    steps = graph_step_ms(args) if args.steps_args and "ours" in args.only else None
    by_name = {r["server"]: r for r in runs}
    report = {
        "benchmark": "peers",
        "command": shlex.join(["python", "-m", "bench.peers", *(argv if argv is not None else sys.argv[1:])]),
        "model": port.name,
        "load": {
            "clients": args.clients,
            "requests_per_client": args.requests,
            "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens,
            "longest_prompt_tokens": args.longest,
        },
        "machine": {**host, "uptime_after": uptime()},
        "reference": {"what": "transformers generate, greedy, float32", "texts": reference},
        "graph_steps": steps,
        "runs": runs,
        "gap": gap(by_name, steps),
    }
    if args.json:
        write_json(report, args.json)
    prompts = "serve_load's prompts" if args.prompt_tokens is None else f"prompts of ~{args.prompt_tokens} tokens"
    print(
        f"\npeers  {port.name}, {args.clients} clients x {args.requests} streamed /v1/completions of "
        f"{args.max_tokens} tokens, {prompts}, greedy; one server at a time"
    )
    print(f"machine: {host['cpu']}, {host['cores']} cores; {host['uptime']}; {host['code']}\n")
    print(render(report))
    for r in runs:
        diff = (r.get("texts_match") or {}).get("first_difference")
        if diff:
            print(f"\n{r['server']}: first text unlike transformers': {diff}")
    return 0 if all(r.get("failed", 0) == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
