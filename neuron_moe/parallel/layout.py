"""Who owns what at tensor-parallel degree t: the one definition the CPU and NxD backends and
the memory planner share.

Placements are those of NxD's parallel layers (dense weights stored [out, in], as nn.Linear;
NxD's expert-fused weights [E, in, out]):

  column          split on dim 0, the output features   (ColumnParallelLinear; no collective after)
  row             split on dim 1, the input features    (RowParallelLinear; all-reduce after)
  vocab           embedding rows split on dim 0         (ParallelEmbedding across the vocabulary)
  experts_column  [E, H, 2I] split on dim 2 with partition stride 2: rank r takes gate channels
                  r·I/t … (r+1)·I/t − 1 and the same up channels (ExpertFusedColumnParallelLinear)
  experts_row     [E, I, H] split on dim 1, the intermediate channels (ExpertFusedRowParallelLinear)
  replicated      whole on every rank                   (norms, router, scalars)
  reader_shard    a rank's reader sidecar shard (`reader/shard.py`): the ranks' shards concatenated on
                  dim 0 in the full checkpoint; U and the Hadamard signs are replicated (`parallel/reader.py`)

Per decoder layer:
  attention   q_proj column (heads split), o_proj row; k_proj / v_proj column after the KV heads
              are replicated up to t when there are fewer than t (the full-size port's global layers
              have 2 KV heads, its sliding layers 8; the tiny port's 2 and 4). Rank r then holds KV
              head r·kv/t, the one its query heads r·h/t … (r+1)·h/t − 1 read.
  dense MLP   gate_proj / up_proj column, down_proj row.
  experts     one of EXPERT_LAYOUTS (`--expert-layout`, the port's [static] expert_layout):
    channel   (the default; NxD's own MoE layout) every rank holds channels r·I/t … (r+1)·I/t − 1
              of every expert: gate_up_proj [E, H, 2I] experts_column (HF's [E, 2I, H] transposed
              to NxD's input-major order; per rank [E, H, 2I/t], each rank's gate columns paired
              with its up columns by the stride), down_proj [E, I, H] experts_row (per rank
              [E, I/t, H]). The router weights are used whole on every rank: nothing in the MoE
              block depends on the rank, and one all-reduce follows the router-weighted sum.
    expert    (expert-parallel) gate_up_proj [E, 2I, H] is one column-parallel linear [E·2I, H];
              down_proj [E, H, I] one row-parallel linear [H, E·I]. Both are ordered expert-major,
              so rank r holds experts r·E/t … (r+1)·E/t − 1 whole. Each rank scatters the dense
              [T, E] router weights to its own [T, E/t] slice, which must use the rank as a tensor
              (SPMDRank), never as a Python int: ModelBuilder traces rank 0 only.
              spmd_rank: a [1] int32 parameter per MoE block (`<...>.experts.spmd_rank.rank`),
              `arange(t)` in the checkpoint, split on dim 0.
  The two layouts use the same parameter names; a state dict's layout is told by the experts'
  rank (2-D linears: expert, 3-D expert-fused: channel), so one layout's checkpoint or shard is
  refused by the other's rank module (`check_expert_layout`).
Embeddings are vocab-parallel (their row offset from an SPMDRank, `embed_tokens.rank_util`) and
lm_head column-parallel over the vocabulary (logits gathered). They are tied in the checkpoint but
two tensors on the device: each parallel layer loads its own.

Quantized linears (`formats/`) are quantized as their layout holds them, along their input dim (dim 1
of all of them); each tensor of a format is placed as its weight, but for a scale with one entry per
output channel in a row layer, which every rank holds whole. int8: per output channel, so the channel
layout's experts per (expert, output channel), the expert layout's down, one linear over all
experts, per hidden channel shared by its experts. Grouped formats (int4, q4_0): a row rank holds
whole groups of its input channels, and an expert's groups lie within its own channels.
"""

from __future__ import annotations

import re

import torch
from transformers import Gemma4TextConfig

from ..errors import UserError
from ..formats import TENSORS
from ..spec import CHANNEL, DEFAULT_EXPERT_LAYOUT, EXPERT, EXPERT_LAYOUTS, TP_DEGREES

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"
EXPERTS_COLUMN, EXPERTS_ROW = "experts_column", "experts_row"
READER_SHARD = (
    "reader_shard"  # a rank's reader sidecar shard: the ranks' shards concatenated on dim 0 (parallel/reader.py)
)
# placement -> (partition dim, partition stride), as NxD's parameter tags say it
PARTITION = {
    COLUMN: (0, 1),
    VOCAB: (0, 1),
    ROW: (1, 1),
    EXPERTS_COLUMN: (2, 2),
    EXPERTS_ROW: (1, 1),
    READER_SHARD: (0, 1),
}
# the degrees (TP_DEGREES) and expert layouts (CHANNEL, EXPERT) are named in spec.py, with the backend
_EXPERT_NDIM = {EXPERT: 2, CHANNEL: 3}  # the experts linears' weights: 2-D linears, or 3-D expert-fused

