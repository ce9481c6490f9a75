"""The engine step over the static graphs: B rows of one KV cache, a piece of work in each.

`Rows.step` is the one host loop over the graphs; every caller drives it, a step at a time:
serving (`serve/engine.py`: threads, a sink per request), the batch evaluation
(`eval/reader_batch.py`: teacher forcing, fillers, each step's reads), and greedy generation of
prompts, a batch at a time (`generate`: `validate`'s static and TP generators, every TP rank in lockstep).
One step is

- admission: each free row, in order, takes the next piece of work `take()` hands it (None:
  nothing now);
- prefill: the next chunk of every row still prefilling, oldest first, as many as one prefill call
  takes (`runtime.prefill_rows`), or all of them (`prefill_all`). A prompt longer than
  `runtime.chunk` is prefilled a chunk per step, each attending to the row's cache of the ones
  before (chunked prefill); a row whose prompt that completes takes its first token from the call;
- decode: one decode call for every row that is generating, each at its own position; or, with a
  runtime built for speculative decoding (`speculative`, `verify`, and `draft` with an assistant),
  one verify call checking each row's drafts (`_speculate`), a row taking several tokens a step;
- or both in one call, where the runtime has a step graph (`fuses`: `decoder.Step`, vLLM V1's and
  llama.cpp's unified batch), the step has both and one call takes its chunks (`_fused`): then no
  row waits on a prefill call of its own (not while speculating: the step's decode is a verify).

Each row's inputs are made here, on the host, once per step: its chunk (`Chunk`), or its next id,
position and sampling (`ids`, `positions`, `sampling`: tensors made once, each row's element
written in place as its work moves on, no tensor made per step). A piece of work ends when its
`next` says so or its caller `free`s it, and its row is free for the next step. A row with nothing
to generate sits in the decode batch as the pad token at its next prefill position (0 for a free
row): it writes only that slot of its own ring, which its next prefill chunk rewrites, and nothing
reads it before then (`cache.py`).

The work in a row (a served request, an evaluated sequence, a prompt to validate) is anything with:

  prompt               the tokens prefilled into the row before it decodes (empty: it decodes at once)
  sampling()           its row of the graphs' `sampling` input for the token the next call chooses
  next(token, logits)  the token its graph chose after the row's latest input (its prompt's last
                       token, or the one it was fed), and the logits [V] from graphs built to return
                       them; (None, None) after an empty prompt. Returns the token to feed at the
                       next step, or None: the work is done
  end(error)           the row let go of it: done, freed by the caller, or its graph call failed

and, for work that asks for logits processing (logprobs, penalties, bias, min_p, bans, a grammar's
bitmask: `static/sampling.py`), also

  asks                 True (fixed for the work's life; absent or False: it asks nothing)
  processing()         its row of the variant's inputs for its next token: (presence, frequency,
                       repetition, min_p), [(token id, bias)] (bans as -inf; at most BIAS_WIDTH), and
                       its bitmask [ceil(V/32)] int32 or None
  next(token, logits, scores)  as `next`, with the token's (logprob, rank, top ids [N], top logprobs [N])
  prompt_scores(start, logprobs [n], ranks [n], top ids [n, N], top logprobs [n, N])  (optional) the scores of
                       the prompt tokens start+1..start+n, from its prefill chunk at `start`
  matcher              (optional) its grammar's matcher, whose bitmask its next `processing()` returns, or
                       None: an object whose class's `fill(matchers)` fills the next bitmask of many at
                       once. A step fills those of all its rows in one call per class (llguidance's batched
                       fill: `serve/grammar.py`) before it asks each row for its `processing()`

Work that asks runs in the runtime's logits-processing variant graphs: it is prefilled up to its
prompt's last token (`prefill_processing`, which writes its prompt into the rows' token counts), and
that last token is its first decode input, so its first token, like every later one, comes from the
variant decode graph (`decode_processing`) with its logprobs. A step's decode runs the variant when
any generating row asks (the other rows with neutral inputs: the same tokens as `decode`), else
`decode` with its own inputs.

What the step does between two graph calls is on the graphs' critical path: `next` runs there for
every row after every call, so it should decide from the token (and logits) alone what to feed
next, and do anything slower beside the graph calls. Serving's work does so: its `next` takes the
token by the ids (EOS, max_tokens) and hands the text and the streaming to a thread of its own
(`serve/engine.py`), which runs while the loop is in the next call; a request that a stop string
ends tells the loop so a step late, and the loop `free`s its row.

A runtime (`GraphRuntime`, or any object with the same attributes) has `batch` rows, a `pad_id`,
`chunk`, `prefill_rows`, `prefill(chunks) -> (tokens [n], logits [n, V] | None)` and
`decode(ids [B, 1], positions [B, 1], sampling [B, 4]) -> (tokens [B], logits [B, V] | None)` (and, with
`fuses`, `step(chunks, ids, positions, sampling)`: both in one call), on
the host, and `processing` (whether it has the variants, `prefill_processing` and `decode_processing`)
and `vocab`; with prefix caching (`prefix`, a `prefix.PrefixIndex`) also `copy_row(src, dst)`. Then
admission puts each piece of work in the least recently used free row, with its prompt's longest
held prefix (`PrefixIndex`) copied there first unless that row holds it; its prefill starts after
the prefix (work that asks for logits processing takes none: its prefill counts its prompt's tokens
and scores them, as vLLM skips the prefix cache for prompt logprobs). Work whose prompt shares more
whole blocks with a row still prefilling than any row holds waits (`held`, and the work behind it
with it) until that row has written them: one prefill serves a request's n generations. The decode
call's inputs are the step's own tensors, written in place before the next call: a runtime reads
them during the call (a device runtime copies them to the device) and keeps no reference past it.
A graph call that fails ends the work it was running with the error, frees those rows, and raises
out of the step.
"""

