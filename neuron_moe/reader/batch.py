"""The reader for a decode step of B tokens: one set of channels under a budget on the union.

Today each token selects its own top k (`rule="token"`): at batch B a step reads the union of
what its tokens read, which grows with B. The batch rule (`rule="batch"`) selects once per step
and layer:

- **Screen.** Each expert of the union scans one set of coordinates per block for all its
  tokens: the `scan` largest of Σ_{t routed to e} |Rx_t| / 2^e_t, each token scaled to about unit
  norm by a power of two (exact, so an expert with one token scans that token's own). Every
  expert of the union then reads blocks × scan strips, as one token reads per expert.
- **Select.** Each token's output-level scores s_tj = |w_te·‖d_j‖·p_tj| (today's), as shares of
  its own total Σ_j s_tj, summed over the tokens of each (expert, channel):
  S_ej = Σ_{t routed to e} s_tj / Σ_j' s_tj'. A chosen channel's rows are read once however many
  tokens use it, and every channel costs the same (three rows, less the b_j it no longer needs),
  so the union budget caps the count: the top K by S is exactly the set with the largest summed
  share that fits (K = accounting.solve_step_k of the union's size and the step's byte limit).
  Shares, not raw scores (`weigh="raw"`): a token's error is relative to its own output, and raw
  sums let the tokens with the largest activations take the channels (the tiny model, B = 8, equal
  reads: KL 0.0112 with shares, 0.0122 raw; bench/results/reader-batch.md).
- **Compute.** Each token computes the chosen channels of its own experts exactly and recovers
  its other channels through the rank-r map, as today.

At B = 1 both rules are today's reader: the same channels, the same output (tests).

Reads are measured, not assumed: `step` gathers each distinct row it needs once (strips, the
union's scales and norms, exact rows, b_j), computes every token's output from those copies
alone, and counts them (accounting.StepRows); accounting.step_reads charges them in sectors.
Shapes depend on the data (the union): this is the PyTorch reference of the rule, not a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference
from ..spec import Reader
from .accounting import StepRows, solve_step_k
from .geometry import Geometry
from .hadamard import rotate_blocks
from .sidecar import BLOCK, unpack_codes

RULES = ("token", "batch")
WEIGHINGS = ("share", "raw")


@dataclass
class StepResult:
    out: torch.Tensor  # [T, H] routed output
    read: dict  # what the step read, each row once: experts [n]; strips [m, 3] (expert, block, coordinate),
    #             exact and coeffs [m, 2] (expert, channel); strips empty: the experts were read whole
    keep: torch.Tensor  # [T, k_e, I] bool: the channels each token computed exactly
    k: int  # token: channels per token; batch: channels of the step

    @property
    def rows(self) -> StepRows:
        return StepRows(*(len(self.read[part]) for part in ("experts", "strips", "exact", "coeffs")))


def expert_scan(rotated: torch.Tensor, local: torch.Tensor, experts: int, scan: int) -> torch.Tensor:
    """Rx of the step's tokens [T, nb, 128], each token's slots' places in the union [T, k_e] -> the
    `scan` coordinates per block each union expert scans for all its tokens, [experts, nb, scan]."""
    _, exponent = torch.frexp(rotated.flatten(1).norm(dim=1))  # ‖Rx_t‖ = m·2^e, m in [0.5, 1)
    unit = rotated.abs() * torch.exp2(-exponent.to(torch.float32))[:, None, None]  # a power of two: exact
    ke = local.shape[1]
    summed = torch.zeros(experts, *rotated.shape[1:]).index_add_(0, local.flatten(), unit.repeat_interleave(ke, 0))
    return summed.topk(scan, dim=-1).indices


@torch.no_grad()
def step(
    x,
    index,
    weights,
    gate_up,
    down_rows,
    sidecar,
    settings: Reader,
    act_fn,
    *,
    rule: str,
    k: int | None = None,
    limit: float | None = None,
    int8=None,
    weigh: str = "share",
) -> StepResult:
    """One decode step of tokens x [T, H] routed to index/weights [T, k_e]: gate_up [E, 2I, H],
    down_rows [E, I, H], the layer's sidecar (sidecar.LayerSidecar). `rule="token"` takes k channels
    per token; `rule="batch"` takes `limit` bytes for the step, its scores summed as `weigh`
    ("share" or "raw"). `int8` (reader/int8.py): exact rows from those int8 weights."""
    if rule not in RULES or weigh not in WEIGHINGS:
        raise ValueError(f"rule must be one of {RULES} and weigh of {WEIGHINGS}, got {rule!r}, {weigh!r}")
    T, ke = index.shape
    E, I, H = down_rows.shape
    geo = Geometry(hidden=H, experts=E, top_k=ke, intermediate=I)
    xf = x.to(torch.float32)
    experts, local = index.unique(return_inverse=True)  # the union, sorted; each slot's place in it
    n = len(experts)
    if rule == "batch":
        k = solve_step_k(geo, settings, n, limit)
        whole = k >= n * I
    else:
        whole = k >= geo.channels
    if whole:  # every channel exact: no screen, the union's experts read whole
        keep = torch.ones(T, ke, I, dtype=torch.bool)
        union = torch.ones(n, I, dtype=torch.bool)
        strips, p = torch.zeros(0, 3, dtype=torch.long), None
    else:
        score, p, strips = _screen(xf, experts, local, weights, sidecar, settings, act_fn, per_expert=rule == "batch")
        if rule == "token":
            keep = torch.zeros(T, ke * I, dtype=torch.bool).scatter_(1, score.flatten(1).topk(k, dim=-1).indices, True)
            keep = keep.view(T, ke, I)
            union = torch.zeros(n, I, dtype=torch.bool).index_put_(
                (local[..., None].expand(-1, -1, I)[keep], torch.arange(I).expand(T, ke, I)[keep]), torch.tensor(True)
            )
        else:
            if weigh == "share":
                score = score / score.flatten(1).sum(1).clamp_min(torch.finfo(torch.float32).tiny)[:, None, None]
            summed = torch.zeros(n, I).index_add_(0, local.flatten(), score.flatten(0, 1))
            union = torch.zeros(n * I, dtype=torch.bool)
            union[summed.flatten().topk(k).indices] = True
            union = union.view(n, I)
            keep = union[local]
    out, exact = _exact(xf, experts, local, weights, keep, union, gate_up, down_rows, act_fn, int8)
    coeffs = torch.zeros(0, 2, dtype=torch.long)
    if settings.recovery_rank and not whole:
        z, coeffs = _recover(experts, local, weights, p, keep, sidecar, settings.recovery_rank)
        out = out + z @ sidecar.basis[:, : settings.recovery_rank].to(torch.float32).T
    read = {"experts": experts, "strips": strips, "exact": exact, "coeffs": coeffs}
    return StepResult(out.to(x.dtype), read, keep, k)


def _screen(xf, experts, local, weights, sidecar, settings, act_fn, per_expert: bool):
    """Scores s and p of every (token, slot, channel) [T, k_e, I] from the strips each union expert
    needs (the union of the coordinates its tokens scan), each read once; and which were read."""
    rotated = rotate_blocks(xf, sidecar.signs, BLOCK)  # [T, nb, 128]
    nb, ke = rotated.shape[1], local.shape[1]
    if per_expert:  # each (token, slot) scans its expert's coordinates
        coords = expert_scan(rotated, local, len(experts), settings.scan)[local]
    else:  # each token its own, in every slot: reference.scanned
        coords = rotated.abs().topk(settings.scan, dim=-1).indices[:, None].expand(-1, ke, -1, -1)
    values = rotated[:, None].expand(-1, ke, -1, -1).gather(-1, coords)  # [T, k_e, nb, scan]
    blocks = torch.arange(nb)[None, None, :, None]
    wanted = (local[:, :, None, None], blocks, coords)  # [T, k_e, nb, scan]: (union expert, block, coordinate)
    need = torch.zeros(len(experts), nb, BLOCK, dtype=torch.bool)
    need[wanted] = True
    where = need.nonzero(as_tuple=True)
    strips = sidecar.codes[experts[where[0]], where[1], where[2]]  # the read: [strips, R_pad/5]
    slot = torch.full(need.shape, -1, dtype=torch.long)
    slot[where] = torch.arange(len(where[0]))
    scales = sidecar.scales[experts]  # the read: [n, nb, 2I]
    norms = sidecar.down_norms[experts]  # the read: [n, I]
    codes = unpack_codes(strips)[:, : scales.shape[-1]].to(torch.float32)  # each read strip decoded once
    estimates = reference.code_estimates(codes[slot[wanted]], values, scales[local])
    score, p = reference.scores(estimates, local, weights, norms, act_fn)
    return score, p, torch.stack([experts[where[0]], where[1], where[2]], dim=1)


def _exact(xf, experts, local, weights, keep, union, gate_up, down_rows, act_fn, int8):
    """The union's chosen channels read once ([m, H] rows each); each token sums those of its own
    experts that it keeps. Returns (output [T, H], the rows' (expert, channel) [m, 2])."""
    inter = down_rows.shape[1]
    ce, cj = union.nonzero(as_tuple=True)
    e = experts[ce]
    if int8 is None:
        gate = gate_up[e, cj].to(torch.float32)
        up = gate_up[e, cj + inter].to(torch.float32)
        down = down_rows[e, cj].to(torch.float32)
    else:
        gate, up, down = int8.rows(e, cj)
    a = act_fn(xf @ gate.T) * (xf @ up.T)  # [T, m]
    uses = (local[:, :, None] == ce) & keep[:, :, cj]  # [T, k_e, m]: token t's slot s keeps row c
    coef = (uses * weights.to(torch.float32)[..., None]).sum(1)
    return (coef * a) @ down, torch.stack([e, cj], dim=1)


def _recover(experts, local, weights, p, keep, sidecar, rank):
    """z [T, rank] = Σ w·p·b_j over each token's unkept channels, each needed b_j read once; and
    which were read."""
    n, inter = len(experts), p.shape[-1]
    rest = weights.to(torch.float32)[..., None] * p * ~keep  # [T, k_e, I]
    needed = torch.zeros(n, inter, dtype=torch.bool)
    needed.index_put_(
        (local[..., None].expand_as(keep)[~keep], torch.arange(inter).expand_as(keep)[~keep]), torch.tensor(True)
    )
    be, bj = needed.nonzero(as_tuple=True)
    b = torch.zeros(n, inter, rank)
    b[be, bj] = sidecar.coeffs[experts[be], bj][:, :rank].to(torch.float32)  # the read: [rows, rank]
    return torch.einsum("tki,tkir->tr", rest, b[local]), torch.stack([experts[be], bj], dim=1)