# Parameter-name suffix (in the parallel layout's names) -> placement; everything else is replicated.
_RULES = (
    (".self_attn.q_proj.weight", COLUMN),
    (".self_attn.k_proj.weight", COLUMN),
    (".self_attn.v_proj.weight", COLUMN),
    (".self_attn.o_proj.weight", ROW),
    (".mlp.gate_proj.weight", COLUMN),
    (".mlp.up_proj.weight", COLUMN),
    (".mlp.down_proj.weight", ROW),
    (".rank_util.rank", COLUMN),
    ("embed_tokens.weight", VOCAB),
    ("lm_head.weight", COLUMN),
)
_EXPERT_RULES = {
    EXPERT: (
        (".experts.gate_up_proj.weight", COLUMN),
        (".experts.down_proj.weight", ROW),
        (".experts.spmd_rank.rank", COLUMN),
    ),
    CHANNEL: (
        (".experts.gate_up_proj.weight", EXPERTS_COLUMN),
        (".experts.down_proj.weight", EXPERTS_ROW),
        *((f".experts.reader.{name}", READER_SHARD) for name in ("codes", "scales", "down_norms", "coeffs")),
    ),
}
# Column-parallel weights whose output every rank takes whole (gather_output): the logits, so that
# every rank takes the same token.
GATHERED = ("lm_head.weight",)
_GATE_UP = ".experts.gate_up_proj.weight"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class LayoutError(UserError):
    pass


def check_layout_name(expert_layout: str) -> str:
    if expert_layout not in EXPERT_LAYOUTS:
        raise LayoutError(f"unknown expert layout {expert_layout!r}; expected one of {', '.join(EXPERT_LAYOUTS)}")
    return expert_layout


def placement(name: str, expert_layout: str = DEFAULT_EXPERT_LAYOUT) -> str:
    """The placement of a parameter, by its name in the parallel layout (see `parallel_state_dict`). A
    weight format's tensor (`….scale`, …: `formats.TENSORS`) is placed as its linear's weight; the
    format says which of them a rank holds whole instead (`Format.replicated`)."""
    prefix, _, tensor = name.rpartition(".")
    if prefix and tensor in TENSORS:
        name = f"{prefix}.weight"
    for suffix, kind in (*_RULES, *_EXPERT_RULES[check_layout_name(expert_layout)]):
        if ("." + name).endswith(suffix):
            return kind
    return REPLICATED


def expert_layout_of(state: dict[str, torch.Tensor]) -> str | None:
    """The expert layout a parallel-layout state dict (full, or one rank's) is in; None without experts."""
    for name, tensor in state.items():
        if ("." + name).endswith(_GATE_UP):
            return next(k for k, ndim in _EXPERT_NDIM.items() if ndim == tensor.dim())
    return None


def check_expert_layout(state: dict[str, torch.Tensor], expert_layout: str, what: str) -> None:
    """Refuse `state` (`what`: where it came from) unless its experts are in `expert_layout`."""
    have = expert_layout_of(state)
    if have is not None and have != expert_layout:
        name = next(n for n in state if ("." + n).endswith(_GATE_UP))
        raise LayoutError(
            f"{what} holds its experts in the {have!r} layout ({name} {list(state[name].shape)}); "
            f"it is used here with the {expert_layout!r} layout: pass --expert-layout {have}, "
            f"or make it again with --expert-layout {expert_layout}"
        )


def kv_heads(config: Gemma4TextConfig, layer: int) -> int:
    return config.per_layer_config[layer].num_key_value_heads