from __future__ import annotations

import math

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..run_config import Shapes
from ..speculative import ngram_propose
from .sampling import BIAS_WIDTH, GREEDY, NEUTRAL, neutral_inputs


def prefill_row(prompt: torch.Tensor, bucket: int, pad_id: int, start: int = 0):
    """One chunk's ids [n] at positions start..start+n-1 -> (input_ids, attention_mask,
    position_ids), each [1, bucket], left-padded (a pad's position is the chunk's first)."""
    n = prompt.shape[0]
    ids = torch.full((1, bucket), pad_id, dtype=torch.long)
    mask = torch.zeros((1, bucket), dtype=torch.long)
    ids[0, bucket - n :], mask[0, bucket - n :] = prompt, 1
    return ids, mask, start + (mask.cumsum(-1) - 1).clamp(min=0)


def bucket_for(n: int, buckets) -> int:
    """The smallest bucket that holds n tokens (the caller checked that one does)."""
    return next(b for b in sorted(buckets) if b >= n)


@dataclass(frozen=True)
class Chunk:
    ids: list[int]  # the tokens of this piece of the prompt
    start: int  # the position of its first token (0: the prompt's first piece)
    row: int  # the cache row it goes into
    sampling: tuple[float, float, float, float]  # the row's sampling (`static.sampling.FIELDS`)
    targets: list[int] | None = None  # the logits-processing prefill's: the prompt token after each of ids


