"""The reader's NKI kernels for NeuronCore-v2 (inf2): screen, exact, recover.

NOT RUN: written against the `nki` namespace (nki.jit, nki.language as nl, nki.isa as nisa) of
nki 0.2.x, Neuron SDK 2.28, the last whose NKI supports inf2 (`forward.NKI_TARGET`; docs/neuron.md),
and checked here only through the pure-PyTorch tile and index plan they consume
(`plan.py`, tested on the CPU). No simulator or NeuronCore has executed this file.

Every row a kernel reads is gathered by indirect DMA (`nisa.dma_copy` from `tensor.ap(...,
vector_offset=idx, indirect_dim=0)`): one row index per SBUF partition, indices from
`plan.py`. Tiles stay within NeuronCore-v2 limits: ≤ 128 partitions, matmul moving free size
≤ 512, stationary free size ≤ 128. All arithmetic in fp32 (the DMA converts bf16/uint8 rows
to fp32 on the way in).

Base-3 codes are decoded on the Vector Engine with comparisons only (exact in fp32, no
integer division): from the top digit down, d = [v ≥ 3^t] + [v ≥ 2·3^t], v -= 3^t·d, and the
code is d − 3·[d ≥ 2].
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

PMAX, MOVING_FMAX = 128, 512
POW3 = (1, 3, 9, 27, 81)
ACTIVATIONS = {"gelu_tanh": nl.gelu_apprx_tanh, "silu": nl.silu}  # forward.py passes one as `act`


def _gather_rows(table, idx_hbm, rows: int, width: int, row_stride: int | None = None):
    """[rows, width] fp32 SBUF tile: row i is the first `width` elements of table row idx[i]
    (indirect DMA, one index per partition; the DMA converts to fp32)."""
    idx = nl.ndarray((rows, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=idx_hbm)
    out = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
    pattern = [[row_stride or width, rows], [1, width]]
    nisa.dma_copy(dst=out, src=table.ap(pattern=pattern, vector_offset=idx, indirect_dim=0))
    return out


@nki.jit
def screen_kernel(codes, strip_idx, values):
    """Unscaled partial estimates, one per (token, slot, block) and digit: [P, 5, S] fp32.

    codes [E·nb·128, S] uint8 (the sidecar's, one strip per row); strip_idx [P, scan, 1] rows of
    the scanned strips (plan.strip_rows); values [P, scan, 1] the rotated x at those coordinates.
    partial[p, t, q] = Σ_c code(strip c, row 5q+t) · x_c: a [scan]ᵀ × [scan, S] matmul per digit.
    """
    P, scan, _ = strip_idx.shape
    S = codes.shape[1]
    out = nl.ndarray((P, 5, S), dtype=nl.float32, buffer=nl.shared_hbm)
    for p in nl.affine_range(P):
        v = _gather_rows(codes, strip_idx[p], scan, S)  # byte values 0..242, exact in fp32
        x = nl.ndarray((scan, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=values[p])
        for t in nl.static_range(4, -1, -1):
            ge1 = nl.ndarray((scan, S), dtype=nl.float32, buffer=nl.sbuf)
            ge2 = nl.ndarray((scan, S), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=ge1, data=v, op0=nl.greater_equal, operand0=float(POW3[t]))
            nisa.tensor_scalar(dst=ge2, data=v, op0=nl.greater_equal, operand0=float(2 * POW3[t]))
            digit = nl.ndarray((scan, S), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=digit, data1=ge1, data2=ge2, op=nl.add)
            step = nl.ndarray((scan, S), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=step, data=digit, op0=nl.multiply, operand0=float(POW3[t]))
            nisa.tensor_tensor(dst=v, data1=v, data2=step, op=nl.subtract)  # the lower digits remain
            code = nl.ndarray((scan, S), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=code, data=digit, op0=nl.greater_equal, operand0=2.0, op1=nl.multiply, operand1=-3.0)
            nisa.tensor_tensor(dst=code, data1=code, data2=digit, op=nl.add)  # 0, 1, 2 -> 0, +1, -1
            acc = nl.ndarray((1, S), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=acc, stationary=x, moving=code)  # [scan, 1]ᵀ · [scan, S] -> [1, S]
            row = nl.ndarray((1, S), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=row, src=acc)
            nisa.dma_copy(dst=out[p, t : t + 1, :], src=row)
    return out


@nki.jit
def exact_kernel(gate_up, down, x, gate_idx, up_idx, down_idx, weights, act):
    """y [T, H] fp32 = Σ_j w_j φ(g_j·x)(v_j·x) d_j over the chosen channels, 128 per tile.

    gate_up [E·2I, H] and down [E·I, H] (bf16 rows); x [T, H] fp32; *_idx [T, KT, 128, 1] rows
    (plan.channel_rows, padded with row 0); weights [T, KT, 128, 1] (0 on padding). act: an
    nl activation (nl.gelu_apprx_tanh or nl.silu).
    """
    T, KT = gate_idx.shape[0], gate_idx.shape[1]
    H = x.shape[1]
    y = nl.ndarray((T, H), dtype=nl.float32, buffer=nl.shared_hbm)
    for t in nl.affine_range(T):
        xb = nl.ndarray((PMAX, H), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xb, src=x.ap(pattern=[[0, PMAX], [1, H]], offset=t * H))  # x broadcast to 128 partitions
        acc = nl.ndarray((1, H), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        for kt in nl.sequential_range(0, KT, 1):
            dots = []
            for idx in (gate_idx, up_idx):
                rows = _gather_rows(gate_up, idx[t, kt], PMAX, H)
                nisa.tensor_tensor(dst=rows, data1=rows, data2=xb, op=nl.multiply)
                dot = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_reduce(dst=dot, op=nl.add, data=rows, axis=1, keepdims=True)
                dots.append(dot)
            coef = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=coef, op=act, data=dots[0])
            nisa.tensor_tensor(dst=coef, data1=coef, data2=dots[1], op=nl.multiply)
            w = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=w, src=weights[t, kt])
            nisa.tensor_tensor(dst=coef, data1=coef, data2=w, op=nl.multiply)
            d = _gather_rows(down, down_idx[t, kt], PMAX, H)
            for h in nl.static_range((H + MOVING_FMAX - 1) // MOVING_FMAX):
                lo, hi = h * MOVING_FMAX, min(H, (h + 1) * MOVING_FMAX)
                part = nl.ndarray((1, hi - lo), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=part, stationary=coef, moving=d[:, lo:hi])  # [128, 1]ᵀ · [128, w] -> [1, w]
                nisa.tensor_tensor(dst=acc[:, lo:hi], data1=acc[:, lo:hi], data2=part, op=nl.add)
        nisa.dma_copy(dst=y[t : t + 1, :], src=acc)
    return y


@nki.jit
def recover_kernel(coeffs, basis, coeff_idx, unchosen, rank):
    """U · Σ_j q_j b_j per token, [T, H, 1] fp32; q = w·p of the unchosen channels, 0 for the chosen.

    coeffs [E·I, R] (b_j rows) and basis [H, R] (U), of which the first `rank` columns are used;
    coeff_idx [T, CT, 128, 1] rows of the routed experts' channels (plan.coeff_rows, padded);
    unchosen [T, CT, 128, 1] (0 on padding).
    """
    T, CT = coeff_idx.shape[0], coeff_idx.shape[1]
    H, full = basis.shape
    out = nl.ndarray((T, H, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    for t in nl.affine_range(T):
        z = nl.ndarray((rank, 1), dtype=nl.float32, buffer=nl.sbuf)  # zᵀ: rank on partitions
        nisa.memset(dst=z, value=0.0)
        for ct in nl.sequential_range(0, CT, 1):
            b = _gather_rows(coeffs, coeff_idx[t, ct], PMAX, rank, row_stride=full)
            q = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=q, src=unchosen[t, ct])
            part = nl.ndarray((rank, 1), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=part, stationary=b, moving=q)  # [128, rank]ᵀ · [128, 1] -> [rank, 1]
            nisa.tensor_tensor(dst=z, data1=z, data2=part, op=nl.add)
        for h in nl.static_range((H + PMAX - 1) // PMAX):
            lo, hi = h * PMAX, min(H, (h + 1) * PMAX)
            ut = nl.ndarray((rank, hi - lo), dtype=nl.float32, buffer=nl.sbuf)  # Uᵀ tile, loaded transposed
            nisa.dma_copy(dst=ut, src=basis.ap(pattern=[[1, rank], [full, hi - lo]], offset=lo * full))
            col = nl.ndarray((hi - lo, 1), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=col, stationary=ut, moving=z)  # [rank, w]ᵀ · [rank, 1] -> [w, 1]
            res = nl.ndarray((hi - lo, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=col)
            nisa.dma_copy(dst=out[t, lo:hi, :], src=res)
    return out
