"""The reader's Triton kernels: screen, exact (gate/up dots, then down rows), recover.

Every kernel reads the sidecar exactly as `reader/prep.py` writes it (docs/reader.md): codes
uint8 [E, nb, 128, S] coordinate-major, base 3, five rows per byte; scales [E, nb, 2I];
coeffs [E, I, rank]; basis [H, rank]; the down projection as rows [E, I, H]. Weights may be
bf16 or fp32: every load is converted to fp32 before any arithmetic (the interpreter gets bf16
arithmetic wrong, and fp32 accumulation is what the reference does).

Kernels live in this file so that `TRITON_INTERPRET=1`, set before it is imported, runs them
on the CPU (the tests do that).
"""

from __future__ import annotations

import triton
import triton.language as tl

GELU_TANH, SILU = 0, 1  # the ACT constexpr: HF's gelu_pytorch_tanh (Gemma-4) or silu (Qwen3)


@triton.jit
def _act(g, ACT: tl.constexpr):
    # gelu_tanh(g) = 0.5·g·(1 + tanh(z)) = g·sigmoid(2z), z = sqrt(2/π)(g + 0.044715 g³); 2·sqrt(2/π)
    # is a literal: the compiler refuses a plain-float global (the first H200 run failed on one, which
    # the interpreter accepts; tests/test_triton_compile.py compiles every kernel for sm_90 on the CPU),
    # and the interpreter cannot multiply a tensor by a tl.constexpr global
    if ACT == 0:
        return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    else:
        return g * tl.sigmoid(g)


