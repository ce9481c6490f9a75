"""Bounded admission: `max_running` generation threads and at most `max_queue` waiting.

Generation is blocking torch code, so each request runs in a thread of a fixed pool; the
pool's own queue is the wait queue, and a request past `max_running + max_queue` is refused
at once (429 + Retry-After) instead of waiting without bound. A slot is released when its
thread returns — not when its client leaves — so the count never over-admits; a client that
goes away sets the job's cancel flag, and the thread stops at the next token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from .engine import SamplingParams
from .protocol import APIError

log = logging.getLogger("neuron_moe.serve")
OVERLOADED_RETRY_AFTER_S = 1
_DONE = object()


class Job:
    """One request's generation: its thread pushes Steps onto an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.future: asyncio.Future | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def run(self, engine, prompt_ids: list[int], params: SamplingParams) -> None:  # in a pool thread
        if self.cancelled.is_set():  # its client left while it waited
            return
        try:
            for step in engine.generate(prompt_ids, params, self.cancelled):
                self._put(step)
        except Exception as e:  # a backend failure ends this request, not the server
            log.exception("generation failed")
            self._put(e)
        finally:
            self._put(_DONE)

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
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
    def __init__(self, max_running: int, max_queue: int):
        self.max_running, self.max_queue = max_running, max_queue
        self.executor = ThreadPoolExecutor(max_running, thread_name_prefix="generate")
        self.admitted = 0  # running + waiting; touched only on the event loop
        self.jobs: set[Job] = set()

    def submit(self, engine, prompt_ids: list[int], params: SamplingParams) -> Job:
        if self.admitted >= self.max_running + self.max_queue:
            raise APIError(429, f"server busy: {self.max_running} request(s) running and "
                                f"{self.max_queue} waiting; retry later", "server_overloaded",
                           code="queue_full", retry_after=OVERLOADED_RETRY_AFTER_S)
        loop = asyncio.get_running_loop()
        job = Job(loop)
        self.admitted += 1
        self.jobs.add(job)
        job.future = loop.run_in_executor(self.executor, job.run, engine, prompt_ids, params)
        job.future.add_done_callback(lambda _: self._release(job))
        return job

    def _release(self, job: Job) -> None:
        self.admitted -= 1
        self.jobs.discard(job)

    def close(self) -> None:
        """Stop what still runs (after the drain), and wait for the threads to return."""
        for job in list(self.jobs):
            job.cancel()
        self.executor.shutdown(wait=True, cancel_futures=True)

