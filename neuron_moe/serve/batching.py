"""Continuous batching: one step loop owns the B rows of the static graphs' batch.

A request waits until a row is free, then joins: it is prefilled into that row (the graph writes
that row of the cache only, `runtime.py`) and its first token is sent at once. Every decode step
advances all active rows together, each row at its own position. A row ends — EOS, a stop string,
max_tokens (at most the end of the cache), or its client went away — and is free that same step:
the next waiting request is prefilled into it before the next decode. A row with no request is fed
the pad token at position 0: it writes only slot 0 of its own ring, which the prefill of its next
request rewrites with the rest of the row, and nothing reads it before then.

Per row, everything else is engine.py's `Output`: greedy rows take the graph's own pick, sampled
rows sample that row's logits with the request's own seeded generator; stop strings, held-back
text and UTF-8 are handled as for a request served alone.

A request comes with a sink (`scheduler.Job`) that the loop, in its own thread, calls: `put(step)`
for each Step, `fail(error)`, and `end()` exactly once when the request is over; the loop reads
`sink.cancelled` (an Event) at every step. `generate` wraps that in Engine.generate's blocking
iterator. A failure in one row's work (its sampling, its text, its sink) ends that request with
the error and leaves the other rows running; a graph call that fails ends the requests it was
running (the prefilled one, or every active row); the loop itself goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .engine import Engine, Output, SamplingParams, Step

log = logging.getLogger("neuron_moe.serve")
_END = object()


@dataclass
class _Request:
    prompt: list[int]
    output: Output
    sink: object  # put(step), fail(error), end(), cancelled: threading.Event


class _QueueSink:
    """Steps for a thread that blocks on them (`BatchEngine.generate`)."""

    def __init__(self, cancelled: threading.Event):
        self.cancelled, self.items = cancelled, queue.SimpleQueue()
        self.put = self.fail = self.items.put

    def end(self) -> None:
        self.items.put(_END)


class BatchEngine(Engine):
    """The engine over a runtime (`runtime.py`): its `batch` rows are this engine's `rows`."""

    def __init__(self, runtime, tokenizer, eos_ids: set[int]):
        super().__init__(runtime, tokenizer, runtime.max_length + 1, eos_ids, runtime.buckets[-1])
        # A prompt of n tokens takes positions 0..n-1 and each new token but the last the next one:
        # n + max_tokens - 1 <= max_length, which is the Engine's n + max_tokens <= max_context.
        self.runtime, self.rows = runtime, runtime.batch
        self.slots: list[_Request | None] = [None] * self.rows  # the request in each row
        self.ids = torch.full((self.rows, 1), runtime.pad_id, dtype=torch.long)  # each row's next input
        self.positions = torch.zeros(self.rows, 1, dtype=torch.long)  # and its position
        self.steps = 0  # decode steps run
        self._waiting: deque[_Request] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="batch-step", daemon=True)
        self._thread.start()

    # ---- requests in ------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink) -> None:
        """Queue a request; its Steps go to `sink` from the loop's thread. A RequestError, before
        anything runs, if the prompt or the budget does not fit the graphs or the sampling cannot
        be served."""
        self.max_tokens_for(len(prompt_ids), params.max_tokens)
        request = _Request(list(prompt_ids), self.output(params), sink)
        with self._wake:
            if self._closed:
                raise RuntimeError("the batching engine is closed")
            self._waiting.append(request)
            self._wake.notify()

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 cancelled: threading.Event | None = None) -> Iterator[Step]:
        """Engine.generate's iterator, for a request that runs in the batch: the Steps come from
        the loop's thread. A consumer that stops reading (or sets `cancelled`) frees its row."""
        sink = _QueueSink(cancelled or threading.Event())
        self.submit(prompt_ids, params, sink)
        try:
            while (item := sink.items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        except GeneratorExit:  # closed (or dropped) by its consumer before the end
            sink.cancelled.set()
            raise

    def close(self) -> None:
        """Stop the loop; requests still waiting or running end without a final Step."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    # ---- the step loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._active():
                    self._wake.wait()
                if self._closed:
                    break
            for row in self._active():
                if self.slots[row].sink.cancelled.is_set():
                    self._free(row)
            self._admit()
            if self._active():
                self._step()
        for row in self._active():
            self._free(row)
        with self._wake:
            while self._waiting:
                self._waiting.popleft().sink.end()

    def _active(self) -> list[int]:
        return [row for row, request in enumerate(self.slots) if request is not None]

    def _admit(self) -> None:
        """Prefill waiting requests into free rows, oldest first (one that ends on its first token
        frees its row for the next at once)."""
        while True:
            free = [row for row, request in enumerate(self.slots) if request is None]
            with self._wake:
                if not free or not self._waiting:
                    return
                request = self._waiting.popleft()
            if request.sink.cancelled.is_set():  # its client left while it waited
                request.sink.end()
                continue
            row = free[0]
            self.slots[row] = request
            try:
                token, logits = self.runtime.prefill(request.prompt, row)
            except Exception as e:
                log.exception("prefill failed")
                self._free(row, e)
                continue
            self.positions[row] = len(request.prompt)
            self._emit(row, int(token[0]), None if logits is None else logits[0])

    def _step(self) -> None:
        active = self._active()
        try:
            tokens, logits = self.runtime.decode(self.ids, self.positions)
        except Exception as e:
            log.exception("decode failed")
            for row in active:
                self._free(row, e)
            return
        self.steps += 1
        self.positions[active] += 1
        for row, token in zip(active, tokens[active].tolist()):
            self._emit(row, token, None if logits is None else logits[row])

    def _emit(self, row: int, token: int, logits: torch.Tensor | None) -> None:
        """Row `row`'s Step from the graph's pick (and the row's logits [V]), sent to its client;
        the row is freed if that was its last, and otherwise fed its token at the next step."""
        request = self.slots[row]
        try:
            step = request.output.next(logits, token)
            request.sink.put(step)
        except Exception as e:  # this request's own failure: the other rows go on
            log.exception("generation failed in row %d", row)
            self._free(row, e)
            return
        if step.finish_reason:
            self._free(row)
        else:
            self.ids[row] = request.output.token

    def _free(self, row: int, error: Exception | None = None) -> None:
        request, self.slots[row] = self.slots[row], None
        self.ids[row], self.positions[row] = self.runtime.pad_id, 0
        if error is not None:
            request.sink.fail(error)
        request.sink.end()
