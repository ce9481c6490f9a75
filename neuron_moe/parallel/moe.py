"""The MoE block of one decoder layer as a rank module: HF's router, replicated, and this rank's
share of the experts in one of the two expert layouts (`layout.py`).

Written once over a library of parallel layers, `layers`: `parallel.cpu` or `parallel.nxd` (the same names).
Both experts modules have transformers' experts signature, forward(x, top_k_index, top_k_weights),
so the full-model rank module (`parallel/model.py`) puts them in place of HF's `Gemma4TextExperts`.

`ChannelExperts` (the channel layout, the default): every expert's I/t channels of this rank, as
NxD's expert-fused layers. Nothing depends on the rank: the router's top-k is used whole, and one
all-reduce sums the ranks' router-weighted partial outputs. Two fixed-shape computations:
  all experts  every token through all E experts' channels (DenseExperts math on the shard), the
               outputs weighted by the dense [T, E] router matrix;
  gather       each token gathers its k experts' channel slices from the [E, …] parameters
               (`weight[expert_indices]`, [T·k, …]: NxD's selective loading), weighted by its k
               router weights.
Which one a graph computes follows the experts implementation the graph was built with (its view's
experts config, `experts/view.py`; `COMPUTE` below): a graph built with `selective` (the port's
decode_experts) gathers while its T·k < E (`spec.Experts.gathers`, NxD's rule), fixed per graph by
its batch size; `dense_masked` (the prefill graphs) computes all experts. A decode graph built with
`channel_reader` reads through the rank's reader instead (`reader.py`: its sidecar shard): each
token's k_r channels of the rank's I/t, fixed shapes (tokens, k_r, scan), the same one all-reduce after.

`WholeExperts` (the expert layout, as expert parallelism places them): the rank's E/t experts whole,
as one column-parallel and one row-parallel linear. Every rank computes the full dense [T, E] router
weights, then keeps the columns of its own experts; with `scatter="spmd"` that slice is indexed by
the SPMDRank tensor (right in a graph traced once on rank 0), with `scatter="naive"` by the
Python-int process-group rank (a wrong model, kept as a test: in that graph every rank weights its
experts with experts 0…E/t−1's router weights). The router weight multiplies the activation before
down, so down is one matmul over the rank's experts and the all-reduce after it sums over all
experts. It computes all its experts in every graph.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

from .. import spec
from ..errors import UserError
from ..experts.dense_masked import router_weight_matrix
from ..formats import NONE, Format
from . import layout


class ChannelExperts(nn.Module):
    def __init__(self, config, tp: int, layers, fmt: Format = NONE, dtype=torch.float32):
        super().__init__()
        E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
        # [E, H, 2I/t]: gate, then up; [E, I/t, H]
        self.gate_up_proj = layers.ExpertFusedColumnParallelLinear(E, H, 2 * I, tp=tp, dtype=dtype, fmt=fmt, stride=2)
        self.down_proj = layers.ExpertFusedRowParallelLinear(E, I, H, tp=tp, dtype=dtype, fmt=fmt)
        self.config = config  # the model's; a graph's view gives it one naming the graph's experts implementation
        self.tp, self.layers, self.num_experts = tp, layers, E
        self.act_fn = ACT2FN[config.hidden_activation]
        self.reader = None  # a reader.ReaderShard: decode graphs built with the reader read through it

    def _mlp(self, x: torch.Tensor, expert_indices: torch.Tensor | None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, expert_indices=expert_indices).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up, expert_indices=expert_indices)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], top-k [T, k] -> [T, H], summed over all ranks' channels, computed as the experts
        implementation of the graph this module is in asks (`COMPUTE`)."""
        experts = spec.dispatched(self.config)
        if experts not in COMPUTE:
            raise UserError(
                f"the channel layout's rank module runs {', '.join(e.name for e in COMPUTE)}, not {experts.name!r}"
            )
        out = COMPUTE[experts](self, x, top_k_index, top_k_weights)
        return self.layers.reduce_from_tensor_model_parallel_region(out, tp=self.tp)

    def every_expert(self, x, top_k_index, top_k_weights):
        """Every token through all E experts' channels, weighted by the dense [T, E] router matrix."""
        T, H = x.shape
        out = self._mlp(x.view(1, 1, T, H), None)[:, 0]  # [E, T, H]
        weights = router_weight_matrix(top_k_index, top_k_weights, self.num_experts)
        return torch.einsum("eth,te->th", out, weights.to(out.dtype))

    def routed(self, x, top_k_index, top_k_weights):
        """Each token's k experts' channels gathered while T·k < E, else every expert."""
        (T, H), k = x.shape, top_k_index.shape[1]
        if not spec.SELECTIVE.gathers(self.config, T):
            return self.every_expert(x, top_k_index, top_k_weights)
        # the expert-fused layers take [E', 1, tokens, in]
        out = self._mlp(x[:, None].expand(T, k, H).reshape(T * k, 1, 1, H), top_k_index.reshape(-1))
        return torch.einsum("tkh,tk->th", out.view(T, k, H), top_k_weights.to(out.dtype))

    def read(self, x, top_k_index, top_k_weights):
        """The rank's reader on its shard: gate/up rows are the columns of [E, H, 2I/t]."""
        if self.reader is None:
            raise UserError(
                "a graph built with the reader needs a reader shard in every experts module (parallel.reader.attach)"
            )
        return self.reader(
            x, top_k_index, top_k_weights, self.gate_up_proj.weight.mT, self.down_proj.weight, self.act_fn
        )


