"""The static-shape Gemma-4 decoder: one prefill graph per bucket and one decode graph.

Both wrap transformers' own Gemma4ForCausalLM — HF's embedding, attention, router, dense MLP
and norms run unchanged. What is ours: the KV cache (`SlotCache`: fixed-size buffers in and
out), the attention masks (built from an attention-mask input and handed to HF as a dict per
layer type, so transformers' masking_utils and its host-side checks never run), and which
fixed-shape experts implementation each graph uses.

Every shape is fixed by (batch, bucket) or (batch, max_cache_len); positions and the cache
slot are tensors. Outputs: the greedy next token [B, 1], the fp32 logits it came from [B, V],
then the KV buffers [k0, v0, k1, v1, ...] (see cache.py for their layout).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .cache import SLIDING, SlotCache, cache_layout, decode_mask, prefill_mask


@contextmanager
def experts_implementation(model, name: str):
    """HF dispatches the experts on `config._experts_implementation` at call time; the prefill
    and decode graphs share one model but not one implementation, so each sets its own for the
    duration of its forward (a trace records the one that was set)."""
    previous = model.config._experts_implementation
    model.config._experts_implementation = name
    try:
        yield
    finally:
        model.config._experts_implementation = previous


class _StaticGraph(torch.nn.Module):
    def __init__(self, model, max_cache_len: int, experts: str):
        super().__init__()
        self.model = model
        self.layout = cache_layout(model.config, max_cache_len)
        self.experts = experts
        # per layer type: the sliding window (None for global layers) and the ring length
        self.kinds = {spec.kind: (model.config.sliding_window if spec.kind == SLIDING else None, spec.length)
                      for spec in self.layout}

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    def _run(self, input_ids, masks, position_ids, cache: SlotCache):
        with experts_implementation(self.model, self.experts):
            out = self.model(input_ids=input_ids, attention_mask=masks, position_ids=position_ids, cache=cache,
                             use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()
        return (logits.argmax(-1, keepdim=True), logits, *cache.new)


class Prefill(_StaticGraph):
    """forward(input_ids [B, bucket], attention_mask [B, bucket], position_ids [B, bucket]).

    The batch is left-padded to the bucket: the last slot is every row's last prompt token.
    """

    def forward(self, input_ids, attention_mask, position_ids):
        masks = {kind: prefill_mask(attention_mask, window, self.dtype) for kind, (window, _) in self.kinds.items()}
        return self._run(input_ids, masks, position_ids, SlotCache(self.layout))


class Decode(_StaticGraph):
    """forward(input_ids [B, 1], position_ids [B, 1], slot [1], attention_mask [B, max_cache_len], *cache).

    `slot` is the cache slot this token is written to (the same for every row); attention_mask
    marks each row's real slots (its prompt tokens and everything generated).
    """

    def forward(self, input_ids, position_ids, slot, attention_mask, *cache):
        masks = {kind: decode_mask(attention_mask, slot, length, self.dtype) for kind, (_, length) in self.kinds.items()}
        return self._run(input_ids, masks, position_ids, SlotCache(self.layout, list(cache), slot))
