"""transformers' model on CPU as a runtime of the engine step (`static/rows.py`), beside the static
graphs' (`static/runtime.py`) and the Neuron artifact's (`serve/neuron.py`).

The engine (`engine.Engine`) drives `Rows.step` over any runtime with Rows' protocol; this one
computes each row's logits with HF's model, a `DynamicCache` per row (any experts implementation, any
prompt length up to max_position_embeddings: no buckets, no fixed cache), and chooses the tokens on the
host with the graphs' own functions (`static/sampling.py`: `pick` over every token of the vocabulary,
so any top_k is exact; `process`, `count_tokens` and `logprobs` for the rows that ask for logits
processing, with the rows' token counts kept here as the variant graphs keep them on the device). So a
request gets what the graphs would give it from the same logits, and every request a static runtime
serves, this one serves too.

`HostRuntime` is that protocol over any model of one row at a time: a subclass says how a row starts a
sequence (`reset`) and computes the logits after some of its tokens (`logits`); `HFRuntime` is HF's
model. A row's sequence grows as the steps feed it: a chunk at position 0 (or a decode at position 0,
a request that asks with a one-token prompt) starts it afresh, every other call goes on from its last
position. An idle row (free, or still prefilling) carries the pad id, -1, which is no token: it is
skipped, not fed, so a step costs the model one forward per row that generates.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..static.rows import Chunk
from ..static.sampling import TOP_LOGPROBS, count_tokens, logprobs, pick, process


class HostRuntime:
    """Rows' runtime protocol (`static/rows.py`: `batch`, `pad_id`, `chunk`, `prefill_rows`, `prefill`,
    `decode`, `processing` and its two variants, `vocab`, `max_cache_len`) over a model that computes one
    row's logits at a time on the host. `chunk`: the longest piece of a prompt one step prefills (default:
    the whole context); every row still prefilling is prefilled each step."""

    pad_id = -1  # an idle row's input: no token, never fed
    buckets = ()  # any prompt length
    candidates = None  # top-k and top-p over every token: any top_k is exact
    processing = True
    prefix_caching = False

    def __init__(self, batch: int, vocab: int, max_cache_len: int, chunk: int | None = None):
        self.batch, self.vocab, self.max_cache_len = batch, vocab, max_cache_len
        self.prefill_rows = (batch,)
        self.chunk = chunk or max_cache_len
        self._length = [0] * batch  # the tokens each row's sequence holds
        # the rows' token counts (`cache.TokenCounts`): generated tokens [B, V], prompt tokens seen [B, V]
        self._output, self._prompt = torch.zeros(batch, vocab), torch.zeros(batch, vocab)

    def reset(self, row: int) -> None:
        """Start a new sequence in `row`."""
        raise NotImplementedError

    def logits(self, row: int, ids: list[int], start: int, keep: int) -> torch.Tensor:
        """The row's sequence goes on with `ids` at positions start.. -> fp32 logits [keep, V] after its
        last `keep` tokens (0: after every one)."""
        raise NotImplementedError

    def _forward(self, row: int, ids: list[int], start: int, keep: int) -> torch.Tensor:
        if start == 0:
            self.reset(row)
        elif start != self._length[row]:
            raise RuntimeError(f"row {row} holds {self._length[row]} tokens; a call went on from position {start}")
        out = self.logits(row, ids, start, keep)
        self._length[row] = start + len(ids)
        return out

    @torch.no_grad()
    def prefill(self, chunks: list[Chunk]):
        """Each chunk into its row -> (the token each chunk's sampling picks after it [n], None)."""
        logits = torch.stack([self._forward(c.row, c.ids, c.start, 1)[-1] for c in chunks])
        return pick(logits, torch.tensor([c.sampling for c in chunks]), self.vocab)[:, 0], None

    @torch.no_grad()
    def prefill_processing(self, chunks: list[Chunk]) -> list[tuple[torch.Tensor, ...]]:
        """Each chunk into its row, its tokens counted as the prompt's (from zero at position 0) -> per
        chunk, its targets' (logprob [n], rank [n], top ids [n, N], top logprobs [n, N])."""
        scores = []
        for c in chunks:
            logits = self._forward(c.row, c.ids, c.start, 0)
            scores.append(logprobs(logits, torch.tensor(c.targets), TOP_LOGPROBS))
            if c.start == 0:
                self._output[c.row], self._prompt[c.row] = 0, 0
            self._prompt[c.row, c.ids] = 1
        return scores

    def _live(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """(the rows fed a token, their logits [L, V] after it)."""
        live = [row for row in range(self.batch) if ids[row, 0] >= 0]
        if not live:
            return live, None
        fed = [self._forward(row, [int(ids[row, 0])], int(positions[row, 0]), 1)[-1] for row in live]
        return live, torch.stack(fed)

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, sampling: torch.Tensor):
        """Every row fed a token -> (tokens [B], None); an idle row's token is the pad id."""
        tokens = torch.full((self.batch,), self.pad_id, dtype=torch.long)
        live, logits = self._live(ids, positions)
        if live:
            tokens[live] = pick(logits, sampling[live].float(), self.vocab)[:, 0]
        return tokens, None

    @torch.no_grad()
    def decode_processing(self, ids, positions, sampling, process_row, bias_ids, bias, mask):
        """As `decode`, each fed token counted as `process_row` flags it and the logits processed as the
        variant decode graph processes them (`decoder.ProcessingDecode`) -> (tokens [B], (logprobs [B],
        ranks [B], top ids [B, N], top logprobs [B, N]), None)."""
        batch = self.batch
        tokens = torch.full((batch,), self.pad_id, dtype=torch.long)
        scores = (torch.zeros(batch), torch.zeros(batch, dtype=torch.long))
        scores += (torch.zeros(batch, TOP_LOGPROBS, dtype=torch.long), torch.zeros(batch, TOP_LOGPROBS))
        live, raw = self._live(ids, positions)
        if not live:
            return tokens, scores, None
        rows = torch.tensor(live)
        output, prompt = count_tokens(self._output[rows], self._prompt[rows], ids[rows], process_row[rows])
        self._output[rows], self._prompt[rows] = output, prompt
        sampling, inputs = sampling[rows].float(), (process_row[rows], bias_ids[rows], bias[rows], mask[rows])
        processed = process(raw, sampling[:, 0], *inputs, output, prompt)
        picked = pick(processed, sampling, self.vocab, torch.isfinite(raw.sum(-1)))[:, 0]
        tokens[rows] = picked
        for all_rows, some in zip(scores, logprobs(raw, picked, TOP_LOGPROBS)):
            all_rows[rows] = some
        return tokens, scores, None


class HFRuntime(HostRuntime):
    """transformers' model on CPU (any experts implementation), `batch` rows, a `DynamicCache` each; its
    context is the model's max_position_embeddings (max_cache_len one less: the last token is never fed)."""

    def __init__(self, model, batch: int = 1, chunk: int | None = None):
        config = model.config
        super().__init__(batch, config.vocab_size, config.max_position_embeddings - 1, chunk)
        self.model = model
        self._caches: list[DynamicCache | None] = [None] * batch

    def reset(self, row: int) -> None:
        self._caches[row] = DynamicCache(config=self.model.config)

    def logits(self, row: int, ids: list[int], start: int, keep: int) -> torch.Tensor:
        out = self.model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.arange(start, start + len(ids))[None],
            cache=self._caches[row],
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits[0].float()
