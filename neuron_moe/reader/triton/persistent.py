"""The reader in one launch: rotate → screen → select → exact / recover → down as phases of one grid.

The H200 runs (bench/results/gpu_reader-h200-2026-11-30-tuning.md) put the batch-1 reader at
~62 µs, of which the bytes are ~4 µs: the rest is eight launches, each starting only when the
last one has drained, and a select stage that is one program per token (~20 µs: a 31-pass
bisection and two prefix sums over 5,632 channels). This kernel removes both:

- **One launch.** Every program takes a ticket (an atomic counter) as its virtual id, and the
  ids are laid out phase after phase: rotate+scan (which also zeroes the atomic workspace),
  screen, pivot, place, exact, recover, down. A program whose inputs come from an earlier phase
  spins on that phase's per-token counter (volatile loads, then an acquire load) until the
  programs it needs have released it. It only ever waits for programs with lower ids, which
  took their tickets before it did and so are running: whatever the GPU keeps resident, no
  program waits for one that cannot start. Under Triton's interpreter the programs run one
  after another in id order, so every wait is already met (the tests run it there). A wait
  that outlasts SPIN_LIMIT polls gives up and counts a fault (`faults()`), so a bug can give a
  wrong answer that the checks catch, never a hang.
- **Select across programs.** One *pivot* program per token finds the k-th largest score
  (`_pivot`: a radix search whose first 8-bit digit runs over all channels and the rest only
  over the few that share it), then counts, for each of CHUNKS slices of the channels, how many
  lie above it and how many tie with it. CHUNKS *place* programs then each place their slice's
  chosen channels from those counts with one short prefix sum, in parallel, instead of one
  program scanning all 5,632 (and the same channels, ties to the lower index, as select_kernel).
- **Light phases.** One launch pays for its heaviest phase in every program (registers per
  thread bound how many programs an SM holds), so each phase works in CH-wide slices: the
  pivot loops over chunks of channels, rotate+scan over 32-row tiles of the Hadamard matrix and
  a sort, where the multi-launch kernels hold a whole 8192-channel or 128×128 tensor.
- The down programs meet in fp32 through atomic adds; the last of a tile's shares to arrive
  writes that tile of the output in the input's dtype (no cast launch).

The counters live in one int32 buffer per device (`_counters`), one 128-byte line each, zero
before a call; the call's last program sets them back to zero for the next (stream order), so
calls must not run concurrently on two streams. The reductions' atomics are relaxed by default
(the counters' release/acquire pairs order them); the kernels.py helpers are the same code the
multi-launch path runs. Each phase is a branch of `persistent_kernel` that waits, runs its helper
(`_pivot`, `_place` and `_arrive` are this file's) and releases; the kernel stays one function
because its 71 parameters are the launch's.

Not yet run on a GPU: bench/gpu_reader.py times it, with a few tile shapes
(PERSISTENT_VARIANTS), beside the multi-launch reader and the dense baselines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ...errors import UserError
from ..sidecar import BLOCK
from .forward import ATOMICS, _check_device, _hadamard, _workspace, activation, check_layer
from .kernels import _down_recovery, _down_rows, _exact, _recover, _scores, _screen, _zero

LINE = 32  # int32 entries per counter (the kernels write it as the literal 32): one 128-byte line each,
# so that programs spinning on one counter do not slow the adds to another
# counter lines: 0 ticket, 1 programs done, 2 faults, 3 rotate+scan programs done; then per token t:
# 4 + 5t + (0 screen, 1 pivot, 2 place, 3 exact, 4 recover); then 4 + 5T + t·tiles + tile: down arrivals
FAULT_LINE = 2
SPIN_LIMIT = 1 << 22  # spins before a wait gives up (~seconds): a fault, not a hang


@dataclass(frozen=True)
class Tiles:
    """The one-launch kernel's shapes: warps per program (one for every phase), screen tiles (SC scanned
    coordinates × BQ code bytes), exact (BK rows × EXACT_BH coordinates) and down (BK rows × BH outputs)
    tiles, BI channels per recover program, CHUNK channels per place program, PROGRAMS the split reductions
    aim for, the reductions' memory order, and nanoseconds a spinning program sleeps
    between polls (0: none; compiled only: the interpreter cannot run the inline asm)."""

    warps: int = 4
    sc: int = 16
    bq: int = 32
    bk: int = 16
    exact_bh: int = 256
    bh: int = 128
    bi: int = 64
    chunk: int = 1024
    programs: int = 1024
    atomics: str = "relaxed"
    spin_ns: int = 0
    maxnreg: int | None = None  # a register cap per thread (more programs per SM, maybe spills)


# the variants bench/gpu_reader.py times side by side (name -> changes to Tiles()); the first is the default.
# Registers per thread, as compiled for sm_90 on the CPU (tests/test_triton_compile.py prints them), bound
# how many programs an SM holds: one launch pays for its heaviest phase everywhere.
PERSISTENT_VARIANTS = {
    "persistent": {},
    "persistent w8": {"warps": 8},
    "persistent sc8": {"sc": 8},  # 8-coordinate screen chunks: 18.8 vs 19.0 µs batch 1, 85 vs 100 batch 8 (H200)
    "persistent spin": {"spin_ns": 256},
    "persistent acq_rel": {"atomics": "acq_rel"},  # the single launch alone, without relaxed reductions
    "persistent r128": {"maxnreg": 128},  # 4 programs of 4 warps per SM, not 3 (143 registers); GELU: 48 B spilled
}


@triton.jit
def _sleep(ns: tl.constexpr):
    """Back off between polls: nanosleep (sm_70+), so that hundreds of spinning programs do not
    flood the L2 slice that holds the counter they wait on."""
    tl.inline_asm_elementwise(
        "nanosleep.u32 $1;\n mov.u32 $0, 0;",
        "=r,r",
        [tl.full([1], ns, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _wait(ctr_ptr, line, target, LIMIT: tl.constexpr, SPIN_NS: tl.constexpr):
    """Spin until counter `line` reaches `target`, then acquire it: the program's later loads see
    everything the programs that released it wrote. Past LIMIT polls: give up, count a fault."""
    ptr = ctr_ptr + line * 32
    seen = tl.load(ptr, volatile=True)
    spins = 0
    while (seen < target) & (spins < LIMIT):
        if SPIN_NS > 0:
            _sleep(SPIN_NS)
        seen = tl.load(ptr, volatile=True)
        spins += 1
    # an atomic add of 0 whose value is used lowers to ld.acquire.gpu (unused, it is dropped)
    late = tl.atomic_add(ptr, 0, sem="acquire") < target
    tl.atomic_add(ctr_ptr + 2 * 32, 1, mask=late, sem="relaxed")
    tl.debug_barrier()  # every thread of the program after the acquire


@triton.jit
def _release(ctr_ptr, line):
    """Count this program's phase work done: after every thread's writes (barrier), a release add."""
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr + line * 32, 1, sem="release")


@triton.jit
def _rotate_scan_tiled(rotate, H, nb, t, b, SCAN: tl.constexpr, BLOCK: tl.constexpr, RT: tl.constexpr):
    """kernels._rotate_scan in RT-row tiles of the Hadamard matrix, the order by one sort of
    (|r| bits, 127 - i) keys (descending: larger |r| first, ties to the lower index); the scanned
    coordinates' values are read back from rot_ptr [T, nb, BLOCK] (a register tensor cannot be gathered).
    `rotate`: the pointers x, signs, hadamard, rot, coords and values."""
    x_ptr, signs_ptr, hadamard_ptr, rot_ptr, coords_ptr, values_ptr = rotate
    i = tl.arange(0, BLOCK)
    r = tl.zeros([BLOCK], dtype=tl.float32)
    for i0 in tl.static_range(0, BLOCK, RT):
        ii = i0 + tl.arange(0, RT)
        h = b * BLOCK + ii
        xs = tl.load(x_ptr + t * H + h, mask=h < H, other=0.0).to(tl.float32) * tl.load(signs_ptr + h).to(tl.float32)
        r += tl.sum(xs[:, None] * tl.load(hadamard_ptr + ii[:, None] * BLOCK + i[None, :]), axis=0)
    rot = rot_ptr + (t * nb + b) * BLOCK
    tl.store(rot + i, r)
    key = (tl.abs(r).to(tl.int32, bitcast=True).to(tl.int64) << 7) | (BLOCK - 1 - i).to(tl.int64)
    key = tl.sort(key, descending=True)
    coord = (BLOCK - 1 - (key & (BLOCK - 1))).to(tl.int32)
    tl.debug_barrier()  # r stored by every thread before any reads it back
    keep = i < SCAN
    dest = (t * nb + b) * SCAN + i
    tl.store(coords_ptr + dest, coord, mask=keep)
    tl.store(values_ptr + dest, tl.load(rot + coord, mask=keep, other=0.0), mask=keep)


@triton.jit
def _digit_pick(hist, need, UNIT: tl.constexpr):
    """Over a histogram of complemented digits (rank 0 = the largest digit): the rank where the count
    of entries with a larger or equal digit first reaches `need`, and `need` less those above it."""
    upto = tl.cumsum(hist, axis=0)
    packed = tl.sum(tl.where(upto < need, UNIT + hist, 0), axis=0)
    return packed // UNIT, need - packed % UNIT


@triton.jit
def _refine(
    cand_ptr,
    t,
    count,
    kth,
    need,
    SHIFT: tl.constexpr,
    WIDTH: tl.constexpr,
    N_P2: tl.constexpr,
    CH: tl.constexpr,
    UNIT: tl.constexpr,
):
    """One more radix digit (bits SHIFT .. SHIFT + WIDTH - 1) of the k-th, over the `count` candidates."""
    hist = tl.zeros([256], dtype=tl.int32)
    for c0 in range(0, count, CH):
        i = c0 + tl.arange(0, CH)
        cb = tl.load(cand_ptr + t * 2 * N_P2 + i, mask=i < count, other=-1)
        match = (cb >= 0) & ((cb >> (SHIFT + WIDTH)) == (kth >> (SHIFT + WIDTH)))
        hist += tl.histogram(255 - ((cb >> SHIFT) & ((1 << WIDTH) - 1)), 256, mask=match)
    top, need = _digit_pick(hist, need, UNIT)
    return kth | ((255 - top) << SHIFT), need


@triton.jit
def _pivot(
    scores,
    select,
    k,
    t,
    ACT: tl.constexpr,
    HAS_RECOVERY: tl.constexpr,
    N_P2: tl.constexpr,
    CH: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Token t's k-th largest score (the largest value v with count(bits >= v) >= k, as kernels._radix_kth)
    and, per chunk of CH channels, how many scores lie above it and how many equal it in the chunks
    before: sel [T, 2 + 2·CHUNKS] = kth, room, above_before[CHUNKS], tied_before[CHUNKS].

    In CH-wide slices: (1) the scores, stored (bits_ptr, and w·p into q_ptr), and a 256-bin
    histogram of their top digit (bits 30..23: the exponent); (2) the entries in the k-th's top-digit
    bin are compacted into cand_ptr with their chunk, and each chunk's count above that bin kept;
    (3) three more digits (8, 8, 7 bits) over the candidates only, typically a few hundred; (4) the
    chunks' counts of candidates above and equal to the k-th, by histograms over the chunk index. `scores`:
    the estimates, routing and down norms the scores come from, with ke and inter; `select`: the select
    phases' buffers bits, q, cand and sel."""
    est_ptr, experts_ptr, weights_ptr, norms_ptr, ke, inter = scores
    bits_ptr, q_ptr, cand_ptr, sel_ptr = select
    UNIT: tl.constexpr = 2 * N_P2  # counts are at most N_P2: one sum carries a rank and a count (_radix_kth)
    hist = tl.zeros([256], dtype=tl.int32)
    for c in range(CHUNKS):
        n, valid, j, e, w, p, bits = _scores(
            est_ptr, experts_ptr, weights_ptr, norms_ptr, ke, inter, t, c * CH, ACT, CH, ".cg"
        )
        tl.store(bits_ptr + t * N_P2 + n, bits)
        if HAS_RECOVERY:
            tl.store(q_ptr + t * ke * inter + n, w * p, mask=valid)  # place zeroes the chosen
        hist += tl.histogram(255 - (bits >> 23), 256, mask=valid)
    top, need = _digit_pick(hist, k, UNIT)
    high = 255 - top  # the k-th's top digit
    tl.debug_barrier()  # the scores stored by every thread before they are read back
    chunk = tl.arange(0, CHUNKS)
    above = tl.zeros([CHUNKS], dtype=tl.int32)
    count = 0
    for c in range(CHUNKS):
        n = c * CH + tl.arange(0, CH)
        bits = tl.load(bits_ptr + t * N_P2 + n)
        digit = bits >> 23  # -1 for padding: never a candidate, never above
        above = tl.where(chunk == c, tl.sum((digit > high).to(tl.int32), axis=0), above)
        cand = digit == high
        at = count + tl.cumsum(cand.to(tl.int32), axis=0) - 1
        tl.store(cand_ptr + t * 2 * N_P2 + at, bits, mask=cand)
        tl.store(cand_ptr + (2 * t + 1) * N_P2 + at, tl.full([CH], c, tl.int32), mask=cand)
        count += tl.sum(cand.to(tl.int32), axis=0)
    tl.debug_barrier()
    kth = high << 23
    kth, need = _refine(cand_ptr, t, count, kth, need, 15, 8, N_P2, CH, UNIT)  # bits 22..15
    kth, need = _refine(cand_ptr, t, count, kth, need, 7, 8, N_P2, CH, UNIT)  # 14..7
    kth, need = _refine(cand_ptr, t, count, kth, need, 0, 7, N_P2, CH, UNIT)  # 6..0
    tied = tl.zeros([CHUNKS], dtype=tl.int32)
    for c0 in range(0, count, CH):
        i = c0 + tl.arange(0, CH)
        m = i < count
        cb = tl.load(cand_ptr + t * 2 * N_P2 + i, mask=m, other=-1)
        cc = tl.load(cand_ptr + (2 * t + 1) * N_P2 + i, mask=m, other=0)
        above += tl.histogram(cc, CHUNKS, mask=m & (cb > kth))
        tied += tl.histogram(cc, CHUNKS, mask=m & (cb == kth))
    sel = sel_ptr + t * (2 + 2 * CHUNKS)
    tl.store(sel + 2 + chunk, tl.cumsum(above, axis=0) - above)
    tl.store(sel + 2 + CHUNKS + chunk, tl.cumsum(tied, axis=0) - tied)
    tl.store(sel, kth)
    tl.store(sel + 1, need)  # how many of the scores equal to the k-th to take


