"""int4 experts in HF's model: `formats/int4.py`'s numbers made from the module's float weights on
first use, every expert computed (as dense_masked), each weight dequantised before its matmul."""

from __future__ import annotations

import torch

from ..formats.int4 import DEFAULT_GROUP, quantize, unpack
from ..parallel.layout import fused
from .dense_masked import router_weight_matrix


def _quantized(experts) -> tuple[torch.Tensor, ...]:
    """The module's packed weights and scales in the channel layout's order (gate_up [E, H, 2I] as
    [E, H/2, 2I] with [E, H/g, 2I]; down [E, I, H] as [E, I/2, H] with [E, I/g, H]), at the module's
    `int4_group` (DEFAULT_GROUP unless set), made on first use and again whenever a source weight is
    replaced or changed in place (keyed on its storage and version counter)."""
    group = getattr(experts, "int4_group", DEFAULT_GROUP)
    key = (group, *((p.data_ptr(), p._version) for p in (experts.gate_up_proj, experts.down_proj)))
    cached = getattr(experts, "_int4_cache", None)
    if cached is None or cached[0] != key:
        cached = (key, *quantize(fused(experts.gate_up_proj), group), *quantize(fused(experts.down_proj), group))
        experts._int4_cache = cached  # a plain attribute: not a buffer, not in the state dict
    return cached[1:]


def int4_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-interface signature, on a `Gemma4TextExperts`: every expert for every
    token (as dense_masked), each weight dequantised in the activations' dtype before its matmul.
    Eager only: the int4 tensors are made on the fly (the graphs' int4 experts are the rank modules')."""
    gate_up_q, gate_up_scale, down_q, down_scale = _quantized(self)
    dtype = hidden_states.dtype
    weights = router_weight_matrix(top_k_index, top_k_weights, self.num_experts)  # [T, E]
    gate_up = torch.einsum("th,eho->eto", hidden_states, unpack(gate_up_q, gate_up_scale, dtype))
    gate, up = gate_up.chunk(2, dim=-1)
    act = self.act_fn(gate) * up  # [E, T, I]
    out = torch.einsum("eti,eih->eth", act, unpack(down_q, down_scale, dtype))  # [E, T, H]
    return torch.einsum("eth,te->th", out, weights.to(dtype))
