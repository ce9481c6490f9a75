"""What counts as a Gemma-4 MoE text config: the one check shared by ports and checkpoints."""

from __future__ import annotations

from typing import Any

from transformers import Gemma4TextConfig

from .errors import UserError

# Keys `Gemma4TextConfig.__post_init__` consumes (popped into per-layer overrides), so they are
# valid input but not dataclass fields.
_POST_INIT_KEYS = {"global_head_dim", "num_global_key_value_heads"}
_MOE_KEYS = ("num_experts", "top_k_experts", "moe_intermediate_size")


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
    if not fields.get("enable_moe_block"):
        raise ConfigError(f"{source}: not a Gemma-4 MoE config (enable_moe_block is not true)")
    missing = [k for k in _MOE_KEYS if not fields.get(k)]
    if missing:
        raise ConfigError(f"{source}: MoE config lacks {missing}")
    if fields["top_k_experts"] > fields["num_experts"]:
        raise ConfigError(
            f"{source}: top_k_experts={fields['top_k_experts']} exceeds num_experts={fields['num_experts']}"
        )
    try:
        return Gemma4TextConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: invalid Gemma-4 config: {e}") from None
