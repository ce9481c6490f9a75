"""Bytes the reader reads per token and MoE layer, charged in whole 32-byte sectors.

Everything follows from the geometry and the sidecar layout of `prep.py`; nothing is fitted.
For one token the reader reads, from its top_k experts:

- sketch: for each expert, block and scanned coordinate one strip of codes (one base-3 code
  per gate/up row, 5 per byte, rows padded to whole sectors), and the expert's scales [blocks, 2I] (bf16);
- norms: ‖d_j‖ of the expert's I channels (bf16);
- exact: for each of the k chosen channels its gate row, up row and down row (H bf16 each);
- recovery: U [H, rank] (bf16) once, and b_j (rank bf16) for every channel not chosen.

The full model reads each routed expert whole: gate_up [2I, H] and down [H, I] in bf16.
A read of n bytes starting on a sector boundary touches ceil(n/32) sectors; where the
layout cannot guarantee that start (a row length not a multiple of 32 bytes) one more.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .hadamard import padded
from .prep import BLOCK, CODES_PER_BYTE, RANK, SCAN, SECTOR

BF16 = 2


class BudgetError(UserError):
    pass


@dataclass(frozen=True)
class Geometry:
    hidden: int
    experts: int
    top_k: int
    intermediate: int

    @classmethod
    def from_config(cls, config) -> "Geometry":
        return cls(config.hidden_size, config.num_experts, config.top_k_experts, config.moe_intermediate_size)

    @property
    def channels(self) -> int:
        """Channels a token's experts hold: the candidates of one selection."""
        return self.top_k * self.intermediate


@dataclass(frozen=True)
class Layout:
    scan: int = SCAN
    rank: int = RANK

    def check(self, geo: Geometry) -> None:
        if not 1 <= self.scan <= BLOCK:
            raise BudgetError(f"scan must be in [1, {BLOCK}], got {self.scan}")
        if not 0 <= self.rank <= geo.hidden:
            raise BudgetError(f"rank must be in [0, hidden={geo.hidden}], got {self.rank}")


def sectors(nbytes: int) -> int:
    """Sectors touched by a read of nbytes that starts on a sector boundary."""
    return -(-nbytes // SECTOR)


def row_sectors(nbytes: int) -> int:
    """Sectors touched by one of many back-to-back rows of nbytes: a row starts on a boundary
    only if the row length is a multiple of 32; otherwise charge the worst case, one more."""
    return sectors(nbytes) + (1 if nbytes % SECTOR else 0)


def strip_bytes(geo: Geometry, layout: Layout) -> int:
    """Bytes of one coordinate's codes for all gate/up rows (5 per byte, rows padded to whole sectors)."""
    return padded(2 * geo.intermediate, SECTOR * CODES_PER_BYTE) // CODES_PER_BYTE


def reads(geo: Geometry, layout: Layout, k: int) -> dict[str, int]:
    """Bytes (whole sectors) read per token and layer with k exact channels, by part."""
    H, I, top_k = geo.hidden, geo.intermediate, geo.top_k
    blocks = padded(H, BLOCK) // BLOCK
    if k >= geo.channels:  # every channel exact: read the experts whole, no screen needed
        return {"sketch": 0, "norms": 0, "exact": full_bytes(geo), "recovery": 0}
    out = {
        "sketch": SECTOR * top_k * (blocks * layout.scan * row_sectors(strip_bytes(geo, layout))
                                    + row_sectors(blocks * 2 * I * BF16)),
        "norms": SECTOR * top_k * row_sectors(I * BF16),
        "exact": SECTOR * k * 3 * row_sectors(H * BF16),
        "recovery": 0,
    }
    if layout.rank:
        out["recovery"] = SECTOR * (sectors(H * layout.rank * BF16) + (geo.channels - k) * row_sectors(layout.rank * BF16))
    return out


def full_bytes(geo: Geometry) -> int:
    """The full model's routed-expert reads per token and layer: top_k whole experts."""
    H, I = geo.hidden, geo.intermediate
    return SECTOR * geo.top_k * (row_sectors(2 * I * H * BF16) + row_sectors(H * I * BF16))


def solve_k(geo: Geometry, layout: Layout, budget: float) -> int:
    """The largest k whose reads fit in `budget` percent of the full model's; 100 -> every channel."""
    layout.check(geo)
    if not 0 < budget <= 100:
        raise BudgetError(f"budget must be in (0, 100] percent, got {budget}")
    if budget == 100:
        return geo.channels
    limit = budget / 100 * full_bytes(geo)
    floor = sum(reads(geo, layout, 0).values())
    if floor > limit:
        parts = ", ".join(f"{name} {100 * v / full_bytes(geo):.2f}%" for name, v in reads(geo, layout, 0).items() if v)
        raise BudgetError(f"budget {budget}% is below what the reader reads before any exact channel "
                          f"({100 * floor / full_bytes(geo):.2f}%: {parts})")
    per_channel = sum(reads(geo, layout, 1).values()) - floor  # reads are linear in k below the full read
    return min(int((limit - floor) // per_channel), geo.channels - 1)


def resident(geo: Geometry, layout: Layout) -> dict[str, int]:
    """Bytes one layer's sidecar adds to memory (the down projection is rearranged, not copied)."""
    H, E, I = geo.hidden, geo.experts, geo.intermediate
    blocks = padded(H, BLOCK) // BLOCK
    return {
        "sketch": E * blocks * (BLOCK * strip_bytes(geo, layout) + 2 * I * BF16),
        "norms": E * I * BF16,
        "recovery": (H + E * I) * layout.rank * BF16,
    }


def expert_bytes(geo: Geometry) -> int:
    """One layer's routed-expert weights in bf16."""
    return geo.experts * 3 * geo.intermediate * geo.hidden * BF16


def breakdown(geo: Geometry, layout: Layout, budget: float) -> dict:
    """Everything `neuron-moe reads` reports: k, reads by part, resident memory by part."""
    k = solve_k(geo, layout, budget)
    full, parts = full_bytes(geo), reads(geo, layout, k)
    held = resident(geo, layout)
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


def rank_geometry(geo: Geometry, tp: int) -> Geometry:
    """What one rank of the channel expert layout holds at TP `tp`: I/t channels of every expert. Its
    reads are the reader's on this geometry (`reads`, `solve_k`): its own sketch strips (2I/t rows,
    padded to whole sectors), norms, k_r exact channels and b_j, and the layer's whole U; its full
    read is 1/t of the model's. Every rank reads the same."""
    if tp < 1 or geo.intermediate % tp:
        raise BudgetError(f"{geo.intermediate} expert channels do not split over {tp} ranks")
    return Geometry(geo.hidden, geo.experts, geo.top_k, geo.intermediate // tp)


def solve_rank_k(geo: Geometry, layout: Layout, budget: float, tp: int) -> int:
    """k per rank at TP `tp`: every rank reads `budget` percent of its share of the full read; a
    budget below a rank's floor is refused with that floor."""
    try:
        return solve_k(rank_geometry(geo, tp), layout, budget)
    except BudgetError as e:
        if tp == 1:
            raise
        raise BudgetError(f"per rank at TP {tp} (each rank reads its own {geo.intermediate // tp} of "
                          f"{geo.intermediate} channels' sketch): {e}") from None
