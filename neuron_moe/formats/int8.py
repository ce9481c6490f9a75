"""int8: per-output-channel symmetric int8 weights, fp32 scales, applied after the matmul.

  values  q = round(w / s) clamped to -127 … 127 (the same grid both sides of zero)
  scale   fp32, one per output channel over the input dim: s = amax(|w|) / 127, shaped as the
          weight with its input dim 1 ([out, 1] or [E, 1, out]: NxD's per_channel_symmetric and
          expert_wise_per_channel scales); a scale of 1 for an all-zero row (it stays zero)

The scale multiplies the matmul's output in fp32 (as NxD's quantized layers do), so the weight in
the compute dtype is the int8 numbers themselves. Sharded: with a column layer the scale splits
with its output channels; with a row layer it is replicated (every rank holds every output
channel) and applied before the all-reduce.

Never mutates the source weight. (NxD's `scale_dequantize` multiplies an fp32 input in place,
since `.to(float32)` of an fp32 tensor is the tensor itself; nothing here does.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Format, Shapes

QMAX = 127


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] or [E, in, out] float -> (int8 of the same shape, fp32 scale [out, 1] or [E, 1, out])
    with w ≈ q · scale: one scale per output channel, the amax over the input dim (dim 1) / 127."""
    w32 = w.detach().to(torch.float32)  # may be `w` itself: only out-of-place ops below
    amax = w32.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w32 / scale).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_output(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y [..., out] of a matmul with int8 weights, times its scale in fp32, back to y's dtype. The
    scale is [out, 1] (a linear) or [E, 1, out] (expert-fused: y is [E, ..., out])."""
    if scale.dim() == 2:
        scale = scale.T
    else:
        scale = scale.view(scale.shape[0], *[1] * (y.dim() - 2), scale.shape[-1])
    return (y.to(torch.float32) * scale).to(y.dtype)


class Int8(Format):
    name = "int8"
    tensors = ("weight", "scale")
    per_output = ("scale",)
    weight_dtype = torch.int8

    def shapes(self, shape: tuple[int, ...], dtype: torch.dtype) -> Shapes:
        return {"weight": (tuple(shape), self.weight_dtype), "scale": ((shape[0], 1, *shape[2:]), torch.float32)}

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = quantize_per_channel(w)
        return {"weight": q, "scale": scale}

    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        w, scale = tensors["weight"], tensors["scale"]
        return (w.to(torch.float32) * scale).to(dtype)

    def linear(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_output(F.linear(x, tensors["weight"].to(x.dtype)), tensors["scale"])

    def expert_matmul(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        y = torch.einsum("e...h,ehi->e...i", x, tensors["weight"].to(x.dtype))
        return dequantize_output(y, tensors["scale"])


INT8 = Int8()
