"""DenseExperts: every expert computed with fixed shapes, weighted by a dense router matrix.

HF's eager experts loop runs only the experts that some token picked (`nonzero` over a
one-hot mask, then a Python loop): its shapes depend on the data, so it cannot be traced
into one static graph. Here every token goes through every expert and the results are
combined with a dense [T, E] weight matrix that is zero off each token's top-k. The shapes
depend only on T, so torch.export / ModelBuilder see one graph; the price is E/k times the
expert FLOPs, which is what prefill on an accelerator pays anyway (NxD's "all experts" mode).

Signature is transformers' experts-interface contract: called as `forward(self, ...)` on a
`Gemma4TextExperts` module (gate_up_proj [E, 2I, H], down_proj [E, H, I]).
"""

from __future__ import annotations

import torch


def router_weight_matrix(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] indices and weights -> dense [T, E] weights, zero for experts a token did not pick.

    `scatter` writes k values per row: a fixed-shape op, unlike a data-dependent index_add.
    """
    dense = top_k_weights.new_zeros(top_k_weights.shape[0], num_experts)
    return dense.scatter(1, top_k_index, top_k_weights)


def dense_masked_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    return dense_masked(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self.act_fn)


def dense_masked(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn,
) -> torch.Tensor:
    """Every expert for every token over the weights given (HF's [E, 2I, H] and [E, H, I])."""
    weights = router_weight_matrix(top_k_index, top_k_weights, gate_up_proj.shape[0])  # [T, E]
    gate_up = torch.einsum("th,eoh->teo", hidden_states, gate_up_proj)  # [T, E, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = act_fn(gate) * up  # [T, E, I]
    out = torch.einsum("tei,ehi->teh", act, down_proj)  # [T, E, H]
    return torch.einsum("teh,te->th", out, weights.to(out.dtype))
