"""The int8 experts the one-rank reader reads (`--backend reader --quantization int8`).

The numbers are `formats/int8.py`'s on the TP channel layout's view of the experts (gate_up
[E, H, 2I] with a scale per (expert, output channel) [E, 1, 2I]; down [E, I, H] with [E, 1, H]):
what a one-rank model with int8 experts holds (`quantize.py`) and what TP int8 holds on the default
layout. `int8_experts` gives them in the reader's rows (reader/int8.py: its decode steps read the
exact channels there); `int8_forward` is the reader's prefill through them (dense_masked over their
dequantised weights: a one-rank int8 model's numbers). Not an experts implementation of its own:
every other backend quantizes its model's modules (`quantize.quantize_model`).

Quantisation never mutates the source weights.
"""

from __future__ import annotations

import torch

from ..formats.int8 import INT8, quantize_per_channel
from ..parallel.layout import fused
from ..reader.int8 import Int8Experts
from .dense_masked import dense_masked


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
    """transformers' experts-interface signature, on a `Gemma4TextExperts`: dense_masked over the int8
    experts' weights dequantised in the activations' dtype, the numbers of a one-rank model with int8
    experts (`quantize.QuantizedExperts` over dense_masked) to the bit."""
    gate_up_q, gate_up_scale, down_q, down_scale = _quantized(self)
    dtype = hidden_states.dtype
    gate_up = fused(INT8.dequantize({"weight": gate_up_q, "scale": gate_up_scale}, dtype))
    down = fused(INT8.dequantize({"weight": down_q, "scale": down_scale}, dtype))
    return dense_masked(hidden_states, top_k_index, top_k_weights, gate_up, down, self.act_fn)
