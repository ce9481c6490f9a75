"""q4_0: llama.cpp's Q4_0 exactly (ggml's `quantize_row_q4_0_ref`), the grid Google's QAT Gemma
checkpoints are trained onto: a weight on that grid is held without loss, where int4 re-rounds it.

  blocks   32 consecutive input channels (dim 1 of [out, in] and of [E, in, out], HF's last dim of
           a linear, as GGUF stores it)
  scale    d = (the block's value of largest magnitude, with its sign) / -8, stored as fp16
           ("block_scale": [out, in/32] or [E, in/32, out]); an all-zero block has d = -0.0
  values   q = min(15, trunc(x · id + 8.5)) with id = 1/d computed in fp32 from d before its fp16
           rounding (0 where d is 0): 0 … 15 stand for q - 8 in -8 … 7, the block's largest value
           for -8 (an asymmetric grid: its sign decides which side gets the 8th step)
  packed   uint8 [out, in/2] or [E, in/2, out], each block's 16 bytes as GGUF stores them: byte j
           holds element j in its low nibble and element j + 16 in its high one

Dequantised as (q - 8) · d in fp32 (exact: 4 bits times fp16's 11), then rounded once to the compute
dtype; an fp32 weight on the grid quantizes back to the same nibbles and scales. (A bf16 copy of one
does only where each d fits bf16's 8 significant bits.) The unpack is int4's (`int4.unpack`: the
bytes widened to int32 for the mask and the shift, as neuronx-cc requires) with the block's scale,
then each block's two halves put back in order. The quantizer replicates ggml's
fp32 arithmetic step by step (a multiply, an add, a truncating cast), so the nibbles and the fp16
scales are ggml's bit for bit.

Sharding is int4's: the packed values and the scales split with the float weight, so a row layer's
rank must hold whole blocks (32 must divide its input channels).
"""

from __future__ import annotations

import torch

from ..errors import UserError
from . import int4
from .base import Format, Shapes

BLOCK = 32  # QK4_0: input channels per block
HALF = BLOCK // 2
OFFSET = 8  # a nibble holds q + 8
SCALE_DTYPE = torch.float16  # ggml_half


class Q4_0Error(UserError):
    pass


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight ([out, in] or [E, in, out], in a multiple of 32) -> (packed uint8, fp16 block
    scales) as ggml's reference computes them, in fp32. Never modifies `w`."""
    a, n, *rest = w.shape
    blocks = w.detach().to(torch.float32).reshape(a, n // BLOCK, BLOCK, *rest)
    magnitude = blocks.abs()
    first = magnitude.argmax(dim=2, keepdim=True)  # the first of equal magnitudes, as ggml's strict `<`
    signed = blocks.gather(2, first)
    largest = torch.where(magnitude.gather(2, first) > 0, signed, torch.zeros_like(signed))  # ggml starts at +0
    d = largest / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    scaled = blocks * inverse  # two fp32 roundings, as ggml's `x*id` then `+ 8.5f`
    q = (scaled + 8.5).to(torch.int8).clamp(max=15).to(torch.uint8)  # the cast truncates toward zero
    packed = q.narrow(2, 0, HALF) | (q.narrow(2, HALF, HALF) << 4)
    return packed.reshape(a, n // 2, *rest).contiguous(), d.squeeze(2).to(SCALE_DTYPE).contiguous()


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight `packed` [a, n/2, *rest] and `scale` [a, n/32, *rest] stand for, [a, n, *rest] in
    `dtype`. int4's unpack lays byte j's nibbles side by side (2j, 2j + 1); GGUF's block holds them
    16 apart, so each block's [16, 2] is transposed to [2, 16]."""
    a, half, *rest = packed.shape
    pairs = int4.unpack(packed, scale, torch.float32).reshape(a, scale.shape[1], HALF, 2, *rest)
    return pairs.transpose(2, 3).reshape(a, 2 * half, *rest).to(dtype)


class Q4_0Format(Format):
    name = "q4_0"
    tensors = ("weight", "block_scale")
    weight_dtype = torch.uint8  # two values a byte

    def shapes(self, shape: tuple[int, ...], dtype: torch.dtype) -> Shapes:
        self.check(shape[1])
        packed, scales = int4.shapes(tuple(shape), BLOCK)
        return {"weight": (packed, self.weight_dtype), "block_scale": (scales, SCALE_DTYPE)}

    def check(self, inputs: int, what: str = "input channels") -> None:
        if inputs % BLOCK:
            raise Q4_0Error(f"q4_0 block size {BLOCK} does not divide the {inputs} {what}")

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, scale = quantize(w)
        return {"weight": packed, "block_scale": scale}

    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(tensors["weight"], tensors["block_scale"], dtype)


Q4_0 = Q4_0Format()
