"""What happens between an engine loading and /health answering 200: the context limit a server
was asked for (`--max-model-len`), a warm-up of every graph, and the start-up banner.

Warm-up runs one prefill per prefill bucket and at least one decode step through the engine's own
request path, as a request would: on Neuron the first call of each compiled key loads and
initialises it, which a user's first request should not wait for.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

from ..errors import UserError
from .engine import Engine, SamplingParams

log = logging.getLogger("neuron_moe.serve")


@dataclass(frozen=True)
class Banner:
    """What the start-up line names: the served model and what runs it."""

    port: str
    names: tuple[str, ...]  # --served-model-name, the first is the one responses carry
    backend: str
    dtype: str


def graph_buckets(engine: Engine) -> list[int] | None:
    """The prefill buckets of a batching engine's graphs; None for the per-request engine."""
    runtime = getattr(engine, "runtime", None)
    return list(runtime.buckets) if runtime is not None else None


def check_max_model_len(max_model_len: int | None, context: int, what: str) -> None:
    """`--max-model-len` above what `what` (the backend's graphs or model) holds is refused, naming both."""
    if max_model_len is not None and max_model_len > context:
        raise UserError(f"--max-model-len {max_model_len} is more than {what} holds: {context} tokens")


def warm_up(engine: Engine) -> int:
    """One prefill in each bucket (a prompt one token longer than the bucket below it) and a decode
    step after it, greedy, EOS ignored; the per-request engine gets one such request. Returns the
    requests run."""
    buckets = graph_buckets(engine) or [1]
    lengths = [below + 1 for below in [0, *buckets[:-1]]]
    endless = copy.copy(engine)  # a shallow copy: the same step loop and model, without EOS
    endless.eos_ids = frozenset()
    token = engine.tokenizer.bos_token_id or 0
    runs = 0
    for n in lengths:
        room = engine.max_context - n
        if room >= 1:
            for _ in endless.generate([token] * n, SamplingParams(min(2, room), temperature=0.0)):
                pass
            runs += 1
    return runs


def ready(engine: Engine, banner: Banner, max_model_len: int | None, what: str) -> Engine:
    """The engine's context cut to `max_model_len` (checked), `warm_up`, then the banner: one line,
    logged when the server turns ready."""
    check_max_model_len(max_model_len, engine.max_context, what)
    engine.max_context = max_model_len or engine.max_context
    started = time.perf_counter()
    runs = warm_up(engine)
    buckets = graph_buckets(engine)
    rows = f"{engine.rows} batch rows" if engine.rows else "one request per thread"
    log.info("serving %s as %s: backend %s, dtype %s, context %d tokens, %s, %s; warmed up in %.2f s (%d requests)",
             banner.port, ", ".join(banner.names), banner.backend, banner.dtype, engine.max_context, rows,
             f"prefill buckets {', '.join(map(str, buckets))}" if buckets else "any prompt length",
             time.perf_counter() - started, runs)
    return engine
