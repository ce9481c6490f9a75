"""The static KV cache: one fixed-size buffer per layer, written by fixed-shape index ops.

Slots, not positions: a batch is left-padded to a prefill bucket, so slot `s` is the same
column for every row (the pads occupy the first slots) while RoPE positions count only a
row's real tokens. A row's real tokens are contiguous, so slot distance = position distance.

Each layer's buffer is a ring of `length` slots; slot `s` lives at index `s % length`:
- global layers: length = max_cache_len, so the ring never wraps (index = slot);
- sliding layers: length = min(sliding_window, max_cache_len), so the ring holds exactly the
  window (the query and the window - 1 slots before it) and overwrites what fell out of it.
With that one rule, prefill, decode and both masks are the same code for both layer kinds,
and nothing depends on how full the cache is (no Python state, no branch on data).

Why not transformers' StaticCache: its StaticSlidingWindowLayer branches on a Python int (how
full the window is), so an exported graph would freeze one branch — transformers' own export
recipes (integrations/executorch.py) therefore swap sliding layers for full-length ones and
pass no padding mask (batch 1). Its buffers are also mutated in place behind one scalar
length. Here the cache is explicit graph inputs/outputs and the masks are built from an
attention-mask input, which is what a compiler's input/output aliasing wants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Gemma4TextConfig

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class LayerCache:
    """Geometry of one layer's KV buffers, each [batch, kv_heads, length, head_dim]."""

    kind: str  # the HF layer type: "sliding_attention" or "full_attention"
    kv_heads: int
    head_dim: int
    length: int  # ring slots


def cache_layout(config: Gemma4TextConfig, max_cache_len: int) -> list[LayerCache]:
    """Per layer: global (full attention) layers have their own head_dim and KV-head count."""
    layout = []
    for i, kind in enumerate(config.layer_types):
        layer = config.per_layer_config[i]
        length = min(config.sliding_window, max_cache_len) if kind == SLIDING else max_cache_len
        layout.append(LayerCache(kind, layer.num_key_value_heads, layer.head_dim, length))
    return layout


def empty_cache(layout: list[LayerCache], batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed K and V for every layer, flat: [k0, v0, k1, v1, ...]."""
    return [torch.zeros(batch, spec.kv_heads, spec.length, spec.head_dim, dtype=dtype)
            for spec in layout for _ in ("k", "v")]


def to_ring(states: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of slots 0..S-1 ([B, H, S, D]) -> a fresh ring buffer [B, H, length, D].

    Slot s goes to index s % length; of more than `length` slots only the last `length` are
    kept. S and length are static, so this is a pad or a slice and a roll, never a scatter.
    """
    slots = states.shape[2]
    if slots <= length:
        return torch.nn.functional.pad(states, (0, 0, 0, length - slots))
    return states[:, :, slots - length:].roll((slots - length) % length, dims=2)


class SlotCache:
    """What HF's attention layers call: `update(key, value, layer_idx)` -> the K/V to attend over.

    Prefill (no `past`): attention runs over the bucket's own K/V; the buffers are built fresh.
    Decode (`past` and the slot being written): the step's K/V is copied into index
    `slot % length` and attention runs over the whole buffer. Either way the new buffers are
    collected in `new`, in layout order, for the graph to return.
    """

    def __init__(self, layout: list[LayerCache], past: list[torch.Tensor] | None = None,
                 slot: torch.Tensor | None = None):
        self.layout, self.past, self.slot = layout, past, slot
        self.new: list[torch.Tensor | None] = [None] * (2 * len(layout))

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        length = self.layout[layer_idx].length
        if self.past is None:
            self.new[2 * layer_idx] = to_ring(key, length)
            self.new[2 * layer_idx + 1] = to_ring(value, length)
            return key, value
        index = self.slot % length
        key = self.past[2 * layer_idx].index_copy(2, index, key)
        value = self.past[2 * layer_idx + 1].index_copy(2, index, value)
        self.new[2 * layer_idx], self.new[2 * layer_idx + 1] = key, value
        return key, value


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean [B, Q, K] -> HF eager attention's additive mask [B, 1, Q, K]."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def prefill_mask(attention_mask: torch.Tensor, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Causal (and, for sliding layers, windowed) attention over the bucket, pads masked."""
    slots = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    dist = slots[:, None] - slots[None, :]  # query slot - key slot
    allowed = dist >= 0
    if window is not None:
        allowed = allowed & (dist < window)
    return _additive(allowed[None] & attention_mask.bool()[:, None, :], dtype)


def decode_mask(attention_mask: torch.Tensor, slot: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The query at `slot` against a ring of `length` indices.

    Index r holds slot s(r) = slot - ((slot - r) mod length): the latest slot <= the query that
    maps to r. It is visible if s(r) >= 0 and the row's attention_mask ([B, max_cache_len], 1 on
    real prompt tokens and on every generated slot) marks it real. Later slots have s(r) < 0, so
    this is also the causal mask; and a ring of at most window slots is the window itself.
    """
    held = slot - torch.remainder(slot - torch.arange(length, device=slot.device), length)  # [length]
    real = attention_mask.gather(1, held.clamp(min=0).expand(attention_mask.shape[0], length)).bool()
    return _additive((real & (held >= 0))[:, None, :], dtype)
