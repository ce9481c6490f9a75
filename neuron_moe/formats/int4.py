"""int4: group-wise symmetric 4-bit weights, bf16 scales, dequantised before each matmul.

  values   q = round(w / s) clamped to -7 … 7 (symmetric: the same grid both sides of zero)
  groups   along the input dim (dim 1 of every weight as the parallel layouts write them:
           [out, in] linears and NxD's expert-fused [E, in, out]), `group` consecutive input
           channels per scale; one scale per (output channel, group): s = clip · amax(|w|) / 7
  packed   uint8, two values per byte along the input dim: input channel 2j in the low nibble,
           2j + 1 in the high one, each stored offset-binary (q + 8, so 1 … 15): [out, in/2] or
           [E, in/2, out]
  scales   bf16 (`SCALE_DTYPE`), [out, in/group] or [E, in/group, out], rounded up to the next
           bf16 where rounding to nearest would shrink it, so |w / s| ≤ clip · 7 stays true and
           the round-to-nearest error of every weight is at most s / 2

Dequantising is plain tensor ops a compiler lowers without custom kernels: the bytes widened to
32-bit words, a bitwise and, a right shift, a convert, a subtract, and a multiply by the group's
scale (`unpack`; every shift and mask on int32, `WORD`, as neuronx-cc requires). It runs in the
graph on the rank's own shard (or on the gathered experts of a selective decode step), so the
compute-dtype weight exists only transiently, one linear at a time.

Sharding: the packed weight and its scales split along the same dim as the float weight (their
output dim with the column layers, their input dim with the row layers), so a row layer's rank
must hold whole groups: `group` must divide the rank's input channels (the channel layout's I/t,
the expert layout's experts × I). Because the groups lie along the input dim, the two expert
layouts hold the same numbers: gate_up's groups are over H in both, down's over one expert's I
(given `group` divides I), so TP int4 in either layout is the one-rank int4 up to summation order.

`clip` < 1 is the calibration-free scale search (`quantize(..., search=True)`): per group, the
clipping ratio from `CLIP_GRID` whose dequantised weight is nearest the original (squared error).
"""

from __future__ import annotations

import torch

from ..errors import UserError
from .base import Format, Shapes

QMAX = 7  # symmetric: -7 … 7
OFFSET = 8  # a nibble holds q + 8
GROUP_SIZES = (16, 32, 64)  # those measured (bench/results/int4-quality.md)
# input channels per bf16 scale: every task within 2 points of bf16 on the tiny model, 64 lost 6
# (bench/results/int4-quality.md)
DEFAULT_GROUP = 32
SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2  # bytes of one SCALE_DTYPE scale
# the integer type the nibbles are masked and shifted in: neuronx-cc's verifier refuses an arithmetic
# right shift of a non-32-bit input ("Cast the first argument's data type to be S32, U32, or F32",
# aws-neuron-sdk compiler/error-codes/EVRF022.rst), and NeuronCore-v2's integer types are UINT8,
# INT32 and UINT32 (about-neuron/arch/neuron-features/data-types.rst)
WORD = torch.int32
CLIP_GRID = tuple(round(1.0 - 0.025 * i, 3) for i in range(13))  # 1.0, 0.975, … 0.7


class Int4Error(UserError):
    pass


def check_group(inputs: int, group: int, what: str = "input channels") -> None:
    """`group` must be even-sized and divide `inputs` (whole groups, whole bytes)."""
    if group < 2 or group % 2:
        raise Int4Error(f"int4 group size must be an even number ≥ 2, got {group}")
    if inputs % group:
        raise Int4Error(f"int4 group size {group} does not divide the {inputs} {what}")


def shapes(shape: tuple[int, ...], group: int = DEFAULT_GROUP) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A float weight's shape ([out, in] or [E, in, out]: the input dim is dim 1) -> the shapes of
    its packed values and of its scales."""
    check_group(shape[1], group)
    return (shape[0], shape[1] // 2, *shape[2:]), (shape[0], shape[1] // group, *shape[2:])


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    """[a, n, *rest] -> [a, n/group, group, *rest]."""
    return w.reshape(w.shape[0], w.shape[1] // group, group, *w.shape[2:])


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 7 in SCALE_DTYPE, never below it (so no value falls outside ±7 by the scale's rounding);
    1 for an all-zero group (it stays zero)."""
    exact = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    s = exact.to(SCALE_DTYPE)
    return torch.where(s.to(torch.float32) < exact, torch.nextafter(s, torch.full_like(s, float("inf"))), s)