# What the channel layout's rank module computes in a graph built with each experts implementation (a
# rank model outside any graph runs its own, dense_masked: `rank_model`; HF's eager, what a standalone
# block over an HF model's config runs, computes the same sum over all its experts).
COMPUTE = {
    spec.EAGER: ChannelExperts.every_expert,
    spec.DENSE_MASKED: ChannelExperts.every_expert,
    spec.SELECTIVE: ChannelExperts.routed,
    spec.CHANNEL_READER: ChannelExperts.read,
}


class WholeExperts(nn.Module):
    def __init__(self, config, tp: int, layers, fmt: Format = NONE, scatter: str = spec.SPMD, dtype=torch.float32):
        super().__init__()
        if scatter not in spec.SCATTERS:
            raise ValueError(f"scatter must be one of {spec.SCATTERS}, got {scatter!r}")
        E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = layers.ColumnParallelLinear(
            H, E * 2 * I, tp=tp, dtype=dtype, fmt=fmt
        )  # this rank's experts × 2I
        self.down_proj = layers.RowParallelLinear(
            E * I, H, tp=tp, dtype=dtype, fmt=fmt
        )  # columns: this rank's experts × I
        self.spmd_rank = layers.SPMDRank(tp)
        self.config = config  # as ChannelExperts': every graph computes all its experts, whatever it names
        self.tp, self.scatter, self.layers = tp, scatter, layers
        self.num_experts, self.local_experts, self.intermediate = E, E // tp, I
        self.act_fn = ACT2FN[config.hidden_activation]

    def local_weights(self, dense: torch.Tensor) -> torch.Tensor:
        """Dense router weights [T, E] -> this rank's columns [T, E/t]."""
        if self.scatter == spec.SPMD:
            return self.layers.scatter_to_process_group_spmd(
                dense, dense.dim() - 1, self.spmd_rank.get_rank(), tp=self.tp
            )
        return self.layers.scatter_to_tensor_model_parallel_region(dense, tp=self.tp)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], top-k [T, k] -> [T, H], summed over all ranks' experts."""
        local = self.local_weights(router_weight_matrix(top_k_index, top_k_weights, self.num_experts))
        x = x[None]  # NxD's quantized layers broadcast their scale as [1, 1, out]: 3-D inputs
        gate_up = self.gate_up_proj(x).unflatten(-1, (self.local_experts, 2 * self.intermediate))
        gate, up = gate_up.chunk(2, dim=-1)
        act = self.act_fn(gate) * up * local[None].unsqueeze(-1).to(x.dtype)
        return self.down_proj(act.flatten(-2))[0]


def parallel_experts(
    config,
    tp: int,
    layers,
    expert_layout: str = layout.DEFAULT_EXPERT_LAYOUT,
    *,
    fmt: Format = NONE,
    scatter: str = spec.SPMD,
    dtype=torch.float32,
) -> nn.Module:
    """This rank's experts in `expert_layout`, their weights in `fmt`. `config` is the model's own (a
    graph's view replaces it with one naming the graph's experts implementation). `scatter` exists only
    in the expert layout."""
    if layout.check_layout_name(expert_layout) == layout.CHANNEL:
        if scatter != spec.SPMD:
            raise UserError(f"scatter {scatter!r} is the expert layout's: the channel layout slices nothing by rank")
        return ChannelExperts(config, tp, layers, fmt, dtype)
    return WholeExperts(config, tp, layers, fmt, scatter, dtype)


class ParallelMoE(nn.Module):
    """forward(router_input, experts_input), both [B, S, H]: the residual (the router normalises
    it itself) and pre_feedforward_layernorm_2 of it, as in Gemma4TextDecoderLayer."""

    def __init__(self, config, tp: int, layers, **options):
        """`options`: `parallel_experts`' (expert_layout, fmt, scatter, dtype)."""
        super().__init__()
        self.router = Gemma4TextRouter(config).to(options.get("dtype", torch.float32))
        self.experts = parallel_experts(config, tp, layers, **options)

    def local_router_weights(self, router_input: torch.Tensor) -> torch.Tensor:
        """The expert layout's scatter of the dense router weights to this rank's experts."""
        _, top_k_weights, top_k_index = self.router(router_input.reshape(-1, router_input.shape[-1]))
        dense = router_weight_matrix(top_k_index, top_k_weights, self.experts.num_experts)
        return self.experts.local_weights(dense).reshape(*router_input.shape[:-1], -1)

    def forward(self, router_input: torch.Tensor, experts_input: torch.Tensor) -> torch.Tensor:
        _, top_k_weights, top_k_index = self.router(router_input.reshape(-1, router_input.shape[-1]))
        out = self.experts(experts_input.reshape(-1, experts_input.shape[-1]), top_k_index, top_k_weights)
        return out.view_as(experts_input)
