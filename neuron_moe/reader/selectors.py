"""Channel selectors the reader is compared against, each under two retention rules.

In expert e, channel j owns gate row j, up row j (gate_up_proj [E, 2I, H], gate rows first)
and down column j (down_proj [E, H, I]); a_j = φ(g_jᵀx)(v_jᵀx), y = Σ_e w_e Σ_j a_j d_j.
A selector scores candidate units per token and keeps some; a rule decides how many:

- `TopK`: a fixed count per part, solved from a reads budget: every token reads the same bytes;
- `Threshold`: keep what scores above a per-layer threshold calibrated on other activations
  (`calibrate`): the bytes read vary by token and drift when the activations shift.

The selectors and the layout each reads in (every unit charged in whole 32-byte sectors,
`accounting.row_sectors`):

- teal:   |x_i| over input coordinates for gate/up (column-major gate_up: coordinate i of every
          routed expert is one strip of 2I values), then |a_j| over the intermediate activations
          for the down (rows of down_rows);
- wina:   |x_i|·‖W_e[:, i]‖ per (expert, coordinate) for gate/up, |a_j|·‖d_j‖ for the down; it
          also reads the column norms of the routed experts;
- cats:   |φ(g_jᵀx)|: the whole gate is read, then an up row and a down row per kept channel;
- oracle: w_e·‖d_j‖·|a_j| with the exact a_j: an upper bound, charged only its 3 rows per channel;
- reader: the sketch score of `reference.py`, charged by `accounting.reads`; its exact rows in
          int8 when the layer has `int8` experts (reader/int8.py; budgets stay a share of the bf16
          full read, so bf16 and int8 cells at one budget read equal bytes).

At budget 100 % every selector keeps every unit and computes the full MoE.

A `Step` rule runs the reader over a decode step's tokens together (reader/batch.py): each token
its own top k, or the batch rule's one set of channels under a budget on the union; its reads are
the step's, each row once (`Result.step`).
The reader at TP t on the channel layout (`shard.py`, its one definition): `MoeLayer.tp` charges each
rank for its own channels on its own geometry (`shard.by_rank`), and `RankTopK` is the per-rank quota
(`shard.quota`: each rank its k of its own).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from . import accounting, batch, reference, shard
from .accounting import BF16, BudgetError, row_sectors, sectors
from ..spec import Reader
from .geometry import Geometry
from .sidecar import SECTOR


@dataclass
class MoeLayer:
    """One MoE layer's routed experts, as HF holds them, and (for the reader) its sidecar."""

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    act_fn: object
    top_k: int
    sidecar: object = None  # sidecar.LayerSidecar
    settings: Reader = field(default_factory=lambda: Reader().resolved())
    int8: object = None  # int8.Int8Experts: the reader reads its exact rows there (settings.quantization "int8")
    tp: int = 1  # the reader's reads are charged per rank of the channel layout at this TP degree

    @property
    def geo(self) -> Geometry:
        E, H, I = self.down.shape
        return Geometry(hidden=H, experts=E, top_k=self.top_k, intermediate=I)


@dataclass(frozen=True)
class Part:
    units: int  # candidates per token
    nbytes: int  # bytes one kept unit costs


@dataclass
class Result:
    out: torch.Tensor  # [T, H] routed output
    reads: torch.Tensor  # [T] bytes read per token (a Step rule: the step's, on every token)
    kept: dict  # part -> [T] fraction of its units kept
    step: accounting.StepRows | None = None  # a Step rule: the rows the step read, each once
    rank_reads: torch.Tensor | None = None  # [T, tp] bytes each rank reads (the reader at tp > 1; reads = their max)


# ---- retention rules: rule(part, score [T, n]) -> keep mask [T, n] ----


@dataclass
class TopK:
    counts: dict  # part -> units kept per token

    def __call__(self, part, score):
        mask = torch.zeros_like(score, dtype=torch.bool)
        return mask.scatter_(1, score.topk(self.counts[part], dim=-1).indices, True)


@dataclass
class RankTopK:
    """The per-rank quota at TP `tp` on the channel layout: rank r holds channels r·I/t … (r+1)·I/t − 1
    of every expert, and keeps counts[part] of its own candidates (`reader/shard.py`)."""

    counts: dict  # part -> units kept per token and rank
    tp: int
    inter: int  # I: channels per expert

    def __call__(self, part, score):
        return shard.quota(score, self.tp, self.inter, self.counts[part])


@dataclass
class Threshold:
    thresholds: dict  # part -> keep scores strictly above

    def __call__(self, part, score):
        return score > self.thresholds[part]


