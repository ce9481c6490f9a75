"""The reader inside the tensor-parallel decode graph: each rank's sidecar shard as state of its
channel-layout experts (`moe.ChannelExperts`), read on decode steps only.

A rank's reader is the one-rank reader on its shard (`reader/shard.py`): `reference.forward` over
the rank's gate/up rows (NxD's [E, H, 2I/t] gate_up seen as [E, 2I/t, H]), its down rows [E, I/t, H]
and its sidecar shard, with k_r channels per token, then the experts' one all-reduce. Every shape
depends on (tokens, k_r, scan) only, and nothing depends on the rank: the graph traced once as rank 0
is every rank's, and a rank differs only by the shard it loads.

`ReaderShard` holds the shard as parameters (never trained): codes, scales, down_norms and coeffs
are split on dim 0 over the t ranks, so the full checkpoint holds the ranks' shards concatenated on
dim 0 (`full_state`) and `shard_checkpoint` hands each rank its own, as it does every weight; U (the
layer's whole recovery map) and the Hadamard signs are the same on every rank, replicated. NxD's
own shard_checkpoint cuts only its parallel layers' parameters (shared/notes/neuron-apis.md), so on
Neuron `neuron/compile.py` writes each rank's shard into that rank's weights file itself.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UserError
from ..spec import NO_QUANTIZATION
from ..reader import reference, shard
from ..reader.accounting import solve_rank_k
from ..spec import Reader
from ..reader.geometry import Geometry
from ..reader.sidecar import LAYER_TENSORS, SidecarLayout
from . import cpu, layout

SPLIT = ("codes", "scales", "down_norms", "coeffs")  # per rank; basis (U) and signs are whole on every rank


class ReaderShard(nn.Module):
    def __init__(self, local: SidecarLayout, tp: int, k: int, scan: int, rank: int, device=None):
        super().__init__()
        for name, (dtype, shape) in local.layer_tensors().items():
            param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
            setattr(self, name, cpu._tag(param, 0 if name in SPLIT else None, tp))
        self.signs = cpu._tag(
            nn.Parameter(torch.zeros(local.hidden_padded, dtype=torch.int8, device=device), requires_grad=False),
            None,
            tp,
        )
        self.k, self.scan, self.rank = k, scan, rank

    def forward(self, x, top_k_index, top_k_weights, gate_up_rows, down_rows, act_fn):
        """This rank's partial routed output [T, H] (the caller all-reduces it)."""
        return reference.forward(
            x,
            top_k_index,
            top_k_weights,
            gate_up_rows,
            down_rows,
            self,
            k=self.k,
            scan=self.scan,
            rank=self.rank,
            act_fn=act_fn,
        )


def attach(model, local: SidecarLayout, tp: int, k: int, scan: int, rank: int) -> None:
    """Give every channel-layout experts module of a rank model a ReaderShard (values: its shard)."""
    device = model.model.embed_tokens.weight.device
    for layer in model.model.layers:
        if not hasattr(layer.experts, "reader"):
            raise ValueError("the reader attaches to the channel expert layout's experts only")
        layer.experts.reader = ReaderShard(local, tp, k, scan, rank, device)


def layer_state(shards: list) -> dict[str, torch.Tensor]:
    """One layer's ReaderShard entries of the full checkpoint from every rank's shard (LayerSidecars,
    rank order): split tensors concatenated on dim 0, U and the signs once."""
    state = {
        name: torch.cat([getattr(s, name) for s in shards]) if name in SPLIT else getattr(shards[0], name)
        for name in LAYER_TENSORS
    }
    return {**state, "signs": shards[0].signs.clone()}  # its own tensor in each layer (safetensors refuses shared ones)


def full_state(sides: list) -> dict[str, torch.Tensor]:
    """The reader's entries of the full (parallel-layout) checkpoint, from every rank's shard file."""
    state = {}
    for i in range(sides[0].layers):
        layer = layer_state([side.layer(i) for side in sides])
        state.update({f"model.layers.{i}.experts.reader.{name}": t for name, t in layer.items()})
    return state


def check_reader(expert_layout: str, quantization: str, budget) -> None:
    """The reader runs in the channel layout's float decode graphs, at a budget."""
    if expert_layout != layout.CHANNEL:
        raise UserError(
            f"the reader runs on the {layout.CHANNEL!r} expert layout (each rank screens its own I/t "
            f"channels of every expert), not the {expert_layout!r} layout"
        )
    if quantization != NO_QUANTIZATION:
        raise UserError(
            f"the reader reads float (bf16/fp32) experts; {quantization} experts with the reader are not built"
        )
    if budget is None:
        raise UserError("the reader needs a budget: pass --budget PERCENT")


def open_shards(config, directory, tp: int, budget: float, rank: int | None = None) -> tuple[list, int, int]:
    """Every check that needs no weights: each rank's shard (`shard.open_shard`), one prep for all,
    the recovery rank, the budget per rank. Returns (shards in rank order, k per rank, recovery rank)."""
    sides = [shard.open_shard(directory, tp, r, config) for r in range(tp)]
    shard.check_shards(sides)
    rank = sides[0].layout.rank if rank is None else rank
    if not 0 <= rank <= sides[0].layout.rank:
        raise UserError(f"recovery rank {rank} outside [0, {sides[0].layout.rank}] (the sidecar's rank)")
    k = solve_rank_k(
        Geometry.from_config(config), Reader(scan=sides[0].scan, recovery_rank=rank).resolved(), budget, tp
    )
    return sides, k, rank
