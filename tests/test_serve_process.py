"""`neuron-moe serve` as a command: what fails before the socket is bound, where artifacts
come from (a directory, or s3:// through neuron_moe.publish.s3.pull), and the container
entrypoint run for real — serving on loopback, then draining a stream on SIGTERM."""

import importlib.util
import json
import os
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from neuron_moe import cli
from neuron_moe.checkpoint import save_checkpoint
from neuron_moe.errors import UserError
from neuron_moe.model import build_model
from neuron_moe.neuron import compile as compile_
from neuron_moe.neuron.artifact import FORMAT, TARGET
from neuron_moe.port import load_port
from neuron_moe.serve import neuron
from neuron_moe.serve.backends import BACKENDS, load_engine
from neuron_moe.serve.decoding import SamplingParams
from neuron_moe.serve.server import ServeError, plan_load

from conftest import port_text_elsewhere, reseeded
from dockerfile import DOCKER, final_stage
from serving import server_process, sse_events

REPO = Path(__file__).resolve().parents[1]


def manifest_dir(tmp_path):
    d = tmp_path / "compiled"
    d.mkdir()
    (d / "manifest.json").write_text(
        json.dumps(
            {
                "format": FORMAT,
                "port": "tiny-gemma4-moe",
                "dtype": "bfloat16",
                "quantization": "none",
                "quantized_layers": ["experts"],
                "tp": 1,
                "expert_layout": "channel",
                "buckets": [64],
                "max_cache_len": 128,
                "batch_size": 1,
                "prefill_rows": [1],
                "prefill_chunk": 64,
                "candidates": 256,
                "target": TARGET,
                "dry_run": False,
                "logits": False,
                "tokenizer": {"kind": "checkpoint", "files": []},
                "files": {},
            }
        )
    )
    return d


@pytest.mark.parametrize(
    "args,message",
    [
        (["--backend", "neuron"], "--backend neuron needs --artifacts"),
        (["--backend", "neuron", "--artifacts", "{tmp}"], "no manifest.json"),
        (
            ["--backend", "neuron", "--artifacts", "{compiled}", "--max-running", "2"],
            "--backend neuron batches: it runs as many requests at once as its graphs have rows; --max-running is for",
        ),
        (
            ["--backend", "neuron", "--artifacts", "{compiled}", "--batch-size", "2"],
            "takes its shapes from the artifact",
        ),
        (
            ["--backend", "neuron", "--artifacts", "{compiled}", "--prefill-rows", "1", "4"],
            "--prefill-rows shapes --backend static's graphs; --backend neuron takes its shapes from the artifact",
        ),
        (
            ["--backend", "static", "--prefill-chunk", "20"],
            "--prefill-chunk 20 is not one of the port's buckets [8, 24, 56]",
        ),
        (["--backend", "static", "--max-running", "2"], "its graphs have rows (--batch-size); --max-running is for"),
        (
            ["--max-cache-len", "200"],
            "--max-cache-len shapes --backend static's graphs; --backend eager runs transformers' model",
        ),
        (["--backend", "static", "--max-cache-len", "600"], "exceeds the model's max_position_embeddings 512"),
        (
            ["--backend", "static", "--max-cache-len", "200", "--max-model-len", "202"],
            "--max-model-len 202 is more than the static graphs ([static] max_cache_len + 1) holds: 201 tokens",
        ),
        (
            ["--batch-size", "4"],
            "--batch-size shapes --backend static's graphs; --backend eager runs transformers' model",
        ),
        (
            ["--no-enable-prefix-caching"],
            "--no-enable-prefix-caching shapes --backend static's graphs; --backend eager runs transformers' model",
        ),
        (["--backend", "static", "--model", "{unstatic}"], "has no [static] table"),
        (["--artifacts", "{tmp}/absent"], "absent: not a directory"),
        (["--checkpoint", "{tmp}", "--artifacts", "{tmp}"], "--checkpoint or --artifacts, not both"),
        (["--model", "no-such-port"], "unknown port 'no-such-port'"),
        (["--model", "{tmp}"], "is a directory, not a port file (a .toml, or a built-in port's name); a checkpoint"),
    ],
)
def test_errors_before_binding_are_one_line(tmp_path, capsys, args, message):
    compiled = manifest_dir(tmp_path)
    unstatic = tmp_path / "unstatic.toml"  # the tiny port without its [static] table
    unstatic.write_text(port_text_elsewhere(load_port("tiny-gemma4-moe")).split("[static]")[0])
    args = [a.format(tmp=tmp_path, compiled=compiled, unstatic=unstatic) for a in args]
    assert cli.main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_max_cache_len_sizes_the_static_graphs_cache_and_context():
    """A longer cache than the port's [static] max_cache_len, and the context it holds (prompt + completion)."""
    port, _ = plan_load(cli.serve_config(["serve", "--backend", "static", "--max-cache-len", "383"]))
    assert port.static.max_cache_len == 383
    plan_load(cli.serve_config(["serve", "--backend", "static", "--max-cache-len", "383", "--max-model-len", "384"]))


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_by_name_before_binding(host):
    """An empty --host would have uvicorn bind every address under a blank name: refused, naming both meanings."""
    with pytest.raises(ServeError, match=r"^--host '\s*' is no address: pass 127\.0\.0\.1 .* or 0\.0\.0\.0 / ::"):
        plan_load(cli.serve_config(["serve", "--host", host]))