def kv_heads_per_rank(config: Gemma4TextConfig, layer: int, tp: int) -> int:
    return max(kv_heads(config, layer) // tp, 1)


def check_degree(config: Gemma4TextConfig, tp: int, expert_layout: str = DEFAULT_EXPERT_LAYOUT) -> None:
    """Raise LayoutError naming every dimension that does not split over `tp` ranks."""
    check_layout_name(expert_layout)
    if tp not in TP_DEGREES:
        raise LayoutError(f"TP degree {tp} is not one of {TP_DEGREES} (the degrees inf2 supports)")
    experts = (
        ("experts", config.num_experts)
        if expert_layout == EXPERT
        else ("expert intermediate channels", config.moe_intermediate_size)
    )
    problems = []
    for what, n in (
        ("attention heads", config.num_attention_heads),
        experts,
        ("dense intermediate size", config.intermediate_size),
        ("vocab size", config.vocab_size),
    ):
        if n % tp:
            problems.append(f"{n} {what} do not split over {tp} ranks")
    for kv in sorted({kv_heads(config, i) for i in range(config.num_hidden_layers)}):
        if kv % tp and tp % kv:
            problems.append(f"{kv} KV heads neither split over nor replicate evenly to {tp} ranks")
    if problems:
        raise LayoutError(f"TP {tp} ({expert_layout} expert layout): " + "; ".join(problems))


def expert_range(config: Gemma4TextConfig, tp: int, rank: int) -> range:
    """The experts rank `rank` holds whole in the expert layout."""
    n = config.num_experts // tp
    return range(rank * n, (rank + 1) * n)


def channel_range(config: Gemma4TextConfig, tp: int, rank: int) -> range:
    """The intermediate channels of every expert rank `rank` holds in the channel layout."""
    n = config.moe_intermediate_size // tp
    return range(rank * n, (rank + 1) * n)


def gate_up_2d(w: torch.Tensor) -> torch.Tensor:
    """Expert layout: [E, 2I, H] -> [E·2I, H]: row e·2I + j is expert e's output channel j (gate rows first)."""
    E, rows, H = w.shape
    return w.reshape(E * rows, H)


def down_2d(w: torch.Tensor) -> torch.Tensor:
    """Expert layout: [E, H, I] -> [H, E·I]: column e·I + i is expert e's input channel i."""
    E, H, I = w.shape
    return w.permute(1, 0, 2).reshape(H, E * I)


def fused(w: torch.Tensor) -> torch.Tensor:
    """Channel layout: HF's [E, out, in] -> NxD's expert-fused [E, in, out] (gate_up [E, H, 2I], down [E, I, H])."""
    return w.transpose(1, 2)


_EXPERTS_AS = {EXPERT: (gate_up_2d, down_2d), CHANNEL: (fused, fused)}


def replicate_kv_heads(w: torch.Tensor, heads: int, tp: int) -> torch.Tensor:
    """[heads·d, H] -> [max(heads, tp)·d, H], each head repeated tp/heads times when heads < tp."""
    if heads >= tp:
        return w
    d = w.shape[0] // heads
    return w.reshape(heads, d, -1).repeat_interleave(tp // heads, dim=0).reshape(tp * d, -1)


def parallel_state_dict(
    state: dict[str, torch.Tensor], config: Gemma4TextConfig, tp: int, expert_layout: str = DEFAULT_EXPERT_LAYOUT
) -> dict[str, torch.Tensor]:
    """An HF state dict in the parallel layout, before any slicing (NxD's preshard step).

    Experts become their linears' weights under `<...>.experts.{gate_up_proj,down_proj}.weight`, as
    `expert_layout` holds them (2-D linears, or NxD's 3-D expert-fused order); in the expert layout
    each MoE block gains `<...>.experts.spmd_rank.rank`. KV projections are replicated up to t heads,
    the embedding gains `<...>.rank_util.rank` (SPMDRanks are arange(t)); every other tensor keeps
    its name and value. The input is never modified.
    """
    check_degree(config, tp, expert_layout)
    gate_up_as, down_as = _EXPERTS_AS[expert_layout]
    out = {}
    for name, w in state.items():
        layer = _LAYER.search(name)
        if name.endswith(".experts.gate_up_proj"):
            out[name + ".weight"] = gate_up_as(w)
            if expert_layout == EXPERT:
                out[name.removesuffix("gate_up_proj") + "spmd_rank.rank"] = torch.arange(tp, dtype=torch.int32)
        elif name.endswith(".experts.down_proj"):
            out[name + ".weight"] = down_as(w)
        elif name.endswith((".self_attn.k_proj.weight", ".self_attn.v_proj.weight")):
            out[name] = replicate_kv_heads(w, kv_heads(config, int(layer.group(1))), tp)
        elif name.endswith("embed_tokens.weight"):
            out[name] = w
            out[name.removesuffix("weight") + "rank_util.rank"] = torch.arange(tp, dtype=torch.int32)
        else:
            out[name] = w
    return out


def split(tensor: torch.Tensor, dim: int, tp: int, rank: int, stride: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of `tensor` along `dim`, as NxD's shard_checkpoint cuts a parameter of
    partition stride s: t·s equal chunks, of which rank r takes r, r + t, …, concatenated (s = 2
    on gate_up [E, H, 2I]: the rank's gate channels, then the same up channels)."""
    n = tensor.shape[dim] // (tp * stride)
    chunks = [tensor.narrow(dim, (rank + j * tp) * n, n) for j in range(stride)]
    return chunks[0] if stride == 1 else torch.cat(chunks, dim)


def shard(tensor: torch.Tensor, kind: str, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a tensor of the given placement."""
    if kind == REPLICATED:
        return tensor
    dim, stride = PARTITION[kind]
    return split(tensor, dim, tp, rank, stride)
