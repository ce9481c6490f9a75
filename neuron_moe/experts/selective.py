"""Selective experts: each token gathers the weights of its own top-k experts (fixed shapes).

For token generation a step has a handful of tokens, each touching k of E experts. Computing
every expert (DenseExperts) reads all E experts' weights per step; gathering k slices per token
reads only k. The gather is `index_select` with T*k indices: its output shape is [T, k, ...]
whatever the router picked, so the graph stays static (NxD calls this "selective loading").
Once T*k reaches E the gathered copy (T*k expert matrices) outgrows the weights themselves, so a
graph of that many tokens computes every expert instead (DenseExperts) — NxD's rule, the same as
the TP channel layout's (`spec.Experts.gathers`); T is fixed per graph, so the choice is made
once, when the graph is traced. Prefill graphs stay on DenseExperts; the port's [static] table
says which graph uses which.

Signature is transformers' experts-interface contract, on a `Gemma4TextExperts` module
(gate_up_proj [E, 2I, H], down_proj [E, H, I]).
"""

from __future__ import annotations

import torch

from .. import spec
from .dense_masked import dense_masked_forward


def selective_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    if not spec.SELECTIVE.gathers(self.config, top_k_index.shape[0]):  # gathering would read more than the weights
        return dense_masked_forward(self, hidden_states, top_k_index, top_k_weights)
    return gather_forward(self, hidden_states, top_k_index, top_k_weights)


def gather_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    gate_up = self.gate_up_proj.index_select(0, flat).view(tokens, k, *self.gate_up_proj.shape[1:])  # [T, k, 2I, H]
    down = self.down_proj.index_select(0, flat).view(tokens, k, *self.down_proj.shape[1:])  # [T, k, H, I]
    gate, up = torch.einsum("th,tkoh->tko", hidden_states, gate_up).chunk(2, dim=-1)
    act = self.act_fn(gate) * up  # [T, k, I]
    out = torch.einsum("tki,tkhi->tkh", act, down)  # [T, k, H]
    return torch.einsum("tkh,tk->th", out, top_k_weights.to(out.dtype))