def quantile_threshold(score: torch.Tensor, keep: float) -> float:
    """The threshold that keeps the top `keep` fraction of the calibration scores (exact order statistic;
    TEAL reads it off a 10,000-bin histogram, too coarse for heavy-tailed channel scores)."""
    score = score.flatten().to(torch.float32)
    drop = round((1 - keep) * score.numel())
    if drop <= 0:
        return -1.0  # scores are magnitudes: keep everything
    return float(score.kthvalue(drop).values)


@dataclass
class Calibrating:
    """A rule that, on calibration activations, sets each part's threshold at its target keep fraction."""

    fractions: dict  # part -> target keep fraction
    thresholds: dict = field(default_factory=dict)

    def __call__(self, part, score):
        self.thresholds[part] = quantile_threshold(score, self.fractions[part])
        return score > self.thresholds[part]


@dataclass
class Step:
    """The reader over one decode step's tokens together (reader/batch.py). `rule` "token": each
    token its own top `k`, the step reading the union; "batch": one set of channels for the step
    within `limit` bytes, or — `limit` None — within what "token" at `k` reads on the same step."""

    rule: str
    k: int | None = None
    limit: float | None = None
    weigh: str = "share"  # the batch rule's scores: each token's as shares of its total, or "raw"
    scan: int | None = None  # the batch rule's scanned coordinates per block (default: the layer's)


# ---- the selectors ----


def _routed(layer, index):
    if layer.int8 is not None:  # what the int8 numbers stand for (reader.int8's rows, dequantised)
        gate_up, down = layer.int8.dequantized()
        return gate_up[index], down[index]
    return layer.gate_up[index].to(torch.float32), layer.down[index].to(torch.float32)  # [T,k,2I,H], [T,k,H,I]


def _output(a, keep, weights, down):
    return torch.einsum("tki,tkhi,tk->th", a * keep, down, weights.to(torch.float32))


def _act(layer, xin, gate_up):
    """a [T, k, I] from inputs xin [T, k, H] (each expert may see its own masked x)."""
    g, v = torch.einsum("tkh,tkrh->tkr", xin, gate_up).chunk(2, dim=-1)
    return layer.act_fn(g) * v


def teal(layer, x, index, weights, rule):
    gate_up, down = _routed(layer, index)
    xin = rule("input", x.abs()) * x  # one mask for all the token's experts: x is shared
    a = _act(layer, xin[:, None].expand(-1, index.shape[1], -1), gate_up)
    keep = rule("channel", a.abs().flatten(1)).view_as(a)
    return _output(a, keep, weights, down), {"input": xin != 0, "channel": keep}


def wina(layer, x, index, weights, rule):
    gate_up, down = _routed(layer, index)
    col_norms = gate_up.norm(dim=2)  # [T, k, H]: ‖W_e[:, i]‖ over the expert's gate and up rows
    score = x.abs()[:, None] * col_norms
    keep_in = rule("input", score.flatten(1)).view_as(score)
    a = _act(layer, x[:, None] * keep_in, gate_up)
    keep = rule("channel", (a.abs() * down.norm(dim=2)).flatten(1)).view_as(a)
    return _output(a, keep, weights, down), {"input": keep_in, "channel": keep}


def cats(layer, x, index, weights, rule):
    gate_up, down = _routed(layer, index)
    g, v = torch.einsum("th,tkrh->tkr", x.to(torch.float32), gate_up).chunk(2, dim=-1)
    act = layer.act_fn(g)
    keep = rule("channel", act.abs().flatten(1)).view_as(act)
    return _output(act * v, keep, weights, down), {"channel": keep}


def oracle(layer, x, index, weights, rule):
    gate_up, down = _routed(layer, index)
    a = _act(layer, x.to(torch.float32)[:, None].expand(-1, index.shape[1], -1), gate_up)
    score = weights.to(torch.float32)[..., None] * down.norm(dim=2) * a.abs()
    keep = rule("channel", score.flatten(1)).view_as(a)
    return _output(a, keep, weights, down), {"channel": keep}


