"""`serve` in vLLM's dialect, run as `serve` runs it (server.make_app over parsed flags): served
names, --max-model-len, /tokenize, /detokenize, /version, /v1/models' max_model_len, prompts as
token ids, the start-up banner, one log line per request, and the warm-up before /health says
ready. Driven by the official `openai` client and by raw HTTP requests, as curl sends them."""

import logging
import re

import httpx
import openai
import pytest

from neuron_moe import __version__, cli
from neuron_moe.port import load_port
from neuron_moe.serve import server
from neuron_moe.serve.chat import render_chat
from neuron_moe.serve.hf_runtime import HFRuntime
from neuron_moe.static.rows import GraphRuntime
from neuron_moe.static.rows import bucket_for
from neuron_moe.tokenizer import load_tokenizer

from serving import serving, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PORT = "tiny-gemma4-moe"
PROMPT = "The capital of France is"


def app_for(*flags):
    """The app `serve` runs with these flags; the static graphs uncompiled (test_static_compiled.py compiles)."""
    return server.make_app(cli.serve_config(["serve", *flags, *(["--no-compile"] if "static" in flags else [])]))


def ready(url):
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "the model to be ready")
    return url


def client(url, key="none"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def error(response, status, param=None):
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["param"] == param, body
    return body["message"]


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    """The static graphs served under two names, the context cut to 64 tokens, behind a key."""
    app = app_for(
        "--backend", "static", "--served-model-name", "tiny", "gemma-4-mini", "--max-model-len", "64", "--api-key", "k"
    )
    with serving(app) as url:
        yield ready(url)


def test_served_names_and_max_model_len_in_v1_models(static):
    models = client(static, "k").models.list().data
    assert [m.id for m in models] == ["tiny", "gemma-4-mini"]
    assert [m.model_extra["max_model_len"] for m in models] == [64, 64]
    assert {m.model_extra["root"] for m in models} == {"tiny"}
    for name in ("tiny", "gemma-4-mini"):  # either name; responses carry the first
        got = client(static, "k").completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0)
        assert got.model == "tiny"
    with pytest.raises(openai.NotFoundError, match="this server serves 'tiny', 'gemma-4-mini'"):
        client(static, "k").completions.create(model=PORT, prompt=PROMPT, max_tokens=4)


