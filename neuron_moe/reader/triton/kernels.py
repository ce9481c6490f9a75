"""The reader's Triton kernels: rotate+scan, screen, select, exact (gate/up dots), recover, down.

Every kernel reads the sidecar exactly as `reader/sidecar.py` lays it out (docs/reader.md): codes
uint8 [E, nb, 128, S] coordinate-major, base 3, five rows per byte; scales [E, nb, 2I];
down_norms [E, I]; coeffs [E, I, rank]; basis [H, rank]; signs [nb·128]; the down projection
as rows [E, I, H]. Weights and tokens may be bf16 or fp32: every load is converted to fp32
before any arithmetic (the interpreter gets bf16 arithmetic wrong, and fp32 accumulation is
what the reference does).

Decode is latency-bound: on an H200 (bench/results/gpu_reader-h200-2026-11-30*.md), programs that
walk long serial loops on a few SMs and dozens of small torch ops take ~75 % of a 360 µs layer. So
every weight-reading kernel splits its reduction across many programs that meet in fp32 buffers
through atomic adds (zeroed once per call), and the glue (rotation, scan choice, top-k) is two
kernels of its own.

Each kernel's body is a `_helper` taking its program indices, so that `persistent.py` runs the
same code as phases of one launch; a helper takes the kernel's pointers and sizes as one tuple (or
two: pointers, sizes), in the kernel's argument order, so that each caller names them once. Triton
inlines the helpers and flattens the tuples: the compiled kernels are those of the flat
arguments. Two constexprs every helper that reduces or reads another
stage's output takes: SEM, the memory order of the reductions' atomic adds (Triton's default
"acq_rel" compiles to `atom.acq_rel`, a round trip and a fence per add; "relaxed" to a
fire-and-forget `red`: both correct here, since a kernel's end or, in the one-launch kernel, a
release/acquire pair on a counter orders them), and CACHE, the cache modifier of those reads
("" as usual; ".cg", L2 only, where another program of the same launch wrote the data).

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
    # is a literal: the compiler refuses a plain-float global, which the interpreter accepts
    # (tests/test_triton_compile.py compiles every kernel for sm_90 on the CPU),
    # and the interpreter cannot multiply a tensor by a tl.constexpr global
    if ACT == 0:
        return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    else:
        return g * tl.sigmoid(g)


@triton.jit
def rotate_scan_kernel(
    x_ptr,
    signs_ptr,
    hadamard_ptr,
    coords_ptr,
    values_ptr,
    zero_ptr,
    H,
    nb,
    zero_n,
    zero_per_program,
    SCAN: tl.constexpr,
    BLOCK: tl.constexpr,
    ZB: tl.constexpr,
):
    """One program: one token's one block of BLOCK coordinates. r = H_n·diag(s)·x_block (the
    sidecar's rotation; H_n the normalised Hadamard matrix), then the SCAN coordinates of largest
    |r|, written in descending order (ties to the lower index) with their r: coords, values
    [T, nb, SCAN]. The order is a coordinate's rank, counted directly: no sort.
    With zero_per_program > 0 each program also zeroes its share of the fp32 buffer zero_ptr
    [zero_n] (the later stages' atomic workspace), in place of a memset launch of its own."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    _zero(zero_ptr, zero_n, (t * nb + b) * zero_per_program, zero_per_program, ZB)
    _rotate_scan(x_ptr, signs_ptr, hadamard_ptr, coords_ptr, values_ptr, H, nb, t, b, SCAN, BLOCK)


@triton.jit
def _zero(ptr, n, first, count, ZB: tl.constexpr):
    """Zero the fp32 entries [first, first + count) of ptr [n]."""
    for z0 in range(first, first + count, ZB):
        z = z0 + tl.arange(0, ZB)
        tl.store(ptr + z, tl.zeros([ZB], dtype=tl.float32), mask=(z < first + count) & (z < n))


@triton.jit
def _rotate_scan(
    x_ptr, signs_ptr, hadamard_ptr, coords_ptr, values_ptr, H, nb, t, b, SCAN: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.arange(0, BLOCK)
    h = b * BLOCK + i
    xs = tl.load(x_ptr + t * H + h, mask=h < H, other=0.0).to(tl.float32) * tl.load(signs_ptr + h).to(tl.float32)
    hadamard = tl.load(hadamard_ptr + i[:, None] * BLOCK + i[None, :])
    r = tl.sum(xs[:, None] * hadamard, axis=0)  # r_j = Σ_i xs_i H_ij (H symmetric)
    a = tl.abs(r)
    ai, aj = a[:, None], a[None, :]
    ahead = (ai > aj) | ((ai == aj) & (i[:, None] < i[None, :]))  # coordinate i comes before j
    rank = tl.sum(ahead.to(tl.int32), axis=0)
    keep = rank < SCAN
    dest = (t * nb + b) * SCAN + rank
    tl.store(coords_ptr + dest, i, mask=keep)
    tl.store(values_ptr + dest, r, mask=keep)


@triton.jit
def _digit(f, xs, acc):
    """Digit 0 of the base-3 numbers f [SC, BQ] (floats holding integers < 243) as codes 0, +1, -1,
    times xs [SC, BQ], added to acc; and f // 3. In fp32 (twice the int32 rate on a GPU): floor(f/3)
    is exact here, and d·(2.5 - 1.5·d) maps d = 0, 1, 2 to 0, 1, -1."""
    rest = tl.floor(f * 0.3333333432674408)
    d = f - 3.0 * rest
    return acc + d * (2.5 - 1.5 * d) * xs, rest


@triton.jit
def screen_kernel(
    codes_ptr,
    scales_ptr,
    experts_ptr,
    coords_ptr,
    values_ptr,
    out_ptr,
    ke,
    nb,
    strip,
    rows,
    blocks_per_program,
    SCAN: tl.constexpr,
    SC: tl.constexpr,
    BQ: tl.constexpr,
    SEM: tl.constexpr = "acq_rel",
):
    """One program: one (token, routed slot), BQ code bytes (5·BQ rows) of the scanned strips of
    `blocks_per_program` blocks. Adds into out [T, ke, rows] (zeroed):

    est[r] += Σ_b Σ_{c scanned} code(e, b, c, r) · (Rx)_{b,c} · scale[e, b, r]

    reading only the scanned strips (coordinate-major: a contiguous run of bytes per coordinate)
    and the scales; SC scanned coordinates at a time (the chunk loop is unrolled: SCAN is a
    constexpr, so the chunks' loads are in flight together). The sums stay elementwise in [SC, BQ]
    accumulators and cross the coordinates once, at the end: a reduction per chunk and digit
    (shuffles across the warp) costs more than the loads it follows on an H200."""
    screen = (codes_ptr, scales_ptr, experts_ptr, coords_ptr, values_ptr, out_ptr)
    sizes = (ke, nb, strip, rows, blocks_per_program)
    _screen(screen, sizes, tl.program_id(0), tl.program_id(1), tl.program_id(2), SCAN, SC, BQ, SEM, "")


@triton.jit
def _screen(
    screen,
    sizes,
    tk,
    tile,
    share,
    SCAN: tl.constexpr,
    SC: tl.constexpr,
    BQ: tl.constexpr,
    SEM: tl.constexpr,
    CACHE: tl.constexpr,
):
    """screen_kernel's program (tk: token · ke + slot; tile: BQ code bytes; share: of the blocks); `screen`
    and `sizes`: its pointers and its sizes, screen_kernel's arguments in their order."""
    codes_ptr, scales_ptr, experts_ptr, coords_ptr, values_ptr, out_ptr = screen
    ke, nb, strip, rows, blocks_per_program = sizes
    t = tk // ke
    q = tile * BQ + tl.arange(0, BQ)
    qm = q < strip
    e = tl.load(experts_ptr + tk).to(tl.int64)
    acc0 = tl.zeros([SC, BQ], dtype=tl.float32)
    acc1 = tl.zeros([SC, BQ], dtype=tl.float32)
    acc2 = tl.zeros([SC, BQ], dtype=tl.float32)
    acc3 = tl.zeros([SC, BQ], dtype=tl.float32)
    acc4 = tl.zeros([SC, BQ], dtype=tl.float32)
    first = share * blocks_per_program
    for b in range(first, tl.minimum(first + blocks_per_program, nb)):
        block = codes_ptr + (e * nb + b) * 128 * strip
        scanned = (t * nb + b) * SCAN
        scale = scales_ptr + (e * nb + b) * rows + 5 * q
        s0 = tl.load(scale, mask=5 * q < rows, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(scale + 1, mask=5 * q + 1 < rows, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(scale + 2, mask=5 * q + 2 < rows, other=0.0).to(tl.float32)[None, :]
        s3 = tl.load(scale + 3, mask=5 * q + 3 < rows, other=0.0).to(tl.float32)[None, :]
        s4 = tl.load(scale + 4, mask=5 * q + 4 < rows, other=0.0).to(tl.float32)[None, :]
        for c0 in tl.static_range(0, SCAN, SC):
            c = c0 + tl.arange(0, SC)
            cm = c < SCAN
            coord = tl.load(coords_ptr + scanned + c, mask=cm, other=0, cache_modifier=CACHE)
            xv = tl.load(values_ptr + scanned + c, mask=cm, other=0.0, cache_modifier=CACHE)[:, None]
            f = tl.load(block + coord[:, None] * strip + q[None, :], mask=cm[:, None] & qm[None, :], other=0).to(
                tl.float32
            )
            acc0, f = _digit(f, xv * s0, acc0)
            acc1, f = _digit(f, xv * s1, acc1)
            acc2, f = _digit(f, xv * s2, acc2)
            acc3, f = _digit(f, xv * s3, acc3)
            acc4, f = _digit(f, xv * s4, acc4)
    out = out_ptr + tk * rows + 5 * q
    tl.atomic_add(out, tl.sum(acc0, axis=0), mask=5 * q < rows, sem=SEM)
    tl.atomic_add(out + 1, tl.sum(acc1, axis=0), mask=5 * q + 1 < rows, sem=SEM)
    tl.atomic_add(out + 2, tl.sum(acc2, axis=0), mask=5 * q + 2 < rows, sem=SEM)
    tl.atomic_add(out + 3, tl.sum(acc3, axis=0), mask=5 * q + 3 < rows, sem=SEM)
    tl.atomic_add(out + 4, tl.sum(acc4, axis=0), mask=5 * q + 4 < rows, sem=SEM)


BISECT, RADIX = 0, 1  # the SEARCH constexpr of select_kernel: how the k-th largest score is found
TWO_SCANS, ONE_SCAN = 0, 1  # its PLACE constexpr: how the chosen channels find their output slots


@triton.jit
def _bisect_kth(bits, k):
    """The k-th largest of the non-negative int32 `bits` (invalid entries -1): the largest v with
    count(bits >= v) >= k, by bisection over [0, +inf]: 31 counting passes, each a reduction
    across the program's warps."""
    lo = tl.full([], 0, tl.int32)  # count(bits >= lo) >= k: every valid score is >= +0.0
    hi = tl.full([], 0x7F800001, tl.int32)  # count(bits >= hi) < k: above +inf
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        enough = tl.sum((bits >= mid).to(tl.int32), axis=0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return lo


@triton.jit
def _radix_kth(bits, k, BITS: tl.constexpr, N_P2: tl.constexpr):
    """The k-th largest of the non-negative int32 `bits` (invalid entries -1): the same value as
    `_bisect_kth`; and how many entries equal to it are among the k largest (k minus those above).

    Digit by digit from the top (BITS bits each; the top digit takes what is left of the 31), each
    a tl.histogram over the candidates, the entries whose higher digits are those found so far:
    the k-th largest's digit is the one where the count of candidates with a larger or equal digit
    first reaches `need` (how many of the k are still among the candidates). The histogram is over
    the digit's complement, rank 0 = digit 2^BITS - 1, so that a forward cumulative sum counts
    "larger or equal". ceil(31 / BITS) passes (4 at 8 bits) instead of the bisection's 31. The
    candidates are recomputed from `bits` each pass rather than kept as a mask: a mask of N_P2
    entries is another register per entry, and the kernel is at the register limit."""
    BINS: tl.constexpr = 1 << BITS
    PASSES: tl.constexpr = (31 + BITS - 1) // BITS
    # one reduction per pass yields both the rank and the count above it: each rank below the
    # chosen one adds UNIT + its count (counts are at most N_P2 < UNIT)
    UNIT: tl.constexpr = 2 * N_P2
    kth = tl.full([], 0, tl.int32)
    need = k
    for i in tl.static_range(PASSES):
        shift = (PASSES - 1 - i) * BITS
        if i == 0:
            cand = bits >= 0
        else:
            cand = (bits >> (shift + BITS)) == (kth >> (shift + BITS))  # -1 (invalid) never matches
        rank = (~bits >> shift) & (BINS - 1)  # (BINS - 1) - digit; ~bits: bit 31 of bits is 0
        hist = tl.histogram(rank, BINS, mask=cand)
        upto = tl.cumsum(hist, axis=0)  # candidates with rank <= r, i.e. digit >= BINS - 1 - r
        packed = tl.sum(tl.where(upto < need, UNIT + hist, 0), axis=0)
        top = packed // UNIT  # the first rank where upto >= need
        need -= packed % UNIT  # the candidates with a larger digit are all among the k
        kth = kth | ((BINS - 1 - top) << shift)
    return kth, need


@triton.jit
def _scores(
    est_ptr,
    experts_ptr,
    weights_ptr,
    norms_ptr,
    ke,
    inter,
    t,
    first,
    ACT: tl.constexpr,
    WIDTH: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Token t's channels n = slot·I + j, n = first .. first + WIDTH - 1 (valid: n < ke·I): n, valid, j,
    expert, router weight, p_j = φ(ĝ_j)·v̂_j, and the scores s_j = |w_e·‖d_j‖·p_j| as int32 bit
    patterns (monotonic for s >= 0; invalid entries -1)."""
    n = first + tl.arange(0, WIDTH)
    valid = n < ke * inter
    slot = n // inter
    j = n % inter
    e = tl.load(experts_ptr + t * ke + slot, mask=valid, other=0).to(tl.int64)
    w = tl.load(weights_ptr + t * ke + slot, mask=valid, other=0.0).to(tl.float32)
    row = est_ptr + (t * ke + slot) * 2 * inter + j
    g = tl.load(row, mask=valid, other=0.0, cache_modifier=CACHE)
    u = tl.load(row + inter, mask=valid, other=0.0, cache_modifier=CACHE)
    norm = tl.load(norms_ptr + e * inter + j, mask=valid, other=0.0).to(tl.float32)
    p = _act(g, ACT) * u
    # NaN scores (from NaN input) count as +inf: above it, k or more of them would make the
    # searches' bounds false and the placement write past the token's row
    bits = tl.where(valid, tl.minimum(tl.abs(w * norm * p).to(tl.int32, bitcast=True), 0x7F800000), -1)
    return n, valid, j, e, w, p, bits


@triton.jit
def _kth(bits, k, SEARCH: tl.constexpr, RADIX_BITS: tl.constexpr, N_P2: tl.constexpr):
    """The k-th largest of `bits` and how many of the entries equal to it are among the k largest."""
    if SEARCH == 0:  # BISECT (a kernel cannot read a plain-int global)
        kth = _bisect_kth(bits, k)
        room = k - tl.sum((bits > kth).to(tl.int32), axis=0)
    else:
        kth, room = _radix_kth(bits, k, RADIX_BITS, N_P2)
    return kth, room


@triton.jit
def select_kernel(
    est_ptr,
    experts_ptr,
    weights_ptr,
    norms_ptr,
    expert_out,
    channel_out,
    weight_out,
    q_out,
    ke,
    inter,
    k,
    ACT: tl.constexpr,
    HAS_RECOVERY: tl.constexpr,
    N_P2: tl.constexpr,
    SEARCH: tl.constexpr = BISECT,
    RADIX_BITS: tl.constexpr = 8,
    PLACE: tl.constexpr = TWO_SCANS,
):
    """One program: one token. Over all its experts' channels n = slot·I + j: p_j = φ(ĝ_j)·v̂_j,
    s_j = |w_e·‖d_j‖·p_j|; the k largest s_j (ties to the lower n) -> expert, channel, weight
    [T, k] in channel order; q [T, ke, I] = w_e·p_j for the others, 0 for the chosen.

    The k-th largest score is found on its fp32 bit pattern (monotonic for s ≥ 0), in registers,
    where torch.topk costs several launches. SEARCH = BISECT: 31 counting passes; RADIX: a few
    histogram passes over RADIX_BITS-bit digits (`_radix_kth`), which also yields how many of
    the scores equal to the k-th to take. On the H200 (BISECT, TWO_SCANS) the loads and scores
    take ~1 µs of its ~20, the bisection ~14, the prefix sums and stores ~11 (each measured
    alone); 4- and 16-way searches (counting at several cuts per pass) and a [rows, 128] layout
    for the prefix sums were slower or no faster.

    PLACE = TWO_SCANS: a prefix sum over the tied scores picks the first `room` of them, a second
    over the chosen gives each its output slot. ONE_SCAN: one prefix sum of (above + N_P2·tied)
    carries both counts, since the chosen up to n are the above up to n plus min(tied up to n,
    room): half the scan work (needs N_P2 <= 32768 so the packed count fits in int32)."""
    t = tl.program_id(0)
    n, valid, j, e, w, p, bits = _scores(est_ptr, experts_ptr, weights_ptr, norms_ptr, ke, inter, t, 0, ACT, N_P2, "")
    kth, room = _kth(bits, k, SEARCH, RADIX_BITS, N_P2)
    above = bits > kth
    if PLACE == 0:  # TWO_SCANS
        tied = (bits == kth).to(tl.int32)
        chosen = above | ((tied != 0) & (tl.cumsum(tied, axis=0) - tied < room))
        pos = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    else:
        tl.static_assert(N_P2 <= 32768)
        both = tl.cumsum(above.to(tl.int32) + (bits == kth).to(tl.int32) * N_P2, axis=0)
        tied_upto = both // N_P2
        chosen = above | ((bits == kth) & (tied_upto <= room))
        pos = both % N_P2 + tl.minimum(tied_upto, room) - 1
    tl.store(expert_out + t * k + pos, e.to(tl.int32), mask=chosen)
    tl.store(channel_out + t * k + pos, j, mask=chosen)
    tl.store(weight_out + t * k + pos, w, mask=chosen)
    if HAS_RECOVERY:
        tl.store(q_out + t * ke * inter + n, tl.where(chosen, 0.0, w * p), mask=valid)


@triton.jit
def exact_kernel(
    gate_up_ptr,
    x_ptr,
    expert_ptr,
    channel_ptr,
    gu_ptr,
    k,
    H,
    inter,
    BK: tl.constexpr,
    BH: tl.constexpr,
    SEM: tl.constexpr = "acq_rel",
):
    """One program: BK chosen channels of one token, BH coordinates of their gate and up rows
    (contiguous runs of the [E, 2I, H] layout). Adds the partial dots g_j·x, v_j·x into
    gu [T, k, 2] (zeroed); the activation is applied where they are complete (down_kernel)."""
    exact = (gate_up_ptr, x_ptr, expert_ptr, channel_ptr, gu_ptr, k, H, inter)
    _exact(exact, tl.program_id(0), tl.program_id(1), tl.program_id(2), BK, BH, SEM, "")


@triton.jit
def _exact(exact, t, jb, hb, BK: tl.constexpr, BH: tl.constexpr, SEM: tl.constexpr, CACHE: tl.constexpr):
    """exact_kernel's program (token t, BK-row tile jb, BH-coordinate tile hb); `exact`: its pointers and
    sizes, exact_kernel's arguments in their order."""
    gate_up_ptr, x_ptr, expert_ptr, channel_ptr, gu_ptr, k, H, inter = exact
    j = jb * BK + tl.arange(0, BK)
    jm = j < k
    h = hb * BH + tl.arange(0, BH)
    hm = h < H
    e = tl.load(expert_ptr + t * k + j, mask=jm, other=0, cache_modifier=CACHE).to(tl.int64)
    ch = tl.load(channel_ptr + t * k + j, mask=jm, other=0, cache_modifier=CACHE).to(tl.int64)
    gate_row = (e * 2 * inter + ch) * H
    xv = tl.load(x_ptr + t * H + h, mask=hm, other=0.0).to(tl.float32)
    m = jm[:, None] & hm[None, :]
    gw = tl.load(gate_up_ptr + gate_row[:, None] + h[None, :], mask=m, other=0.0).to(tl.float32)
    uw = tl.load(gate_up_ptr + (gate_row + inter * H)[:, None] + h[None, :], mask=m, other=0.0).to(tl.float32)
    tl.atomic_add(gu_ptr + (t * k + j) * 2, tl.sum(gw * xv[None, :], axis=1), mask=jm, sem=SEM)
    tl.atomic_add(gu_ptr + (t * k + j) * 2 + 1, tl.sum(uw * xv[None, :], axis=1), mask=jm, sem=SEM)


@triton.jit
def recover_kernel(
    coeffs_ptr,
    q_ptr,
    experts_ptr,
    z_ptr,
    ke,
    inter,
    rank,
    stride_e,
    stride_i,
    stride_r,
    RANK_P2: tl.constexpr,
    BI: tl.constexpr,
    SEM: tl.constexpr = "acq_rel",
):
    """One program: one (token, routed slot), BI of its expert's channels. Adds Σ_j q_j·b_j into
    the token's z [T, RANK_P2] (zeroed; summed over slots, which is all the down epilogue needs);
    q_j = w_e·p_j for unchosen channels and 0 for chosen ones, whose b_j are never read."""
    recover = (coeffs_ptr, q_ptr, experts_ptr, z_ptr, ke, inter, rank, stride_e, stride_i, stride_r)
    _recover(recover, tl.program_id(0), tl.program_id(1), RANK_P2, BI, SEM, "")


@triton.jit
def _recover(recover, tk, ib, RANK_P2: tl.constexpr, BI: tl.constexpr, SEM: tl.constexpr, CACHE: tl.constexpr):
    """recover_kernel's program (tk: token · ke + slot; ib: BI channels); `recover`: its pointers and sizes,
    recover_kernel's arguments in their order."""
    coeffs_ptr, q_ptr, experts_ptr, z_ptr, ke, inter, rank, stride_e, stride_i, stride_r = recover
    t = tk // ke
    i = ib * BI + tl.arange(0, BI)
    e = tl.load(experts_ptr + tk).to(tl.int64)
    r = tl.arange(0, RANK_P2)
    rm = r < rank
    qv = tl.load(q_ptr + tk * inter + i, mask=i < inter, other=0.0, cache_modifier=CACHE)
    m = ((i < inter) & (qv != 0.0))[:, None] & rm[None, :]
    b = tl.load(coeffs_ptr + e * stride_e + i[:, None] * stride_i + r[None, :] * stride_r, mask=m, other=0.0)
    tl.atomic_add(z_ptr + t * RANK_P2 + r, tl.sum(qv[:, None] * b.to(tl.float32), axis=0), mask=rm, sem=SEM)


@triton.jit
def exact_recover_kernel(
    gate_up_ptr,
    x_ptr,
    expert_ptr,
    channel_ptr,
    gu_ptr,
    coeffs_ptr,
    q_ptr,
    experts_ptr,
    z_ptr,
    T,
    k,
    H,
    inter,
    ke,
    rank,
    stride_e,
    stride_i,
    stride_r,
    BK: tl.constexpr,
    BH: tl.constexpr,
    RANK_P2: tl.constexpr,
    BI: tl.constexpr,
    SEM: tl.constexpr = "acq_rel",
):
    """exact_kernel's programs, then recover_kernel's, in one launch (a 1-D grid of both counts):
    the two stages need only select's output, so recover's few programs run beside exact's
    rather than after them, and a launch is saved."""
    pid = tl.program_id(0)
    j_tiles = tl.cdiv(k, BK)
    n_exact = T * j_tiles * tl.cdiv(H, BH)
    if pid < n_exact:
        exact = (gate_up_ptr, x_ptr, expert_ptr, channel_ptr, gu_ptr, k, H, inter)
        _exact(exact, pid % T, (pid // T) % j_tiles, pid // (T * j_tiles), BK, BH, SEM, "")
    else:
        r = pid - n_exact
        recover = (coeffs_ptr, q_ptr, experts_ptr, z_ptr, ke, inter, rank, stride_e, stride_i, stride_r)
        _recover(recover, r % (T * ke), r // (T * ke), RANK_P2, BI, SEM, "")


@triton.jit
def down_kernel(
    down_ptr,
    expert_ptr,
    channel_ptr,
    weight_ptr,
    gu_ptr,
    basis_ptr,
    z_ptr,
    out_ptr,
    k,
    H,
    inter,
    rank,
    stride_h,
    stride_r,
    rows_per_share,
    ACT: tl.constexpr,
    HAS_RECOVERY: tl.constexpr,
    RANK_P2: tl.constexpr,
    BK: tl.constexpr,
    BH: tl.constexpr,
    SEM: tl.constexpr = "acq_rel",
):
    """One program: BH output coordinates of one token, one share (`rows_per_share` rows) of its
    k chosen rows. coef_j = w_e·φ(g_j·x)(v_j·x) from gu; y[h] += Σ_j coef_j·down[e_j, ch_j, h]
    (each a contiguous H-row of the [E, I, H] layout); share 0 also adds the recovery U[h, :]·z.
    Shares meet in y [T, H] (zeroed) through atomic adds."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    share = tl.program_id(2)
    rows = (down_ptr, expert_ptr, channel_ptr, weight_ptr, gu_ptr, k, H, inter, rows_per_share)
    acc = _down_rows(rows, t, h, share, ACT, BK, BH, "")
    if HAS_RECOVERY:
        if share == 0:
            acc += _down_recovery(basis_ptr, z_ptr, H, rank, stride_h, stride_r, t, h, RANK_P2, "")
    tl.atomic_add(out_ptr + t * H + h, acc, mask=h < H, sem=SEM)


@triton.jit
def _down_rows(rows, t, h, share, ACT: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, CACHE: tl.constexpr):
    """Σ_j coef_j·down[e_j, ch_j, h] over the share's rows, [BH] fp32; `rows`: down_kernel's pointers and
    sizes (its arguments in their order) up to rows_per_share."""
    down_ptr, expert_ptr, channel_ptr, weight_ptr, gu_ptr, k, H, inter, rows_per_share = rows
    hm = h < H
    first = share * rows_per_share
    last = tl.minimum(first + rows_per_share, k)
    acc = tl.zeros([BH], dtype=tl.float32)
    for j0 in range(first, last, BK):
        j = j0 + tl.arange(0, BK)
        jm = j < last
        e = tl.load(expert_ptr + t * k + j, mask=jm, other=0, cache_modifier=CACHE).to(tl.int64)
        ch = tl.load(channel_ptr + t * k + j, mask=jm, other=0, cache_modifier=CACHE).to(tl.int64)
        g = tl.load(gu_ptr + (t * k + j) * 2, mask=jm, other=0.0, cache_modifier=CACHE)
        u = tl.load(gu_ptr + (t * k + j) * 2 + 1, mask=jm, other=0.0, cache_modifier=CACHE)
        coef = tl.load(weight_ptr + t * k + j, mask=jm, other=0.0, cache_modifier=CACHE) * _act(g, ACT) * u
        d = tl.load(
            down_ptr + ((e * inter + ch) * H)[:, None] + h[None, :], mask=jm[:, None] & hm[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(coef[:, None] * d, axis=0)
    return acc


@triton.jit
def _down_recovery(basis_ptr, z_ptr, H, rank, stride_h, stride_r, t, h, RANK_P2: tl.constexpr, CACHE: tl.constexpr):
    """The recovery term U[h, :]·z of token t, [BH] fp32."""
    r = tl.arange(0, RANK_P2)
    z = tl.load(z_ptr + t * RANK_P2 + r, cache_modifier=CACHE)
    u = tl.load(
        basis_ptr + h[:, None] * stride_h + r[None, :] * stride_r,
        mask=(h < H)[:, None] & (r < rank)[None, :],
        other=0.0,
    ).to(tl.float32)
    return tl.sum(u * z[None, :], axis=1)
