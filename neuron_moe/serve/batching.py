"""Continuous batching: one step loop owns the B rows of the static graphs' batch.

A request waits until a row is free, then joins: its prompt is prefilled into that row (the graph
writes that row of the cache only, `runtime.py`), and its first token, which the prefill graph
chose, is sent at once. Each turn of the loop runs at most one prefill call and then one decode
step of every row that is generating:

- the prefill call takes every row still prefilling, oldest first, up to the largest number of
  rows a prefill graph takes (`runtime.prefill_rows`): a request that joins while others wait is
  prefilled together with them, in one call;
- a prompt longer than the chunk (`runtime.chunk`) is prefilled a chunk per turn, each chunk
  attending to the row's cache of the ones before, so a long prompt costs the rows generating
  beside it one chunk's call per token, not its whole prefill (chunked prefill);
- the decode step advances all generating rows together, each at its own position.

A row ends — EOS, a stop string, max_tokens (at most the end of the cache), or its client went
away — and is free that same turn for the next waiting request. A row with nothing to generate
sits in the decode batch as the pad token at its next prefill position (0 for a free row): it
writes only that slot of its own ring, which its next prefill chunk rewrites, and nothing reads it
before then (`static/cache.py`).

Sampling happens in the graphs (`static/sampling.py`): each row's sampling input carries its
request's temperature, top-k, top-p and a uniform draw from the request's own seeded generator
(`engine.Output.sampling`), so a seeded request gets the same tokens whatever runs beside it.
Per row, everything else is engine.py's `Output`: stop strings, held-back text and UTF-8 are
handled as for a request served alone.

A request comes with a sink (`scheduler.Job`) that the loop, in its own thread, calls: `put(step)`
for each Step, `fail(error)`, and `end()` exactly once when the request is over; the loop reads
`sink.cancelled` (an Event) at every step. `generate` wraps that in Engine.generate's blocking
iterator. A failure in one row's work (its text, its sink) ends that request with the error and
leaves the other rows running; a graph call that fails ends the requests it was running (the
prefilled ones, or every generating row); the loop itself goes on.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..static.sampling import GREEDY
from .engine import Engine, Output, SamplingParams, Step
from .runtime import Chunk

log = logging.getLogger("neuron_moe.serve")
_END = object()
_ORDER = itertools.count()


@dataclass
class _Request:
    prompt: list[int]
    output: Output
    sink: object  # put(step), fail(error), end(), cancelled: threading.Event
    done: int = 0  # prompt tokens prefilled so far
    order: int = field(default_factory=lambda: next(_ORDER))  # admission order: oldest first

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.prompt)


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
        # Any prompt that fits the cache: a prompt longer than the chunk is prefilled a chunk at a time.
        # A prompt of n tokens takes positions 0..n-1 and each new token but the last the next one:
        # n + max_tokens - 1 <= max_length, which is the Engine's n + max_tokens <= max_context.
        super().__init__(runtime, tokenizer, runtime.max_length + 1, eos_ids)
        self.runtime, self.rows = runtime, runtime.batch
        self.slots: list[_Request | None] = [None] * self.rows  # the request in each row
        self.ids = torch.full((self.rows, 1), runtime.pad_id, dtype=torch.long)  # each row's next input
        self.positions = torch.zeros(self.rows, 1, dtype=torch.long)  # and its position
        self.steps = 0  # decode steps run
        self.metrics = None  # a metrics.Metrics, once a server counts this engine's calls
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

    def load(self) -> tuple[int, int, int, int]:
        """(requests running, waiting, rows, rows in use), for /metrics."""
        in_use = sum(request is not None for request in self.slots)
        return in_use, len(self._waiting), self.rows, in_use

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
            self._prefill()
            if self._generating():
                self._step()
        for row in self._active():
            self._free(row)
        with self._wake:
            while self._waiting:
                self._waiting.popleft().sink.end()

    def _active(self) -> list[int]:
        return [row for row, request in enumerate(self.slots) if request is not None]

    def _generating(self) -> list[int]:
        return [row for row, request in enumerate(self.slots) if request is not None and not request.prefilling]

    def _admit(self) -> None:
        """Give each free row to the oldest waiting request (whose client has not left)."""
        for row in [row for row, request in enumerate(self.slots) if request is None]:
            with self._wake:
                while self._waiting and self._waiting[0].sink.cancelled.is_set():  # its client left while it waited
                    self._waiting.popleft().sink.end()
                if not self._waiting:
                    return
                self.slots[row] = self._waiting.popleft()

    def _prefill(self) -> None:
        """One prefill call: the next chunk of every row still prefilling, oldest first, as many as
        one call takes. A row whose prompt that completes takes its first token from the call."""
        rows = sorted((row for row in self._active() if self.slots[row].prefilling),
                      key=lambda row: self.slots[row].order)[:self.runtime.prefill_rows[-1]]
        if not rows:
            return
        chunks = []
        for row in rows:
            request = self.slots[row]
            piece = request.prompt[request.done:request.done + self.runtime.chunk]
            last = request.done + len(piece) == len(request.prompt)
            chunks.append(Chunk(piece, request.done, row, request.output.sampling() if last else GREEDY))
        try:
            tokens, logits = self.runtime.prefill(chunks)
        except Exception as e:
            log.exception("prefill failed")
            for row in rows:
                self._free(row, e)
            return
        if self.metrics is not None:
            self.metrics.prefill_calls.inc()
            self.metrics.prefill_rows.inc(len(rows))
        for i, (row, chunk) in enumerate(zip(rows, chunks)):
            request = self.slots[row]
            request.done += len(chunk.ids)
            self.positions[row] = request.done  # the next chunk's first position, or the first token's
            if not request.prefilling:
                self._emit(row, int(tokens[i]), None if logits is None else logits[i])

    def _step(self) -> None:
        rows = self._generating()
        sampling = torch.tensor([GREEDY] * self.rows)
        for row in rows:
            sampling[row] = torch.tensor(self.slots[row].output.sampling())
        try:
            tokens, logits = self.runtime.decode(self.ids, self.positions, sampling)
        except Exception as e:
            log.exception("decode failed")
            for row in rows:
                self._free(row, e)
            return
        self.steps += 1
        if self.metrics is not None:
            self.metrics.decode_calls.inc()
            self.metrics.decode_rows.inc(len(rows))
        self.positions[rows] += 1
        for row, token in zip(rows, tokens[rows].tolist()):
            self._emit(row, token, None if logits is None else logits[row])

    def _emit(self, row: int, token: int, logits: torch.Tensor | None) -> None:
        """Row `row`'s Step from the token its graph chose, sent to its client; the row is freed if
        that was its last, and otherwise fed its token at the next step."""
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
