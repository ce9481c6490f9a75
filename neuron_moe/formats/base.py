"""A weight format: how a linear's weight is stored, unpacked in the graph, counted and sharded.

Every weight is seen as the parallel layouts write it: [out, in] (a linear, HF's and NxD's) or
[E, in, out] (NxD's expert-fused layers). The input dim is dim 1 in both, and it is the one a
format groups along (HF's last dim of a linear, as GGUF stores it). A format turns one weight into
named tensors of the same rank (`quantize`), gives the weight back in a compute dtype inside the
graph with ops every XLA backend lowers (`dequantize`), and names its tensors' shapes and dtypes
for a weight's shape (`shapes`). The rest follows from those:

  bytes     `nbytes`: what the planner, `reads` and `info` charge for a weight
  matmuls   `linear` (x @ Wᵀ) and `expert_matmul` (NxD's einsum over [E, in, out]): the weight
            dequantised in x's dtype, then one matmul; a format may apply part after the matmul
  sharding  each tensor splits as the float weight does along the weight's partition dim, but for
            a tensor with one entry per output channel (`per_output`: int8's scale) where the weight
            splits on its input dim (a row-parallel linear): every rank holds it whole
            (`replicated`). `check` refuses an input dim (a row layer's rank: its share) that does
            not hold the format's groups whole.

`Format` itself is "none": the weight as it is, in the compute dtype. Each quantized format is one
module (`int8.py`, `int4.py`, `q4_0.py`) and one line of the registry (`formats/__init__.py`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Format:
    name = "none"
    tensors = ("weight",)  # what `shapes` and `quantize` name, in that order
    per_output: tuple[str, ...] = ()  # those with one entry per output channel (no input dim to split)
    weight_dtype: torch.dtype | None = None  # what "weight" is stored in (None: the float weight's dtype)

    def stored(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the "weight" tensor of a weight whose float form is in `dtype` (what verify reads)."""
        return self.weight_dtype or dtype

    def shapes(self, shape: tuple[int, ...], dtype: torch.dtype) -> Shapes:
        """Each tensor's (shape, dtype) for a weight of `shape` whose float form is in `dtype`."""
        return {"weight": (tuple(shape), dtype)}

    def check(self, inputs: int, what: str = "input channels") -> None:
        """A UserError unless `inputs` input channels (`what`: which, in its message) hold whole groups
        (none: any)."""

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """A weight ([out, in] or [E, in, out]) in this format; never modifies `w`. On the meta device
        only the shapes are made (the planner's and the shape checks' way)."""
        self.check(w.shape[1])
        if w.device.type == "meta":
            return {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in self.shapes(w.shape, w.dtype).items()}
        return self.encode(w)

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": w}

    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The weight the tensors stand for, in `dtype`, shaped as the float weight."""
        return tensors["weight"].to(dtype)

    def linear(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [..., in] times an [out, in] weight's transpose, as F.linear."""
        return F.linear(x, self.dequantize(tensors, x.dtype))

    def expert_matmul(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [E, 1, tokens, in] through an [E, in, out] weight, as NxD's expert-fused layers."""
        return torch.einsum("e...h,ehi->e...i", x, self.dequantize(tensors, x.dtype))

    def replicated(self, tensor: str, dim: int) -> bool:
        """Whether every rank holds `tensor` whole where its weight splits on `dim` (1: the input dim)."""
        return tensor in self.per_output and dim == 1

    def nbytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of a weight of `shape` in this format (none: in `dtype`)."""
        return sum(math.prod(s) * d.itemsize for s, d in self.shapes(shape, dtype).values())


NONE = Format()
