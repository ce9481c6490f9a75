"""Geometry and parameter counts of a port, computed on the meta device (no memory, any size)."""

from __future__ import annotations

import copy

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from .errors import UserError
from .formats import FORMATS, NONE
from .report import table
from .spec import EXPERTS

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


def _quantized_experts(config: Gemma4TextConfig, rest: int) -> dict[str, int]:
    """Bytes of the weights with the routed experts in each quantized format (formats.FORMATS:
    `Format.nbytes`, scales included, as NxD's expert-fused layers hold them: gate_up [E, H, 2I] and
    down [E, I, H], the input dim first after E) and `rest` parameters in bf16; a format whose groups
    do not divide the experts' input dims has no row."""
    E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
    out = {}
    for name, fmt in FORMATS.items():
        try:
            experts = fmt.nbytes((E, H, 2 * I)) + fmt.nbytes((E, I, H))
        except UserError:
            continue
        if fmt is not NONE:
            out[f"{name}_experts_bf16_rest"] = rest * 2 + config.num_hidden_layers * experts
    return out


def parameter_counts(config: Gemma4TextConfig) -> dict:
    model = meta_model(config)
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():  # tied weights are yielded once
        groups[parameter_group(name)] = groups.get(parameter_group(name), 0) + p.numel()
    total = sum(groups.values())
    experts = groups.get("experts", 0)
    active = total - experts + experts * config.top_k_experts // config.num_experts
    return {
        "total": total,
        "groups": dict(sorted(groups.items())),
        "active_per_token": active,
        "bytes": {"float32": total * 4, "bfloat16": total * 2, **_quantized_experts(config, total - experts)},
    }


def _experts_per_token(config: Gemma4TextConfig) -> dict[str, int]:
    """Experts each implementation reads and computes per layer for one decoded token (batch 1): those
    over the model's own weights that need nothing attached, the graphs' first, then HF's eager loop
    (only the experts some token picked, k at batch 1, but with data-dependent shapes: the CPU
    reference, never a graph)."""
    costed = sorted((e for e in EXPERTS.values() if e.needs is None), key=lambda e: not e.graphs)
    return {e.name: e.experts_read(config) for e in costed}


def per_token_costs(config: Gemma4TextConfig, dtype: torch.dtype) -> dict:
    """Weight bytes read and FLOPs per decoded token (batch 1) for each experts implementation,
    from the geometry. Attention over the KV cache is left out: it depends on the context length."""
    params = parameter_counts(config)
    nbytes = torch.finfo(dtype).bits // 8
    layers, H = config.num_hidden_layers, config.hidden_size
    expert_params = 3 * config.moe_intermediate_size * H  # gate_up [2I, H] + down [H, I]
    # Everything but the experts is read every step; an untied embedding table is only looked up
    # (one row), a tied one is also the LM head and is read whole.
    embed = config.vocab_size * H
    rest = params["total"] - params["groups"]["experts"]
    rest_read = rest if config.tie_word_embeddings else rest - embed + H
    # matmul weights of the rest (2 FLOPs each): everything but norms, scalars and the lookup
    rest_matmul = sum(n for g, n in params["groups"].items() if g not in ("experts", "norms_and_scalars", "embeddings"))
    rest_matmul += embed  # the LM head, tied or not
    rows = []
    for name, experts in _experts_per_token(config).items():
        layer_bytes = experts * expert_params * nbytes
        rows.append(
            {
                "experts": name,
                "experts_read_per_layer": experts,
                "expert_bytes_per_layer": layer_bytes,
                "expert_bytes_per_token": layers * layer_bytes,
                "weight_bytes_per_token": layers * layer_bytes + rest_read * nbytes,
                "flops_per_token": 2 * (layers * experts * expert_params + rest_matmul),
            }
        )
    dense = max(row["expert_bytes_per_layer"] for row in rows)  # every expert: dense_masked's
    for row in rows:
        row["expert_bytes_reduction"] = dense / row["expert_bytes_per_layer"]
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "batch": 1,
        # gathering k slices per token costs batch * k expert reads per step, DenseExperts E:
        # selective reads less while batch * top_k < num_experts
        "selective_below_batch": -(-config.num_experts // config.top_k_experts),
        "implementations": rows,
    }


def info_report(port, per_token: bool = False) -> dict:
    """`neuron-moe info`: geometry and parameter counts, and with `per_token` the costs per decoded token."""
    report = {"model": port.name, "geometry": geometry(port.config), "parameters": parameter_counts(port.config)}
    if per_token:
        report["per_token"] = per_token_costs(port.config, port.dtype)
    return report


def render_info(report: dict, description: str) -> str:
    params = report["parameters"]
    rows = [
        {"what": g, "count": n, "B": n / 1e9, "share": f"{100 * n / params['total']:.1f}%"}
        for g, n in params["groups"].items()
    ]
    rows += [
        {"what": "total", "count": params["total"], "B": params["total"] / 1e9, "share": "100.0%"},
        {
            "what": "active per token",
            "count": params["active_per_token"],
            "B": params["active_per_token"] / 1e9,
            "share": f"{100 * params['active_per_token'] / params['total']:.1f}%",
        },
    ]
    unit, scale = ("GiB", 2**30) if params["bytes"]["bfloat16"] >= 2**30 else ("MiB", 2**20)
    lines = [
        f"{report['model']}: {description}\n",
        table(
            [{"field": k, "value": v} for k, v in report["geometry"].items()], [("field", "geometry"), ("value", "")]
        ),
        "",
        table(rows, [("what", "parameters"), ("count", "count"), ("B", "billions"), ("share", "share")]),
        "",
        table(
            [{"dtype": k, "size": v / scale} for k, v in params["bytes"].items()],
            [("dtype", "weights as"), ("size", unit, "{:.2f}")],
        ),
    ]
    if "per_token" in report:
        lines.append(_render_per_token(report["per_token"], report["geometry"]))
    return "\n".join(lines)


def _render_per_token(costs: dict, geometry: dict) -> str:
    rows = [
        {
            "experts": r["experts"],
            "read": r["experts_read_per_layer"],
            "mb_layer": r["expert_bytes_per_layer"] / 1e6,
            "gb_experts": r["expert_bytes_per_token"] / 1e9,
            "gb_all": r["weight_bytes_per_token"] / 1e9,
            "gflop": r["flops_per_token"] / 1e9,
            "x": f"{r['expert_bytes_reduction']:.0f}x",
        }
        for r in costs["implementations"]
    ]
    return "\n".join(
        [
            f"\nper decoded token (batch 1, weights in {costs['dtype']}; attention over the KV cache not counted)\n",
            table(
                rows,
                [
                    ("experts", "experts impl"),
                    ("read", "experts read/layer"),
                    ("mb_layer", "expert MB/layer", "{:.1f}"),
                    ("gb_experts", "expert GB/token", "{:.3f}"),
                    ("gb_all", "all weights GB/token", "{:.3f}"),
                    ("gflop", "GFLOP/token", "{:.3f}"),
                    ("x", "expert bytes vs dense_masked"),
                ],
            ),
            f"\nselective reads batch x {geometry['top_k']} experts per layer and step, dense_masked "
            f"{geometry['num_experts']}: selective reads less below batch {costs['selective_below_batch']}",
        ]
    )
