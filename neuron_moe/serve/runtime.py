"""The static graphs as the batching engine calls them: one interface, two runtimes.

A runtime holds a KV cache of `batch` rows as its state (`static/cache.py`); no cache tensor
crosses its calls. What goes in is ids and positions, what comes back is the graphs' tokens (and
their logits, from graphs built to return them):

  prefill(ids, row)            one prompt, left-padded to the smallest bucket that holds it, into
                               cache row `row` (the other rows are not touched) -> (token [1], logits [1, V] | None)
  decode(ids, positions)       [B, 1] each: every row one token at its own position
                               -> (tokens [B], logits [B, V] | None)

`GraphRuntime` makes these calls on two callables with the static decoder's signatures
(`static/decoder.py`): on CPU the `Prefill` and `Decode` modules themselves over one `KVCache`
(`static_runtime`, `serve --backend static`), on Inferentia2 the compiled artifact, whose one
callable NxD routes to the key whose input shapes match (`neuron.py`).
"""

from __future__ import annotations

import torch

from ..static.decoder import Decode, Prefill, new_cache
from ..static.loop import bucket_for, prefill_row


class GraphRuntime:
    def __init__(self, prefill, decode, *, batch: int, buckets, max_length: int, logits: bool, pad_id: int = 0):
        self._prefill, self._decode = prefill, decode
        self.batch, self.buckets, self.max_length = batch, sorted(buckets), max_length
        self.pad_id = pad_id
        self.logits = logits
        self.greedy_only = not logits  # the graphs return the greedy token alone: temperature 0 only

    @torch.no_grad()
    def prefill(self, ids: list[int], row: int):
        """The caller checked that a bucket holds the prompt and that `row` is one of the batch."""
        inputs = prefill_row(torch.tensor(ids), bucket_for(len(ids), self.buckets), self.pad_id)
        return self._out(self._prefill(*inputs, torch.tensor([row])))

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, positions: torch.Tensor):
        return self._out(self._decode(ids, positions))

    def _out(self, outputs):
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)  # one output may come bare
        return outputs[0][:, 0].cpu(), (outputs[1].float().cpu() if self.logits else None)


def static_runtime(model, spec, batch: int | None = None) -> GraphRuntime:
    """The port's static graphs on CPU, as modules: `Prefill` (every bucket) and `Decode` over one
    KV cache of `batch` rows (default: the port's [static] batch_size), each graph with the experts
    implementation the port names for it. Built with logits, so that requests can sample."""
    batch = batch or spec.batch_size
    cache = new_cache(model, spec.max_cache_len, batch)
    return GraphRuntime(Prefill(model, cache, spec.prefill_experts, logits=True),
                        Decode(model, cache, spec.decode_experts, logits=True),
                        batch=batch, buckets=spec.buckets, max_length=spec.max_cache_len, logits=True,
                        pad_id=model.config.pad_token_id or 0)
