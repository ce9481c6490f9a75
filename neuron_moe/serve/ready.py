"""What happens between an engine loading and /health answering 200: the context limit a server
was asked for (`--max-model-len`), a warm-up of every graph, and the start-up banner.

Warm-up calls every graph once before the first request: each prefill graph (every row count of
`prefill_rows` at every bucket) and the decode graph of a batching engine's runtime, greedy, then
their logits-processing variants with neutral inputs (where the runtime has them) and the copy graph
(prefix caching), or one request through the per-request engine. On Neuron the first call of each
compiled key loads and initialises it, which a user's first request should not wait for. The rows
it writes hold nothing a request reads: a row's prefill writes every position its request will read
before it reads it, and no row holds a prefix yet.

A server told to exit while it warms up stops the warm-up (`Stopper`) rather than compile on for
minutes, graph after graph, before it can exit.
"""

from __future__ import annotations

import copy
import ctypes
import logging
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..static.rows import Chunk
from ..static.sampling import GREEDY, neutral_inputs
from .engine import Engine, SamplingParams

log = logging.getLogger("neuron_moe.serve")


@dataclass(frozen=True)
class Banner:
    """What the start-up line names: the served model and what runs it."""

    port: str
    names: tuple[str, ...]  # --served-model-name, the first is the one responses carry
    backend: str
    dtype: str


class Stopped(BaseException):
    """Raised in a warm-up's thread by `Stopper.stop`. A BaseException, as KeyboardInterrupt is, so
    that no `except Exception` inside torch.compile takes it for a failed compile and carries on."""

    def __str__(self) -> str:
        return "the server is exiting: its warm-up was stopped"


class Stopper:
    """Stops a server's warm-up from the thread that exits the server: `Stopped` is raised in the
    warm-up's thread at its next Python instruction (a graph's compile by inductor is Python; what
    it waits for in C — one C++ compiler run — ends first), and a warm-up that starts after `stop`
    raises it at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stopped = False
        self._threads: set[int] = set()

    @contextmanager
    def running(self):
        """The block (a warm-up) runs until `stop`."""
        ident = threading.get_ident()
        with self._lock:
            if self._stopped:
                raise Stopped
            self._threads.add(ident)
        try:
            yield
        finally:  # the lock held while `stop` raises in the block's thread: Stopped lands in here at the latest
            with self._lock:
                self._threads.discard(ident)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for ident in self._threads:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(Stopped))


def graph_buckets(engine: Engine) -> list[int] | None:
    """The prefill buckets of a batching engine's graphs; None for the per-request engine."""
    return list(engine.runtime.buckets) if engine.rows is not None else None


def check_max_model_len(max_model_len: int | None, context: int, what: str) -> None:
    """`--max-model-len` above what `what` (the backend's graphs or model) holds is refused, naming both."""
    if max_model_len is not None and max_model_len > context:
        raise UserError(f"--max-model-len {max_model_len} is more than {what} holds: {context} tokens")


def warm_up(engine: Engine) -> int:
    """Every graph of a batching engine's runtime called once (each prefill row count at each bucket,
    then a decode step at each decode length), greedy; the per-request engine gets one request, EOS
    ignored. Returns the calls made. Each graph's call is logged as it starts: on CPU the first call
    of a graph compiled by torch.compile compiles it (or loads it from the compile cache), tens of
    seconds a graph."""
    token = engine.tokenizer.bos_token_id or 0
    runtime = engine.runtime
    if engine.rows is None:  # one request per thread over HF's model
        endless = copy.copy(engine)  # a shallow copy: the same model, without EOS
        endless.eos_ids = frozenset()
        if engine.max_context < 2:  # no room for a token after the prompt
            return 0
        for _ in endless.generate([token], SamplingParams(min(2, engine.max_context - 1), temperature=0.0)):
            pass
        return 1
    starts = getattr(runtime, "decode_starts", (0,))  # a position that runs each decode graph
    calls, graphs = 0, len(runtime.prefill_rows) * len(runtime.buckets) + len(starts)
    for rows in runtime.prefill_rows:
        for bucket in runtime.buckets:
            log.info("warm-up %d/%d: the prefill graph of %d rows x %d tokens", calls + 1, graphs, rows, bucket)
            runtime.prefill([Chunk([token] * bucket, 0, row, GREEDY) for row in range(rows)])
            calls += 1
    batch = runtime.batch
    ids, sampling = torch.full((batch, 1), token), torch.tensor([GREEDY] * batch)
    for start in starts:
        log.info("warm-up %d/%d: the decode graph of %d rows from position %d", calls + 1, graphs, batch, start)
        runtime.decode(ids, torch.full((batch, 1), start), sampling)
        calls += 1
    if getattr(runtime, "processing", False):  # the logits-processing variants, each once, neutral
        log.info("warm-up: the logits-processing variants of the %d graphs", graphs)
        for rows in runtime.prefill_rows:
            for bucket in runtime.buckets:
                runtime.prefill_processing(
                    [Chunk([token] * bucket, 0, row, GREEDY, [token] * bucket) for row in range(rows)]
                )
                calls += 1
        for start in starts:
            runtime.decode_processing(
                ids, torch.full((batch, 1), start), sampling, *neutral_inputs(batch, runtime.vocab)
            )
            calls += 1
    if getattr(runtime, "prefix_caching", False):  # the copy graph: a row onto itself (no row holds a prefix yet)
        runtime.copy_row(0, 0)
        calls += 1
    return calls


def ready(
    engine: Engine, banner: Banner, max_model_len: int | None, what: str, stopper: Stopper | None = None
) -> Engine:
    """The engine's context cut to `max_model_len` (checked), `warm_up` (until `stopper` stops it),
    then the banner: one line, logged when the server turns ready."""
    check_max_model_len(max_model_len, engine.max_context, what)
    engine.max_context = max_model_len or engine.max_context
    started = time.perf_counter()
    with stopper.running() if stopper is not None else nullcontext():
        runs = warm_up(engine)
    buckets = graph_buckets(engine)
    rows = f"{engine.rows} batch rows" if engine.rows else "one request per thread"
    log.info(
        "serving %s as %s: backend %s, dtype %s, context %d tokens, %s, %s; warmed up in %.2f s (%d graph calls)",
        banner.port,
        ", ".join(banner.names),
        banner.backend,
        banner.dtype,
        engine.max_context,
        rows,
        f"prefill buckets {', '.join(map(str, buckets))}" if buckets else "any prompt length",
        time.perf_counter() - started,
        runs,
    )
    return engine
