"""int8 experts: per-output-channel symmetric int8 weights, fp32 scales, dequantised after the matmul.

The quantisation is defined once, on the experts' two linears as the parallel layout writes them
(`parallel/layout.py`): gate_up [E·2I, H] gets a scale per expert and output channel; down
[H, E·I] a scale per hidden channel, shared by the experts, because there down is one linear whose
output channels are the hidden units. That is what NxD's QuantizedColumnParallel /
QuantizedRowParallel (per_channel_symmetric, channel axis 0) hold, so the single-rank
implementation below (`int8`, registered with transformers) and the TP rank modules carry the
same int8 numbers. The router weight multiplies the activation before down, so down's
output-channel scale still applies after one matmul over all experts.

Quantisation never mutates the source weights. (NxD's `scale_dequantize` multiplies an fp32
input in place, since `.to(float32)` of an fp32 tensor is the tensor itself; nothing here does.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..parallel.layout import down_2d, gate_up_2d
from .dense_masked import router_weight_matrix

QMAX = 127  # symmetric: -127 … 127, so the grid is the same both sides of zero


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], fp32 scale [out, 1]) with w ≈ q · scale."""
    w32 = w.detach().to(torch.float32)  # may be `w` itself: only out-of-place ops below
    amax = w32.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))  # an all-zero row stays zero
    q = torch.round(w32 / scale).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_output(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y [..., out] of a matmul with int8 weights, times the [out, 1] scale, in fp32, back to y's dtype."""
    return (y.to(torch.float32) * scale.T).to(y.dtype)


def quantize_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A parallel-layout state dict with every experts linear replaced by int8 `weight` + fp32 `scale`."""
    out = {}
    for name, w in state.items():
        if ("." + name).endswith((".experts.gate_up_proj.weight", ".experts.down_proj.weight")):
            out[name], out[name.removesuffix("weight") + "scale"] = quantize_per_channel(w)
        else:
            out[name] = w
    return out


def _quantized(experts) -> tuple[torch.Tensor, ...]:
    """The module's int8 weights and scales, made on first use and again whenever a source weight
    is replaced or changed in place (keyed on its storage and version counter)."""
    key = tuple((p.data_ptr(), p._version) for p in (experts.gate_up_proj, experts.down_proj))
    cached = getattr(experts, "_int8_cache", None)
    if cached is None or cached[0] != key:
        cached = (key, *quantize_per_channel(gate_up_2d(experts.gate_up_proj)),
                  *quantize_per_channel(down_2d(experts.down_proj)))
        experts._int8_cache = cached  # a plain attribute: not a buffer, not in the state dict
    return cached[1:]


def int8_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-interface signature, on a `Gemma4TextExperts`. Fixed shapes (every
    expert for every token, as dense_masked), eager only: the int8 tensors are made on the fly."""
    gate_up_q, gate_up_scale, down_q, down_scale = _quantized(self)
    T, dtype = hidden_states.shape[0], hidden_states.dtype
    E, I = self.num_experts, self.intermediate_dim
    weights = router_weight_matrix(top_k_index, top_k_weights, E)  # [T, E]
    gate_up = dequantize_output(F.linear(hidden_states, gate_up_q.to(dtype)), gate_up_scale)
    gate, up = gate_up.view(T, E, 2 * I).chunk(2, dim=-1)
    act = self.act_fn(gate) * up * weights.unsqueeze(-1).to(dtype)  # [T, E, I]
    return dequantize_output(F.linear(act.reshape(T, E * I), down_q.to(dtype)), down_scale)