class GraphRuntime:
    """Two callables with the static decoder's signatures (`decoder.py`), as the rows call them, at
    `shapes` (the graphs' `Shapes`: a port's [static] table, or an artifact's manifest). The KV cache
    of `batch_size` rows is their state (`cache.py`): no cache tensor crosses a call.

    A prefill call takes P rows of one bucket: P the smallest of `prefill_rows` (the compiled
    graphs' row counts) that holds the chunks, padded with copies of the last chunk (the same row
    written twice with the same values), the bucket the smallest that holds the longest chunk (no
    `buckets`: its own length, unpadded). More chunks than the largest P go in successive calls. A
    chunk is a whole prompt or a piece of one (`Chunk.start` > 0: it attends to what the row's
    cache holds of the pieces before it). Inputs are made on the host and sent to `device`; the
    tokens (and, `logits`, the logits: graphs built to return them; None: whichever the graphs
    return, with no state among their outputs) come back to the host.

    On CPU the callables are the `Prefill` and `Decode` modules themselves over one `KVCache`
    (`static/runtime.py`, `eval/reader_batch.py`) or exported programs (`graph_runtime`); on
    Inferentia2 the compiled artifact, whose one callable NxD routes to the key whose input shapes
    match (`serve/neuron.py`).
    """

    def __init__(
        self,
        prefill,
        decode,  # a callable, or {KV length: callable}: the decode graphs by the positions they attend
        shapes: Shapes,
        *,
        logits: bool | None = None,
        candidates: int | None = None,
        pad_id: int = 0,
        device: torch.device | str = "cpu",
        prefill_processing=None,
        decode_processing=None,
        vocab: int | None = None,
        copy=None,
        verify=None,
        speculative=None,
        draft=None,
        step=None,
    ):
        self._prefill, self._decode, self._copy = prefill, _by_length(decode), copy
        # speculative decoding: the verify graph (`decoder.Verify`) and its `speculative.SpeculativeConfig`,
        # and the assistant's draft graph (`draft.Draft`) over the same cache (None: no assistant)
        self._verify, self.speculative, self._draft = verify, speculative, draft
        # a step graph (`decoder.Step`): a prefill chunk and the decode step in one call (None: two calls)
        self._step = step
        self.fuses = step is not None
        # a copy graph (`decoder.Copy`) over a whole-row cache: what prefix caching needs
        self.prefix_caching = copy is not None
        # the logits-processing variants (`decoder.ProcessingPrefill`, `ProcessingDecode`; None: this
        # runtime has none, and requests that ask for them are refused)
        self._prefill_processing, self._decode_processing = prefill_processing, _by_length(decode_processing)
        # a position that runs each decode graph (the first past the next shorter graph's length): a
        # warm-up that decodes at each calls every graph once
        self.decode_starts = (0, *(self._decode.lengths[:-1] if self._decode is not None else ()))
        self.processing = decode_processing is not None and prefill_processing is not None
        self.vocab = vocab
        self.batch, self.buckets, self.max_cache_len = (
            shapes.batch_size,
            sorted(shapes.buckets or ()),
            shapes.max_cache_len,
        )
        self.prefill_rows = sorted(shapes.prefill_rows or (1,))
        # the longest piece of a prompt one prefill call takes
        self.chunk = shapes.prefill_chunk or self.buckets[-1]
        self.candidates = candidates  # top-k / top-p candidate width of the graphs
        self.pad_id, self.logits, self.device = pad_id, logits, torch.device(device)

    @torch.no_grad()
    def prefill(self, chunks: list[Chunk]):
        """The caller checked that each chunk fits a bucket and the cache, and that their rows are
        distinct rows of the batch."""
        most = self.prefill_rows[-1]
        if len(chunks) > most:
            tokens, logits = zip(*(self.prefill(chunks[i : i + most]) for i in range(0, len(chunks), most)))
            return torch.cat(tokens), None if logits[0] is None else torch.cat(logits)
        padded, inputs = self._padded(chunks)
        inputs.append(torch.tensor([c.sampling for c in padded]))
        tokens, logits = self._out(self._prefill(*self._sent(inputs)))
        return tokens[: len(chunks)], None if logits is None else logits[: len(chunks)]

    def _padded(self, chunks: list[Chunk]) -> tuple[list[Chunk], list[torch.Tensor]]:
        """One prefill call's chunks -> (the chunks padded to P rows with copies of the last, the inputs
        every prefill graph takes first: input_ids, attention_mask, position_ids, each [P, bucket] and
        left-padded as `prefill_row` pads, and row_ids [P])."""
        rows = next(p for p in self.prefill_rows if p >= len(chunks))
        longest = max(len(c.ids) for c in chunks)
        bucket = bucket_for(longest, self.buckets) if self.buckets else longest
        padded = chunks + [chunks[-1]] * (rows - len(chunks))
        ids, mask, positions = [], [], []  # `prefill_row`'s, all rows at once (lists, then a tensor each)
        for c in padded:
            n, pad = len(c.ids), bucket - len(c.ids)
            ids.append([self.pad_id] * pad + list(c.ids))
            mask.append([0] * pad + [1] * n)
            positions.append([c.start] * pad + list(range(c.start, c.start + n)))
        inputs = [torch.tensor(ids), torch.tensor(mask), torch.tensor(positions), torch.tensor([c.row for c in padded])]
        return padded, inputs

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, sampling: torch.Tensor):
        return self._out(self._decode[self.decode_length(positions)](*self._sent((ids, positions, sampling))))

    def decode_length(self, positions: torch.Tensor) -> int | None:
        """The KV length of the decode graph a step at `positions` runs: the smallest of the shorter
        graphs' that is above every row's position (NxDI's token-generation bucket), else the whole
        cache's (its length, or None where the runtime was not told it)."""
        *shorter, whole = self._decode.lengths
        if not shorter:
            return whole
        need = int(positions.max()) + 1
        return next((n for n in shorter if n >= need), whole)

    @torch.no_grad()
    def verify(self, ids, positions, sampling, drafted, uniforms):
        """The verify graph (`decoder.Verify`): ids and positions [B, q], sampling [B, 4], drafted [B],
        uniforms [B, q] -> (tokens [B, q], accepted [B], logits [B, q, V] or None, hidden [B, q, H] or
        None: the target's final hidden state, with an assistant), on the host."""
        outputs = self._verify(*self._sent((ids, positions, sampling, drafted, uniforms)))
        hidden = self._draft is not None
        logits = self.logits if self.logits is not None else len(outputs) > 2 + hidden
        return (
            outputs[0].cpu(),
            outputs[1].cpu(),
            outputs[2].float().cpu() if logits else None,
            outputs[2 + logits].cpu() if hidden else None,
        )

    @torch.no_grad()
    def draft(self, last_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """The assistant's k drafts after each row's last token `last_ids` [B] at `positions` [B], from
        the target's final hidden state at the position before, `hidden` [B, H] (`draft.Draft`) ->
        (tokens [B, k], logits [B, k, V] fp32), on the host. The ids and positions go in as [B, 1], as
        the decode graph takes them (a compiled graph names its shape by the first input's two dims)."""
        inputs = (last_ids.reshape(-1, 1), hidden, positions.reshape(-1, 1))
        tokens, logits = self._draft(*self._sent(inputs))
        return tokens.cpu(), logits.float().cpu()

    @torch.no_grad()
    def step(self, chunks: list[Chunk], ids: torch.Tensor, positions: torch.Tensor, sampling: torch.Tensor):
        """`prefill(chunks)` and `decode(ids, positions, sampling)` in one call of the step graph (the
        chunks are one call's: at most the largest of `prefill_rows`) -> (the chunks' tokens [n], their
        logits [n, V] or None, every row's tokens [B], their logits [B, V] or None)."""
        padded, inputs = self._padded(chunks)
        inputs += [torch.tensor([c.sampling for c in padded]), ids, positions, sampling]
        tokens, logits = self._out(self._step(*self._sent(inputs)))
        n, rows = len(chunks), len(padded)
        return (
            tokens[:n],
            None if logits is None else logits[:n],
            tokens[rows:],
            None if logits is None else logits[rows:],
        )

    def _sent(self, inputs):
        """The inputs on `device`. One already there is passed as it is, not through `to`: a call into
        torch releases the GIL, and another thread of the host (serving's text thread) may then hold
        it until its work is done, in series with the graph call that follows."""
        return [x if x.device == self.device else x.to(self.device) for x in inputs]

    @torch.no_grad()
    def copy_row(self, src: int, dst: int) -> None:
        """Row `src` of the KV state copied into row `dst` on the device (prefix caching)."""
        out = self._copy(*(torch.tensor([r]).to(self.device) for r in (src, dst)))
        (out[0] if isinstance(out, (tuple, list)) else out).cpu()  # waits for the call

    @torch.no_grad()
    def prefill_processing(self, chunks: list[Chunk]) -> list[tuple[torch.Tensor, ...]]:
        """The logits-processing prefill of `chunks` (each with its `targets`), batched as `prefill`
        batches: per chunk, its tokens' (logprob of the target [n], its rank [n], top ids [n, N], top
        logprobs [n, N])."""
        most = self.prefill_rows[-1]
        if len(chunks) > most:
            return [s for i in range(0, len(chunks), most) for s in self.prefill_processing(chunks[i : i + most])]
        padded, inputs = self._padded(chunks)
        bucket = inputs[0].shape[1]
        inputs.append(torch.tensor([[0] * (bucket - len(c.ids)) + list(c.targets) for c in padded]))
        scores = [t.cpu() for t in self._prefill_processing(*self._sent(inputs))[:4]]
        return [tuple(t[i, -len(c.ids) :] for t in scores) for i, c in enumerate(chunks)]

    @torch.no_grad()
    def decode_processing(self, ids, positions, sampling, process, bias_ids, bias, mask):
        """The logits-processing decode -> (tokens [B], (logprobs [B], ranks [B], top ids [B, N], top
        logprobs [B, N]), logits [B, V] or None)."""
        inputs = (ids, positions, sampling, process, bias_ids, bias, mask)
        outputs = self._decode_processing[self.decode_length(positions)](*self._sent(inputs))
        logits = self.logits if self.logits is not None else len(outputs) > 5
        scores = (outputs[1][:, 0].cpu(), outputs[2][:, 0].cpu(), outputs[3].cpu(), outputs[4].cpu())
        return outputs[0][:, 0].cpu(), scores, (outputs[5].float().cpu() if logits else None)

    def _out(self, outputs):
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)  # one output may come bare
        logits = self.logits if self.logits is not None else len(outputs) > 1
        return outputs[0][:, 0].cpu(), (outputs[1].float().cpu() if logits else None)


