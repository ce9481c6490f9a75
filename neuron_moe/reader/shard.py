"""The reader at tensor-parallel degree t: per-rank shards of the sidecar, and the per-rank reader.

On the channel expert layout (`parallel/layout.py`) rank r of t holds channels r·I/t … (r+1)·I/t − 1
of every expert: those gate rows and the same up rows (gate_up split with stride 2, so they pair)
and those down rows. A rank's reader is the one-rank reader (`reference.forward`) on that shard:

- its sidecar is the whole sidecar's rows of its channels: a row's ternary codes and scale depend on
  that row alone, so the shard's sketch is the same numbers, repacked with the shard's 2I/t rows
  padded to whole 32-byte strips (the `SidecarLayout` of the rank's geometry); norms and b_j of its
  channels; and the layer's whole U, which every rank projects its own recovery through;
- it selects k_r channels per token among its top_k·I/t candidates by the same output-level score,
  k_r solved from the accounting on the rank's geometry (`accounting.rank_geometry`), so every
  rank reads the same bytes;
- its output is a partial sum that the experts' one all-reduce adds up:
  Σ_r (exact_r + U·z_r) = Σ exact + U·Σ z_r.

At TP 1 the shard is the sidecar itself, and the per-rank reader the one-rank reader.

This is the one definition of the reader at TP, which its three uses take: the rank module's reader
(`parallel/reader.py`: `reference.forward` on the rank's shard), the per-rank reader of t ranks in
one process (`forward_ranks`, `emulated`: `experts.channel_reader.attach_reader(tp=)`), and
eval-reader's selector on the whole layer (`reader/selectors.py`: each rank's quota, `quota`, and its
own reads, counted by `by_rank`); k_r is `accounting.solve_rank_k` in all three.

Files. `write_shards` (`neuron-moe prep-reader --tp t`) writes `tp{t}-rank{r}.safetensors` per rank
beside the whole sidecar, in the sidecar format (`sidecar.py`) with the rank's geometry (intermediate
I/t); their metadata adds `tp`, `tp_rank` and `expert_layout`, and keeps `source_sha256` of the whole
model's expert weights. `open_shard` refuses a shard made for another TP degree, rank, layout or
model, naming which.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from ..parallel import layout as tp_layout
from ..report import atomic_write
from . import reference
from .accounting import rank_geometry
from .geometry import Geometry
from .sidecar import (
    CODES_PER_BYTE,
    LayerSidecar,
    Sidecar,
    SidecarError,
    SidecarLayout,
    metadata,
    pack_codes,
    stream_layers,
    unpack_codes,
)

WHOLE = "reader.safetensors"  # the whole sidecar, in a `prep-reader --tp` directory


def shard_name(tp: int, rank: int) -> str:
    return f"tp{tp}-rank{rank}.safetensors"


def rank_rows(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s gate rows then the same up rows along `dim` (2I long), as the channel layout
    splits gate_up (stride 2)."""
    return tp_layout.split(t, dim, tp, rank, stride=2)


