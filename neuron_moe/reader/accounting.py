"""Bytes the reader reads per token and MoE layer, charged in whole 32-byte sectors.

Everything follows from the geometry and the sidecar layout of `sidecar.py`; nothing is fitted.
For one token the reader reads, from its top_k experts:

- sketch: for each expert, block and scanned coordinate one strip of codes (one base-3 code
  per gate/up row, 5 per byte, rows padded to whole sectors), and the expert's scales [blocks, 2I] (bf16);
- norms: ‖d_j‖ of the expert's I channels (bf16);
- exact: for each of the k chosen channels its gate row, up row and down row (H bf16 each);
- recovery: U [H, rank] (bf16) once, and b_j (rank bf16) for every channel not chosen.

The full model reads each routed expert whole: gate_up [2I, H] and down [H, I] in bf16, or in
the experts' format (`formats/`: each of the format's tensors of the weight, `Format.shapes`).
A read of n bytes starting on a sector boundary touches ceil(n/32) sectors; where the
layout cannot guarantee that start (a row length not a multiple of 32 bytes) one more.

One definition charges every read: `step_reads` prices a set of distinct rows (`StepRows`), each
read once — one token's (`token_rows`: that is `reads`) or a decode step's of B tokens. The
blocks and code strips it charges are the sidecar's own (`sidecar.SidecarLayout`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from .. import formats
from ..errors import UserError
from ..report import table
from ..spec import INT8_QUANTIZATION, NO_QUANTIZATION, QUANTIZATIONS, STEP_BUDGET, Reader
from .geometry import Geometry
from .sidecar import BLOCK, CODES_PER_BYTE, SECTOR, SidecarLayout

BF16 = 2
INT8, FP32 = 1, 4


class BudgetError(UserError):
    pass


def check_settings(settings: Reader, geo: Geometry) -> None:
    """The reader's settings (`spec.Reader`, resolved: every field the accounting charges given) fit `geo`."""
    if settings.scan is None or settings.recovery_rank is None or settings.quantization is None:
        raise BudgetError(f"the reader's scan, recovery rank and quantization must be given, got {settings}")
    if not 1 <= settings.scan <= BLOCK:
        raise BudgetError(f"scan must be in [1, {BLOCK}], got {settings.scan}")
    if not 0 <= settings.recovery_rank <= geo.hidden:
        raise BudgetError(f"recovery rank must be in [0, hidden={geo.hidden}], got {settings.recovery_rank}")
    if settings.quantization not in QUANTIZATIONS:
        raise BudgetError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {settings.quantization!r}")


