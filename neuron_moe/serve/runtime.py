"""The static graphs as the batching engine calls them (`static/rows.py`): one interface, two runtimes.

A runtime holds a KV cache of `batch` rows as its state (`static/cache.py`); no cache tensor
crosses its calls. What goes in is ids, positions and each row's sampling (temperature, top-k,
top-p and a uniform draw, `static/sampling.py`); what comes back is the token each row's graph
chose (and the logits, from graphs built to return them):

  prefill(chunks)                  up to max(prefill_rows) chunks of prompts, each into its own
                                   cache row (the other rows are not touched), in one call
                                   -> (tokens [n], logits [n, V] | None)
  decode(ids, positions, sampling) [B, 1], [B, 1], [B, 4]: every row one token at its own position
                                   -> (tokens [B], logits [B, V] | None)

A prefill call takes P rows of one bucket: P the smallest of the compiled `prefill_rows` that
holds the chunks (padded with copies of the last chunk: the same row written twice with the same
values), the bucket the smallest that holds the longest chunk. A chunk is a whole prompt or a
piece of one (`Chunk.start` > 0: it attends to what the row's cache holds of the pieces before it).

`GraphRuntime` makes these calls on two callables with the static decoder's signatures
(`static/decoder.py`): on CPU the `Prefill` and `Decode` modules themselves over one `KVCache`
(`static_runtime`, `serve --backend static`), on Inferentia2 the compiled artifact, whose one
callable NxD routes to the key whose input shapes match (`neuron.py`).
"""

from __future__ import annotations

import torch

from ..static.decoder import Decode, Prefill, new_cache
from ..static.loop import bucket_for, prefill_row
from ..static.rows import Chunk
from ..static.sampling import CANDIDATES


class GraphRuntime:
    def __init__(
        self,
        prefill,
        decode,
        *,
        batch: int,
        buckets,
        prefill_rows,
        max_length: int,
        logits: bool,
        candidates: int,
        pad_id: int = 0,
        chunk: int | None = None,
    ):
        self._prefill, self._decode = prefill, decode
        self.batch, self.buckets, self.max_length = batch, sorted(buckets), max_length
        self.prefill_rows = sorted(prefill_rows)
        self.chunk = chunk or self.buckets[-1]  # the longest piece of a prompt one prefill call takes
        self.candidates = candidates  # top-k / top-p candidate width of the graphs
        self.pad_id = pad_id
        self.logits = logits

    @torch.no_grad()
    def prefill(self, chunks: list[Chunk]):
        """The caller checked that each chunk fits a bucket and the cache, that their rows are
        distinct rows of the batch, and that there are at most max(prefill_rows) of them."""
        rows = next(p for p in self.prefill_rows if p >= len(chunks))
        bucket = bucket_for(max(len(c.ids) for c in chunks), self.buckets)
        padded = chunks + [chunks[-1]] * (rows - len(chunks))
        parts = [prefill_row(torch.tensor(c.ids), bucket, self.pad_id, c.start) for c in padded]
        inputs = [torch.cat(column) for column in zip(*parts)]
        inputs += [torch.tensor([c.row for c in padded]), torch.tensor([c.sampling for c in padded])]
        tokens, logits = self._out(self._prefill(*inputs))
        return tokens[: len(chunks)], None if logits is None else logits[: len(chunks)]

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, sampling: torch.Tensor):
        return self._out(self._decode(ids, positions, sampling))

    def _out(self, outputs):
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)  # one output may come bare
        return outputs[0][:, 0].cpu(), (outputs[1].float().cpu() if self.logits else None)


def static_runtime(
    model, spec, batch: int | None = None, *, prefill_rows=None, chunk: int | None = None, logits: bool = False
) -> GraphRuntime:
    """The port's static graphs on CPU, as modules: `Prefill` (every bucket and row count) and
    `Decode` over one KV cache of `batch` rows (default: the port's [static] batch_size), each graph
    with the experts implementation the port names for it, choosing its tokens itself. `prefill_rows`
    and `chunk` default to the port's; `logits=True` also returns the logits (tests)."""
    batch = batch or spec.batch_size
    cache = new_cache(model, spec.max_cache_len, batch)
    rows = sorted({min(p, batch) for p in prefill_rows}) if prefill_rows else spec.rows_for(batch)
    return GraphRuntime(
        Prefill(model, cache, spec.prefill_experts, logits=logits),
        Decode(model, cache, spec.decode_experts, logits=logits),
        batch=batch,
        buckets=spec.buckets,
        prefill_rows=rows,
        max_length=spec.max_cache_len,
        logits=logits,
        candidates=min(CANDIDATES, model.config.vocab_size),
        pad_id=model.config.pad_token_id or 0,
        chunk=chunk or spec.chunk,
    )