def test_max_model_len_bounds_every_request(static):
    n = len(load_tokenizer(load_port(PORT)).encode(PROMPT))
    raw = httpx.post(
        f"{static}/v1/completions",
        headers={"Authorization": "Bearer k"},
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 64 - n + 1, "temperature": 0},
    )
    assert "this model's context is 64 tokens" in error(raw, 400, "max_tokens")
    done = client(static, "k").completions.create(model="tiny", prompt=PROMPT, temperature=0)  # no max_tokens
    assert done.usage.prompt_tokens + done.usage.completion_tokens <= 64


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--backend", "static", "--max-model-len", "98"],
            "--max-model-len 98 is more than the static graphs ([static] max_cache_len + 1) holds: 97 tokens",
        ),
        (["--max-model-len", "513"], "--max-model-len 513 is more than the model (max_position_embeddings) holds: 512"),
    ],
)
def test_max_model_len_above_the_graphs_is_refused_before_binding(capsys, flags, message):
    assert cli.main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_tokenize_and_detokenize_as_vllm(static):
    tokenizer = load_tokenizer(load_port(PORT))
    auth = {"Authorization": "Bearer k"}
    got = httpx.post(f"{static}/tokenize", json={"model": "tiny", "prompt": PROMPT}, headers=auth).json()
    assert got == {
        "count": len(tokenizer.encode(PROMPT)),
        "max_model_len": 64,
        "tokens": tokenizer.encode(PROMPT),
        "token_strs": None,
    }
    bare = httpx.post(f"{static}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}, headers=auth).json()
    assert bare["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False) == got["tokens"][1:]
    chat = [{"role": "user", "content": "hi"}]
    rendered = httpx.post(f"{static}/tokenize", json={"messages": chat}, headers=auth).json()
    assert rendered["tokens"] == render_chat(tokenizer, chat)[0]  # what /v1/chat/completions would prefill
    text = httpx.post(f"{static}/detokenize", json={"tokens": got["tokens"]}, headers=auth).json()
    assert text == {"prompt": PROMPT}
    assert "below the vocabulary size 2048" in error(
        httpx.post(f"{static}/detokenize", json={"tokens": [1, 2048]}, headers=auth), 400, "tokens"
    )
    assert "either 'prompt'" in error(
        httpx.post(f"{static}/tokenize", json={"prompt": "a", "messages": chat}, headers=auth), 400
    )
    assert httpx.post(f"{static}/tokenize", json={"prompt": "a"}).status_code == 401  # behind the key
    assert httpx.get(f"{static}/version").json()["version"] == __version__  # open, as /health


def test_prompts_as_token_ids_or_a_list_of_one(static):
    tokenizer = load_tokenizer(load_port(PORT))
    ids = tokenizer.encode(PROMPT)
    text = client(static, "k").completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    for prompt in (ids, [ids], [PROMPT]):
        same = client(static, "k").completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        assert same.choices[0].text == text.choices[0].text and same.usage.prompt_tokens == len(ids)
    auth = {"Authorization": "Bearer k"}
    for prompt, param, message in (
        ([PROMPT, PROMPT], "prompt", "one prompt per request is supported, got 2"),
        ([ids, ids], "prompt", "one prompt per request is supported, got 2"),
        ([], "prompt", "the prompt holds no token"),
        ([2, 5000], "prompt", "token id 5000 is not below the vocabulary size 2048"),
        ([2, -1], "prompt", "token ids are integers from 0, got -1"),
        ([2, True], "prompt", "token ids are integers from 0, got True"),
        ([2, "a"], "prompt", "must be a string, a list of token ids, or a list of one"),
        ({"a": 1}, "prompt", ""),
    ):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
        assert message in error(httpx.post(f"{static}/v1/completions", json=body, headers=auth), 400, param)


def test_banner_and_one_log_line_per_request(caplog):
    caplog.set_level(logging.INFO, logger="neuron_moe.serve")
    with serving(app_for("--backend", "static")) as url:
        ready(url)
        banner = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving ")]
        assert len(banner) == 1 and banner[0].startswith(
            "serving tiny-gemma4-moe as tiny-gemma4-moe: backend static, dtype float32, context 97 tokens, "
            "2 batch rows, prefill buckets 8, 24, 56; warmed up in "
        )
        caplog.clear()
        client(url).completions.create(model=PORT, prompt=PROMPT, max_tokens=5, temperature=0)
        body = {
            "model": PORT,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            list(r.iter_lines())
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    assert len(lines) == 2, lines
    pattern = (
        r"request (cmpl|chatcmpl)-[0-9a-f]{32}: prompt (\d+) tokens, completion (\d+) tokens, "
        r"TTFT (\d+\.\d{3}) s, duration (\d+\.\d{3}) s, finish (length|stop)"
    )
    (plain, stream) = [re.fullmatch(pattern, line) for line in lines]
    assert plain and stream, lines
    assert plain[1] == "cmpl" and int(plain[3]) <= 5 and stream[1] == "chatcmpl" and int(stream[3]) <= 3
    for m in (plain, stream):
        assert 0 < float(m[4]) <= float(m[5])


@pytest.mark.parametrize("backend", ["static", "eager"])
def test_warm_up_runs_every_graph_before_health_is_ready(monkeypatch, backend):
    """Static graphs: every prefill graph (each row count at each bucket) and each decode graph, then their
    logits-processing variants, then the copy graph (prefix caching is on by default), all before /health
    answers 200; transformers' model (no buckets): a decode step of every row, plain and processing."""
    calls, prefill, decode, copy = [], GraphRuntime.prefill, GraphRuntime.decode, GraphRuntime.copy_row
    monkeypatch.setattr(
        GraphRuntime,
        "prefill",
        lambda self, chunks: (
            calls.append(("prefill", len(chunks), bucket_for(max(len(c.ids) for c in chunks), self.buckets)))
            or prefill(self, chunks)
        ),
    )
    monkeypatch.setattr(
        GraphRuntime,
        "decode",
        lambda self, *inputs: calls.append(("decode", self.decode_length(inputs[1]))) or decode(self, *inputs),
    )
    variant_prefill, variant_decode = GraphRuntime.prefill_processing, GraphRuntime.decode_processing
    monkeypatch.setattr(
        GraphRuntime,
        "prefill_processing",
        lambda self, chunks: calls.append(("prefill processing", len(chunks))) or variant_prefill(self, chunks),
    )
    monkeypatch.setattr(
        GraphRuntime,
        "decode_processing",
        lambda self, *inputs: (
            calls.append(("decode processing", self.decode_length(inputs[1]))) or variant_decode(self, *inputs)
        ),
    )
    monkeypatch.setattr(GraphRuntime, "copy_row", lambda self, *rows: calls.append(("copy",)) or copy(self, *rows))
    eager = []
    for name in ("prefill", "decode", "prefill_processing", "decode_processing"):
        method = getattr(HFRuntime, name)
        monkeypatch.setattr(HFRuntime, name, lambda self, *a, _m=method, _n=name: eager.append(_n) or _m(self, *a))
    with serving(app_for("--backend", backend)) as url:
        ready(url)
        seen = list(calls), list(eager)
    if backend == "static":
        # every prefill graph (the tiny port's prefill_rows [1, 4] cut to its batch of 2, each bucket), then the
        # decode graph of each decode length (the port's 64 and 96)
        prefills = [("prefill", rows, bucket) for rows in (1, 2) for bucket in (8, 24, 56)]
        assert seen[0][:8] == prefills + [("decode", 64), ("decode", 96)]
        # (the step graphs, not counted here) and their logits-processing variants, once each, then the copy graph
        variants = [("prefill processing", rows) for _, rows, _ in prefills]
        variants += [("decode processing", n) for n in (64, 96)]
        assert seen[0][8:] == variants + [("copy",)]
    else:
        assert seen == ([], ["decode", "decode_processing"])