def reader(layer, x, index, weights, rule):
    """The reader's forward (`reference.forward`) with the rule choosing the exact channels from s_j:
    the kept channels exactly, the rest through the rank-r recovery map. Masked rather than gathered,
    so tokens with different k run together (equal to `reference.forward` at each token's k)."""
    sc = layer.sidecar
    if sc is None:
        raise BudgetError("reader: this MoeLayer has no sidecar (sidecar.LayerSidecar); run prep first")
    xf = x.to(torch.float32)
    estimates = reference.sketch_estimates(xf, index, sc, layer.settings.scan)
    score, p = reference.scores(estimates, index, weights, sc.down_norms, layer.act_fn)
    keep = rule("channel", score.flatten(1)).view_as(score)
    gate_up, down = _routed(layer, index)
    out = _output(_act(layer, xf[:, None].expand(-1, index.shape[1], -1), gate_up), keep, weights, down)
    rank = layer.settings.recovery_rank
    if rank:
        rest = weights.to(torch.float32)[..., None] * p * ~keep
        z = torch.einsum("tki,tkir->tr", rest, sc.coeffs[index][..., :rank].to(torch.float32))
        out = out + z @ sc.basis[:, :rank].to(torch.float32).T
    return out, {"channel": keep}


def _row(geo: Geometry) -> int:
    return SECTOR * row_sectors(geo.hidden * BF16)  # one gate, up or down row


def _teal_parts(geo: Geometry) -> tuple[int, dict[str, Part]]:
    strip = SECTOR * row_sectors(2 * geo.intermediate * BF16)  # one input coordinate of one expert's gate_up
    return 0, {"input": Part(geo.hidden, geo.top_k * strip), "channel": Part(geo.channels, _row(geo))}


def _wina_parts(geo: Geometry) -> tuple[int, dict[str, Part]]:
    H, I, k = geo.hidden, geo.intermediate, geo.top_k
    norms = SECTOR * k * (sectors(H * BF16) + sectors(I * BF16))
    strip = SECTOR * row_sectors(2 * I * BF16)
    return norms, {"input": Part(k * H, strip), "channel": Part(geo.channels, _row(geo))}


def _cats_parts(geo: Geometry) -> tuple[int, dict[str, Part]]:
    return geo.top_k * geo.intermediate * _row(geo), {"channel": Part(geo.channels, 2 * _row(geo))}


def _oracle_parts(geo: Geometry) -> tuple[int, dict[str, Part]]:
    return 0, {"channel": Part(geo.channels, 3 * _row(geo))}


def _reader_parts(geo: Geometry) -> tuple[int, dict[str, Part]]:
    return 0, {"channel": Part(geo.channels, 0)}  # charged by accounting.reads, not linearly


@dataclass(frozen=True)
class Selector:
    """A selector: its forward, the (fixed bytes per token, parts) of its natural layout, and whether
    it is the reader (`sketch`: scores from the sidecar's sketch, its reads charged by the reader's
    accounting, not linearly in k, and per rank at TP > 1)."""

    forward: object
    parts: object
    sketch: bool = False


SELECTORS = {
    "teal": Selector(teal, _teal_parts),
    "wina": Selector(wina, _wina_parts),
    "cats": Selector(cats, _cats_parts),
    "oracle": Selector(oracle, _oracle_parts),
    "reader": Selector(reader, _reader_parts, sketch=True),
}


def _selector(name) -> Selector:
    if name not in SELECTORS:
        raise BudgetError(f"unknown selector {name!r}; known: {', '.join(SELECTORS)}")
    return SELECTORS[name]


def layout_parts(name, geo: Geometry, settings) -> tuple[int, dict[str, Part]]:
    """(fixed bytes per token, parts) of each selector's natural layout."""
    return _selector(name).parts(geo)


def charged(name, geo: Geometry, settings, counts: dict) -> int:
    """Bytes a token reads keeping counts[part] units of each part."""
    if _selector(name).sketch:
        return sum(accounting.reads(geo, settings, counts["channel"]).values())
    fixed, parts = layout_parts(name, geo, settings)
    return fixed + sum(counts[p] * part.nbytes for p, part in parts.items())


