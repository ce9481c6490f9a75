"""Test helpers: a uvicorn server in a thread on a free loopback port, always shut down; a server
process started on port 0 and always ended; the batching engine's requests seen from their sinks."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import socket
import subprocess
import threading
import time

import httpx
import torch
import uvicorn

from neuron_moe.serve.hf_runtime import HostRuntime
from neuron_moe.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()


def server_config(app) -> uvicorn.Config:
    return uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)


@contextlib.contextmanager
def serving(app, timeout_s: float = 30.0, server: uvicorn.Server | None = None):
    """Run `app` on 127.0.0.1 (a port the OS picks) and yield its base URL; `server`: a uvicorn
    Server of `server_config(app)` to run it with, instead of a plain one."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = server or uvicorn.Server(server_config(app))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            assert thread.is_alive(), "the test server stopped during startup"
            assert time.monotonic() < deadline, f"the test server did not start within {timeout_s} s"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"


def wait_for(predicate, timeout_s: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


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


@contextlib.contextmanager
def server_process(argv: list, env: dict, ready: str, cwd=None, timeout_s: float = 120.0):
    """Start the server `argv` (it listens on 127.0.0.1, port 0, and says where) and yield (proc, its
    Output, base URL) once GET `ready` answers 200; killed at the end unless it has exited."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = Output(proc.stdout)
        url = "http://127.0.0.1:" + out.wait_for(r"running on http://127\.0\.0\.1:(\d+)", timeout_s).group(1)
        wait_for(lambda: httpx.get(url + ready).status_code == 200, timeout_s, "the model to load")
        yield proc, out, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def sse_events(lines) -> list:
    """`data:` payloads of an SSE stream, JSON-decoded ([DONE] kept as the string)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---- the batching engine (serve/engine.py) -------------------------------------------------------


class IdTokenizer:
    """A tokenizer whose text spells the token ids (`<5><17>`), so a request's text is its tokens."""

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def tokens_of(steps) -> list[int]:
    return [int(t) for t in "".join(s.text for s in steps).strip("<>").split("><") if t]


class Sink:
    """A request's end of the engine (as scheduler.Job is): records each Step with the decode step
    it came in, when (`time.perf_counter`) and on which thread, and how the request ended."""

    def __init__(self, engine, fail_at=None):
        self.engine, self.fail_at = engine, fail_at
        self.cancelled, self.ended = threading.Event(), threading.Event()
        self.steps, self.at, self.times, self.threads, self.error = [], [], [], [], None

    def put(self, step):
        if len(self.steps) == self.fail_at:
            raise RuntimeError("injected fault in one row")
        self.steps.append(step)
        self.at.append(self.engine.steps)
        self.times.append(time.perf_counter())
        self.threads.append(threading.current_thread().name)

    def fail(self, error):
        self.error = error

    def end(self):
        self.ended.set()


def serve_together(engine, requests, sinks=None):
    """Submit every (prompt, params) at once, so that the step loop admits them together (it takes
    waiting requests under the lock held here); wait until each has ended."""
    sinks = sinks or [Sink(engine) for _ in requests]
    with engine._wake:
        for (prompt, params), sink in zip(requests, sinks):
            engine.submit(prompt, params, sink)
    for sink in sinks:
        assert sink.ended.wait(60), "a request did not end"
    return sinks


class Scripted(HostRuntime):
    """A runtime that emits the given tokens in order, whatever the prompt (then EOS), in each of its
    `batch` rows: a row's first token comes from its prompt's last logits, each next from a decode."""

    def __init__(self, tokens, vocab=BYTES.vocab_size, batch: int = 1, max_cache_len: int = 511):
        super().__init__(batch, vocab, max_cache_len)
        self.tokens, self.at = list(tokens), [0] * batch

    def reset(self, row):
        self.at[row] = 0

    def logits(self, row, ids, start, keep):
        """The script's next logits after each call whose last logits choose a token (a logits-processing
        prefill, `keep` 0, scores the prompt and chooses none: the script does not move)."""
        if keep == 0:
            return torch.stack([self.script(self.at[row])] * len(ids))
        self.at[row] += 1
        return self.script(self.at[row] - 1)[None]

    def script(self, i):
        logits = torch.full((self.vocab,), -30.0)
        logits[self.tokens[i] if i < len(self.tokens) else BYTES.eos_token_id] = 0.0
        return logits
