"""Port files: a declarative description of one model we serve (config, weights, tokenizer).

A port is named (`--model tiny-gemma4-moe` finds `neuron_moe/ports/tiny-gemma4-moe.toml`,
packaged with the wheel) or given as a path to any `.toml` file of the same shape.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import Gemma4TextConfig

from .config import gemma4_moe_config
from .errors import UserError
from .parallel.layout import DEFAULT_EXPERT_LAYOUT, EXPERT_LAYOUTS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

DEFAULT_PORT = "tiny-gemma4-moe"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# [static]: the traced graphs' shapes (static/); [reader]: the channel reader's settings (experts/channel_reader.py)
_SECTIONS = {"name", "description", "weights", "tokenizer", "config", "static", "reader"}
_WEIGHT_SOURCES = ("random", "checkpoint")
_TOKENIZERS = ("bytes", "checkpoint")


class PortError(UserError):
    pass


@dataclass(frozen=True)
class StaticSpec:
    """The `[static]` table: the fixed shapes every traced graph of this port is built for."""

    buckets: tuple[int, ...]  # prefill sequence lengths, ascending; a prompt is padded to the smallest that holds it
    max_cache_len: int  # KV-cache slots of a global layer: bucket + new tokens - 1 at most
    batch_size: int  # rows of every graph
    prefill_experts: str  # experts implementation of the prefill graphs
    decode_experts: str  # experts implementation of the decode graph
    expert_layout: str = DEFAULT_EXPERT_LAYOUT  # how the TP graphs split the experts (parallel/layout.py)


@dataclass(frozen=True)
class Port:
    name: str
    description: str
    path: Path
    config: Gemma4TextConfig
    weights_source: str  # "random" (seeded) or "checkpoint"
    dtype: torch.dtype
    seed: int | None = None
    checkpoint: Path | None = None  # directory; None means "supply --checkpoint"
    tokenizer: str = "bytes"
    static: StaticSpec | None = None  # None: the port has no [static] table (no traced graphs)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def static_spec(self, what: str) -> StaticSpec:
        """The [static] table, or a UserError saying that `what` needs one."""
        if self.static is None:
            raise UserError(f"port {self.name!r} has no [static] table (buckets, max_cache_len, batch_size, "
                            f"prefill_experts, decode_experts): {what} needs the static graphs it describes")
        return self.static


def builtin_ports() -> list[str]:
    return sorted(p.name[: -len(".toml")] for p in resources.files("neuron_moe.ports").iterdir()
                  if p.name.endswith(".toml"))


def _port_path(name_or_path: str) -> Path:
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise PortError(f"port file not found: {path}")
        return path
    res = resources.files("neuron_moe.ports") / f"{name_or_path}.toml"
    if not res.is_file():
        raise PortError(f"unknown port {name_or_path!r}; built-in ports: {', '.join(builtin_ports())}")
    return Path(str(res))


def _require(table: dict, key: str, kind: type, where: str):
    if key not in table:
        raise PortError(f"{where}: missing field '{key}'")
    value = table[key]
    if not isinstance(value, kind):
        raise PortError(f"{where}: field '{key}' must be {kind.__name__}, got {type(value).__name__}")
    return value


_STATIC_FIELDS = {"buckets", "max_cache_len", "batch_size", "prefill_experts", "decode_experts", "expert_layout"}


def _static_spec(table: dict, config: Gemma4TextConfig, where: str) -> StaticSpec:
    from .static import GRAPH_EXPERTS

    where = f"{where} [static]"
    unknown = sorted(set(table) - _STATIC_FIELDS)
    if unknown:
        raise PortError(f"{where}: unknown field(s) {unknown}; expected {sorted(_STATIC_FIELDS)}")
    buckets = _require(table, "buckets", list, where)
    if not buckets or not all(type(b) is int and b > 0 for b in buckets):
        raise PortError(f"{where}: buckets must be a non-empty list of positive integers, got {buckets}")
    if buckets != sorted(set(buckets)):
        raise PortError(f"{where}: buckets must be strictly increasing, got {buckets}")
    max_cache_len = _require(table, "max_cache_len", int, where)
    if max_cache_len < buckets[-1]:
        raise PortError(f"{where}: max_cache_len {max_cache_len} is shorter than the largest bucket {buckets[-1]}")
    if max_cache_len > config.max_position_embeddings:
        raise PortError(f"{where}: max_cache_len {max_cache_len} exceeds max_position_embeddings "
                        f"{config.max_position_embeddings}")
    batch_size = _require(table, "batch_size", int, where)
    if batch_size < 1:
        raise PortError(f"{where}: batch_size must be at least 1, got {batch_size}")
    experts = {}
    for key in ("prefill_experts", "decode_experts"):
        experts[key] = _require(table, key, str, where)
        if experts[key] not in GRAPH_EXPERTS:
            raise PortError(f"{where}: {key} {experts[key]!r} is not an experts implementation for static "
                            f"graphs; choose from {list(GRAPH_EXPERTS)}")
    expert_layout = table.get("expert_layout", DEFAULT_EXPERT_LAYOUT)
    if expert_layout not in EXPERT_LAYOUTS:
        raise PortError(f"{where}: expert_layout {expert_layout!r} is not one of {list(EXPERT_LAYOUTS)}")
    return StaticSpec(tuple(buckets), max_cache_len, batch_size, **experts, expert_layout=expert_layout)


def load_port(name_or_path: str = DEFAULT_PORT) -> Port:
    path = _port_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PortError(f"{path}: not valid TOML: {e}") from None
    where = str(path)
    unknown = sorted(set(raw) - _SECTIONS)
    if unknown:
        raise PortError(f"{where}: unknown field(s) {unknown}; expected {sorted(_SECTIONS)}")

    weights = _require(raw, "weights", dict, where)
    source = _require(weights, "source", str, f"{where} [weights]")
    if source not in _WEIGHT_SOURCES:
        raise PortError(f"{where} [weights]: source {source!r} is not one of {_WEIGHT_SOURCES}")
    dtype_name = weights.get("dtype", "float32")
    if dtype_name not in DTYPES:
        raise PortError(f"{where} [weights]: dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    seed = _require(weights, "seed", int, f"{where} [weights]") if source == "random" else None
    checkpoint = None
    if "checkpoint" in weights:
        checkpoint = (path.parent / _require(weights, "checkpoint", str, f"{where} [weights]")).resolve()
        if not checkpoint.is_dir():  # relative paths are relative to the port file
            raise PortError(f"{where} [weights]: checkpoint directory {checkpoint} not found")

    tokenizer = raw.get("tokenizer", {}).get("kind", "bytes")
    if tokenizer not in _TOKENIZERS:
        raise PortError(f"{where} [tokenizer]: kind {tokenizer!r} is not one of {_TOKENIZERS}")

    config = gemma4_moe_config(_require(raw, "config", dict, where), where)
    static = _static_spec(_require(raw, "static", dict, where), config, where) if "static" in raw else None
    return Port(
        name=_require(raw, "name", str, where),
        description=raw.get("description", ""),
        path=path,
        config=config,
        weights_source=source,
        dtype=DTYPES[dtype_name],
        seed=seed,
        checkpoint=checkpoint,
        tokenizer=tokenizer,
        static=static,
        raw=raw,
    )