@triton.jit
def _digit_dot(byte, xv, POW: tl.constexpr):
    """Σ_c code(c)·x_c over the scanned coordinates for the rows in base-3 digit POW of each byte."""
    d = (byte // POW) % 3
    code = (d - 3 * (d >> 1)).to(tl.float32)  # digit 0, 1, 2 -> code 0, +1, -1
    return tl.sum(code * xv[:, None], axis=0)


@triton.jit
def _scaled_add(scales_row, acc, q, rows, part, t: tl.constexpr):
    """acc + scale[r]·part for rows r = 5q + t (digit t of each byte)."""
    r = 5 * q + t
    return acc + tl.load(scales_row + r, mask=r < rows, other=0.0).to(tl.float32) * part


@triton.jit
def screen_kernel(codes_ptr, scales_ptr, experts_ptr, coords_ptr, values_ptr, out_ptr,
                  ke, nb, scan, strip, rows,
                  SCAN_P2: tl.constexpr, BQ: tl.constexpr):
    """One program: one (token, routed slot) and BQ bytes (5·BQ rows) of every scanned strip.

    est[r] = Σ_b scale[e, b, r] · Σ_{c scanned} code(e, b, c, r) · (Rx)_{b,c}; reads only the
    scanned strips (coordinate-major: one contiguous run of bytes per coordinate) and scales.
    """
    tk = tl.program_id(0)  # token · ke + slot
    t = tk // ke
    q = tl.program_id(1) * BQ + tl.arange(0, BQ)
    qmask = q < strip
    c = tl.arange(0, SCAN_P2)
    cmask = c < scan
    e = tl.load(experts_ptr + tk).to(tl.int64)
    acc0 = tl.zeros([BQ], dtype=tl.float32)
    acc1 = tl.zeros([BQ], dtype=tl.float32)
    acc2 = tl.zeros([BQ], dtype=tl.float32)
    acc3 = tl.zeros([BQ], dtype=tl.float32)
    acc4 = tl.zeros([BQ], dtype=tl.float32)
    for b in range(nb):
        coord = tl.load(coords_ptr + (t * nb + b) * scan + c, mask=cmask, other=0).to(tl.int64)
        xv = tl.load(values_ptr + (t * nb + b) * scan + c, mask=cmask, other=0.0)
        block = codes_ptr + (e * nb + b) * 128 * strip
        byte = tl.load(block + coord[:, None] * strip + q[None, :], mask=cmask[:, None] & qmask[None, :],
                       other=0).to(tl.int32)
        scales_row = scales_ptr + (e * nb + b) * rows
        acc0 = _scaled_add(scales_row, acc0, q, rows, _digit_dot(byte, xv, 1), 0)
        acc1 = _scaled_add(scales_row, acc1, q, rows, _digit_dot(byte, xv, 3), 1)
        acc2 = _scaled_add(scales_row, acc2, q, rows, _digit_dot(byte, xv, 9), 2)
        acc3 = _scaled_add(scales_row, acc3, q, rows, _digit_dot(byte, xv, 27), 3)
        acc4 = _scaled_add(scales_row, acc4, q, rows, _digit_dot(byte, xv, 81), 4)
    out_row = out_ptr + tk * rows
    tl.store(out_row + 5 * q, acc0, mask=5 * q < rows)
    tl.store(out_row + 5 * q + 1, acc1, mask=5 * q + 1 < rows)
    tl.store(out_row + 5 * q + 2, acc2, mask=5 * q + 2 < rows)
    tl.store(out_row + 5 * q + 3, acc3, mask=5 * q + 3 < rows)
    tl.store(out_row + 5 * q + 4, acc4, mask=5 * q + 4 < rows)


@triton.jit
def exact_act_kernel(gate_up_ptr, x_ptr, expert_ptr, channel_ptr, weight_ptr, coef_ptr,
                     k, H, inter,
                     ACT: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr):
    """One program: BK chosen channels of one token. Reads their gate and up rows (contiguous,
    H each) and writes coef_j = w_e · φ(g_j·x)(v_j·x)."""
    t = tl.program_id(0)
    j = tl.program_id(1) * BK + tl.arange(0, BK)
    jm = j < k
    e = tl.load(expert_ptr + t * k + j, mask=jm, other=0).to(tl.int64)
    ch = tl.load(channel_ptr + t * k + j, mask=jm, other=0).to(tl.int64)
    gate_row = (e * 2 * inter + ch) * H
    up_row = gate_row + inter * H
    g = tl.zeros([BK], dtype=tl.float32)
    u = tl.zeros([BK], dtype=tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        hm = h < H
        xv = tl.load(x_ptr + t * H + h, mask=hm, other=0.0)
        m = jm[:, None] & hm[None, :]
        gw = tl.load(gate_up_ptr + gate_row[:, None] + h[None, :], mask=m, other=0.0).to(tl.float32)
        uw = tl.load(gate_up_ptr + up_row[:, None] + h[None, :], mask=m, other=0.0).to(tl.float32)
        g += tl.sum(gw * xv[None, :], axis=1)
        u += tl.sum(uw * xv[None, :], axis=1)
    w = tl.load(weight_ptr + t * k + j, mask=jm, other=0.0)
    tl.store(coef_ptr + t * k + j, w * _act(g, ACT) * u, mask=jm)


@triton.jit
def recover_kernel(coeffs_ptr, q_ptr, z_ptr, inter, rank, stride_e, stride_i, stride_r, experts_ptr,
                   RANK_P2: tl.constexpr, BI: tl.constexpr):
    """One program: one (token, routed slot). z[r] = Σ_j q_j · b_j[r] over the expert's channels,
    q_j = w_e·p_j for unchosen channels and 0 for chosen ones, whose b_j are never read."""
    tk = tl.program_id(0)
    e = tl.load(experts_ptr + tk).to(tl.int64)
    r = tl.arange(0, RANK_P2)
    rm = r < rank
    z = tl.zeros([RANK_P2], dtype=tl.float32)
    for i0 in range(0, inter, BI):
        i = i0 + tl.arange(0, BI)
        qv = tl.load(q_ptr + tk * inter + i, mask=i < inter, other=0.0)
        m = ((i < inter) & (qv != 0.0))[:, None] & rm[None, :]
        b = tl.load(coeffs_ptr + e * stride_e + i[:, None] * stride_i + r[None, :] * stride_r, mask=m, other=0.0)
        z += tl.sum(qv[:, None] * b.to(tl.float32), axis=0)
    tl.store(z_ptr + tk * RANK_P2 + r, z)


@triton.jit
def down_kernel(down_ptr, expert_ptr, channel_ptr, coef_ptr, basis_ptr, z_ptr, out_ptr,
                k, H, inter, ke, rank, stride_h, stride_r,
                HAS_RECOVERY: tl.constexpr, RANK_P2: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr):
    """One program: BH output coordinates of one token, one of `split` shares of its k chosen rows.

    y[h] += Σ_j coef_j · down[e_j, ch_j, h] over rows j ≡ share (mod split), BK rows at a time
    (each a contiguous H-row of the [E, I, H] layout); share 0 also adds the recovery,
    U[h, :] · Σ_slots z (fused here: U is read once per tile, y is written once per share).
    Shares meet in y through atomic adds (y starts at zero)."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    share = tl.program_id(2)
    split = tl.num_programs(2)
    acc = tl.zeros([BH], dtype=tl.float32)
    for j0 in range(share * BK, k, split * BK):
        j = j0 + tl.arange(0, BK)
        jm = j < k
        e = tl.load(expert_ptr + t * k + j, mask=jm, other=0).to(tl.int64)
        ch = tl.load(channel_ptr + t * k + j, mask=jm, other=0).to(tl.int64)
        cf = tl.load(coef_ptr + t * k + j, mask=jm, other=0.0)
        d = tl.load(down_ptr + ((e * inter + ch) * H)[:, None] + h[None, :], mask=jm[:, None] & hm[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(cf[:, None] * d, axis=0)
    if HAS_RECOVERY:
        if share == 0:
            r = tl.arange(0, RANK_P2)
            rm = r < rank
            z = tl.zeros([RANK_P2], dtype=tl.float32)
            for s in range(ke):
                z += tl.load(z_ptr + (t * ke + s) * RANK_P2 + r)
            u = tl.load(basis_ptr + h[:, None] * stride_h + r[None, :] * stride_r, mask=hm[:, None] & rm[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(u * z[None, :], axis=1)
    tl.atomic_add(out_ptr + t * H + h, acc, mask=hm)