@pytest.mark.parametrize(
    "backend,message",
    [
        ("channel_reader", "'channel_reader' is not served: the reader needs a sidecar and a budget"),
        ("selector", "'selector' is not served: a channel selector"),
    ],
)
def test_a_backend_serve_cannot_run_is_not_offered(backend, message, capsys):
    """Both answered every completion with a 500 (no sidecar attached): now refused by name, before binding."""
    with pytest.raises(SystemExit) as e:
        plan_load(cli.serve_config(["serve", "--backend", backend]))
    assert e.value.code == 2 and f"argument --backend: {message}" in capsys.readouterr().err
    assert backend not in BACKENDS
    with pytest.raises(UserError, match=message):
        load_engine(load_port("tiny-gemma4-moe"), backend)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "neuron"])  # neuron: test_serve_neuron.py
def test_every_backend_offered_generates(backend, tiny_port, one_torch_thread):
    with load_engine(tiny_port, backend) as engine:
        steps = list(engine.generate([2, 40, 41], SamplingParams(3, temperature=0.0)))
    assert [s.completion_tokens for s in steps] == list(range(1, len(steps) + 1)) and steps[-1].finish_reason


def test_neuron_backend_without_the_sdk(tmp_path, capsys):
    if all(importlib.util.find_spec(m) for m in neuron.SDK_MODULES):
        pytest.skip("the Neuron SDK is installed here")
    # a whole artifact (trace-and-compile's dry run, its files verified): the artifact's checks pass, the SDK's do not
    out = tmp_path / "art"
    compile_.trace_and_compile(
        load_port("tiny-gemma4-moe"), compile_.Build.at(tp=1, out=out, dtype="float32", dry_run=True, export=False)
    )
    args = ["serve", "--backend", "neuron", "--artifacts", str(out)]
    assert cli.main(args) == 2
    assert "needs the Neuron SDK (missing torch_neuronx, neuronx_distributed)" in capsys.readouterr().err