def rank_channels(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s channels along `dim` (I long)."""
    return tp_layout.split(t, dim, tp, rank)


def shard_layer(layer, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of one layer's sidecar tensors (a LayerSidecar or a dict of them), in the
    sidecar format of the rank's geometry. Codes are unpacked one expert at a time (bounded memory)."""
    get = layer.get if isinstance(layer, dict) else lambda name: getattr(layer, name)
    codes, scales = get("codes"), get("scales")
    E, nb, block, _ = codes.shape
    rows = scales.shape[-1]  # 2I
    if rows % (2 * tp):
        raise SidecarError(f"{rows // 2} expert channels do not split over {tp} ranks")
    hidden, rank_u = get("basis").shape
    local = SidecarLayout(Geometry(hidden=hidden, experts=E, intermediate=rows // (2 * tp)), rank_u)
    out = torch.zeros(E, nb, block, local.rows_padded // CODES_PER_BYTE, dtype=torch.uint8)
    for e in range(E):
        mine = rank_rows(unpack_codes(codes[e])[..., :rows], -1, tp, rank)
        out[e] = pack_codes(torch.nn.functional.pad(mine, (0, local.rows_padded - local.rows)))
    return {
        "codes": out,
        "scales": rank_rows(scales, -1, tp, rank).contiguous(),
        "down_norms": rank_channels(get("down_norms"), 1, tp, rank).contiguous(),
        "basis": get("basis"),
        "coeffs": rank_channels(get("coeffs"), 1, tp, rank).contiguous(),
    }


def shard_weights(gate_up: torch.Tensor, down_rows: torch.Tensor, tp: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s expert weights in the reader's row layout: gate_up [E, 2I/t, H], down rows [E, I/t, H]."""
    return rank_rows(gate_up, 1, tp, rank), rank_channels(down_rows, 1, tp, rank)


def rank_sidecar(layer: LayerSidecar, tp: int, rank: int) -> LayerSidecar:
    return LayerSidecar.from_tensors(shard_layer(layer, tp, rank), layer.signs)


def by_rank(values: torch.Tensor, tp: int, inter: int) -> torch.Tensor:
    """A token's per-channel values over its experts, [T, slots·I] (slot-major, I channels each), as
    each rank holds them: [T, tp, slots·I/t], rank r's being its channels r·I/t … (r+1)·I/t − 1 of
    every slot (`rank_channels`)."""
    T, n = values.shape[0], inter // tp
    return values.view(T, -1, tp, n).transpose(1, 2).reshape(T, tp, -1)


def quota(score: torch.Tensor, tp: int, inter: int, k: int) -> torch.Tensor:
    """The per-rank quota on a whole layer's scores [T, slots·I]: each rank keeps the top k of its own
    channels (what `reference.forward` on its shard selects) -> keep mask [T, slots·I]."""
    T, n = score.shape[0], inter // tp
    mine = by_rank(score, tp, inter)
    keep = torch.zeros_like(mine, dtype=torch.bool).scatter_(2, mine.topk(k, dim=-1).indices, True)
    return keep.view(T, tp, -1, n).transpose(1, 2).reshape(T, -1)


def forward_ranks(x, top_k_index, top_k_weights, shards, *, k: int, scan: int, rank: int, act_fn) -> torch.Tensor:
    """The per-rank reader of t ranks in one process: each rank's `reference.forward` on its shard
    (`shards`: [(gate_up rows, down rows, LayerSidecar)] per rank) with k channels per rank, summed as
    the all-reduce sums them (fp32, rank order)."""
    out = sum(
        reference.forward(
            x, top_k_index, top_k_weights, gate_up, down, layer, k=k, scan=scan, rank=rank, act_fn=act_fn
        ).to(torch.float32)
        for gate_up, down, layer in shards
    )
    return out.to(x.dtype)


def emulated(layer: LayerSidecar, tp: int):
    """A forward with `reference.forward`'s signature that runs the per-rank reader of `tp` ranks on one
    layer in one process: each rank's shard of `layer` (made once) and its share of the experts, summed."""
    shards = [rank_sidecar(layer, tp, r) for r in range(tp)]

    def run(x, top_k_index, top_k_weights, gate_up, down_rows, layer, **kw):
        ranks = [(*shard_weights(gate_up, down_rows, tp, r), side) for r, side in enumerate(shards)]
        return forward_ranks(x, top_k_index, top_k_weights, ranks, **kw)

    return run


def write_shards(
    sidecar: Sidecar, out_dir: Path, tp: int, expert_layout: str = tp_layout.CHANNEL, progress: bool = True
) -> list[Path]:
    """Every rank's shard of `sidecar`, streamed layer by layer into `out_dir` (each file a temp file,
    then renamed). Only the channel layout splits channels: the expert layout holds experts whole."""
    if expert_layout != tp_layout.CHANNEL:
        raise SidecarError(
            f"reader shards exist for the {tp_layout.CHANNEL!r} expert layout only (each rank holds "
            f"every expert's I/t channels); the {expert_layout!r} layout holds experts whole"
        )
    if tp not in tp_layout.TP_DEGREES:
        raise SidecarError(f"TP degree {tp} is not one of {tp_layout.TP_DEGREES}")
    whole = sidecar.layout
    channels = whole.geometry.intermediate
    if channels % tp:
        raise SidecarError(f"{sidecar.path}: {channels} expert channels do not split over {tp} ranks")
    local = SidecarLayout(rank_geometry(whole.geometry, tp), whole.rank)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / shard_name(tp, r) for r in range(tp)]
    for r, path in enumerate(paths):
        meta = dict(
            metadata(local, sidecar.layers, sidecar.scan, sidecar.seed, sidecar.source_sha256),
            tp=str(tp),
            tp_rank=str(r),
            expert_layout=expert_layout,
        )
        tensors = (shard_layer(sidecar.layer(i), tp, r) for i in range(sidecar.layers))
        with atomic_write(path, "wb", seekable=True) as f:
            stream_layers(
                f,
                local,
                sidecar.layers,
                meta,
                sidecar.signs,
                tqdm(
                    tensors, total=sidecar.layers, desc=f"reader shard {r} of {tp}", unit="layer", disable=not progress
                ),
            )
    return paths


def open_shard(directory: Path, tp: int, rank: int, config, expert_layout: str = tp_layout.CHANNEL) -> Sidecar:
    """Rank `rank`'s shard for a model of `config` at TP `tp`, every tie checked (the weights' digest
    is checked by the caller, which holds them: `Sidecar.check_source`)."""
    path = Path(directory) / shard_name(tp, rank)
    if not path.is_file():
        have = sorted(p.name for p in Path(directory).glob("tp*-rank*.safetensors")) if Path(directory).is_dir() else []
        raise SidecarError(
            f"{path}: no reader shard for rank {rank} at TP {tp}"
            + (f" (the directory holds {', '.join(have[:4])})" if have else "")
            + f"; make them with `neuron-moe prep-reader --tp {tp} --out {directory}`"
        )
    side = Sidecar(path)
    if side.tp is None:
        raise SidecarError(f"{path}: a whole sidecar, not a TP shard (no tp / tp_rank metadata)")
    if side.tp != tp:
        raise SidecarError(f"{path}: a shard for TP {side.tp}, loaded at TP {tp}")
    if side.tp_rank != rank:
        raise SidecarError(f"{path}: holds rank {side.tp_rank}'s channels, loaded on rank {rank}")
    if side.expert_layout != expert_layout:
        raise SidecarError(
            f"{path}: a shard of the {side.expert_layout!r} expert layout, used with the {expert_layout!r} layout"
        )
    want = (*rank_geometry(Geometry.from_config(config), tp).sizes, config.num_hidden_layers)
    have = (*side.layout.geometry.sizes, side.layers)
    if want != have:
        raise SidecarError(
            f"{path}: shard geometry (hidden, experts, intermediate per rank, layers) = {have}, this "
            f"model's at TP {tp} = {want}: a sidecar of another model"
        )
    return side


def check_shards(sides: list[Sidecar]) -> None:
    """The ranks' shards must come from one prep: same source weights, scan, recovery rank and seed."""
    ties = {(s.source_sha256, s.scan, s.layout.rank, s.seed) for s in sides}
    if len(ties) > 1:
        raise SidecarError(
            "the ranks' reader shards come from different preps (source sha256, scan, rank or seed "
            f"differ: {', '.join(str(s.path) for s in sides)}); re-run `neuron-moe prep-reader --tp`"
        )
