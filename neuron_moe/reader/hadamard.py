"""Random block Hadamard rotation: R = H·diag(s)/√n applied to every n-coordinate block.

H is the Sylvester Hadamard matrix (n a power of two), s a seeded ±1 vector. R is
orthogonal, so (R·g)ᵀ(R·x) = gᵀx: the reader rotates weight rows once at prep time and each
token's x at run time, and inner products are unchanged. The rotation spreads a row's
energy evenly over its coordinates, which is what makes a 3-level (ternary) code with one
scale per block a good sketch of it.

The transform is the fast Walsh–Hadamard butterfly, O(n log n) per block, in plain
PyTorch (the pattern QuaRot's `matmul_hadU` uses; no CUDA-only dependency).
"""

from __future__ import annotations

import math

import torch


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform over the last dimension (a power of two): x·H."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    lead = x.shape[:-1]
    h = 1
    while h < n:
        # pairs (i, i+h) inside each group of 2h: (a, b) -> (a+b, a-b)
        pairs = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return x.reshape(*lead, n)


def random_signs(length: int, seed: int) -> torch.Tensor:
    """The seeded ±1 vector s (int8), one entry per (padded) coordinate."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (length,), generator=gen, dtype=torch.int8) * 2 - 1).to(torch.int8)


def padded(width: int, block: int) -> int:
    """The width rounded up to whole blocks: hidden sizes that are not a multiple are zero-padded."""
    return -(-width // block) * block


def rotate_blocks(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """[..., W] -> [..., W_pad / block, block]: zero-pad to whole blocks, then R per block (fp32)."""
    width = x.shape[-1]
    x = torch.nn.functional.pad(x.to(torch.float32), (0, signs.numel() - width))
    x = (x * signs.to(torch.float32)).reshape(*x.shape[:-1], -1, block)
    return fwht(x) / math.sqrt(block)
