"""The reader's forward on the Triton kernels: same inputs, same output as `reference.forward`.

Stages (docs/reader.md), one kernel each: `rotate_scan` (the block rotation of x and the
scanned coordinates), `screen` (the scanned code strips and the scales -> estimates), `select`
(scores, the top k, the recovery weights), `exact` (the chosen gate/up rows), `recover` (b_j
of the unchosen channels) and `down` (the chosen down rows, the activation, and U). The
reductions meet in one zeroed fp32 workspace through atomic adds, so a call is eight
launches: the zeroing, the six kernels and the cast of y to the input dtype. `fuse=True` makes
it six (untimed on a GPU so far: bench/gpu_reader.py times it beside the default): rotate+scan
zeroes the workspace, and exact and recover share one launch. `atomics="relaxed"` makes every
reduction a fire-and-forget add instead of Triton's default acq_rel round trip (also untimed).
The same stages in one launch, with the select spread over programs: `persistent.py`.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton

from ...errors import UserError
from .. import reference
from ..hadamard import fwht
from ..sidecar import BLOCK, CODES_PER_BYTE, SECTOR
from . import kernels

# Tile sizes. BQ code bytes (5·BQ rows) per screen program: 32, one sector of a scanned strip
# (strips are whole sectors), SC scanned coordinates at a time. BK rows per exact/down step;
# EXACT_BH coordinates of a gate/up row per exact program; BH output coordinates per down
# program; BI channels per recover program. PROGRAMS: how many programs the split reductions aim
# for (a few per SM of a 132-SM H200), so that no stage walks a long serial loop on a few SMs at
# batch 1. Measured alternatives: bench/results/gpu_reader-h200-2026-11-30-tuning.md.
BQ, SC, BK, EXACT_BH, BH, BI, PROGRAMS = 32, 16, 16, 256, 128, 64, 1024

# The memory order of the reductions' atomic adds (kernels.py): Triton's default "acq_rel", as
# measured on the H200; "relaxed" (ATOMICS) compiles to fire-and-forget reductions, not yet timed.
DEFAULT_ATOMICS = "acq_rel"
ATOMICS = ("acq_rel", "relaxed")

# select_kernel's variants beside the default (`select` keywords), named for bench/gpu_reader.py and
# the tests, which run each: the k-th largest by radix histograms of 8- or 5-bit digits (4 or 7
# passes) instead of bisection (31), and placement by one prefix sum instead of two. 5 bits: the
# fewest instructions of 4-8 bits compiled for sm_90 by triton 3.6 (32 bins: one per lane).
SELECT_VARIANTS = {
    "bisect": {},
    "radix8": {"search": kernels.RADIX, "radix_bits": 8},
    "radix5": {"search": kernels.RADIX, "radix_bits": 5},
    "bisect+1scan": {"place": kernels.ONE_SCAN},
    "radix8+1scan": {"search": kernels.RADIX, "radix_bits": 8, "place": kernels.ONE_SCAN},
    "radix5+1scan": {"search": kernels.RADIX, "radix_bits": 5, "place": kernels.ONE_SCAN},
}


def activation(act_fn) -> int:
    """The kernels' ACT constant for an HF activation module."""
    return {"gelu_tanh": kernels.GELU_TANH, "silu": kernels.SILU}[reference.activation_name(act_fn)]


def _contiguous(**tensors):
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise UserError(
                f"reader triton backend: {name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})"
            )


@functools.lru_cache(maxsize=None)
def _hadamard(device: torch.device) -> torch.Tensor:
    """The normalised Hadamard matrix the sidecar's rotation uses (`hadamard.rotate_blocks`), fp32;
    made on a device's first call (a warm-up call, before any CUDA-graph capture)."""
    return (fwht(torch.eye(BLOCK)) / math.sqrt(BLOCK)).to(device)