def _round(grouped: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Values of `grouped` [a, n/g, g, …] on the grid of `scale` [a, n/g, 1, …], int -7 … 7 (as fp32)."""
    return torch.round(grouped / scale.to(torch.float32)).clamp(-QMAX, QMAX)


def quantize(w: torch.Tensor, group: int = DEFAULT_GROUP, *, search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight ([out, in] or [E, in, out]) -> (packed uint8, SCALE_DTYPE scales) as the module
    docstring says. `search`: each group's clipping ratio chosen from CLIP_GRID by the squared
    error of its dequantised weight (no calibration data); else round to nearest with clip 1.
    Never modifies `w`. On the meta device only the shapes are made."""
    packed_shape, scale_shape = shapes(tuple(w.shape), group)
    if w.device.type == "meta":
        return (
            torch.empty(packed_shape, dtype=torch.uint8, device="meta"),
            torch.empty(scale_shape, dtype=SCALE_DTYPE, device="meta"),
        )
    g = _grouped(w.detach().to(torch.float32), group)  # may be `w` itself: only out-of-place ops below
    amax = g.abs().amax(dim=2, keepdim=True)
    scale = _scale(amax)
    if search:
        best = ((_round(g, scale) * scale.to(torch.float32) - g) ** 2).sum(dim=2, keepdim=True)
        for clip in CLIP_GRID[1:]:
            s = _scale(amax * clip)
            err = ((_round(g, s) * s.to(torch.float32) - g) ** 2).sum(dim=2, keepdim=True)
            better = err < best
            scale, best = torch.where(better, s, scale), torch.where(better, err, best)
    q = (_round(g, scale) + OFFSET).to(torch.uint8).reshape(w.shape)
    pairs = q.reshape(w.shape[0], w.shape[1] // 2, 2, *w.shape[2:])
    packed = pairs.select(2, 0) | (pairs.select(2, 1) << 4)
    return packed.contiguous(), scale.squeeze(2).contiguous()


def unpack(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The weight `packed` and `scale` stand for, in `dtype`: [a, n/2, *rest] and [a, n/g, *rest]
    -> [a, n, *rest]. Widen, mask, shift, convert, subtract, multiply: ops every XLA backend lowers.
    The bytes are widened to WORD first, so that the mask and the shift take 32-bit integers only
    (neuronx-cc refuses an arithmetic right shift of any other width: NCC_EVRF022), and the shift's
    amount is a WORD tensor too: torch-xla 2.9 lowers a shift by a Python int to an s64 shift of
    the words converted to s64 (measured on XLA:CPU), one by an int32 tensor to an s32 shift. The
    packed bytes in HBM stay one per two values; the widened copy is as transient as the result."""
    words = packed.to(WORD)  # 0 … 255: the arithmetic and the logical right shift agree
    low = torch.bitwise_and(words, 15)
    high = torch.bitwise_right_shift(words, torch.full_like(words, 4))
    a, half, *rest = packed.shape
    n = 2 * half
    values = torch.cat([low.unsqueeze(2), high.unsqueeze(2)], dim=2).reshape(a, n, *rest).to(dtype) - OFFSET
    groups = scale.shape[1]
    grouped = values.reshape(a, groups, n // groups, *rest) * scale.to(dtype).unsqueeze(2)
    return grouped.reshape(a, n, *rest)


class Int4(Format):
    """The format at one group size (the registry's: DEFAULT_GROUP)."""

    name = "int4"
    tensors = ("weight", "group_scale")
    weight_dtype = torch.uint8  # two values a byte

    def __init__(self, group: int = DEFAULT_GROUP):
        self.group = group

    def shapes(self, shape: tuple[int, ...], dtype: torch.dtype) -> Shapes:
        packed, scales = shapes(tuple(shape), self.group)
        return {"weight": (packed, self.weight_dtype), "group_scale": (scales, SCALE_DTYPE)}

    def check(self, inputs: int, what: str = "input channels") -> None:
        check_group(inputs, self.group, what)

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, scale = quantize(w, self.group)
        return {"weight": packed, "group_scale": scale}

    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return unpack(tensors["weight"], tensors["group_scale"], dtype)


INT4 = Int4()