class _Lengths(dict):
    """Decode graphs by the KV length they attend over (`lengths`: ascending; None, the whole cache of a
    length the runtime was not told, last)."""

    def __init__(self, graphs: dict):
        super().__init__(graphs)
        self.lengths = sorted(graphs, key=lambda n: math.inf if n is None else n)


def _by_length(decode) -> _Lengths | None:
    """A decode callable, or {KV length: callable}, as `_Lengths` (None: no such graph)."""
    if decode is None:
        return None
    return _Lengths(decode if isinstance(decode, dict) else {None: decode})


def graph_runtime(graphs: dict, batch: int, pad_id: int, device="cpu") -> GraphRuntime:
    """Graphs keyed "prefill <bucket>" (one row each), "decode" (over the whole cache) and "decode <L>"
    (an artifact's decode key over the first L positions, `with_kv_length`), sharing one KV state, as a
    runtime."""
    buckets = [int(key.split()[1]) for key in graphs if key.startswith("prefill ")]
    prefill = lambda *inputs: graphs[f"prefill {inputs[0].shape[1]}"](*inputs)  # noqa: E731
    spans = {int(key.split()[1]): graph for key, graph in graphs.items() if key.startswith("decode ")}
    decode = {n: with_kv_length(graph, n) for n, graph in spans.items()} | {None: graphs["decode"]}
    return GraphRuntime(prefill, decode, Shapes(batch_size=batch, buckets=buckets), pad_id=pad_id, device=device)


def with_kv_length(graph, length: int):
    """An artifact's decode key over the first `length` positions (`token_generation_<L>`,
    `neuron/artifact.py`) called as the whole cache's is: its last input, `kv_length` [length], appended,
    the input whose shape alone routes a call to that key (made once here, never read)."""
    kv_length = torch.zeros(length, dtype=torch.int32)
    return lambda *inputs: graph(*inputs, kv_length)


