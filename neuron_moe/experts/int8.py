"""int8 experts: per-output-channel symmetric int8 weights, fp32 scales, dequantised after the matmul.

The quantisation is defined once, on the experts' linears as the parallel layouts write them
(`parallel/layout.py`): each weight gets one scale per output channel, over its input dim (dim 1
of all of them: [out, in] linears and NxD's expert-fused [E, in, out]). So it follows the layout:

  channel  gate_up [E, H, 2I] and down [E, I, H]: a scale per (expert, output channel) for both,
           [E, 1, 2I] and [E, 1, H] (NxD's QuantizedExpertFused* layers, expert_wise_per_channel);
  expert   gate_up [E·2I, H]: per (expert, output channel), the same numbers as channel's;
           down [H, E·I], one linear over all experts: per hidden channel, shared by the experts
           (NxD's QuantizedRowParallel, per_channel_symmetric).

The one-rank implementation below (`int8`, registered with transformers) holds the channel
layout's numbers, so TP int8 on the default layout is one-rank int8 up to fp32 summation order.
Why that one: it is the finer quantisation (on the tiny port, mean |Δlogit| against fp32 is 0.018
with down per (expert, hidden) and 0.025 with down's scale shared by the experts; prefill of three
prompts, measured on CPU), and NxD's selective loading gathers the scales with the weights
(`scale[expert_indices]`), so the channel layout's down needs a scale per expert anyway. The expert
layout cannot hold it: its down is one matmul over all of a rank's experts, after which a scale can
only be per hidden channel. Its down is the coarser quantisation, checked against its own
dequantised weights (tests/test_tensor_parallel.py).

Quantisation never mutates the source weights. (NxD's `scale_dequantize` multiplies an fp32
input in place, since `.to(float32)` of an fp32 tensor is the tensor itself; nothing here does.)
"""

from __future__ import annotations

import torch

from ..formats.int8 import dequantize_output, quantize_per_channel
from ..parallel.layout import fused
from ..reader.int8 import Int8Experts
from .dense_masked import router_weight_matrix


def _quantized(experts) -> tuple[torch.Tensor, ...]:
    """The module's int8 weights and scales in the channel layout's order (gate_up [E, H, 2I],
    [E, 1, 2I]; down [E, I, H], [E, 1, H]), made on first use and again whenever a source weight
    is replaced or changed in place (keyed on its storage and version counter)."""
    key = tuple((p.data_ptr(), p._version) for p in (experts.gate_up_proj, experts.down_proj))
    cached = getattr(experts, "_int8_cache", None)
    if cached is None or cached[0] != key:
        cached = (
            key,
            *quantize_per_channel(fused(experts.gate_up_proj)),
            *quantize_per_channel(fused(experts.down_proj)),
        )
        experts._int8_cache = cached  # a plain attribute: not a buffer, not in the state dict
    return cached[1:]


def int8_experts(experts):
    """The module's int8 numbers as the reader holds them (reader/int8.py: rows, scale pairs)."""
    return Int8Experts.from_channel_layout(*_quantized(experts))


def int8_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-interface signature, on a `Gemma4TextExperts`. Fixed shapes (every
    expert for every token, as dense_masked), eager only: the int8 tensors are made on the fly."""
    gate_up_q, gate_up_scale, down_q, down_scale = _quantized(self)
    dtype = hidden_states.dtype
    weights = router_weight_matrix(top_k_index, top_k_weights, self.num_experts)  # [T, E]
    gate_up = dequantize_output(torch.einsum("th,eho->eto", hidden_states, gate_up_q.to(dtype)), gate_up_scale)
    gate, up = gate_up.chunk(2, dim=-1)
    act = self.act_fn(gate) * up  # [E, T, I]
    out = dequantize_output(torch.einsum("eti,eih->eth", act, down_q.to(dtype)), down_scale)  # [E, T, H]
    return torch.einsum("eth,te->th", out, weights.to(dtype))
