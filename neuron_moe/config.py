"""What counts as a Gemma-4 MoE text config: the one check shared by ports and checkpoints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import Gemma4TextConfig

from .errors import UserError
from .report import read_json_object

# Keys `Gemma4TextConfig.__post_init__` consumes (popped into per-layer overrides), so they are
# valid input but not dataclass fields.
_POST_INIT_KEYS = {"global_head_dim", "num_global_key_value_heads"}
_MOE_KEYS = ("num_experts", "top_k_experts", "moe_intermediate_size")
# Sizes that shape tensors or loops: (least, most). Checked before anything is built from them: a
# typo of 10^6 layers would build modules for hours, and a vocab of 10^12 allocate a terabyte.
# The bounds are far beyond any released model (Gemma-4 26B: 30 layers, hidden 2816, vocab 262144).
SIZES = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 18),
    "num_hidden_layers": (1, 256),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "global_head_dim": (1, 4096),
    "num_global_key_value_heads": (1, 1024),
    "num_experts": (1, 4096),
    "top_k_experts": (1, 4096),
    "moe_intermediate_size": (1, 1 << 18),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "hidden_size_per_layer_input": (0, 1 << 16),
    "vocab_size_per_layer_input": (0, 1 << 22),
    "num_kv_shared_layers": (0, 256),
}
# What makes two configs the same model to a checkpoint: every field that shapes a tensor or
# changes the arithmetic. A port serves its checkpoint only if they agree on all of them.
# (head_dim and num_key_value_heads are per layer: compared layer by layer.)
GEOMETRY = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "layer_types",
    "sliding_window",
    "max_position_embeddings",
    "attention_k_eq_v",
    "hidden_size_per_layer_input",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
    "tie_word_embeddings",
    "final_logit_softcapping",
)


class ConfigError(UserError):
    pass


def text_config_dict(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The text part of an HF config.json: itself for `gemma4_text`, `text_config` for `gemma4`."""
    model_type = raw.get("model_type")
    if model_type == "gemma4":
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError(f"{source}: model_type 'gemma4' but no 'text_config' object")
        return dict(raw["text_config"], model_type="gemma4_text")
    if model_type == "gemma4_text":
        return dict(raw)
    raise ConfigError(
        f"{source}: model_type {model_type!r} is not a Gemma-4 model (expected 'gemma4_text' or 'gemma4')"
    )


def read_config_file(path: Path, error: type[UserError] = ConfigError) -> Gemma4TextConfig:
    """An HF config.json (a checkpoint's), checked as `gemma4_moe_config` checks a port's fields;
    `error` for a file that is not a JSON object."""
    raw = read_json_object(path, error, f"{path.parent}: no {path.name}")
    return gemma4_moe_config(text_config_dict(raw, str(path)), str(path))


def gemma4_moe_config(fields: dict[str, Any], source: str) -> Gemma4TextConfig:
    """Build a `Gemma4TextConfig` and insist it is the MoE variant (experts beside the dense MLP)."""
    fields = {k: v for k, v in fields.items() if k not in ("model_type", "architectures", "transformers_version")}
    known = set(Gemma4TextConfig.__dataclass_fields__) | _POST_INIT_KEYS
    # Checkpoint configs carry extra serialised attributes (dtype, per_layer_config, ...) that
    # HF accepts; only a port file (written by us) is held to the known-field list.
    if source.endswith(".toml"):
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown config field(s) {unknown}")
    if fields.get("enable_moe_block") is not True:
        raise ConfigError(f"{source}: not a Gemma-4 MoE config (enable_moe_block is not true)")
    missing = [k for k in _MOE_KEYS if fields.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: MoE config lacks {missing}")
    for key, (least, most) in SIZES.items():
        value = fields.get(key)
        if value is None:
            continue  # transformers' default
        if type(value) is not int:
            raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
        if not least <= value <= most:
            raise ConfigError(f"{source}: {key} = {value} is outside [{least}, {most}]")
    bad = _non_finite(fields)
    if bad:
        raise ConfigError(f"{source}: {bad} is not a finite number")
    if fields["top_k_experts"] > fields["num_experts"]:
        raise ConfigError(
            f"{source}: top_k_experts={fields['top_k_experts']} exceeds num_experts={fields['num_experts']}"
        )
    try:
        config = Gemma4TextConfig(**fields)
        layers = per_layer(config)
    # StrictDataclassError: transformers' own field checks; the others: what its per-layer views raise on
    # a malformed per_layer_config
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, StrictDataclassError) as e:
        raise ConfigError(f"{source}: invalid Gemma-4 config: {_one_line(e)}") from None
    for i, layer in enumerate(layers):  # per_layer_config may set these per layer
        for key in ("head_dim", "num_key_value_heads"):
            value, (least, most) = getattr(layer, key), SIZES[key]
            if type(value) is not int or not least <= value <= most:
                raise ConfigError(f"{source}: layer {i}'s {key} {value!r} is not an integer in [{least}, {most}]")
        if config.num_attention_heads % layer.num_key_value_heads:
            raise ConfigError(
                f"{source}: num_attention_heads {config.num_attention_heads} is not a multiple of "
                f"layer {i}'s key-value heads {layer.num_key_value_heads}"
            )
    return config


def _non_finite(value: Any, where: str = "") -> str | None:
    """The first field holding NaN or inf (TOML has both), however deep."""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def per_layer(config: Gemma4TextConfig) -> list:
    """Each layer's view of the config: global layers carry their own head_dim and KV heads."""
    return [config.per_layer_config[i] for i in range(config.num_hidden_layers)]


def geometry_differences(expected: Gemma4TextConfig, got: Gemma4TextConfig) -> list[str]:
    """The GEOMETRY fields (and per-layer head_dim / KV heads) where `got` differs from `expected`,
    each as 'field got (expected)'."""
    diffs = [
        f"{key} {getattr(got, key, None)!r} (expected {getattr(expected, key, None)!r})"
        for key in GEOMETRY
        if getattr(got, key, None) != getattr(expected, key, None)
    ]
    for i, (a, b) in enumerate(zip(per_layer(expected), per_layer(got))):
        if (a.head_dim, a.num_key_value_heads) != (b.head_dim, b.num_key_value_heads):
            diffs.append(
                f"layer {i} head_dim, key-value heads {b.head_dim}, {b.num_key_value_heads} "
                f"(expected {a.head_dim}, {a.num_key_value_heads})"
            )
            break
    return diffs