class Rows:
    """The `batch` rows of a runtime's graphs, the work in each, and the step that runs them.

    `prefill_all`: each step prefills every row still prefilling (in as many calls as the runtime
    needs) before its decode; else one prefill call's worth, so that a long prompt costs the rows
    generating beside it one chunk's call per token, not its whole prefill."""

    def __init__(self, runtime, prefill_all: bool = False, prefix=None):
        self.runtime, self.batch = runtime, runtime.batch
        self.prefix = prefix  # a prefix.PrefixIndex: prefix caching (the runtime has `copy_row`), or None
        self._per_step = runtime.batch if prefill_all else runtime.prefill_rows[-1]  # chunks a step prefills
        self.slots: list = [None] * self.batch  # the work in each row
        # The decode call's inputs, made once and written in place a row at a time (through numpy views
        # of the same memory: a write of one element costs a fraction of a tensor's indexing).
        self.ids = torch.full((self.batch, 1), runtime.pad_id, dtype=torch.long)  # each row's next input
        self.positions = torch.zeros(self.batch, 1, dtype=torch.long)  # and its position
        self.sampling = torch.tensor([GREEDY] * self.batch)  # and its sampling (`static.sampling.FIELDS`)
        self._ids, self._positions, self._sampling = self.ids.numpy(), self.positions.numpy(), self.sampling.numpy()
        self.steps = 0  # decode steps run
        # called after each graph call that ran, before its tokens are handed out: (graph, rows it ran)
        self.counted: Callable[[str, int], None] | None = None
        # called after each prefix lookup: (prompt tokens queried, tokens taken from a held prefix)
        self.looked_up: Callable[[int, int], None] | None = None
        # called after each verify call (speculation): the drafts of each row that had any, and how
        # many of them it accepted
        self.verified: Callable[[list[int], list[int]], None] | None = None
        # speculation's verify inputs, made once and written in place as the decode's are (`_verify_inputs`)
        self.verify_inputs, self._verify = _verify_buffers(runtime)
        # prompt lookup: each row's tokens, each at its position (its prompt, then every token it is fed,
        # `_next`), in an array that grows: what the proposer searches, read as a view (None: no lookup)
        lookup = getattr(getattr(runtime, "speculative", None), "method", None) == "ngram"
        self._tokens: list[np.ndarray] | None = [np.zeros(0, dtype=np.int64)] * self.batch if lookup else None
        # per row, with an assistant: (its work, the position of its fed token, the target's hidden state before it)
        self._hidden: dict[int, tuple[object, int, torch.Tensor]] = {}
        self._done = [0] * self.batch  # prompt tokens prefilled so far, per row
        self._asks = [False] * self.batch  # whether each row's work runs in the logits-processing variants
        self._fed = [NEUTRAL[4:]] * self.batch  # its (reset, fed_prompt, fed_output) flags for its next decode
        self._order = [0] * self.batch  # when each row's work was admitted: the oldest prefills first
        self._admitted = itertools.count()
        # work taken but not yet admitted: it waits for a row still prefilling to write the prefix it takes
        self.held = None

    def active(self) -> list[int]:
        return [row for row, work in enumerate(self.slots) if work is not None]

    def generating(self) -> list[int]:
        return [row for row in self.active() if not self._prefilling(row)]

    def step(self, take: Callable[[], object] = lambda: None) -> list[int]:
        """Admission from `take`, a prefill, then a decode (each only if a row needs it), in one call
        of the runtime's step graph where it can (`_fused`); the rows the decode ran."""
        self._admit(take)
        rows, chunks = self._chunks()
        speculating = getattr(self.runtime, "speculative", None)
        fused = None if speculating else self._fused(rows, chunks)
        if fused is not None:
            return fused
        self._prefill(rows, chunks)
        return self._speculate() if speculating else self._decode()

    def free(self, row: int, error: Exception | None = None) -> None:
        """End the work in `row` (with `error`, if it failed) and free the row."""
        work, self.slots[row] = self.slots[row], None
        # a free row waits at position 0, or after the prefix it holds (which its pad must not touch)
        self._ids[row, 0] = self.runtime.pad_id
        self._positions[row, 0] = 0 if self.prefix is None else self.prefix.park(row, error)
        work.end(error)

    def _prefilling(self, row: int) -> bool:
        return self._done[row] < self._prefilled(row)

    def _prefilled(self, row: int) -> int:
        """The prompt tokens the row's prefill takes: all, or all but the last for work that asks."""
        n = len(self.slots[row].prompt)
        return n - 1 if self._asks[row] and n else n

    def _admit(self, take: Callable[[], object]) -> None:
        admitted: set[int] = set()  # a row takes one piece of work a step
        while free := [row for row in range(self.batch) if self.slots[row] is None and row not in admitted]:
            work, self.held = take() if self.held is None else self.held, None
            if work is None:
                return
            asks = bool(getattr(work, "asks", False))
            if self.prefix is not None and not asks and self._awaits(work.prompt):
                self.held = work
                return
            if self.prefix is None:
                row, source, hit = free[0], None, 0
            else:
                row, source, hit = self._place(work.prompt, free, lookup=not asks)
            admitted.add(row)
            self.slots[row], self._done[row], self._order[row] = work, hit, next(self._admitted)
            self._positions[row, 0] = hit  # its first chunk's first position
            self._asks[row] = asks
            if self._tokens is not None:
                self._tokens[row] = np.array(work.prompt, dtype=np.int64)
            if source is not None and source != row:
                self._call("copy", [row], self.runtime.copy_row, source, row)
            if self._asks[row] and len(work.prompt) == 1:  # no prefill: its first decode resets its counts
                self._fed_prompt(row, reset=True)
            elif not work.prompt:
                self._next(row, None, None)

    def _awaits(self, prompt: list[int]) -> bool:
        """Whether a row still prefilling will write more whole blocks of `prompt`'s takeable prefix
        than any row holds now: then the work waits for them (a step for a prompt within one chunk),
        and so do the pieces of work behind it. One prefill then serves a request's n generations of
        one prompt, or prompts sent together that share a long prefix; the rest of each is copied."""
        end = self.prefix.held(prompt) + self.prefix.block  # the next whole block past what is held
        if end > len(prompt) - 1:
            return False
        for row in self.active():
            if self._prefilling(row) and self._prefilled(row) >= end and self.slots[row].prompt[:end] == prompt[:end]:
                return True
        return False

    def _place(self, prompt: list[int], free: list[int], lookup: bool) -> tuple[int, int | None, int]:
        """(the row for `prompt`, the row holding its longest held prefix or None, that prefix's length);
        `lookup` False: no prefix taken nor counted (work that asks for logits processing)."""
        source, hit = self.prefix.lookup(prompt, free) if lookup else (None, 0)
        row = self.prefix.victim(free)
        self.prefix.admit(row, source, hit)
        if lookup and self.looked_up is not None:
            self.looked_up(len(prompt), hit)
        return row, source, hit

    def _fed_prompt(self, row: int, reset: bool) -> None:
        """Work that asks, prefilled but for its prompt's last token: that token is its next decode input."""
        prompt = self.slots[row].prompt
        self._ids[row, 0], self._positions[row, 0] = prompt[-1], len(prompt) - 1
        self._fed[row] = (1.0 if reset else 0.0, 1.0, 0.0)

    def _chunks(self) -> tuple[list[int], list[Chunk]]:
        """The rows this step prefills (the oldest first, as many as a step takes) and the chunk of each."""
        prefilling = [row for row in self.active() if self._prefilling(row)]
        rows = sorted(prefilling, key=self._order.__getitem__)[: self._per_step]
        chunks = []
        for row in rows:
            work, done = self.slots[row], self._done[row]
            end = self._prefilled(row)
            piece = work.prompt[done : min(done + self.runtime.chunk, end)]
            if self._asks[row]:  # no token from this prefill: what it writes, and the prompt's logprobs
                chunks.append(Chunk(piece, done, row, GREEDY, work.prompt[done + 1 : done + 1 + len(piece)]))
            else:
                chunks.append(Chunk(piece, done, row, work.sampling() if done + len(piece) == end else GREEDY))
        return rows, chunks

    def _prefill(self, rows: list[int], chunks: list[Chunk]) -> None:
        plain = [(row, c) for row, c in zip(rows, chunks) if c.targets is None]
        asking = [(row, c) for row, c in zip(rows, chunks) if c.targets is not None]
        if plain:
            tokens, logits = self._call("prefill", [r for r, _ in plain], self.runtime.prefill, [c for _, c in plain])
            self._took_chunks(plain, tokens, logits)
        if asking:
            rows = [r for r, _ in asking]
            scores = self._call("prefill", rows, self.runtime.prefill_processing, [c for _, c in asking])
            for (row, chunk), chunk_scores in zip(asking, scores):
                self._prefilled_chunk(row, chunk)
                work = self.slots[row]
                if hasattr(work, "prompt_scores"):
                    try:
                        work.prompt_scores(chunk.start, *chunk_scores)
                    except Exception as e:  # the work's own failure: its row is freed, the others go on
                        self.free(row, e)
                        continue
                if not self._prefilling(row):
                    self._fed_prompt(row, reset=False)

    def _took_chunks(self, plain: list[tuple[int, Chunk]], tokens: torch.Tensor, logits: torch.Tensor | None) -> None:
        """The chunks of `plain` (row, chunk) prefilled: a row whose prompt that completes takes its token."""
        for i, (row, chunk) in enumerate(plain):
            self._prefilled_chunk(row, chunk)
            if not self._prefilling(row):
                self._next(row, int(tokens[i]), None if logits is None else logits[i])

    def _fused(self, prefilling: list[int], chunks: list[Chunk]) -> list[int] | None:
        """The step's prefill (`chunks` into rows `prefilling`) and decode in one call of the runtime's
        step graph, when it has one (`fuses`), rows are generating and a chunk is to be prefilled, all
        in one call's worth (`prefill_rows`), and no row asks for logits processing -> the rows it
        decoded; else None, and the step makes its two calls. A row being prefilled sits in the decode
        part as the pad at its position after its chunk (a row whose prompt completes decodes from the
        next step on). The call counts as a prefill of its chunks and a decode of its rows (`counted`)."""
        if not getattr(self.runtime, "fuses", False):
            return None
        decoding = self.generating()
        if not chunks or not decoding or len(chunks) > self.runtime.prefill_rows[-1]:
            return None
        if any(self._asks[row] for row in prefilling + decoding):
            return None
        for row, chunk in zip(prefilling, chunks):
            self._positions[row, 0] = chunk.start + len(chunk.ids)
        self._sample(decoding)
        fed = None if self.prefix is None else [int(self._ids[row, 0]) for row in decoding]
        inputs = (chunks, self.ids, self.positions, self.sampling)
        out = self._call(None, prefilling + decoding, self.runtime.step, *inputs)
        if self.counted is not None:
            self.counted("prefill", len(chunks))
            self.counted("decode", len(decoding))
        self._took_chunks(list(zip(prefilling, chunks)), *out[:2])
        self._decoded(decoding, fed, *out[2:])
        return decoding

    def _prefilled_chunk(self, row: int, chunk: Chunk) -> None:
        """The row's cache now holds `chunk`: its next chunk (or its first token) starts after it."""
        if self.prefix is not None:
            self.prefix.extend(row, chunk.ids)
        self._done[row] += len(chunk.ids)
        self._positions[row, 0] = self._done[row]

    def _decode(self) -> list[int]:
        rows = self.generating()
        if not rows:
            return []
        self._sample(rows)
        asking = [row for row in rows if self._asks[row]]
        if asking:
            inputs = self._processing_inputs(asking)
            rows = [row for row in rows if self.slots[row] is not None]  # a work whose inputs failed is gone
            if not rows:
                return []
        fed = None if self.prefix is None else [int(self._ids[row, 0]) for row in rows]
        if asking:
            tokens, scores, logits = self._call(
                "decode", rows, self.runtime.decode_processing, self.ids, self.positions, self.sampling, *inputs
            )
        else:
            tokens, logits = self._call("decode", rows, self.runtime.decode, self.ids, self.positions, self.sampling)
            scores = None
        self._decoded(rows, fed, tokens, logits, scores)
        return rows

    def _sample(self, rows: list[int]) -> None:
        """The decode's sampling input: each of `rows`' own, greedy for the others."""
        self._sampling[:] = GREEDY
        for row in rows:
            self._sampling[row] = self.slots[row].sampling()

    def _decoded(self, rows: list[int], fed: list[int] | None, tokens, logits, scores=None) -> None:
        """A decode of `rows` ran (`fed`: the ids they were fed, for the prefix index): each row's token to its work."""
        self.steps += 1
        tokens = tokens.tolist()
        if fed is not None:  # each row's cache now holds the token it was fed
            for row, token in zip(rows, fed):
                self.prefix.extend(row, [token])
        for row in rows:
            self._positions[row, 0] += 1
            row_logits = None if logits is None else logits[row]
            if self._asks[row]:
                self._fed[row] = (0.0, 0.0, 1.0)  # its token is fed next: an output token
                chosen, rank, top_ids, top = scores
                self._next(row, tokens[row], row_logits, (float(chosen[row]), int(rank[row]), top_ids[row], top[row]))
            else:
                self._next(row, tokens[row], row_logits)

    def _speculate(self) -> list[int]:
        """The decode of a runtime built with speculation: each generating row proposes up to k drafts
        (`_drafts`), one verify call checks them all (`GraphRuntime.verify`), and each row takes its
        accepted drafts and the token after them through its work's `next`, one at a time (so an end
        mid-way drops the rest), its position advancing by what it took. A step in which some row asks
        for logits processing, or (prompt lookup) no row has a draft, is a plain decode step
        (`_decode`): those rows' processing (penalties, bias, grammar, logprobs) applies at one
        position a step as without speculation, and their steps speculate for no row."""
        rows = self.generating()
        if any(self._asks[row] for row in rows):
            return self._decode()
        drafts = self._drafts(rows)
        if not any(drafts.values()) and self.runtime.speculative.method == "ngram":
            return self._decode()
        self._verify_inputs(rows, drafts)
        ids, positions, drafted, uniforms = self.verify_inputs
        tokens, accepted, logits, hidden = self._call(
            "verify", rows, self.runtime.verify, ids, positions, self.sampling, drafted, uniforms
        )
        self.steps += 1
        accepted = accepted.tolist()
        if self.verified is not None:
            proposed = [row for row in rows if drafts[row]]
            self.verified([len(drafts[row]) for row in proposed], [accepted[row] for row in proposed])
        for row in rows:
            n = accepted[row] + 1
            if self.prefix is not None:  # the row's cache now holds its fed token and the drafts it took
                self.prefix.extend(row, self._verify[0][row, :n].tolist())
            work = self.slots[row]
            if hidden is not None:  # the assistant's input at the row's next token: the last one it took here
                self._hidden[row] = (work, int(self._positions[row, 0]) + n, hidden[row, n - 1])
            for i, token in enumerate(tokens[row, :n].tolist()):
                self._positions[row, 0] += 1
                self._next(row, token, None if logits is None else logits[row, i])
                if self.slots[row] is not work:  # it ended: the rest is dropped
                    break
        return rows

    def _drafts(self, rows: list[int]) -> dict[int, list[int]]:
        """Each generating row's drafts: prompt lookup over its tokens (`speculative.ngram_propose`), or
        the assistant's k (`GraphRuntime.draft`) from the target's hidden state at the position before
        the row's fed token, which the row's last verify call gave (none before that: its first
        speculative step drafts nothing, and its verify call gives it)."""
        config = self.runtime.speculative
        k = config.num_speculative_tokens
        if config.method == "ngram":
            low, high = config.prompt_lookup_min, config.prompt_lookup_max
            return {row: ngram_propose(self._context(row), k, low, high) for row in rows}
        held = {}
        for row in rows:
            work, position, state = self._hidden.get(row, (None, None, None))
            if work is self.slots[row] and position == int(self._positions[row, 0]):
                held[row] = state
        if not held:
            return {row: [] for row in rows}
        states = torch.zeros(self.batch, next(iter(held.values())).shape[-1])
        for row, state in held.items():
            states[row] = state
        tokens = self.runtime.draft(self.ids[:, 0], states, self.positions[:, 0])[0]
        return {row: tokens[row].tolist() if row in held else [] for row in rows}

    def _context(self, row: int) -> np.ndarray:
        """The row's tokens up to the one it is fed now (what prompt lookup searches): a view of its
        token array, no copy."""
        return self._tokens[row][: int(self._positions[row, 0]) + 1]

    def _verify_inputs(self, rows: list[int], drafts: dict[int, list[int]]) -> None:
        """The verify call's inputs (`verify_inputs`), written in place: ids and positions [B, q] (each
        row's fed token, then its drafts, padded), drafted [B] and uniforms [B, q] (a sampled row's own
        draw for each column it fills, `sampling`; its sampling row in `self.sampling`), every row's
        positions running on from its own."""
        ids, positions, drafted, uniforms = self._verify
        ids[:, 0], ids[:, 1:] = self._ids[:, 0], self.runtime.pad_id
        np.add(self._positions, np.arange(ids.shape[1]), out=positions)
        drafted[:], uniforms[:] = 0, 0.0
        self._sampling[:] = GREEDY
        for row in rows:
            work, draft = self.slots[row], drafts[row]
            n = len(draft)
            ids[row, 1 : 1 + n] = draft
            drafted[row] = n
            draws = [work.sampling() for _ in range(n + 1)]
            self._sampling[row] = draws[0]
            uniforms[row, : n + 1] = [d[3] for d in draws]

    def _processing_inputs(self, asking: list[int]):
        """(process, bias_ids, bias, mask) of the variant decode: neutral but for the rows that ask."""
        process, bias_ids, bias, mask = neutral_inputs(self.batch, self.runtime.vocab)
        groups: dict[type, list] = {}  # the rows' grammar matchers, by class: each class fills its own at once
        for row in asking:
            matcher = getattr(self.slots[row], "matcher", None)
            if matcher is not None:
                groups.setdefault(type(matcher), []).append(matcher)
        for kind, matchers in groups.items():
            kind.fill(matchers)
        for row in asking:
            try:
                values, entries, allowed = self.slots[row].processing()
                if len(entries) > BIAS_WIDTH:
                    raise ValueError(f"{len(entries)} logit bias and banned entries; the graphs take {BIAS_WIDTH}")
            except Exception as e:  # the work's own failure: its row is freed (neutral), the others go on
                self.free(row, e)
                continue
            process[row] = torch.tensor((*values, *self._fed[row]))
            if entries:
                ids, values = zip(*entries)
                bias_ids[row, : len(ids)] = torch.tensor(ids)
                bias[row, : len(ids)] = torch.tensor(values)
            if allowed is not None:
                mask[row] = allowed
        return process, bias_ids, bias, mask

    def _call(self, graph: str, rows: list[int], call, *inputs):
        try:
            out = call(*inputs)
        except Exception as e:
            for row in rows:
                self.free(row, e)
            raise
        if self.counted is not None and graph is not None:
            self.counted(graph, len(rows))
        return out

    def _next(self, row: int, token: int | None, logits: torch.Tensor | None, scores=None) -> None:
        work = self.slots[row]
        feed = work.next(token, logits) if scores is None else work.next(token, logits, scores)
        if feed is None:
            self.free(row)
        else:
            self._ids[row, 0] = feed
            if self._tokens is not None:
                self._fed_token(row, feed)

    def _fed_token(self, row: int, token: int) -> None:
        """Prompt lookup: `token`, fed to the row now, into its token array at its position (the array
        doubled when full)."""
        position, tokens = int(self._positions[row, 0]), self._tokens[row]
        if position >= len(tokens):
            tokens = self._tokens[row] = np.concatenate([tokens, np.zeros(max(position + 1, 16), dtype=np.int64)])
        tokens[position] = token