def sectors(nbytes: int) -> int:
    """Sectors touched by a read of nbytes that starts on a sector boundary."""
    return -(-nbytes // SECTOR)


def row_sectors(nbytes: int) -> int:
    """Sectors touched by one of many back-to-back rows of nbytes: a row starts on a boundary
    only if the row length is a multiple of 32; otherwise charge the worst case, one more."""
    return sectors(nbytes) + (1 if nbytes % SECTOR else 0)


def reads(geo: Geometry, settings: Reader, k: int) -> dict[str, int]:
    """Bytes (whole sectors) read per token and layer with k exact channels, by part: the token's
    rows (`token_rows`) as `step_reads` charges them."""
    return step_reads(geo, settings, token_rows(geo, settings, k))


def full_bytes(geo: Geometry) -> int:
    """The full model's routed-expert reads per token and layer: top_k whole experts in bf16."""
    return geo.top_k * expert_read_bytes(geo)


def solve_k(geo: Geometry, settings: Reader, budget: float, full: float | None = None) -> int:
    """The largest k whose reads fit in `budget` percent of `full` bytes (default: the full model's
    read in the settings' quantization); 100 -> every channel. A budget the screen alone overruns is
    refused, unless the experts read whole fit in it (a share of a larger full read: int8 experts
    at a share of bf16's)."""
    check_settings(settings, geo)
    if not 0 < budget <= 100:
        raise BudgetError(f"budget must be in (0, 100] percent, got {budget}")
    if budget == 100:
        return geo.channels
    own = full_reads(geo, settings)
    limit = budget / 100 * (own if full is None else full)
    floor = reads(geo, settings, 0)
    if sum(floor.values()) > limit and own > limit:
        parts = ", ".join(f"{name} {100 * v / own:.2f}%" for name, v in floor.items() if v)
        experts = "" if settings.quantization == NO_QUANTIZATION else f" of the {settings.quantization} experts"
        raise BudgetError(
            f"budget {budget}% is below what the reader reads before any exact channel "
            f"({100 * sum(floor.values()) / own:.2f}%{experts}: {parts})"
        )
    return solve_step_k(geo, settings, geo.top_k, limit)


def resident(geo: Geometry, settings: Reader) -> dict[str, int]:
    """Bytes one layer's sidecar adds to memory (the down projection is rearranged, not copied): its
    tensors at the settings' rank (`sidecar.SidecarLayout`)."""
    held = {
        name: math.prod(shape) * dtype.itemsize
        for name, (dtype, shape) in SidecarLayout(geo, settings.recovery_rank).layer_tensors().items()
    }
    return {
        "sketch": held["codes"] + held["scales"],
        "norms": held["down_norms"],
        "recovery": held["basis"] + held["coeffs"],
    }


def expert_bytes(geo: Geometry) -> int:
    """One layer's routed-expert weights in bf16."""
    return geo.experts * 3 * geo.intermediate * geo.hidden * BF16


def breakdown(geo: Geometry, settings: Reader, budget: float) -> dict:
    """Everything `neuron-moe reads` reports: k, reads by part, resident memory by part."""
    k = solve_k(geo, settings, budget)
    full, parts = full_reads(geo, settings), reads(geo, settings, k)
    held = resident(geo, settings)
    return {
        "budget_percent": budget,
        "k": k,
        "channels": geo.channels,
        "full_bytes": full,
        "reads": {name: {"bytes": v, "percent": 100 * v / full} for name, v in parts.items()},
        "total_percent": 100 * sum(parts.values()) / full,
        "expert_bytes": expert_bytes(geo),
        "resident": {name: {"bytes": v, "percent": 100 * v / expert_bytes(geo)} for name, v in held.items()},
    }


# ---- int8 experts, and decode steps of B tokens ----
#
# int8 experts (reader/int8.py's layout): each exact channel reads its gate, up and down rows in
# int8 and its (gate, up) scale pair, 8 bytes of fp32 side by side (one sector); each routed expert
# also reads its down scale, one fp32 per hidden channel, whether or not a channel of it is chosen.
# The sketch, norms and recovery map stay bf16: the same bytes, now against half the full read.
#
# A decode step of B tokens reads every row once, however many of its tokens use it: the sketch
# and norms of each expert in the union of the tokens' experts, each distinct exact channel, each
# distinct b_j. One token is the step of B = 1 (`token_rows`).


@dataclass(frozen=True)
class StepRows:
    """The distinct rows one decode step reads, each once whichever of its tokens use it."""

    experts: int  # routed experts in the union of the step's tokens' experts
    strips: int  # scanned code strips, distinct (expert, block, coordinate); 0: no screen, experts read whole
    exact: int  # exact channels, distinct (expert, channel)
    coeffs: int  # recovery rows b_j, distinct (expert, channel); 0 without recovery


def row_bytes(n: int, quantization: str = NO_QUANTIZATION) -> int:
    """A row of n weights in the format with its scales beside it (`Format.nbytes` of a [1, n] weight:
    groups along the row)."""
    return formats.get(quantization).nbytes((1, n), torch.bfloat16)


def weight_sectors(shape: tuple[int, int], quantization: str = NO_QUANTIZATION) -> int:
    """Sectors of a weight of `shape` ([out, in]) read whole in the format: each of its tensors
    (`Format.shapes`: the values and their scales) from a boundary of its own."""
    held = formats.get(quantization).shapes(shape, torch.bfloat16).values()
    return sum(row_sectors(math.prod(s) * dtype.itemsize) for s, dtype in held)


def channel_bytes(geo: Geometry, quantization: str = NO_QUANTIZATION) -> int:
    """One exact channel: its gate, up and down rows. int8 (the one-rank reader's layout, `reader/int8.py`):
    three int8 rows and the gate/up scale pair, one sector. Any other format (no reader of its own is
    built: accounted only): each row in the format with its own scales beside it (`row_bytes`), groups
    along H: gate and up as the experts hold them, the down row in the reader's own grouping, since
    the experts' down groups lie along I."""
    if quantization == INT8_QUANTIZATION:
        return SECTOR * (3 * row_sectors(geo.hidden * INT8) + 1)
    return SECTOR * 3 * row_sectors(row_bytes(geo.hidden, quantization))


def expert_read_bytes(geo: Geometry, quantization: str = NO_QUANTIZATION) -> int:
    """One routed expert read whole: gate_up [2I, H] and down [H, I] in the format, scales included
    (`weight_sectors`; int8: one fp32 scale per gate/up row and one per hidden channel)."""
    H, I = geo.hidden, geo.intermediate
    return SECTOR * (weight_sectors((2 * I, H), quantization) + weight_sectors((H, I), quantization))


def full_reads(geo: Geometry, settings: Reader, experts: int | None = None) -> int:
    """The full model's routed-expert reads in the settings' quantization: `experts` (default top_k) read whole."""
    return (geo.top_k if experts is None else experts) * expert_read_bytes(geo, settings.quantization)


def token_rows(geo: Geometry, settings: Reader, k: int) -> StepRows:
    """What one token reads with k exact channels (each token on its own: today's reader)."""
    if k >= geo.channels:
        return StepRows(geo.top_k, 0, geo.channels, 0)
    return batch_rows(geo, settings, geo.top_k, k)


def batch_rows(geo: Geometry, settings: Reader, experts: int, k: int) -> StepRows:
    """What the batch rule reads: every expert of the union scans `scan` coordinates per block for
    all its tokens (blocks × scan strips), K channels exact, the union's other channels' b_j."""
    channels = experts * geo.intermediate
    if k >= channels:
        return StepRows(experts, 0, channels, 0)
    blocks = SidecarLayout(geo, settings.recovery_rank).blocks
    return StepRows(experts, experts * blocks * settings.scan, k, channels - k if settings.recovery_rank else 0)


def step_reads(geo: Geometry, settings: Reader, rows: StepRows) -> dict[str, int]:
    """Bytes (whole sectors) a step reads, by part, reading each of `rows` once."""
    H, I = geo.hidden, geo.intermediate
    if rows.strips == 0:  # no screen: every channel of the union exact, its experts read whole
        return {"sketch": 0, "norms": 0, "exact": full_reads(geo, settings, rows.experts), "recovery": 0}
    layout = SidecarLayout(geo, settings.recovery_rank)
    down_scales = rows.experts * row_sectors(H * FP32) if settings.quantization == INT8_QUANTIZATION else 0
    out = {
        "sketch": SECTOR
        * (rows.strips * row_sectors(layout.strip_bytes) + rows.experts * row_sectors(layout.blocks * 2 * I * BF16)),
        "norms": SECTOR * rows.experts * row_sectors(I * BF16),
        "exact": rows.exact * channel_bytes(geo, settings.quantization) + SECTOR * down_scales,
        "recovery": 0,
    }
    if settings.recovery_rank:
        out["recovery"] = SECTOR * (
            sectors(H * settings.recovery_rank * BF16) + rows.coeffs * row_sectors(settings.recovery_rank * BF16)
        )
    return out


def solve_step_k(geo: Geometry, settings: Reader, experts: int, limit: float) -> int:
    """The batch rule's K: the most exact channels a step whose union holds `experts` experts reads
    within `limit` bytes. Every channel (the experts read whole) if that fits; else the largest K
    whose screened reads fit (reads are linear in K below the full read); 0 if not even the screen
    fits — the step then reads its screen anyway, over the limit."""
    check_settings(settings, geo)
    channels = experts * geo.intermediate
    total = lambda k: sum(step_reads(geo, settings, batch_rows(geo, settings, experts, k)).values())  # noqa: E731
    if total(channels) <= limit:
        return channels
    floor = total(0)
    return max(0, min(int((limit - floor) // (total(1) - floor)), channels - 1))


def expected_union(geo: Geometry, batch: int) -> float:
    """Experts in the union of `batch` tokens' top_k under uniform routing: E·(1 − (1 − top_k/E)^B)."""
    return geo.experts * (1 - (1 - geo.top_k / geo.experts) ** batch)


def batch_breakdown(
    geo: Geometry, settings: Reader, budget: float, batch: int, step_budget: float = STEP_BUDGET
) -> dict:
    """A step of `batch` tokens under uniform routing, its union taken at its expected size: the
    full batch (the union's experts whole); independent top-k at `budget` per token, at most (no
    channel or strip shared by two tokens of an expert; what a kernel that does not share reads is
    `batch` × one token's); the batch rule within `step_budget` × one token's reads."""
    check_settings(settings, geo)
    n = max(geo.top_k, round(expected_union(geo, batch)))
    k = solve_k(geo, settings, budget)
    one = sum(reads(geo, settings, k).values())
    full = full_reads(geo, settings, n)
    blocks = SidecarLayout(geo, settings.recovery_rank).blocks
    if k >= geo.channels:
        token = StepRows(n, 0, n * geo.intermediate, 0)
    else:
        token = StepRows(
            n,
            min(batch * geo.top_k * blocks * settings.scan, n * blocks * BLOCK),
            min(batch * k, n * geo.intermediate),
            min(batch * (geo.channels - k), n * geo.intermediate) if settings.recovery_rank else 0,
        )
    limit = step_budget * one
    rule = batch_rows(geo, settings, n, solve_step_k(geo, settings, n, limit))

    def row(rows: StepRows, **more) -> dict:
        parts = step_reads(geo, settings, rows)
        total = sum(parts.values())
        return {
            "rows": rows.__dict__,
            "reads": parts,
            "bytes": total,
            "percent_of_full_batch": 100 * total / full,
            "x_one_token": total / one,
            **more,
        }

    return {
        "batch": batch,
        "routing": "uniform",
        "union_experts": n,
        "expected_union": expected_union(geo, batch),
        "k_per_token": k,
        "one_token_bytes": one,
        "full_bytes": full,
        "step_budget": step_budget,
        "limit_bytes": limit,
        "rules": {"token": row(token, bound="at most"), "batch": row(rule, k=rule.exact)},
    }


def rank_geometry(geo: Geometry, tp: int) -> Geometry:
    """What one rank of the channel expert layout holds at TP `tp`: I/t channels of every expert. Its
    reads are the reader's on this geometry (`reads`, `solve_k`): its own sketch strips (2I/t rows,
    padded to whole sectors), norms, k_r exact channels and b_j, and the layer's whole U; its full
    read is 1/t of the model's. Every rank reads the same."""
    if tp < 1 or geo.intermediate % tp:
        raise BudgetError(f"{geo.intermediate} expert channels do not split over {tp} ranks")
    return replace(geo, intermediate=geo.intermediate // tp)


def solve_rank_k(geo: Geometry, settings: Reader, budget: float, tp: int) -> int:
    """k per rank at TP `tp`: every rank reads `budget` percent of its share of the full read; a
    budget below a rank's floor is refused with that floor."""
    try:
        return solve_k(rank_geometry(geo, tp), settings, budget)
    except BudgetError as e:
        if tp == 1:
            raise
        raise BudgetError(
            f"per rank at TP {tp} (each rank reads its own {geo.intermediate // tp} of "
            f"{geo.intermediate} channels' sketch): {e}"
        ) from None


def reads_report(
    name: str,
    geo: Geometry,
    settings: Reader,
    budget: float,
    tp: int = 1,
    batch: int | None = None,
    step_budget: float = STEP_BUDGET,
) -> dict:
    """Everything `neuron-moe reads` reports: `breakdown` for a token of `geo` (named `name`), per rank
    at TP `tp` on the channel expert layout, and with `batch` a decode step of that many tokens."""
    local = geo
    if tp > 1 and (settings.quantization != NO_QUANTIZATION or batch is not None):
        given = f"--quantization {settings.quantization}" if batch is None else "--batch-size"
        raise UserError(f"reads --tp T is the per-rank reader over bf16 experts, one token a step (not with {given})")
    if tp > 1:  # one rank of the channel layout: I/t channels of every expert
        local = rank_geometry(geo, tp)
        solve_rank_k(geo, settings, budget, tp)  # a budget below a rank's floor: the error names TP
    report = {
        "model": name,
        "geometry": asdict(geo),
        "scan": settings.scan,
        "recovery_rank": settings.recovery_rank,
        "tp": tp,
        "quantization": settings.quantization,
        **breakdown(local, settings, budget),
    }
    if settings.quantization != NO_QUANTIZATION:
        report["percent_of_bf16_full"] = 100 * sum(v["bytes"] for v in report["reads"].values()) / full_bytes(local)
    if batch is not None:
        report["batch"] = batch_breakdown(local, settings, budget, batch, step_budget)
    return report


def render_reads(report: dict) -> str:
    whole, tp, quantization = Geometry(**report["geometry"]), report["tp"], report["quantization"]
    geo = rank_geometry(whole, tp) if tp > 1 else whole
    lines = [
        f"reads per token and MoE layer: {report['model']} (hidden {geo.hidden}, {geo.experts} experts, "
        f"top-{geo.top_k}, intermediate {whole.intermediate})"
    ]
    if tp > 1:
        lines.append(
            f"per rank at TP {tp} (channel expert layout: each rank its {geo.intermediate} of "
            f"{whole.intermediate} channels of every expert, its own sketch strips, the whole U); every "
            f"rank reads the same"
        )
    experts = _experts_layout(quantization, geo.hidden)
    rows = [{"part": p, **v} for p, v in report["reads"].items()]
    rows += [
        {
            "part": "total",
            "bytes": sum(v["bytes"] for v in report["reads"].values()),
            "percent": report["total_percent"],
        },
        {
            "part": "full model" if tp == 1 else "full (the rank's share)",
            "bytes": report["full_bytes"],
            "percent": 100.0,
        },
    ]
    lines += [
        f"layout: the sidecar's (base-3 codes, {CODES_PER_BYTE} per byte), scan {report['scan']} of {BLOCK} per "
        f"block, recovery rank {report['recovery_rank']}, {experts}, {SECTOR}-byte sectors",
        f"budget {report['budget_percent']}% -> k = {report['k']} exact channels of {report['channels']} "
        f"({100 * report['k'] / report['channels']:.1f}%)\n",
        table(rows, [("part", "read"), ("bytes", "bytes"), ("percent", "share of full", "{:.2f}%")]),
        "",
        table(
            [{"part": p, **v} for p, v in report["resident"].items()],
            [("part", "resident (per layer)"), ("bytes", "bytes"), ("percent", "share of the bf16 experts", "{:.2f}%")],
        ),
    ]
    if quantization != NO_QUANTIZATION:
        lines.append(
            f"\n{report['total_percent']:.2f}% of the {quantization} experts' full read is "
            f"{report['percent_of_bf16_full']:.2f}% of the bf16 experts'"
        )
    if "batch" in report:
        lines.append(_render_batch(report["batch"]))
    return "\n".join(lines)


def _experts_layout(quantization: str, hidden: int) -> str:
    """How `render_reads` names the experts' format: bf16, the int8 reader's layout, or another format's
    rows (accounted only), with their bits a weight."""
    if quantization == NO_QUANTIZATION:
        return "bf16"
    if quantization == INT8_QUANTIZATION:
        return "int8 exact rows with fp32 scales, the sketch and recovery bf16"
    bits = 8 * row_bytes(hidden, quantization) / hidden
    return (
        f"{quantization} exact rows at {bits:.2f} bits a weight, scales beside them (accounted only), "
        "the sketch and recovery bf16"
    )


def _render_batch(b: dict) -> str:
    token, rule = b["rules"]["token"], b["rules"]["batch"]
    rows = [
        {
            "rule": "full batch (the union's experts whole)",
            "bytes": b["full_bytes"],
            "percent": 100.0,
            "x": b["full_bytes"] / b["one_token_bytes"],
            "k": "",
        },
        {
            "rule": f"independent top-k, k = {b['k_per_token']} per token (at most)",
            "bytes": token["bytes"],
            "percent": token["percent_of_full_batch"],
            "x": token["x_one_token"],
            "k": "",
        },
        {
            "rule": f"batch rule within {b['step_budget']:g}x one token's reads",
            "bytes": rule["bytes"],
            "percent": rule["percent_of_full_batch"],
            "x": rule["x_one_token"],
            "k": rule["k"],
        },
    ]
    return (
        f"\na decode step of batch {b['batch']} (uniform routing: {b['expected_union']:.1f} experts expected in "
        f"the union, taken as {b['union_experts']}), each row read once; one token reads "
        f"{b['one_token_bytes']} B\n"
        + table(
            rows,
            [
                ("rule", "step reads"),
                ("bytes", "bytes"),
                ("percent", "share of full batch", "{:.2f}%"),
                ("x", "x one token", "{:.2f}"),
                ("k", "channels of the step"),
            ],
        )
    )
