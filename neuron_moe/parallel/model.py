"""The full Gemma-4 MoE model as a rank module: transformers' Gemma4ForCausalLM with each rank's
share of every weight (`layout.py`), so the static decoder (`static/decoder.py`) wraps it unchanged.

HF's modules are kept where a rank holds them whole (norms, router, rotary embedding, layer scalar)
and where their code is already per-head (attention: it reads the head counts from its config).
The rank's config has h/t query heads, max(kv/t, 1) KV heads per layer and I/t dense intermediate
channels; the linears that hold a share are replaced by parallel layers of `layers` (`parallel.cpu` or `parallel.nxd`):

  attention   q/k/v_proj ColumnParallelLinear, o_proj RowParallelLinear (all-reduce)
  dense MLP   gate/up_proj ColumnParallelLinear, down_proj RowParallelLinear (all-reduce)
  experts     `moe.parallel_experts`: in the channel layout every expert's I/t channels (one
              all-reduce after the router-weighted sum), in the expert layout the rank's experts
              whole (router weights scattered by rank)
  embedding   ParallelEmbedding over the vocabulary (× HF's embed scale), all-reduce
  lm_head     ColumnParallelLinear over the vocabulary, gather_output: every rank has all logits,
              so every rank takes the same greedy token

The skeleton is built on the meta device (HF would otherwise allocate all E experts and the full
vocabulary once per rank), then materialised empty: every value comes from the rank's shard.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Gemma4ForCausalLM, Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from . import layout
from .moe import parallel_experts


def rank_config(config: Gemma4TextConfig, tp: int, expert_layout: str = layout.DEFAULT_EXPERT_LAYOUT) -> Gemma4TextConfig:
    """The config one rank's HF modules see: its heads, KV heads and dense intermediate size."""
    layout.check_degree(config, tp, expert_layout)
    fields = config.to_dict()
    fields["num_attention_heads"] = config.num_attention_heads // tp
    fields["num_key_value_heads"] = max(fields["num_key_value_heads"] // tp, 1)
    fields["intermediate_size"] = config.intermediate_size // tp
    fields["per_layer_config"] = {
        i: dict(o, num_key_value_heads=max(o["num_key_value_heads"] // tp, 1)) if "num_key_value_heads" in o else o
        for i, o in fields.get("per_layer_config", {}).items()}
    local = Gemma4TextConfig(**fields)
    local._attn_implementation = "eager"  # what build_model uses: the reference's attention
    return local


def _scaled(embedding: nn.Module, scale: torch.Tensor) -> nn.Module:
    """HF's Gemma4TextScaledWordEmbedding multiplies by sqrt(H) rounded to the weight dtype; a hook
    keeps the parallel embedding's own parameter names (`embed_tokens.weight`, `.rank_util.rank`)."""
    embedding.register_forward_hook(lambda module, args, out: out * scale.to(out.dtype))
    return embedding


def rank_model(config: Gemma4TextConfig, tp: int, layers, *, expert_layout: str = layout.DEFAULT_EXPERT_LAYOUT,
               int8: bool = False, scatter: str = "spmd", dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> Gemma4ForCausalLM:
    """One rank's Gemma4ForCausalLM over `layers` (`parallel.cpu` or `parallel.nxd`); its state dict
    names are those of `layout.parallel_state_dict` in `expert_layout` (int8: of
    `experts.int8.quantize_experts` of it). `device="meta"` builds it without memory (for plans and
    shape checks)."""
    local = rank_config(config, tp, expert_layout)
    H, V = config.hidden_size, config.vocab_size
    with torch.device("meta"):
        model = Gemma4ForCausalLM(local)
    if device != "meta":
        model.to_empty(device=device)
    model.to(dtype)
    with torch.device(device):
        for i, layer in enumerate(model.model.layers):
            attn, mlp, head_dim = layer.self_attn, layer.mlp, local.per_layer_config[i].head_dim
            kv = max(layout.kv_heads(config, i), tp) * head_dim  # replicated up to t heads, then split
            attn.q_proj = layers.ColumnParallelLinear(H, config.num_attention_heads * head_dim, tp=tp, dtype=dtype)
            attn.k_proj = layers.ColumnParallelLinear(H, kv, tp=tp, dtype=dtype)
            if attn.v_proj is not None:  # k_eq_v global layers have none: V is K before its norm
                attn.v_proj = layers.ColumnParallelLinear(H, kv, tp=tp, dtype=dtype)
            attn.o_proj = layers.RowParallelLinear(config.num_attention_heads * head_dim, H, tp=tp, dtype=dtype)
            mlp.gate_proj = layers.ColumnParallelLinear(H, config.intermediate_size, tp=tp, dtype=dtype)
            mlp.up_proj = layers.ColumnParallelLinear(H, config.intermediate_size, tp=tp, dtype=dtype)
            mlp.down_proj = layers.RowParallelLinear(config.intermediate_size, H, tp=tp, dtype=dtype)
            layer.experts = parallel_experts(model.config, tp, layers, expert_layout, int8=int8, scatter=scatter,
                                             dtype=dtype)
        scale = torch.tensor(H**0.5)
        model.model.embed_tokens = _scaled(layers.ParallelEmbedding(V, H, tp=tp, dtype=dtype), scale)
        model.lm_head = layers.ColumnParallelLinear(H, V, tp=tp, dtype=dtype, gather_output=True)
        model.model.rotary_emb = Gemma4TextRotaryEmbedding(local)  # its inv_freq buffers are computed, not loaded
    return model.eval()


def materialize(model: Gemma4ForCausalLM, config: Gemma4TextConfig, tp: int,
                expert_layout: str = layout.DEFAULT_EXPERT_LAYOUT, device: str = "cpu") -> Gemma4ForCausalLM:
    """A rank model built on the meta device, allocated on `device` (uninitialised: every value
    then comes from the rank's shard, `load_state_dict`), with what `rank_model` computes rather
    than loads computed again there: the rotary embedding's buffers and the embedding scale."""
    model.to_empty(device=device)
    embedding = model.model.embed_tokens
    embedding._forward_hooks.clear()  # the one hook `_scaled` registered, over a meta tensor
    _scaled(embedding, torch.tensor(config.hidden_size**0.5, device=device))
    model.model.rotary_emb = Gemma4TextRotaryEmbedding(rank_config(config, tp, expert_layout)).to(device)
    return model