def _verify_buffers(runtime) -> tuple[tuple[torch.Tensor, ...] | None, tuple[np.ndarray, ...] | None]:
    """A speculating runtime's verify inputs (`GraphRuntime.verify`): ids and positions [B, q] int64,
    drafted [B] int64, uniforms [B, q] fp32, q = k + 1; and numpy views of each, through which a step
    writes them. (None, None) for a runtime that does not speculate."""
    config = getattr(runtime, "speculative", None)
    if config is None:
        return None, None
    batch, q = runtime.batch, config.num_speculative_tokens + 1
    tensors = (
        torch.full((batch, q), runtime.pad_id, dtype=torch.long),
        torch.zeros(batch, q, dtype=torch.long),
        torch.zeros(batch, dtype=torch.long),
        torch.zeros(batch, q),
    )
    return tensors, tuple(t.numpy() for t in tensors)


@dataclass
class _Greedy:
    """A prompt generating `n` tokens greedily, keeping them (and their logits)."""

    prompt: list[int]
    n: int
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    def sampling(self) -> tuple[float, float, float, float]:
        return GREEDY

    def next(self, token: int, logits: torch.Tensor | None) -> int | None:
        self.tokens.append(token)
        if logits is not None:
            self.logits.append(logits)
        return token if len(self.tokens) < self.n else None

    def end(self, error: Exception | None = None) -> None:
        """Nothing to release: a failed graph call raises out of `generate`."""


def generate(runtime, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int):
    """Greedy generation of left-padded prompts, `runtime.batch` at a time (prompt i in row i mod
    batch): a step prefills every prompt it admits and decodes every row; the rows end together and
    the next step admits the next prompts -> (tokens [prompts, n], logits [prompts, n, V] or None) on
    the host. The prompts were checked against the buckets and the cache (`StaticGenerator.check`)."""
    prompts = [_Greedy(ids[mask.bool()].tolist(), max_new_tokens) for ids, mask in zip(input_ids, attention_mask)]
    rows, waiting = Rows(runtime, prefill_all=True), deque(prompts)
    while waiting or rows.active():
        rows.step(lambda: waiting.popleft() if waiting else None)
    logits = torch.stack([torch.stack(p.logits) for p in prompts]) if prompts[0].logits else None
    return torch.tensor([p.tokens for p in prompts]), logits