@triton.jit
def persistent_kernel(
    x_ptr,
    signs_ptr,
    hadamard_ptr,
    codes_ptr,
    scales_ptr,
    experts_ptr,
    weights_ptr,
    norms_ptr,
    gate_up_ptr,
    down_ptr,
    coeffs_ptr,
    basis_ptr,
    rot_ptr,
    coords_ptr,
    values_ptr,
    est_ptr,
    bits_ptr,
    cand_ptr,
    q_ptr,
    sel_ptr,
    expert_ptr,
    channel_ptr,
    weight_ptr,
    gu_ptr,
    z_ptr,
    y_ptr,
    zero_ptr,
    out_ptr,
    ctr_ptr,
    T,
    H,
    nb,
    ke,
    inter,
    k,
    rank,
    strip,
    rows,
    zero_n,
    zero_per,
    screen_tiles,
    screen_shares,
    blocks_per_share,
    exact_jt,
    exact_ht,
    recover_it,
    down_tiles,
    down_shares,
    rows_per_share,
    stride_ce,
    stride_ci,
    stride_cr,
    stride_bh,
    stride_br,
    ACT: tl.constexpr,
    HAS_RECOVERY: tl.constexpr,
    N_P2: tl.constexpr,
    CHUNKS: tl.constexpr,
    SCAN: tl.constexpr,
    BLOCK: tl.constexpr,
    SC: tl.constexpr,
    BQ: tl.constexpr,
    BK: tl.constexpr,
    EXACT_BH: tl.constexpr,
    BH: tl.constexpr,
    BI: tl.constexpr,
    RANK_P2: tl.constexpr,
    ZB: tl.constexpr,
    SEM: tl.constexpr,
    LIMIT: tl.constexpr,
    SPIN_NS: tl.constexpr,
):
    """One program: one item of one phase, by its ticket (the module's docstring). Phases, in id order:
    T·nb rotate+scan, T·ke·screen_tiles·screen_shares screen, T pivot, T·CHUNKS place, T·exact_jt·exact_ht
    exact, T·ke·recover_it recover (with recovery), T·down_tiles·down_shares down; token-major in each."""
    CH: tl.constexpr = N_P2 // CHUNKS
    n_rot = T * nb
    n_screen = T * ke * screen_tiles * screen_shares
    e_screen = n_rot + n_screen
    e_pivot = e_screen + T
    e_place = e_pivot + T * CHUNKS
    e_exact = e_place + T * exact_jt * exact_ht
    e_recover = e_exact
    if HAS_RECOVERY:
        e_recover += T * ke * recover_it
    total = e_recover + T * down_tiles * down_shares
    vid = tl.atomic_add(ctr_ptr, 1, sem="relaxed")
    scores = (est_ptr, experts_ptr, weights_ptr, norms_ptr, ke, inter)
    select = (bits_ptr, q_ptr, cand_ptr, sel_ptr)
    if vid < n_rot:  # rotate+scan one (token, block), and zero a share of the workspace
        _zero(zero_ptr, zero_n, vid * zero_per, zero_per, ZB)
        rotate = (x_ptr, signs_ptr, hadamard_ptr, rot_ptr, coords_ptr, values_ptr)
        _rotate_scan_tiled(rotate, H, nb, vid // nb, vid % nb, SCAN, BLOCK, 32)
        _release(ctr_ptr, 3)
    elif vid < e_screen:  # screen: waits for every rotate program (they zero the estimates)
        i = vid - n_rot
        per_token = ke * screen_tiles * screen_shares
        t = i // per_token
        r = i % per_token
        _wait(ctr_ptr, 3, n_rot, LIMIT, SPIN_NS)
        screen = (codes_ptr, scales_ptr, experts_ptr, coords_ptr, values_ptr, est_ptr)
        tk, tile, share = t * ke + r % ke, (r // ke) % screen_tiles, r // (ke * screen_tiles)
        _screen(screen, (ke, nb, strip, rows, blocks_per_share), tk, tile, share, SCAN, SC, BQ, SEM, ".cg")
        _release(ctr_ptr, 4 + 5 * t)
    elif vid < e_pivot:  # pivot: the token's k-th largest score and the chunks' counts
        t = vid - e_screen
        _wait(ctr_ptr, 4 + 5 * t, ke * screen_tiles * screen_shares, LIMIT, SPIN_NS)
        _pivot(scores, select, k, t, ACT, HAS_RECOVERY, N_P2, CH, CHUNKS)
        _release(ctr_ptr, 5 + 5 * t)
    elif vid < e_place:  # place: one chunk's chosen channels, in channel order, at their output slots
        i = vid - e_pivot
        t = i // CHUNKS
        c = i % CHUNKS
        _wait(ctr_ptr, 5 + 5 * t, 1, LIMIT, SPIN_NS)
        _place(scores, select, (expert_ptr, channel_ptr, weight_ptr), k, t, c, HAS_RECOVERY, N_P2, CH, CHUNKS)
        _release(ctr_ptr, 6 + 5 * t)
    elif vid < e_exact:  # exact: BK chosen rows × EXACT_BH coordinates of their gate and up rows
        i = vid - e_place
        t = i // (exact_jt * exact_ht)
        r = i % (exact_jt * exact_ht)
        _wait(ctr_ptr, 6 + 5 * t, CHUNKS, LIMIT, SPIN_NS)
        exact = (gate_up_ptr, x_ptr, expert_ptr, channel_ptr, gu_ptr, k, H, inter)
        _exact(exact, t, r % exact_jt, r // exact_jt, BK, EXACT_BH, SEM, ".cg")
        _release(ctr_ptr, 7 + 5 * t)
    elif vid < e_recover:  # recover: b_j of BI unchosen channels of one (token, slot)
        i = vid - e_exact
        t = i // (ke * recover_it)
        r = i % (ke * recover_it)
        _wait(ctr_ptr, 6 + 5 * t, CHUNKS, LIMIT, SPIN_NS)
        recover = (coeffs_ptr, q_ptr, experts_ptr, z_ptr, ke, inter, rank, stride_ce, stride_ci, stride_cr)
        _recover(recover, t * ke + r % ke, r // ke, RANK_P2, BI, SEM, ".cg")
        _release(ctr_ptr, 8 + 5 * t)
    elif vid < total:  # down: BH outputs × one share of the chosen rows; the tile's last share writes it out
        i = vid - e_recover
        t = i // (down_tiles * down_shares)
        r = i % (down_tiles * down_shares)
        tile = r // down_shares
        share = r % down_shares
        h = tile * BH + tl.arange(0, BH)
        _wait(ctr_ptr, 7 + 5 * t, exact_jt * exact_ht, LIMIT, SPIN_NS)
        chosen = (down_ptr, expert_ptr, channel_ptr, weight_ptr, gu_ptr, k, H, inter, rows_per_share)
        acc = _down_rows(chosen, t, h, share, ACT, BK, BH, ".cg")
        if HAS_RECOVERY:
            if share == 0:
                _wait(ctr_ptr, 8 + 5 * t, ke * recover_it, LIMIT, SPIN_NS)
                acc += _down_recovery(basis_ptr, z_ptr, H, rank, stride_bh, stride_br, t, h, RANK_P2, ".cg")
        tl.atomic_add(y_ptr + t * H + h, acc, mask=h < H, sem=SEM)
        tl.debug_barrier()
        _arrive(ctr_ptr + (4 + 5 * T + t * down_tiles + tile) * 32, down_shares, y_ptr, out_ptr, t, h, H)
    tl.debug_barrier()
    done = tl.atomic_add(ctr_ptr + 32, 1, sem="acq_rel")
    if done == total - 1:  # every other program has made its last counter access: reset them (not the faults)
        _reset(ctr_ptr, 4 + 5 * T + T * down_tiles, ZB)


@triton.jit
def _place(
    scores,
    select,
    picks,
    k,
    t,
    c,
    HAS_RECOVERY: tl.constexpr,
    N_P2: tl.constexpr,
    CH: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Chunk c of token t's channels: its chosen ones (above the k-th, or tied with it and among the first
    `room` tied of the token) written to picks (expert, channel, weight [T, k]) at their output slots, from
    the pivot's counts; their q zeroed. `scores`, `select`: as `_pivot`'s."""
    _, experts_ptr, weights_ptr, _, ke, inter = scores
    bits_ptr, q_ptr, _, sel_ptr = select
    expert_ptr, channel_ptr, weight_ptr = picks
    sel = sel_ptr + t * (2 + 2 * CHUNKS)
    kth = tl.load(sel, cache_modifier=".cg")
    room = tl.load(sel + 1, cache_modifier=".cg")
    above_before = tl.load(sel + 2 + c, cache_modifier=".cg")
    tied_before = tl.load(sel + 2 + CHUNKS + c, cache_modifier=".cg")
    n = c * CH + tl.arange(0, CH)
    valid = n < ke * inter
    bits = tl.load(bits_ptr + t * N_P2 + n, cache_modifier=".cg")
    tied = (bits == kth).to(tl.int32)
    # the tied ones go to the lowest channels: those whose rank among all the token's tied is < room
    chosen = (bits > kth) | ((tied != 0) & (tied_before + tl.cumsum(tied, axis=0) <= room))
    pos = above_before + tl.minimum(tied_before, room) + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    slot = n // inter
    e = tl.load(experts_ptr + t * ke + slot, mask=valid, other=0)
    w = tl.load(weights_ptr + t * ke + slot, mask=valid, other=0.0).to(tl.float32)
    tl.store(expert_ptr + t * k + pos, e.to(tl.int32), mask=chosen)
    tl.store(channel_ptr + t * k + pos, n % inter, mask=chosen)
    tl.store(weight_ptr + t * k + pos, w, mask=chosen)
    if HAS_RECOVERY:
        tl.store(q_ptr + t * ke * inter + n, tl.zeros([CH], dtype=tl.float32), mask=chosen)


@triton.jit
def _arrive(arrivals_ptr, shares, y_ptr, out_ptr, t, h, H):
    """Count a down share's arrival at its tile (its sums already added into y); the last of the tile's
    `shares` to arrive writes that tile of y out in out's dtype."""
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
    tl.debug_barrier()
    if arrived == shares - 1:
        yv = tl.load(y_ptr + t * H + h, mask=h < H, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + t * H + h, yv.to(out_ptr.dtype.element_ty), mask=h < H)


@triton.jit
def _reset(ctr_ptr, lines, ZB: tl.constexpr):
    """Zero the first `lines` counter lines but the faults' (line 2), for the next call."""
    for l0 in range(0, lines, ZB):
        line = l0 + tl.arange(0, ZB)
        tl.store(ctr_ptr + line * 32, tl.zeros([ZB], dtype=tl.int32), mask=(line < lines) & (line != 2))


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _counters(device: torch.device, lines: int) -> torch.Tensor:
    """The device's zeroed counter buffer, at least `lines` lines. A larger one replaces it when needed
    (on a warm-up call, before any CUDA-graph capture); the old ones are kept, since a captured graph
    may still point at them."""
    kept = _COUNTERS.setdefault(device, [])
    if not kept or kept[-1].numel() < lines * LINE:
        kept.append(torch.zeros(max(lines, 1024) * LINE, dtype=torch.int32, device=device))
    return kept[-1]


def faults(device) -> int:
    """How many waits of the one-launch kernel gave up on this device so far (0 when all went right)."""
    return sum(int(c[FAULT_LINE * LINE].item()) for c in _COUNTERS.get(torch.device(device), []))


def tiles(variant: str = "persistent", **changes) -> Tiles:
    """A PERSISTENT_VARIANTS entry's Tiles, with `changes` on top."""
    if variant not in PERSISTENT_VARIANTS:
        raise UserError(f"unknown persistent variant {variant!r}; known: {', '.join(PERSISTENT_VARIANTS)}")
    return replace(Tiles(), **{**PERSISTENT_VARIANTS[variant], **changes})


def _selection(T: int, ke: int, inter: int, k: int, shape: Tiles, dev) -> tuple[int, int, dict]:
    """N_P2, the place programs' chunk, and the select phases' buffers."""
    if not 0 < k <= ke * inter:
        raise UserError(f"reader: k = {k} channels, but a token's experts have {ke * inter}")
    if shape.atomics not in ATOMICS:
        raise UserError(f"persistent reader: atomics {shape.atomics!r}; known: {', '.join(ATOMICS)}")
    n_p2 = triton.next_power_of_2(ke * inter)
    chunk = min(triton.next_power_of_2(shape.chunk), n_p2)
    buffers = {
        name: torch.empty(T, *size, dtype=dtype, device=dev)
        for name, (size, dtype) in {
            "bits": ((n_p2,), torch.int32),
            "cand": ((2, n_p2), torch.int32),
            "q": ((ke, inter), torch.float32),
            "sel": ((2 + 2 * (n_p2 // chunk),), torch.int32),
            "expert": ((k,), torch.int32),
            "channel": ((k,), torch.int32),
            "weight": ((k,), torch.float32),
        }.items()
    }
    return n_p2, chunk, buffers


def _launch(shape: Tiles, T: int, counts: dict, pointers: dict, sizes: dict, constexprs: dict, dev):
    """persistent_kernel over exactly its programs (the phases' counts: `counts`, which sizes may be 0)."""
    programs = (
        counts["rot"]
        + counts["screen"]
        + T
        + T * constexprs["CHUNKS"]
        + counts["exact"]
        + (counts["recover"] if constexprs["HAS_RECOVERY"] else 0)
        + counts["down"]
    )
    ctr = _counters(dev, 4 + 5 * T + T * sizes["down_tiles"])
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    persistent_kernel[(programs,)](
        *(pointers[name] for name in _POINTERS),
        ctr,
        *(sizes[name] for name in _SIZES),
        **constexprs,
        SEM=shape.atomics,
        LIMIT=SPIN_LIMIT,
        ZB=1024,
        SPIN_NS=0 if interpreted else shape.spin_ns,
        num_warps=shape.warps,
        **({"maxnreg": shape.maxnreg} if shape.maxnreg else {}),
    )


_POINTERS = (
    "x",
    "signs",
    "hadamard",
    "codes",
    "scales",
    "experts",
    "weights",
    "norms",
    "gate_up",
    "down",
    "coeffs",
    "basis",
    "rot",
    "coords",
    "values",
    "est",
    "bits",
    "cand",
    "q",
    "sel",
    "expert",
    "channel",
    "weight",
    "gu",
    "z",
    "y",
    "zero",
    "out",
)
_SIZES = (
    "T",
    "H",
    "nb",
    "ke",
    "inter",
    "k",
    "rank",
    "strip",
    "rows",
    "zero_n",
    "zero_per",
    "screen_tiles",
    "screen_shares",
    "blocks_per_share",
    "exact_jt",
    "exact_ht",
    "recover_it",
    "down_tiles",
    "down_shares",
    "rows_per_share",
    "stride_ce",
    "stride_ci",
    "stride_cr",
    "stride_bh",
    "stride_br",
)


def forward(
    x, top_k_index, top_k_weights, gate_up, down_rows, layer, *, k: int, scan: int, rank: int, act_fn, shape=Tiles()
) -> torch.Tensor:
    """`reference.forward` (screen="sketch") in one launch; same inputs and output as `forward.forward`."""
    _check_device(x)
    check_layer(layer)
    T, H = x.shape
    ke = top_k_index.shape[1]
    rows = gate_up.shape[1]
    inter, nb, strip = rows // 2, layer.signs.numel() // BLOCK, layer.codes.shape[-1]
    for name, t in (("gate_up", gate_up), ("down_rows", down_rows), ("codes", layer.codes), ("scales", layer.scales)):
        if not t.is_contiguous():
            raise UserError(f"persistent reader: {name} must be contiguous (shape {tuple(t.shape)})")
    dev = x.device
    n_p2, chunk, sel = _selection(T, ke, inter, k, shape, dev)
    rank_p2 = triton.next_power_of_2(max(rank, 1))
    flat, work = _workspace(T, {"est": (ke, rows), "gu": (k, 2), "z": (rank_p2,), "y": (H,)}, dev, zeroed=False)
    sizes = {"T": T, "H": H, "nb": nb, "ke": ke, "inter": inter, "k": k, "rank": rank, "strip": strip, "rows": rows}
    sizes |= {"zero_n": flat.numel(), "zero_per": triton.cdiv(flat.numel(), T * nb), **_split(shape, sizes)}
    sizes.update(zip(("stride_ce", "stride_ci", "stride_cr"), layer.coeffs.stride()))
    sizes.update(zip(("stride_bh", "stride_br"), layer.basis.stride()))
    out = torch.empty(T, H, dtype=x.dtype, device=dev)
    pointers = dict(
        x=x.contiguous(),
        signs=layer.signs,
        hadamard=_hadamard(dev),
        codes=layer.codes,
        scales=layer.scales,
        experts=top_k_index.contiguous(),
        weights=top_k_weights.contiguous(),
        norms=layer.down_norms,
        gate_up=gate_up,
        down=down_rows,
        coeffs=layer.coeffs,
        basis=layer.basis,
        rot=torch.empty(T, nb, BLOCK, device=dev),
        coords=torch.empty(T, nb, scan, dtype=torch.int32, device=dev),
        values=torch.empty(T, nb, scan, device=dev),
        zero=flat,
        out=out,
        **sel,
        **{name: work[name] for name in ("est", "gu", "z", "y")},
    )
    constexprs = _constexprs(shape, activation(act_fn), rank > 0, n_p2, chunk, scan, rank_p2)
    _launch(shape, T, _counts(sizes), pointers, sizes, constexprs, dev)
    return out


def _split(shape: Tiles, sizes: dict) -> dict:
    """The phases' tiles and shares: the multi-launch kernels' work split (forward.py), with this variant's
    tiles. `sizes`: the call's T, H, nb, ke, inter and k."""
    T, H, nb, ke, k = (sizes[name] for name in ("T", "H", "nb", "ke", "k"))
    screen_tiles = triton.cdiv(sizes["strip"], shape.bq)
    per = triton.cdiv(nb, max(1, min(nb, triton.cdiv(shape.programs, T * ke * screen_tiles))))
    down_tiles = triton.cdiv(H, shape.bh)
    rows_per_share = triton.cdiv(k, max(1, min(triton.cdiv(k, shape.bk), triton.cdiv(shape.programs, T * down_tiles))))
    return {
        "screen_tiles": screen_tiles,
        "screen_shares": triton.cdiv(nb, per),
        "blocks_per_share": per,
        "exact_jt": triton.cdiv(k, shape.bk),
        "exact_ht": triton.cdiv(H, shape.exact_bh),
        "recover_it": triton.cdiv(sizes["inter"], shape.bi),
        "down_tiles": down_tiles,
        "down_shares": triton.cdiv(k, rows_per_share),  # no empty share: each arrives
        "rows_per_share": rows_per_share,
    }


def _counts(sizes: dict) -> dict:
    """Each phase's programs but the select's (pivot and place: T and T·CHUNKS), from the call's sizes."""
    T, ke = sizes["T"], sizes["ke"]
    return {
        "rot": T * sizes["nb"],
        "screen": T * ke * sizes["screen_tiles"] * sizes["screen_shares"],
        "exact": T * sizes["exact_jt"] * sizes["exact_ht"],
        "recover": T * ke * sizes["recover_it"],
        "down": T * sizes["down_tiles"] * sizes["down_shares"],
    }


def _constexprs(shape: Tiles, act: int, recovery: bool, n_p2: int, chunk: int, scan: int, rank_p2: int) -> dict:
    """persistent_kernel's constexprs but those `_launch` adds (SEM, LIMIT, ZB, SPIN_NS)."""
    select = {"ACT": act, "HAS_RECOVERY": recovery, "N_P2": n_p2, "CHUNKS": n_p2 // chunk}
    tiles = {"SC": shape.sc, "BQ": shape.bq, "BK": shape.bk, "EXACT_BH": shape.exact_bh, "BH": shape.bh, "BI": shape.bi}
    return select | {"SCAN": scan, "BLOCK": BLOCK, "RANK_P2": rank_p2} | tiles


def select(
    estimates, top_k_index, top_k_weights, down_norms, k: int, act: int, recovery: bool = True, shape: Tiles = Tiles()
):
    """The pivot and place phases alone (the others sized 0), from given estimates [T, ke, 2I]: the same
    result as `forward.select` (expert, channel, weight [T, k], q [T, ke, I] or None): for the tests,
    and for bench/gpu_reader.py to time selection across programs beside select_kernel."""
    T, ke, rows = estimates.shape
    dev = estimates.device
    n_p2, chunk, sel = _selection(T, ke, rows // 2, k, shape, dev)
    sizes = dict.fromkeys(_SIZES, 0) | dict(T=T, ke=ke, inter=rows // 2, k=k, rows=rows)
    unused = sel["q"]  # never read: every phase that would is sized 0
    pointers = dict.fromkeys(_POINTERS, unused) | dict(
        est=estimates.contiguous(),
        experts=top_k_index.contiguous(),
        weights=top_k_weights.contiguous(),
        norms=down_norms,
        **sel,
    )
    constexprs = _constexprs(shape, act, recovery, n_p2, chunk, 1, 1)
    _launch(shape, T, dict(rot=0, screen=0, exact=0, recover=0, down=0), pointers, sizes, constexprs, dev)
    return sel["expert"], sel["channel"], sel["weight"], (sel["q"] if recovery else None)
