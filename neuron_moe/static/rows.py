"""Continuous batching over the static graphs: B rows of one KV cache, a piece of work in each.

The one loop that serving (`serve/batching.py`: threads, a sink per request) and the batch
evaluation (`eval/reader_batch.py`: teacher forcing, fillers, each step's reads) drive, a turn at a
time, from loops of their own:

- `admit(take)`: each free row, in order, takes the next piece of work `take()` hands it (None:
  nothing now);
- `prefill()`: one prefill call: the next chunk of every row still prefilling, oldest first, as
  many as one call takes (`runtime.prefill_rows`). A prompt longer than `runtime.chunk` is
  prefilled a chunk per call, each attending to the row's cache of the ones before (chunked
  prefill); a row whose prompt that completes takes its first token from the call;
- `decode()`: one decode step of every row that is generating, each at its own position.

A piece of work ends when its `next` says so or its caller `free`s it, and its row is free for the
next `admit`. A row with nothing to generate sits in the decode batch as the pad token at its next
prefill position (0 for a free row): it writes only that slot of its own ring, which its next
prefill chunk rewrites, and nothing reads it before then (`static/cache.py`).

The work in a row (a served request, an evaluated sequence) is anything with:

  prompt               the tokens prefilled into the row before it decodes (empty: it decodes at once)
  sampling()           its row of the graphs' `sampling` input for the token the next call chooses
  next(token, logits)  the token its graph chose after the row's latest input (its prompt's last
                       token, or the one it was fed), and the logits [V] from graphs built to return
                       them; (None, None) after an empty prompt. Returns the token to feed at the
                       next step, or None: the work is done
  end(error)           the row let go of it: done, freed by the caller, or its graph call failed

A runtime (`serve/runtime.py`) has `batch` rows, a `pad_id`, `chunk`, `prefill_rows`,
`prefill(chunks) -> (tokens [n], logits [n, V] | None)` and `decode(ids [B, 1], positions [B, 1],
sampling [B, 4]) -> (tokens [B], logits [B, V] | None)`. A graph call that fails ends the work it
was running with the error, frees those rows, and raises.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampling import GREEDY


@dataclass(frozen=True)
class Chunk:
    ids: list[int]  # the tokens of this piece of the prompt
    start: int  # the position of its first token (0: the prompt's first piece)
    row: int  # the cache row it goes into
    sampling: tuple[float, float, float, float]  # the row's sampling (`static.sampling.FIELDS`)


class Rows:
    """The `batch` rows of a runtime's graphs and the work in each."""

    def __init__(self, runtime):
        self.runtime, self.batch = runtime, runtime.batch
        self.slots: list = [None] * self.batch  # the work in each row
        self.ids = torch.full((self.batch, 1), runtime.pad_id, dtype=torch.long)  # each row's next input
        self.positions = torch.zeros(self.batch, 1, dtype=torch.long)  # and its position
        self.steps = 0  # decode steps run
        # called after each graph call that ran, before its tokens are handed out: (graph, rows it ran)
        self.counted: Callable[[str, int], None] | None = None
        self._done = [0] * self.batch  # prompt tokens prefilled so far, per row
        self._order = [0] * self.batch  # when each row's work was admitted: the oldest prefills first
        self._admitted = itertools.count()

    def active(self) -> list[int]:
        return [row for row, work in enumerate(self.slots) if work is not None]

    def generating(self) -> list[int]:
        return [row for row in self.active() if not self._prefilling(row)]

    def _prefilling(self, row: int) -> bool:
        return self._done[row] < len(self.slots[row].prompt)

    def admit(self, take: Callable[[], object]) -> None:
        """Give each free row, in order, the work `take()` returns, until it returns None."""
        for row in range(self.batch):
            if self.slots[row] is not None:
                continue
            work = take()
            if work is None:
                return
            self.slots[row], self._done[row], self._order[row] = work, 0, next(self._admitted)
            if not work.prompt:
                self._next(row, None, None)

    def prefill(self) -> list[int]:
        """One prefill call (none if no row is prefilling); the rows it ran."""
        rows = sorted((row for row in self.active() if self._prefilling(row)), key=self._order.__getitem__)[
            : self.runtime.prefill_rows[-1]
        ]
        if not rows:
            return []
        chunks = []
        for row in rows:
            work, done = self.slots[row], self._done[row]
            piece = work.prompt[done : done + self.runtime.chunk]
            last = done + len(piece) == len(work.prompt)
            chunks.append(Chunk(piece, done, row, work.sampling() if last else GREEDY))
        tokens, logits = self._call("prefill", rows, self.runtime.prefill, chunks)
        for i, (row, chunk) in enumerate(zip(rows, chunks)):
            self._done[row] += len(chunk.ids)
            self.positions[row] = self._done[row]  # the next chunk's first position, or the first token's
            if not self._prefilling(row):
                self._next(row, int(tokens[i]), None if logits is None else logits[i])
        return rows

    def decode(self) -> list[int]:
        """One decode step of every generating row (none if no row is); the rows it ran."""
        rows = self.generating()
        if not rows:
            return []
        sampling = torch.tensor([GREEDY] * self.batch)
        for row in rows:
            sampling[row] = torch.tensor(self.slots[row].sampling())
        tokens, logits = self._call("decode", rows, self.runtime.decode, self.ids, self.positions, sampling)
        self.steps += 1
        self.positions[rows] += 1
        for row, token in zip(rows, tokens[rows].tolist()):
            self._next(row, token, None if logits is None else logits[row])
        return rows

    def free(self, row: int, error: Exception | None = None) -> None:
        """End the work in `row` (with `error`, if it failed) and free the row."""
        work, self.slots[row] = self.slots[row], None
        self.ids[row], self.positions[row] = self.runtime.pad_id, 0
        work.end(error)

    def _call(self, graph: str, rows: list[int], call, *inputs):
        try:
            out = call(*inputs)
        except Exception as e:
            for row in rows:
                self.free(row, e)
            raise
        if self.counted is not None:
            self.counted(graph, len(rows))
        return out

    def _next(self, row: int, token: int | None, logits: torch.Tensor | None) -> None:
        feed = self.slots[row].next(token, logits)
        if feed is None:
            self.free(row)
        else:
            self.ids[row] = feed
