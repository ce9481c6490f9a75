"""`neuron-moe serve` as a command: what fails before the socket is bound, where artifacts
come from (a directory, or s3:// through neuron_moe.publish.s3.pull), and the container
entrypoint run for real — serving on loopback, then draining a stream on SIGTERM."""

import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from neuron_moe import cli
from neuron_moe.checkpoint import save_checkpoint
from neuron_moe.model import build_model
from neuron_moe.neuron.artifact import FORMAT
from neuron_moe.port import load_port
from neuron_moe.serve import neuron
from neuron_moe.serve.server import plan_load

from conftest import port_text_elsewhere, reseeded
from dockerfile import DOCKER, final_stage
from serving import sse_events, wait_for

REPO = Path(__file__).resolve().parents[1]


def manifest_dir(tmp_path):
    d = tmp_path / "compiled"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"format": FORMAT, "port": "tiny-gemma4-moe", "dtype": "bf16", "tp": 1,
                                                "expert_layout": "channel", "buckets": [64], "max_length": 128,
                                                "batch_size": 1, "prefill_rows": [1], "prefill_chunk": 64,
                                                "candidates": 256, "dry_run": False, "logits": False}))
    return d


@pytest.mark.parametrize("args,message", [
    (["--backend", "neuron"], "--backend neuron needs --artifacts"),
    (["--backend", "neuron", "--artifacts", "{tmp}"], "no manifest.json"),
    (["--backend", "neuron", "--artifacts", "{compiled}", "--max-running", "2"],
     "--backend neuron batches: it runs as many requests at once as its graphs have rows; --max-running is for"),
    (["--backend", "neuron", "--artifacts", "{compiled}", "--batch-size", "2"], "takes its shapes from the artifact"),
    (["--backend", "neuron", "--artifacts", "{compiled}", "--prefill-rows", "1", "4"],
     "--prefill-rows shapes --backend static's graphs; --backend neuron takes its shapes from the artifact"),
    (["--backend", "static", "--prefill-chunk", "20"], "--prefill-chunk 20 is not one of the port's buckets [8, 56]"),
    (["--backend", "static", "--max-running", "2"], "its graphs have rows (--batch-size); --max-running is for"),
    (["--batch-size", "4"], "--batch-size shapes --backend static's graphs; --backend eager runs one"),
    (["--backend", "static", "--model", "{unstatic}"], "has no [static] table"),
    (["--artifacts", "{tmp}/absent"], "absent: not a directory"),
    (["--checkpoint", "{tmp}", "--artifacts", "{tmp}"], "--checkpoint or --artifacts, not both"),
    (["--model", "no-such-port"], "unknown port 'no-such-port'"),
    (["--max-queue", "-1"], "--max-queue must be 0 or more"),
])
def test_errors_before_binding_are_one_line(tmp_path, capsys, args, message):
    compiled = manifest_dir(tmp_path)
    unstatic = tmp_path / "unstatic.toml"  # the tiny port without its [static] table
    unstatic.write_text(port_text_elsewhere(load_port("tiny-gemma4-moe")).split("[static]")[0])
    args = [a.format(tmp=tmp_path, compiled=compiled, unstatic=unstatic) for a in args]
    assert cli.main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_neuron_backend_without_the_sdk(tmp_path, capsys):
    if all(importlib.util.find_spec(m) for m in neuron.SDK_MODULES):
        pytest.skip("the Neuron SDK is installed here")
    assert cli.main(["serve", "--backend", "neuron", "--artifacts", str(manifest_dir(tmp_path))]) == 2
    assert "needs the Neuron SDK (missing torch_neuronx, neuronx_distributed)" in capsys.readouterr().err


def test_s3_artifacts_without_boto3(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if the publish extra were not installed
    assert cli.main(["serve", "--artifacts", "s3://bucket/prefix"]) == 2
    assert "--artifacts s3://... needs the 'boto3' package: pip install 'neuron-moe[publish]'" in capsys.readouterr().err


def _embedding(engine):
    return engine.backend.model.model.embed_tokens.weight


@pytest.mark.parametrize("where", ["dir", "s3"])
def test_cpu_backend_loads_its_checkpoint_from_artifacts(tmp_path, monkeypatch, tiny_port, where, one_torch_thread):
    other = build_model(reseeded(tiny_port, 4242))  # weights unlike the port's own
    published = save_checkpoint(other, tmp_path / "published")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a published checkpoint carries its tokenizer
        shutil.copy(tiny_port.checkpoint / name, published / name)
    pulls = []

    def pull(uri, dest):
        pulls.append((uri, Path(dest)))
        shutil.copytree(published, dest)

    if where == "s3":
        monkeypatch.setattr("neuron_moe.publish.s3.pull", pull)
        spec = "s3://bucket/runs/../tiny/"
    else:
        spec = str(published)
    args = cli.parser().parse_args(["serve", "--artifacts", spec, "--artifacts-cache", str(tmp_path / "cache")])
    port, load = plan_load(args)
    assert pulls == []  # nothing is pulled before the server is up and answering 503
    engine = load()
    assert torch.equal(_embedding(engine), other.model.embed_tokens.weight)
    if where == "s3":
        assert pulls == [(spec, tmp_path / "cache" / "bucket" / "runs" / "tiny")]  # '..' cannot escape the cache


class Output:
    """A child's merged stdout/stderr, read in a thread so the pipe never fills."""

    def __init__(self, stream):
        self.lines: queue.Queue = queue.Queue()
        self.all: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            self.all.append(line)
            self.lines.put(line)
        self.lines.put(None)  # the child closed its output: it exited

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s:\n{''.join(self.all)}")


def test_entrypoint_serves_then_sigterm_drains_the_stream_in_flight(tmp_path):
    final = final_stage(DOCKER / "Dockerfile.cpu")
    (cmd,) = [json.loads(a) for k, a in final if k == "CMD"]
    bin_dir = tmp_path / "bin"  # the image's python3 is its venv's; here, this interpreter
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO),
               HOST="127.0.0.1", PORT="0", OMP_NUM_THREADS="1", NEURON_MOE_API_KEY="k")
    proc = subprocess.Popen([str(DOCKER / "entrypoint.sh"), *cmd], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out = Output(proc.stdout)
        url = "http://127.0.0.1:" + out.wait_for(r"running on http://127\.0\.0\.1:(\d+)", 120).group(1)
        wait_for(lambda: httpx.get(f"{url}/ping").status_code == 200, 120, "the model to load")
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key came from the environment
        body = {"model": "tiny-gemma4-moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
            lines = r.iter_lines()
            before = sse_events([next(lines), next(lines)])  # the role chunk and a first step
            proc.send_signal(signal.SIGTERM)
            after = sse_events(lines)
        # finished, not cut: the generation's own end (EOS or max_tokens), many steps after the signal
        finish = [e["choices"][0]["finish_reason"] for e in after[:-1] if e["choices"]]
        assert after[-1] == "[DONE]" and finish[-1] in ("stop", "length") and after[-2]["usage"]["completion_tokens"] > 10
        assert any(e["choices"] for e in after[:-2]) and before[0]["choices"][0]["delta"]["role"] == "assistant"
        assert proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
        assert "draining the requests in flight" in "".join(out.all)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
