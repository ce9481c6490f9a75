"""Bounded admission: at most `max_running` requests generating and `max_queue` waiting.

A request past `max_running + max_queue` is refused at once (429 + Retry-After) instead of
waiting without bound. The engine (`engine.py`) takes each Job itself: its step loop runs up to
`rows` requests at once (`max_running` is its rows), and its own wait queue holds the rest. A slot is
released when the generation ends (`Job.end`) — not when its client leaves — so the count never
over-admits; a client that goes away sets the job's cancel flag, and the engine frees its row at its
next step.

Every request's Steps pass through its Job: that is where its latencies and tokens are counted for
/metrics (`metrics.RequestClock`).
"""

from __future__ import annotations

import asyncio
import threading
import time

from .decoding import SamplingParams
from .metrics import Metrics, RequestClock
from .protocol import APIError

OVERLOADED_RETRY_AFTER_S = 1
_DONE = object()


class Job:
    """One request's generation: the engine's thread calls `put(step)`, `fail(error)` and, once,
    `end()`; the event loop reads them from an asyncio queue (`events`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: Metrics | None = None, prompt_tokens: int = 0):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.done: asyncio.Future = loop.create_future()  # resolved by end(), on the loop
        self.clock, self.prompt_tokens = RequestClock(metrics, time.perf_counter()), prompt_tokens
        self.finish_reason: str | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, step) -> None:
        self.clock.token(time.perf_counter(), self.prompt_tokens)
        self.finish_reason = step.finish_reason or self.finish_reason
        self._send(self.queue.put_nowait, step)

    def fail(self, error: Exception) -> None:
        self.finish_reason = None  # counted as an abort
        self._send(self.queue.put_nowait, error)

    def end(self) -> None:
        self.clock.end(self.finish_reason)
        self._send(self._finish)

    def _finish(self) -> None:
        self.queue.put_nowait(_DONE)
        if not self.done.done():
            self.done.set_result(None)

    def _send(self, call, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(call, *args)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            self.cancelled.set()

    async def events(self, keepalive_s: float | None = None):
        """Steps, then an Exception if generation failed; None every `keepalive_s` of silence."""
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), keepalive_s)
            except asyncio.TimeoutError:
                yield None
                continue
            if item is _DONE:
                return
            yield item


class Scheduler:
    def __init__(self, max_running: int | None, max_queue: int, metrics: Metrics | None = None):
        """`max_running` None: the engine's rows (set by `open`)."""
        self.max_running, self.max_queue = max_running, max_queue
        self.admitted = 0  # running + waiting; touched only on the event loop
        self.jobs: set[Job] = set()
        self.metrics = metrics

    def open(self, engine) -> None:
        """Size the admission for the engine that is ready to serve (and count its calls)."""
        if self.metrics is not None:
            self.metrics.watch(engine.load)
            engine.metrics = self.metrics
        if self.max_running not in (None, engine.rows):
            raise ValueError(
                f"the engine runs its {engine.rows} rows at once; max_running ({self.max_running}) "
                "does not apply to it (choose the rows)"
            )
        self.max_running = engine.rows

    def submit(self, engine, prompt_ids: list[int], params: SamplingParams) -> Job:
        return self.submit_all(engine, prompt_ids, [params])[0]

    def submit_all(self, engine, prompt_ids: list[int], params: list[SamplingParams]) -> list[Job]:
        """One Job per SamplingParams (a request's n or best_of generations of one prompt): all
        admitted, or none (429)."""
        if self.admitted + len(params) > self.max_running + self.max_queue:
            raise APIError(
                429,
                f"server busy: {self.max_running} request(s) running and {self.max_queue} waiting; retry later",
                "server_overloaded",
                code="queue_full",
                retry_after=OVERLOADED_RETRY_AFTER_S,
            )
        return [self._start(engine, prompt_ids, p) for p in params]

    def _start(self, engine, prompt_ids: list[int], params: SamplingParams) -> Job:
        loop = asyncio.get_running_loop()
        job = Job(loop, self.metrics, len(prompt_ids))
        engine.submit(prompt_ids, params, job)
        self.admitted += 1
        self.jobs.add(job)
        job.done.add_done_callback(lambda _: self._release(job))
        return job

    def _release(self, job: Job) -> None:
        self.admitted -= 1
        self.jobs.discard(job)

    def close(self) -> None:
        """Stop what still runs (after the drain): the engine frees the rows at its next step."""
        for job in list(self.jobs):
            job.cancel()
