"""The reader's forward on the Triton kernels: same inputs, same output as `reference.forward`.

Stages (docs/reader.md): the rotation of x and the choice of scanned coordinates (a [T, H]
op), the selection (torch.topk) and the w·p of the unchosen channels stay in PyTorch — they
touch no weights. What reads weights is a kernel: `screen` (the scanned code strips and the
scales), `exact` (the chosen gate/up rows, then the chosen down rows), `recover` (b_j of the
unchosen channels; U is read in the down kernel's epilogue).
"""

from __future__ import annotations

import os

import torch
import triton

from ...errors import UserError
from .. import reference
from ..prep import BLOCK, CODES_PER_BYTE, SECTOR
from . import kernels

# Tile sizes (not yet tuned on a GPU). BQ code bytes (5·BQ rows) per screen program: 32, one
# sector of every scanned strip (strips are whole sectors); BK chosen rows per exact program;
# BH output coordinates per down program, whose k rows are split in SPLIT shares (more
# programs at batch 1, where T·H/BH alone would leave most of a GPU idle).
BQ, BK, BH, BI, SPLIT = 32, 16, 128, 64, 4


def activation(act_fn) -> int:
    """The kernels' ACT constant for an HF activation module."""
    return {"gelu_tanh": kernels.GELU_TANH, "silu": kernels.SILU}[reference.activation_name(act_fn)]


def _contiguous(**tensors):
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise UserError(f"reader triton backend: {name} must be contiguous (shape {tuple(t.shape)}, "
                            f"stride {t.stride()})")


def screen(values, coords, top_k_index, codes, scales) -> torch.Tensor:
    """Sketch estimates [T, ke, 2I] from the scanned Rx values and coordinates [T, nb, scan]."""
    T, ke = top_k_index.shape
    nb, scan = coords.shape[1:]
    strip, rows = codes.shape[-1], scales.shape[-1]
    _contiguous(codes=codes, scales=scales)
    if not rows <= CODES_PER_BYTE * strip < rows + SECTOR * CODES_PER_BYTE:  # prep pads rows to whole sectors
        raise UserError(f"reader codes: strips of {strip} bytes do not hold {rows} rows at {CODES_PER_BYTE} per byte")
    out = torch.empty(T, ke, rows, dtype=torch.float32, device=values.device)
    grid = (T * ke, triton.cdiv(strip, BQ))
    kernels.screen_kernel[grid](codes, scales, top_k_index.to(torch.int32).contiguous(),
                                coords.to(torch.int32).contiguous(), values.contiguous(), out,
                                ke, nb, scan, strip, rows, SCAN_P2=triton.next_power_of_2(scan), BQ=BQ)
    return out


def exact(x, expert, channel, weight, gate_up, act: int) -> torch.Tensor:
    """coef [T, k] = w_e·φ(g_j·x)(v_j·x) of the chosen channels (their gate and up rows read whole)."""
    T, k = expert.shape
    _, rows, H = gate_up.shape
    _contiguous(gate_up=gate_up)
    coef = torch.empty(T, k, dtype=torch.float32, device=x.device)
    kernels.exact_act_kernel[(T, triton.cdiv(k, BK))](
        gate_up, x, expert.to(torch.int32).contiguous(), channel.to(torch.int32).contiguous(),
        weight.contiguous(), coef, k, H, rows // 2, ACT=act, BK=BK, BH=BH)
    return coef


def recover(unchosen, top_k_index, coeffs, rank: int) -> torch.Tensor:
    """Per (token, slot) z = Σ_j q_j b_j [T, ke, RANK_P2], q = `reference.unchosen_weights` (0 = chosen)."""
    T, ke, inter = unchosen.shape
    rank_p2 = triton.next_power_of_2(rank)
    z = torch.empty(T, ke, rank_p2, dtype=torch.float32, device=unchosen.device)
    kernels.recover_kernel[(T * ke,)](coeffs, unchosen.contiguous(), z, inter, rank, *coeffs.stride(),
                                      top_k_index.to(torch.int32).contiguous(), RANK_P2=rank_p2, BI=BI)
    return z


def down(coef, expert, channel, down_rows, basis=None, z=None, rank: int = 0, split: int = SPLIT) -> torch.Tensor:
    """y [T, H] = Σ_j coef_j d_j (+ U·Σ_slots z when rank > 0), fp32."""
    T, k = coef.shape
    _, inter, H = down_rows.shape
    _contiguous(down_rows=down_rows)
    out = torch.zeros(T, H, dtype=torch.float32, device=coef.device)
    recovery = rank > 0
    if not recovery:
        basis, z = out, out  # never read
    kernels.down_kernel[(T, triton.cdiv(H, BH), split)](
        down_rows, expert.to(torch.int32).contiguous(), channel.to(torch.int32).contiguous(), coef, basis, z, out,
        k, H, inter, z.shape[1] if recovery else 0, rank, *basis.stride(),
        HAS_RECOVERY=recovery, RANK_P2=triton.next_power_of_2(max(rank, 1)), BK=BK, BH=BH)
    return out


def forward(x, top_k_index, top_k_weights, gate_up, down_rows, layer, *, k: int, scan: int, rank: int,
            act_fn) -> torch.Tensor:
    """`reference.forward` (screen="sketch") on the kernels; x [T, H], gate_up [E, 2I, H], down_rows [E, I, H]."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(f"reader backend 'triton' needs CUDA tensors (these are on {x.device}); on a CPU, "
                        f"TRITON_INTERPRET=1 runs the kernels in Triton's interpreter (slow: for tests)")
    if layer.codes.shape[2] != BLOCK:
        raise UserError(f"reader codes have {layer.codes.shape[2]} coordinates per block, expected {BLOCK}")
    xf = x.to(torch.float32).contiguous()
    coords, values = reference.scanned(xf, layer, scan)
    estimates = screen(values, coords, top_k_index, layer.codes, layer.scales)
    chosen, p = reference.select(estimates, top_k_index, top_k_weights, layer.down_norms, k, act_fn)
    expert, channel, weight = reference.chosen_rows(chosen, top_k_index, top_k_weights, down_rows.shape[1])
    coef = exact(xf, expert, channel, weight, gate_up, activation(act_fn))
    z = recover(reference.unchosen_weights(p, chosen, top_k_weights), top_k_index, layer.coeffs, rank) if rank else None
    return down(coef, expert, channel, down_rows, layer.basis, z, rank).to(x.dtype)


def dense_forward(x, top_k_index, top_k_weights, gate_up, down_rows, *, act_fn) -> torch.Tensor:
    """The dense top-k MoE on the same kernels, every channel of the routed experts exact: a
    fused-MoE-style GEMV baseline (gate/up rows with the activation fused, then down rows) that
    differs from the reader only in what it reads."""
    T, ke = top_k_index.shape
    inter = down_rows.shape[1]
    expert = top_k_index.repeat_interleave(inter, dim=1)  # [T, ke·I]: slot-major, like the reader's grid
    channel = torch.arange(inter, device=x.device).repeat(T, ke)
    weight = top_k_weights.to(torch.float32).repeat_interleave(inter, dim=1)
    xf = x.to(torch.float32).contiguous()
    coef = exact(xf, expert, channel, weight, gate_up, activation(act_fn))
    return down(coef, expert, channel, down_rows).to(x.dtype)