def test_s3_artifacts_without_boto3(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if the publish extra were not installed
    assert cli.main(["serve", "--artifacts", "s3://bucket/prefix"]) == 2
    assert (
        "--artifacts s3://... needs the 'boto3' package: pip install 'neuron-moe[publish]'" in capsys.readouterr().err
    )


def _embedding(engine):
    return engine.runtime.model.model.embed_tokens.weight


@pytest.mark.parametrize("where", ["dir", "s3"])
def test_cpu_backend_loads_its_checkpoint_from_artifacts(tmp_path, monkeypatch, tiny_port, where, one_torch_thread):
    other = build_model(reseeded(tiny_port, 4242))  # weights unlike the port's own
    published = save_checkpoint(other, tmp_path / "published")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a published checkpoint carries its tokenizer
        shutil.copy(tiny_port.checkpoint / name, published / name)
    pulls = []

    def pull(uri, dest, **_):
        pulls.append((uri, Path(dest)))
        shutil.copytree(published, dest)

    if where == "s3":
        monkeypatch.setattr("neuron_moe.publish.s3.pull", pull)
        spec = "s3://bucket/runs/tiny/"
    else:
        spec = str(published)
    config = cli.serve_config(["serve", "--artifacts", spec, "--artifacts-cache", str(tmp_path / "cache")])
    port, load = plan_load(config)
    assert pulls == []  # nothing is pulled before the server is up and answering 503
    engine = load()
    assert torch.equal(_embedding(engine), other.model.embed_tokens.weight)
    if where == "s3":
        assert pulls == [(spec, tmp_path / "cache" / "bucket" / "runs" / "tiny")]  # ('..' is refused: test_deploy)


def test_entrypoint_serves_then_sigterm_drains_the_stream_in_flight(tmp_path):
    final = final_stage(DOCKER / "Dockerfile.cpu")
    (cmd,) = [json.loads(a) for k, a in final if k == "CMD"]
    bin_dir = tmp_path / "bin"  # the image's python3 is its venv's; here, this interpreter
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
        HOST="127.0.0.1",
        PORT="0",
        OMP_NUM_THREADS="1",
        NEURON_MOE_API_KEY="k",
    )
    with server_process([str(DOCKER / "entrypoint.sh"), *cmd], env, "/ping") as (proc, out, url):
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key came from the environment
        body = {
            "model": "tiny-gemma4-moe",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 60,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
            lines = r.iter_lines()
            before = sse_events([next(lines), next(lines)])  # the role chunk and a first step
            proc.send_signal(signal.SIGTERM)
            after = sse_events(lines)
        # finished, not cut: the generation's own end (EOS or max_tokens), many steps after the signal
        finish = [e["choices"][0]["finish_reason"] for e in after[:-1] if e["choices"]]
        assert (
            after[-1] == "[DONE]" and finish[-1] in ("stop", "length") and after[-2]["usage"]["completion_tokens"] > 10
        )
        assert any(e["choices"] for e in after[:-2]) and before[0]["choices"][0]["delta"]["role"] == "assistant"
        assert proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
        assert "draining the requests in flight" in "".join(out.all)


def test_an_address_in_use_is_one_line_before_anything_loads(capsys):
    """The socket is bound before the model loads: a failed bind was uvicorn's exit 3 after the load had
    begun in a thread (and, with the batching engine, could abort the process as it exited)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--backend", "static", "--no-compile", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in err and "Traceback" not in err
    assert not any(t.name == "load-model" for t in threading.enumerate())


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_binding(capsys, monkeypatch):
    """A batch whose KV cache and a step's logits pass the memory available is refused after the flags,
    before binding (not by a failed allocation once the server is up); past any batch a graph can have
    (1024 rows) the flag itself is refused."""
    from neuron_moe.serve import server

    monkeypatch.setattr(server, "available_memory", lambda: 2**20)  # 1 MiB: what a small container has left
    assert cli.main(["serve", "--backend", "static", "--batch-size", "1024", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --batch-size 1024: the static graphs' KV cache (")
        and "need more than the 0.0 GiB of memory available" in err
        and err.count("\n") == 1
    ), err
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--backend", "static", "--batch-size", "100000000", "--port", "1"])
    assert e.value.code == 2 and "argument --batch-size: must be in [1, 1024], got 100000000" in capsys.readouterr().err


def _stream_until_done(url: str, started: threading.Semaphore, ends: list) -> None:
    body = {"model": "tiny-gemma4-moe", "prompt": "Once upon a time", "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: ") and not events:
                    started.release()
                events += sse_events([line])
            ends.append(events[-2:])
    except httpx.HTTPError as e:
        ends.append(e)


def test_sigterm_under_load_and_slow_clients_on_a_real_server(tmp_path):
    """A real `serve --backend static` process: a client that never finishes its headers is cut at
    --header-timeout and one that never finishes its body gets 408; then SIGTERM with every request
    still generating: they end (finished, or the drain's error event) and the process exits 0. It
    aborted ('terminate called without an active exception', exit 134) when the interpreter exited
    with the step loop inside a decode step; 256 rows make each step long enough to be caught in."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with server_process(
        [
            sys.executable,
            "-m",
            "neuron_moe",
            "serve",
            "--backend",
            "static",
            "--no-compile",
            "--port",
            "0",
            "--batch-size",
            "256",
            "--drain-timeout",
            "0.5",
            "--header-timeout",
            "1",
            "--body-timeout",
            "1",
        ],
        env,
        "/health",
        cwd=REPO,
    ) as (proc, out, url):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as headers_only:
            headers_only.sendall(b"GET /health HTTP/1.1\r\n")
            assert headers_only.recv(100) == b""  # closed, unanswered
        with socket.create_connection(("127.0.0.1", port), timeout=10) as body_short:
            body_short.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            assert body_short.recv(100).startswith(b"HTTP/1.1 408")
        started, ends = threading.Semaphore(0), []
        clients = [threading.Thread(target=_stream_until_done, args=(url, started, ends)) for _ in range(12)]
        for t in clients:
            t.start()
        for _ in clients:
            assert started.acquire(timeout=60), "a stream did not start"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(out.all)
        for t in clients:
            t.join(30)
        assert len(ends) == len(clients) and all(isinstance(e, list) and e[-1] == "[DONE]" for e in ends), ends
        assert "terminate called" not in "".join(out.all)