def plan(name, geo: Geometry, settings, budget: float) -> dict:
    """Top-k counts per part whose reads fit `budget` percent of the full model's reads.

    Two-part selectors keep the same fraction of each part (TEAL and WINA's uniform allocation).
    """
    if not 0 < budget <= 100:
        raise BudgetError(f"budget must be in (0, 100] percent, got {budget}")
    fixed, parts = layout_parts(name, geo, settings)
    if budget == 100:
        return {p: part.units for p, part in parts.items()}
    sketch = _selector(name).sketch
    if sketch and settings.quantization != "none":  # equal bytes: a share of the bf16 full read
        return {"channel": accounting.solve_k(geo, settings, budget, full=accounting.full_bytes(geo))}
    if sketch:
        return {"channel": accounting.solve_k(geo, settings, budget)}
    limit = budget / 100 * accounting.full_bytes(geo)
    lead, *rest = parts
    for m in range(parts[lead].units, -1, -1):  # reads grow with m: the first that fits is the most
        counts = {lead: m, **{p: m * parts[p].units // parts[lead].units for p in rest}}
        if charged(name, geo, settings, counts) <= limit:
            return counts
    raise BudgetError(
        f"{name}: budget {budget}% is below its fixed reads ({100 * fixed / accounting.full_bytes(geo):.2f}%)"
    )


def run(name, layer: MoeLayer, x, index, weights, rule) -> Result:
    """Selector `name` on tokens x [T, H] routed to index/weights [T, top_k]; reads measured from what it kept."""
    selector = _selector(name)
    if isinstance(rule, Step):
        return run_step(layer, x, index, weights, rule)
    with torch.no_grad():
        out, masks = selector.forward(layer, x, index, weights, rule)
    geo = layer.geo
    counts = {p: m.flatten(1).sum(1) for p, m in masks.items()}
    fixed, units = layout_parts(name, geo, layer.settings)
    if selector.sketch and layer.tp > 1:
        return _rank_result(
            name, layer, out.to(x.dtype), masks["channel"], {p: c / units[p].units for p, c in counts.items()}
        )
    if selector.sketch:  # not linear in k (recovery, the full read at every channel): charge each k once
        ks = counts["channel"]
        reads = torch.zeros_like(ks)
        for k in ks.unique().tolist():
            reads[ks == k] = charged(name, geo, layer.settings, {"channel": k})
    else:
        reads = fixed + sum(c * units[p].nbytes for p, c in counts.items())
    return Result(out.to(x.dtype), reads, {p: c / units[p].units for p, c in counts.items()})


def run_step(layer: MoeLayer, x, index, weights, rule: Step) -> Result:
    """The reader on one decode step of tokens x [T, H] under a Step rule."""
    if layer.sidecar is None:
        raise BudgetError("reader: this MoeLayer has no sidecar (sidecar.LayerSidecar); run prep first")
    if layer.tp > 1:
        raise BudgetError(f"reader: the Step rules run at TP 1; this layer is charged per rank at TP {layer.tp}")

    def go(settings, **kw):
        return batch.step(
            x,
            index,
            weights,
            layer.gate_up,
            layer.down.mT,
            layer.sidecar,
            settings,
            layer.act_fn,
            int8=layer.int8,
            **kw,
        )

    settings = layer.settings
    if rule.rule == "token":
        done = go(settings, rule="token", k=rule.k)
    else:
        limit = rule.limit
        if limit is None:
            limit = sum(accounting.step_reads(layer.geo, settings, go(settings, rule="token", k=rule.k).rows).values())
        if rule.scan is not None:
            settings = dataclasses.replace(settings, scan=rule.scan)
        done = go(settings, rule="batch", limit=limit, weigh=rule.weigh)
    nbytes = sum(accounting.step_reads(layer.geo, settings, done.rows).values())
    reads = torch.full((len(x),), nbytes, dtype=torch.long)
    return Result(done.out, reads, {"channel": done.keep.flatten(1).float().mean(1)}, done.rows)


def _rank_result(name, layer: MoeLayer, out, keep, kept) -> Result:
    """The reader at TP > 1: each rank charged for its own channels on its own geometry
    (`accounting.rank_geometry`); a step waits for its slowest rank, so `reads` is their max."""
    geo = layer.geo
    ks = shard.by_rank(keep.flatten(1), layer.tp, geo.intermediate).sum(-1)  # [T, tp]: channels each rank keeps
    local = accounting.rank_geometry(geo, layer.tp)
    rank_reads = torch.zeros_like(ks)
    for k in ks.unique().tolist():
        rank_reads[ks == k] = charged(name, local, layer.settings, {"channel": k})
    return Result(out, rank_reads.max(1).values, kept, rank_reads=rank_reads)


def top_k(name, layer: MoeLayer, budget: float) -> TopK:
    return TopK(plan(name, layer.geo, layer.settings, budget))


def calibrate(name, layer: MoeLayer, x, index, weights, budget: float) -> Threshold:
    """Per-layer thresholds from calibration activations, set to keep what top-k keeps at `budget`.

    Pass only calibration-split activations: the thresholds are then applied to other data.
    """
    geo, parts = layer.geo, layout_parts(name, layer.geo, layer.settings)[1]
    fractions = {p: c / parts[p].units for p, c in plan(name, geo, layer.settings, budget).items()}
    rule = Calibrating(fractions)
    run(name, layer, x, index, weights, rule)
    return Threshold(rule.thresholds)
