"""The weight formats, one module each behind one protocol (`base.Format`), and the registry.

A run quantizes the linears of the layer groups it names (`spec.LAYER_GROUPS`: `--quantized-layers`,
the routed experts by default) in one format (`--quantization`); everything else stays in the
compute dtype (embeddings too: a lookup reads one row). `format_of` says which format a weight of
the parallel layout is in, `quantize_stream` / `quantize_state` write a parallel-layout checkpoint
in it, and the parallel layers (`parallel/cpu.py`, `parallel/nxd.py`) hold and unpack whatever
format they are given: no module outside this package names a format.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from .. import spec
from .base import NONE, Format
from .int4 import INT4
from .int8 import INT8
from .q4_0 import Q4_0

FORMATS: dict[str, Format] = {f.name: f for f in (NONE, INT8, INT4, Q4_0)}
TENSORS = frozenset(name for f in FORMATS.values() for name in f.tensors)  # every format's tensor names

__all__ = ["FORMATS", "NONE", "TENSORS", "Format", "format_of", "get", "quantize_state", "quantize_stream"]


def get(quantization: str) -> Format:
    """The format named `quantization` (one of spec.QUANTIZATIONS)."""
    return FORMATS[spec.check_quantization(quantization)]


def format_of(name: str, quantization: str, layers: Iterable[str]) -> Format:
    """The format of the weight `name` (a parallel-layout name) in a run that quantizes `layers` in
    `quantization`: that format for a linear of one of those groups, else none."""
    return get(quantization) if spec.layer_group(name) in tuple(layers) else NONE


def quantize_tensor(
    name: str, w: torch.Tensor, quantization: str, layers: Iterable[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs that replace `w` (named `name` in the parallel layout): a quantized linear's
    tensors, named after its weight (`….weight`, `….scale`, …), anything else as it is."""
    fmt = format_of(name, quantization, layers)
    if fmt is NONE:
        yield name, w
        return
    prefix = name.removesuffix("weight")
    for suffix, t in fmt.quantize(w).items():
        yield prefix + suffix, t


def quantize_stream(
    items: Iterable[tuple[str, torch.Tensor]], quantization: str, layers: Iterable[str] = spec.DEFAULT_QUANTIZED_LAYERS
) -> Iterator[tuple[str, torch.Tensor]]:
    """`quantize_tensor` over a stream of (name, tensor): one tensor at a time, so a caller that reads a
    checkpoint layer by layer and drops what it has passed on never holds more than one float linear
    beside the quantized ones."""
    get(quantization)
    layers = spec.check_quantized_layers(layers)
    for name, w in items:
        yield from quantize_tensor(name, w, quantization, layers)


def quantize_state(
    state: dict[str, torch.Tensor], quantization: str, layers: Iterable[str] = spec.DEFAULT_QUANTIZED_LAYERS
) -> dict[str, torch.Tensor]:
    """A parallel-layout state dict with `layers` in `quantization`, a new dict. The float tensors are
    taken out of `state` as each is quantized (`state` is emptied; the tensors themselves are never
    modified), so the float and quantized linears are not both held whole."""
    return dict(quantize_stream(((name, state.pop(name)) for name in list(state)), quantization, layers))
