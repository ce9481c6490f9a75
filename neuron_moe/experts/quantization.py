"""The routed experts' weight formats over a parallel-layout state dict: one entry per
`spec.QUANTIZATIONS` value, so every caller (the TP ranks, trace-and-compile, the planner) quantises
the same way."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from .. import spec
from . import int4, int8

EXPERTS_LINEARS = (".experts.gate_up_proj.weight", ".experts.down_proj.weight")


def check(quantization: str) -> str:
    return spec.check_quantization(quantization, where="experts quantization")


def quantize_tensor(name: str, w: torch.Tensor, quantization: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs that replace `w` (named `name` in the parallel layout): an experts linear's
    quantised weight and its scale, anything else (or every tensor with "none") as it is."""
    if quantization == spec.NO_QUANTIZATION or not ("." + name).endswith(EXPERTS_LINEARS):
        yield name, w
    elif quantization == spec.INT8_QUANTIZATION:
        q, scale = int8.quantize_per_channel(w)
        yield name, q
        yield name.removesuffix("weight") + "scale", scale
    else:
        packed, scale = int4.quantize(w)
        yield name, packed
        yield name.removesuffix("weight") + "group_scale", scale


def quantize_stream(items: Iterable[tuple[str, torch.Tensor]], quantization: str) -> Iterator[tuple[str, torch.Tensor]]:
    """`quantize_tensor` over a stream of (name, tensor): one tensor at a time, so a caller that reads a
    checkpoint layer by layer and drops what it has passed on never holds more than one float experts
    linear beside the quantised ones."""
    check(quantization)
    for name, w in items:
        yield from quantize_tensor(name, w, quantization)


def quantize_experts(state: dict[str, torch.Tensor], quantization: str) -> dict[str, torch.Tensor]:
    """A parallel-layout state dict with its experts in `quantization`, a new dict. The experts'
    float tensors are taken out of `state` as each is quantised (`state` is emptied; the tensors
    themselves are never modified), so the float and quantised experts are not both held whole."""
    check(quantization)
    out = {}
    for name in list(state):
        out.update(quantize_tensor(name, state.pop(name), quantization))
    return out
