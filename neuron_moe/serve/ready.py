"""What happens between an engine loading and /health answering 200: the context limit a server
was asked for (`--max-model-len`), a warm-up of every graph, and the start-up banner.

Warm-up calls every graph once before the first request: each prefill graph (every row count of
`prefill_rows` at every bucket) and the decode graph of the engine's runtime, greedy, then their
logits-processing variants with neutral inputs (where the runtime has them) and the copy graph
(prefix caching); transformers' model, which has no buckets, a decode step of every row. On CPU the
first call of each graph compiled by torch.compile compiles it or loads it from the compile cache; on
Neuron the first call of each compiled key loads and initialises it: neither a user's first request
should wait for. The rows it writes hold nothing a request reads: a row's prefill writes every
position its request will read before it reads it, and no row holds a prefix yet.

A server told to exit while it warms up stops the warm-up (`Stopper`) rather than compile on for
minutes, graph after graph, before it can exit.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..static.rows import Chunk
from ..static.sampling import GREEDY, neutral_inputs
from .engine import Engine

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


def graph_buckets(engine: Engine) -> list[int]:
    """The prefill buckets of the engine's graphs ([]: any prompt length, transformers' model)."""
    return list(engine.runtime.buckets)


def check_max_model_len(max_model_len: int | None, context: int, what: str) -> None:
    """`--max-model-len` above what `what` (the backend's graphs or model) holds is refused, naming both."""
    if max_model_len is not None and max_model_len > context:
        raise UserError(f"--max-model-len {max_model_len} is more than {what} holds: {context} tokens")


def warm_up(engine: Engine) -> int:
    """Every graph of the engine's runtime called once (`graph_calls`), greedy. Returns the calls
    made. Each graph's call is logged as it starts (`warm-up i/n: the decode graph of 8 rows`): on CPU
    the first call of a graph compiled by torch.compile compiles it (or loads it from the compile
    cache), tens of seconds a graph."""
    token = engine.tokenizer.bos_token_id or 0
    calls = graph_calls(engine.runtime, token)
    for i, (graph, call) in enumerate(calls, 1):
        log.info("warm-up %d/%d: %s", i, len(calls), graph)
        call()
    return len(calls)


def speculative_calls(runtime, token: int) -> list[tuple[str, Callable[[], object]]]:
    """The verify graph's call (every row feeding `token` and no draft at positions 0..k), then with an
    assistant the draft graph's, fed the verify's hidden state."""
    batch, q = runtime.batch, runtime.speculative.num_speculative_tokens + 1
    ids, positions = torch.full((batch, q), token), torch.arange(q).repeat(batch, 1)
    sampling, uniforms = torch.tensor([GREEDY] * batch), torch.zeros(batch, q)
    drafted = torch.zeros(batch, dtype=torch.long)
    verified = []

    def verify():
        verified[:] = [runtime.verify(ids, positions, sampling, drafted, uniforms)[3]]

    calls = [(f"the verify graph of {batch} rows x {q} tokens", verify)]
    if runtime.speculative.method == "mtp":
        calls.append(
            (
                f"the draft graph of {batch} rows",
                lambda: runtime.draft(ids[:, 0], verified[0][:, 0], positions[:, 0] + 1),
            )
        )
    return calls


def graph_calls(runtime, token: int) -> list[tuple[str, Callable[[], object]]]:
    """One call of each graph of a runtime, fed `token`, as (the graph in words, the call): each prefill
    row count at each bucket, a decode step at each decode length, the step graphs (prefill folded into the step), the
    verify and draft graphs (speculative decoding), then the logits-processing variants with neutral
    inputs (where the runtime has them) and the copy graph, a row onto itself (prefix caching)."""
    batch, shapes = runtime.batch, [(rows, bucket) for rows in runtime.prefill_rows for bucket in runtime.buckets]
    ids, positions = torch.full((batch, 1), token), torch.zeros(batch, 1, dtype=torch.long)
    sampling = torch.tensor([GREEDY] * batch)

    def chunks(rows: int, bucket: int, targets: bool = False) -> list[Chunk]:
        return [Chunk([token] * bucket, 0, row, GREEDY, [token] * bucket if targets else None) for row in range(rows)]

    calls = [
        (f"the prefill graph of {r} rows x {b} tokens", lambda r=r, b=b: runtime.prefill(chunks(r, b)))
        for r, b in shapes
    ]
    starts = getattr(runtime, "decode_starts", (0,))  # a position that runs each decode graph (its KV length)
    calls += [
        (
            f"the decode graph of {batch} rows from position {start}",
            lambda start=start: runtime.decode(ids, torch.full((batch, 1), start), sampling),
        )
        for start in starts
    ]
    if getattr(runtime, "fuses", False):  # the step graphs: each prefill shape with the decode of every row
        calls += [
            (
                f"the step graph of {r} rows x {b} tokens and the decode of {batch}",
                lambda r=r, b=b: runtime.step(chunks(r, b), ids, positions, sampling),
            )
            for r, b in shapes
        ]
    if getattr(runtime, "speculative", None) is not None:
        calls += speculative_calls(runtime, token)
    if getattr(runtime, "processing", False):
        calls += [
            (
                f"the logits-processing prefill graph of {r} rows x {b} tokens",
                lambda r=r, b=b: runtime.prefill_processing(chunks(r, b, targets=True)),
            )
            for r, b in shapes
        ]
        neutral = neutral_inputs(batch, runtime.vocab)
        calls += [
            (
                f"the logits-processing decode graph of {batch} rows from position {start}",
                lambda start=start: runtime.decode_processing(ids, torch.full((batch, 1), start), sampling, *neutral),
            )
            for start in starts
        ]
    if getattr(runtime, "prefix_caching", False):  # no row holds a prefix yet
        calls.append(("the copy graph", lambda: runtime.copy_row(0, 0)))
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
    rows = f"{engine.rows} batch rows"
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
