"""Who owns what at tensor-parallel degree t: the one definition the CPU and NxD backends and
the memory planner share.

Placements are those of NxD's parallel layers (weights stored [out, in], as nn.Linear):

  column      split on dim 0, the output features   (ColumnParallelLinear; no collective after)
  row         split on dim 1, the input features    (RowParallelLinear; all-reduce after)
  vocab       embedding rows split on dim 0         (ParallelEmbedding across the vocabulary)
  replicated  whole on every rank                   (norms, router, scalars)

Per decoder layer:
  attention   q_proj column (heads split), o_proj row; k_proj / v_proj column after the KV heads
              are replicated up to t when there are fewer than t (the full-size port's global layers
              have 2 KV heads, its sliding layers 8; the tiny port's 2 and 4). Rank r then holds KV
              head r·kv/t, the one its query heads r·h/t … (r+1)·h/t − 1 read.
  dense MLP   gate_proj / up_proj column, down_proj row.
  experts     gate_up_proj [E, 2I, H] is one column-parallel linear [E·2I, H]; down_proj [E, H, I]
              one row-parallel linear [H, E·I]. Both are ordered expert-major, so rank r holds
              experts r·E/t … (r+1)·E/t − 1 whole. The router is replicated; each rank scatters the
              dense [T, E] router weights to its own [T, E/t] slice, which must use the rank as a
              tensor (SPMDRank), never as a Python int: ModelBuilder traces rank 0 only.
  spmd_rank   a [1] int32 parameter per MoE block (`<...>.experts.spmd_rank.rank`), `arange(t)` in the
              checkpoint, split on dim 0.
Embeddings are vocab-parallel (their row offset from an SPMDRank, `embed_tokens.rank_util`) and
lm_head column-parallel over the vocabulary (logits gathered). They are tied in the checkpoint but
two tensors on the device: each parallel layer loads its own.
"""

from __future__ import annotations

import re

import torch
from transformers import Gemma4TextConfig

from ..errors import UserError

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"
SPLIT_DIM = {COLUMN: 0, VOCAB: 0, ROW: 1}
TP_DEGREES = (1, 2, 4, 8, 24)  # what inf2 supports

# Parameter-name suffix (in the parallel layout's names) -> placement; everything else is replicated.
_RULES = (
    (".self_attn.q_proj.weight", COLUMN),
    (".self_attn.k_proj.weight", COLUMN),
    (".self_attn.v_proj.weight", COLUMN),
    (".self_attn.o_proj.weight", ROW),
    (".mlp.gate_proj.weight", COLUMN),
    (".mlp.up_proj.weight", COLUMN),
    (".mlp.down_proj.weight", ROW),
    (".experts.gate_up_proj.weight", COLUMN),
    (".experts.down_proj.weight", ROW),
    (".spmd_rank.rank", COLUMN),
    (".rank_util.rank", COLUMN),
    ("embed_tokens.weight", VOCAB),
    ("lm_head.weight", COLUMN),
)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class LayoutError(UserError):
    pass


def placement(name: str) -> str:
    """The placement of a parameter, by its name in the parallel layout (see `parallel_state_dict`)."""
    for suffix, kind in _RULES:
        if ("." + name).endswith(suffix):
            return kind
    return REPLICATED


def kv_heads(config: Gemma4TextConfig, layer: int) -> int:
    return config.per_layer_config[layer].num_key_value_heads


def kv_heads_per_rank(config: Gemma4TextConfig, layer: int, tp: int) -> int:
    return max(kv_heads(config, layer) // tp, 1)


def check_degree(config: Gemma4TextConfig, tp: int) -> None:
    """Raise LayoutError naming every dimension that does not split over `tp` ranks."""
    if tp not in TP_DEGREES:
        raise LayoutError(f"TP degree {tp} is not one of {TP_DEGREES} (the degrees inf2 supports)")
    problems = []
    for what, n in (("attention heads", config.num_attention_heads), ("experts", config.num_experts),
                    ("dense intermediate size", config.intermediate_size), ("vocab size", config.vocab_size)):
        if n % tp:
            problems.append(f"{n} {what} do not split over {tp} ranks")
    for kv in sorted({kv_heads(config, i) for i in range(config.num_hidden_layers)}):
        if kv % tp and tp % kv:
            problems.append(f"{kv} KV heads neither split over nor replicate evenly to {tp} ranks")
    if problems:
        raise LayoutError(f"TP {tp}: " + "; ".join(problems))


def expert_range(config: Gemma4TextConfig, tp: int, rank: int) -> range:
    n = config.num_experts // tp
    return range(rank * n, (rank + 1) * n)


def gate_up_2d(w: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] -> [E·2I, H]: row e·2I + j is expert e's output channel j (gate rows first)."""
    E, O, H = w.shape
    return w.reshape(E * O, H)


def down_2d(w: torch.Tensor) -> torch.Tensor:
    """[E, H, I] -> [H, E·I]: column e·I + i is expert e's input channel i."""
    E, H, I = w.shape
    return w.permute(1, 0, 2).reshape(H, E * I)


def replicate_kv_heads(w: torch.Tensor, heads: int, tp: int) -> torch.Tensor:
    """[heads·d, H] -> [max(heads, tp)·d, H], each head repeated tp/heads times when heads < tp."""
    if heads >= tp:
        return w
    d = w.shape[0] // heads
    return w.reshape(heads, d, -1).repeat_interleave(tp // heads, dim=0).reshape(tp * d, -1)


def parallel_state_dict(state: dict[str, torch.Tensor], config: Gemma4TextConfig, tp: int) -> dict[str, torch.Tensor]:
    """An HF state dict in the parallel layout, before any slicing (NxD's preshard step).

    Experts become their 2-D linear weights under `<...>.experts.{gate_up_proj,down_proj}.weight`,
    KV projections are replicated up to t heads, each MoE block gains `<...>.experts.spmd_rank.rank` and
    the embedding `<...>.rank_util.rank`, both arange(t); every other tensor keeps its name and
    value. The input is never modified.
    """
    check_degree(config, tp)
    out = {}
    for name, w in state.items():
        layer = _LAYER.search(name)
        if name.endswith(".experts.gate_up_proj"):
            out[name + ".weight"] = gate_up_2d(w)
            out[name.removesuffix("gate_up_proj") + "spmd_rank.rank"] = torch.arange(tp, dtype=torch.int32)
        elif name.endswith(".experts.down_proj"):
            out[name + ".weight"] = down_2d(w)
        elif name.endswith((".self_attn.k_proj.weight", ".self_attn.v_proj.weight")):
            out[name] = replicate_kv_heads(w, kv_heads(config, int(layer.group(1))), tp)
        elif name.endswith("embed_tokens.weight"):
            out[name] = w
            out[name.removesuffix("weight") + "rank_util.rank"] = torch.arange(tp, dtype=torch.int32)
        else:
            out[name] = w
    return out


def split(tensor: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s chunk of `tensor` along `dim`: t contiguous equal chunks, as NxD's
    shard_checkpoint cuts a parameter of partition stride 1."""
    n = tensor.shape[dim] // tp
    return tensor.narrow(dim, rank * n, n)


def shard(tensor: torch.Tensor, kind: str, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a tensor of the given placement."""
    return tensor if kind == REPLICATED else split(tensor, SPLIT_DIM[kind], tp, rank)
