"""The MoE block of one decoder layer as a rank module: HF's router, replicated, and this rank's
experts as one column-parallel and one row-parallel linear (`layout.py`).

Written once over a parallel-layer backend (`parallel.cpu` or `parallel.nxd`, the same names).
Every rank computes the full dense [T, E] router weights, then keeps the columns of its own
experts; with `scatter="spmd"` that slice is indexed by the SPMDRank tensor (right in a graph
traced once on rank 0), with `scatter="naive"` by the Python-int process-group rank (the seed
port's bug: in that graph every rank weights its experts with experts 0…E/t−1's router weights).
The router weight multiplies the activation before down, so down is one matmul over the rank's
experts and the all-reduce after it sums over all experts.

`ParallelExperts` has transformers' experts signature, forward(x, top_k_index, top_k_weights), so
the full-model rank module (`parallel/model.py`) puts it in place of HF's `Gemma4TextExperts`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

from ..experts.dense_masked import router_weight_matrix

SCATTERS = ("spmd", "naive")


class ParallelExperts(nn.Module):
    def __init__(self, config, tp: int, backend, int8: bool = False, scatter: str = "spmd", dtype=torch.float32):
        super().__init__()
        if scatter not in SCATTERS:
            raise ValueError(f"scatter must be one of {SCATTERS}, got {scatter!r}")
        E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
        column = backend.QuantizedColumnParallel if int8 else backend.ColumnParallelLinear
        row = backend.QuantizedRowParallel if int8 else backend.RowParallelLinear
        self.gate_up_proj = column(H, E * 2 * I, tp=tp, dtype=dtype)  # rows: this rank's experts × 2I
        self.down_proj = row(E * I, H, tp=tp, dtype=dtype)  # columns: this rank's experts × I
        self.spmd_rank = backend.SPMDRank(tp)
        self.tp, self.scatter, self.backend = tp, scatter, backend
        self.num_experts, self.local_experts, self.intermediate = E, E // tp, I
        self.act_fn = ACT2FN[config.hidden_activation]

    def local_weights(self, dense: torch.Tensor) -> torch.Tensor:
        """Dense router weights [T, E] -> this rank's columns [T, E/t]."""
        if self.scatter == "spmd":
            return self.backend.scatter_to_process_group_spmd(dense, dense.dim() - 1, self.spmd_rank.get_rank(), tp=self.tp)
        return self.backend.scatter_to_tensor_model_parallel_region(dense, tp=self.tp)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], top-k [T, k] -> [T, H], summed over all ranks' experts."""
        local = self.local_weights(router_weight_matrix(top_k_index, top_k_weights, self.num_experts))
        x = x[None]  # NxD's quantized layers broadcast their scale as [1, 1, out]: 3-D inputs
        gate_up = self.gate_up_proj(x).unflatten(-1, (self.local_experts, 2 * self.intermediate))
        gate, up = gate_up.chunk(2, dim=-1)
        act = self.act_fn(gate) * up * local[None].unsqueeze(-1).to(x.dtype)
        return self.down_proj(act.flatten(-2))[0]


class ParallelMoE(nn.Module):
    """forward(router_input, experts_input), both [B, S, H]: the residual (the router normalises
    it itself) and pre_feedforward_layernorm_2 of it, as in Gemma4TextDecoderLayer."""

    def __init__(self, config, tp: int, backend, *, int8: bool = False, scatter: str = "spmd", dtype=torch.float32):
        super().__init__()
        self.router = Gemma4TextRouter(config).to(dtype)
        self.experts = ParallelExperts(config, tp, backend, int8, scatter, dtype)

    def local_router_weights(self, router_input: torch.Tensor) -> torch.Tensor:
        _, top_k_weights, top_k_index = self.router(router_input.reshape(-1, router_input.shape[-1]))
        dense = router_weight_matrix(top_k_index, top_k_weights, self.experts.num_experts)
        return self.experts.local_weights(dense).reshape(*router_input.shape[:-1], -1)

    def forward(self, router_input: torch.Tensor, experts_input: torch.Tensor) -> torch.Tensor:
        _, top_k_weights, top_k_index = self.router(router_input.reshape(-1, router_input.shape[-1]))
        out = self.experts(experts_input.reshape(-1, experts_input.shape[-1]), top_k_index, top_k_weights)
        return out.view_as(experts_input)