def rotate_scan(x, signs, scan: int, zero=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.scanned` in one kernel: coords (int32) and Rx values (fp32), [T, nb, scan] each.
    `zero`: a contiguous fp32 buffer the kernel's programs also fill with zeros (or None)."""
    T, H = x.shape
    nb = signs.numel() // BLOCK
    coords = torch.empty(T, nb, scan, dtype=torch.int32, device=x.device)
    values = torch.empty(T, nb, scan, dtype=torch.float32, device=x.device)
    zero_n = 0 if zero is None else zero.numel()  # 0: nothing zeroed, `values` stands in as the pointer
    kernels.rotate_scan_kernel[(T, nb)](
        x.contiguous(),
        signs,
        _hadamard(x.device),
        coords,
        values,
        values if zero is None else zero,
        H,
        nb,
        zero_n,
        triton.cdiv(zero_n, T * nb),
        SCAN=scan,
        BLOCK=BLOCK,
        ZB=1024,
    )
    return coords, values


def _shares(total: int, others: int) -> int:
    """How many pieces to cut a reduction of `total` steps into, with `others` programs per piece."""
    return max(1, min(total, triton.cdiv(PROGRAMS, others)))


def screen(values, coords, top_k_index, codes, scales, out=None, warps=None, sem=DEFAULT_ATOMICS) -> torch.Tensor:
    """Sketch estimates [T, ke, 2I] from the scanned Rx values and coordinates [T, nb, scan]."""
    T, ke = top_k_index.shape
    nb, scan = coords.shape[1:]
    strip, rows = codes.shape[-1], scales.shape[-1]
    _contiguous(codes=codes, scales=scales)
    if not rows <= CODES_PER_BYTE * strip < rows + SECTOR * CODES_PER_BYTE:  # prep pads rows to whole sectors
        raise UserError(f"reader codes: strips of {strip} bytes do not hold {rows} rows at {CODES_PER_BYTE} per byte")
    out = torch.zeros(T, ke, rows, dtype=torch.float32, device=values.device) if out is None else out
    tiles = triton.cdiv(strip, BQ)
    per = triton.cdiv(nb, _shares(nb, T * ke * tiles))
    # warps per program, as measured fastest on the H200: 1 at one token (more programs resident),
    # else 4 (fewer registers a thread; measured at 4 and 8 tokens)
    warps = warps or (1 if T == 1 else 4)
    kernels.screen_kernel[(T * ke, tiles, triton.cdiv(nb, per))](
        codes,
        scales,
        top_k_index.contiguous(),
        coords.to(torch.int32).contiguous(),
        values.contiguous(),
        out,
        ke,
        nb,
        strip,
        rows,
        per,
        SCAN=scan,
        SC=SC,
        BQ=BQ,
        SEM=sem,
        num_warps=warps,
    )
    return out


def select(
    estimates,
    top_k_index,
    top_k_weights,
    down_norms,
    k: int,
    act: int,
    recovery: bool = True,
    warps: int = 8,
    search: int = kernels.BISECT,
    radix_bits: int = 8,
    place: int = kernels.TWO_SCANS,
):
    """Top-k channels per token by s_j over all its experts' channels: expert (int32), channel (int32),
    weight (fp32) [T, k] in channel order, and q [T, ke, I] = w_e·p_j for the others (None without recovery).
    One program per token; 8 warps measured fastest on the H200 (4: 1.5×, 16: 1.07× the time).
    `search` (BISECT or RADIX with `radix_bits`-bit digits) and `place` (TWO_SCANS or ONE_SCAN):
    the kernel's variants (`kernels.select_kernel`); the same channels whichever is chosen."""
    T, ke, rows = estimates.shape
    inter = rows // 2
    if not 0 < k <= ke * inter:
        raise UserError(f"reader: k = {k} channels, but a token's experts have {ke * inter}")
    n_p2 = triton.next_power_of_2(ke * inter)
    if place == kernels.ONE_SCAN and n_p2 > 32768:
        raise UserError(
            f"reader select: one-scan placement packs two counts of up to {n_p2} in int32; "
            f"{ke} experts × {inter} channels is too many for it"
        )
    dev = estimates.device
    expert = torch.empty(T, k, dtype=torch.int32, device=dev)
    channel = torch.empty(T, k, dtype=torch.int32, device=dev)
    weight = torch.empty(T, k, dtype=torch.float32, device=dev)
    q = torch.empty(T, ke, inter, dtype=torch.float32, device=dev) if recovery else weight  # weight: never written
    kernels.select_kernel[(T,)](
        estimates,
        top_k_index.contiguous(),
        top_k_weights.contiguous(),
        down_norms,
        expert,
        channel,
        weight,
        q,
        ke,
        inter,
        k,
        ACT=act,
        HAS_RECOVERY=recovery,
        N_P2=n_p2,
        SEARCH=search,
        RADIX_BITS=radix_bits,
        PLACE=place,
        num_warps=warps,
    )
    return expert, channel, weight, (q if recovery else None)


def exact(x, expert, channel, gate_up, out=None, sem=DEFAULT_ATOMICS) -> torch.Tensor:
    """gu [T, k, 2] = (g_j·x, v_j·x) of the chosen channels (their gate and up rows read whole)."""
    T, k = expert.shape
    _, rows, H = gate_up.shape
    _contiguous(gate_up=gate_up)
    out = torch.zeros(T, k, 2, dtype=torch.float32, device=x.device) if out is None else out
    kernels.exact_kernel[(T, triton.cdiv(k, BK), triton.cdiv(H, EXACT_BH))](
        gate_up,
        x.contiguous(),
        expert.contiguous(),
        channel.contiguous(),
        out,
        k,
        H,
        rows // 2,
        BK=BK,
        BH=EXACT_BH,
        SEM=sem,
    )
    return out


def exact_recover(x, expert, channel, gate_up, q, top_k_index, coeffs, rank: int, gu, z, sem=DEFAULT_ATOMICS):
    """`exact` and `recover` in one launch, into their zeroed outputs gu [T, k, 2] and z [T, RANK_P2]."""
    T, k = expert.shape
    H = gate_up.shape[2]
    ke, inter = q.shape[1:]
    _contiguous(gate_up=gate_up)
    programs = T * triton.cdiv(k, BK) * triton.cdiv(H, EXACT_BH) + T * ke * triton.cdiv(inter, BI)
    kernels.exact_recover_kernel[(programs,)](
        gate_up,
        x.contiguous(),
        expert.contiguous(),
        channel.contiguous(),
        gu,
        coeffs,
        q.contiguous(),
        top_k_index.contiguous(),
        z,
        T,
        k,
        H,
        inter,
        ke,
        rank,
        *coeffs.stride(),
        BK=BK,
        BH=EXACT_BH,
        RANK_P2=z.shape[1],
        BI=BI,
        SEM=sem,
    )


def recover(q, top_k_index, coeffs, rank: int, out=None, sem=DEFAULT_ATOMICS) -> torch.Tensor:
    """z [T, RANK_P2] = Σ_slots Σ_j q_j b_j (b_j: the first `rank` of an expert's coefficients)."""
    T, ke, inter = q.shape
    rank_p2 = triton.next_power_of_2(rank)
    out = torch.zeros(T, rank_p2, dtype=torch.float32, device=q.device) if out is None else out
    kernels.recover_kernel[(T * ke, triton.cdiv(inter, BI))](
        coeffs,
        q.contiguous(),
        top_k_index.contiguous(),
        out,
        ke,
        inter,
        rank,
        *coeffs.stride(),
        RANK_P2=rank_p2,
        BI=BI,
        SEM=sem,
    )
    return out


def down(
    gu,
    weight,
    expert,
    channel,
    down_rows,
    act: int,
    basis=None,
    z=None,
    rank: int = 0,
    split=None,
    out=None,
    sem=DEFAULT_ATOMICS,
) -> torch.Tensor:
    """y [T, H] = Σ_j w_j·φ(g_j)·u_j·d_j (+ U·z when rank > 0), fp32; `split` shares of the k rows."""
    T, k = expert.shape
    _, inter, H = down_rows.shape
    _contiguous(down_rows=down_rows)
    out = torch.zeros(T, H, dtype=torch.float32, device=gu.device) if out is None else out
    tiles = triton.cdiv(H, BH)
    split = split or _shares(triton.cdiv(k, BK), T * tiles)
    recovery = rank > 0
    if not recovery:
        basis, z = out, out  # never read
    kernels.down_kernel[(T, tiles, split)](
        down_rows,
        expert.contiguous(),
        channel.contiguous(),
        weight.contiguous(),
        gu,
        basis,
        z,
        out,
        k,
        H,
        inter,
        rank,
        *basis.stride(),
        triton.cdiv(k, split),
        ACT=act,
        HAS_RECOVERY=recovery,
        RANK_P2=z.shape[1] if recovery else 1,
        BK=BK,
        BH=BH,
        SEM=sem,
    )
    return out


def _workspace(T: int, sizes: dict[str, tuple[int, ...]], device, zeroed: bool = True):
    """fp32 buffers for the atomic reductions, carved from one allocation (zeroed: one memset):
    the allocation, and the buffers by name."""
    flat = (torch.zeros if zeroed else torch.empty)(
        T * sum(math.prod(s) for s in sizes.values()), dtype=torch.float32, device=device
    )
    out, at = {}, 0
    for name, shape in sizes.items():
        n = T * math.prod(shape)
        out[name] = flat[at : at + n].view(T, *shape)
        at += n
    return flat, out


def _check_device(x):
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(
            f"reader kernel 'triton' needs CUDA tensors (these are on {x.device}); on a CPU, "
            f"TRITON_INTERPRET=1 runs the kernels in Triton's interpreter (slow: for tests)"
        )


def forward(
    x,
    top_k_index,
    top_k_weights,
    gate_up,
    down_rows,
    layer,
    *,
    k: int,
    scan: int,
    rank: int,
    act_fn,
    select_variant: str = "bisect",
    fuse: bool = False,
    atomics: str = DEFAULT_ATOMICS,
) -> torch.Tensor:
    """`reference.forward` (screen="sketch") on the kernels; x [T, H], gate_up [E, 2I, H], down_rows [E, I, H].
    `select_variant`: a name in SELECT_VARIANTS; `fuse`: six launches instead of eight (the module's
    docstring); `atomics`: the reductions' memory order, one of ATOMICS. All give the same output;
    bench/gpu_reader.py times each."""
    _check_device(x)
    if select_variant not in SELECT_VARIANTS:
        raise UserError(f"unknown select variant {select_variant!r}; known: {', '.join(SELECT_VARIANTS)}")
    if atomics not in ATOMICS:
        raise UserError(f"unknown atomics {atomics!r}; known: {', '.join(ATOMICS)}")
    check_layer(layer)
    act = activation(act_fn)
    T, H = x.shape
    ke = top_k_index.shape[1]
    rows = gate_up.shape[1]
    flat, work = _workspace(
        T,
        {"est": (ke, rows), "gu": (k, 2), "z": (triton.next_power_of_2(max(rank, 1)),), "y": (H,)},
        x.device,
        zeroed=not fuse,
    )
    coords, values = rotate_scan(x, layer.signs, scan, zero=flat if fuse else None)
    screen(values, coords, top_k_index, layer.codes, layer.scales, out=work["est"], sem=atomics)
    expert, channel, weight, q = select(
        work["est"],
        top_k_index,
        top_k_weights,
        layer.down_norms,
        k,
        act,
        recovery=rank > 0,
        **SELECT_VARIANTS[select_variant],
    )
    if fuse and rank:
        exact_recover(
            x, expert, channel, gate_up, q, top_k_index, layer.coeffs, rank, work["gu"], work["z"], sem=atomics
        )
    else:
        exact(x, expert, channel, gate_up, out=work["gu"], sem=atomics)
        if rank:
            recover(q, top_k_index, layer.coeffs, rank, out=work["z"], sem=atomics)
    y = down(
        work["gu"], weight, expert, channel, down_rows, act, layer.basis, work["z"], rank, out=work["y"], sem=atomics
    )
    return y.to(x.dtype)


def check_layer(layer) -> None:
    if layer.codes.shape[2] != BLOCK:
        raise UserError(f"reader codes have {layer.codes.shape[2]} coordinates per block, expected {BLOCK}")


def dense_forward(x, top_k_index, top_k_weights, gate_up, down_rows, *, act_fn) -> torch.Tensor:
    """The dense top-k MoE on the same kernels, every channel of the routed experts exact: a
    fused-MoE-style GEMV baseline (gate/up rows, then down rows with the activation fused) that
    differs from the reader only in what it reads."""
    _check_device(x)
    T, ke = top_k_index.shape
    inter = down_rows.shape[1]
    expert = top_k_index.to(torch.int32).repeat_interleave(inter, dim=1)  # [T, ke·I]: slot-major
    channel = torch.arange(inter, device=x.device, dtype=torch.int32).repeat(T, ke)
    weight = top_k_weights.to(torch.float32).repeat_interleave(inter, dim=1)
    act = activation(act_fn)
    return down(exact(x, expert, channel, gate_up), weight, expert, channel, down_rows, act).to(x.dtype)
