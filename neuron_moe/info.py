"""Geometry and parameter counts of a port, computed on the meta device (no memory, any size)."""

from __future__ import annotations

import copy

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

# Parameter groups, by the first matching name fragment; the rest are norms and scalars.
_GROUPS = (
    ("embeddings", ("embed_tokens", "lm_head")),
    ("experts", (".experts.",)),
    ("router", (".router.",)),
    ("dense_mlp", (".mlp.",)),
    ("attention", (".self_attn.",)),
)


def parameter_group(name: str) -> str:
    for group, fragments in _GROUPS:
        if any(f in name for f in fragments):
            return group
    return "norms_and_scalars"


def geometry(config: Gemma4TextConfig) -> dict:
    types = list(config.layer_types)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
    out = {
        "hidden_size": H,
        "num_layers": config.num_hidden_layers,
        "sliding_layers": len(sliding),
        "full_layers": len(full),
        "sliding_window": config.sliding_window,
        "attention_heads": config.num_attention_heads,
        "vocab_size": config.vocab_size,
        "dense_intermediate": config.intermediate_size,
        "num_experts": E,
        "top_k": config.top_k_experts,
        "moe_intermediate": I,
        "experts_gate_up_shape": [E, 2 * I, H],
        "experts_down_shape": [E, H, I],
        "attention_k_eq_v": bool(config.attention_k_eq_v),
        "tie_word_embeddings": bool(config.tie_word_embeddings),
    }
    # head_dim and KV heads are per-layer attributes: global layers override them
    for kind, layers in (("sliding", sliding), ("full", full)):
        if layers:
            layer = config.per_layer_config[layers[0]]
            out[f"kv_heads_{kind}"] = layer.num_key_value_heads
            out[f"head_dim_{kind}"] = layer.head_dim
    return out


def meta_model(config: Gemma4TextConfig) -> Gemma4ForCausalLM:
    """The model with every tensor on the meta device: shapes and names, no memory."""
    with torch.device("meta"):
        return Gemma4ForCausalLM(copy.deepcopy(config))


def parameter_counts(config: Gemma4TextConfig) -> dict:
    model = meta_model(config)
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():  # tied weights are yielded once
        groups[parameter_group(name)] = groups.get(parameter_group(name), 0) + p.numel()
    total = sum(groups.values())
    experts = groups.get("experts", 0)
    active = total - experts + experts * config.top_k_experts // config.num_experts
    # int8 experts: one byte per weight plus an fp32 scale per output channel (per-channel symmetric)
    E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
    expert_scales = config.num_hidden_layers * E * (2 * I + H)
    return {
        "total": total,
        "groups": dict(sorted(groups.items())),
        "active_per_token": active,
        "bytes": {
            "float32": total * 4,
            "bfloat16": total * 2,
            "int8_experts_bf16_rest": (total - experts) * 2 + experts + expert_scales * 4,
        },
    }
