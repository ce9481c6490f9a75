"""Port files: a declarative description of one model we serve (config, weights, tokenizer).

A port is named (`--model tiny-gemma4-moe` finds the repository's `ports/tiny-gemma4-moe.toml`,
packaged with the wheel as the package data of `neuron_moe.ports`: see pyproject.toml's
package-dir) or given as a path to any `.toml` file of the same shape.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import Gemma4TextConfig

from . import spec
from .config import gemma4_moe_config
from .errors import UserError
from .report import table
from .run_config import Shapes
from .spec import DEFAULT_EXPERT_LAYOUT, DEFAULT_PORT, EXPERT_LAYOUTS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# [static]: the traced graphs' shapes (static/); [reader]: the channel reader's settings (experts/channel_reader.py)
_SECTIONS = {"name", "description", "weights", "tokenizer", "config", "static", "reader"}
_WEIGHT_SOURCES = ("random", "checkpoint")
_TOKENIZERS = ("bytes", "checkpoint")
# the fields of each table but [config] (Gemma4TextConfig's), [static] (_STATIC_FIELDS) and [reader] (_READER_FIELDS)
_FIELDS = {"weights": {"source", "seed", "checkpoint", "dtype"}, "tokenizer": {"kind"}}
MAX_BATCH = 1024  # rows of a static graph; the KV cache is allocated for all of them
MAX_BUCKETS = 64


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
    prefill_rows: tuple[int, ...] = (1,)  # prompts one prefill graph takes at once (at most the batch: `rows_for`)
    prefill_chunk: int | None = None  # the longest piece of a prompt a prefill call takes (a bucket; None: the largest)
    # the decode graphs' KV lengths below max_cache_len (`lengths`: with max_cache_len, the graph of every position)
    decode_lengths: tuple[int, ...] = ()

    def rows_for(self, batch: int) -> tuple[int, ...]:
        """The prefill row counts of graphs over a cache of `batch` rows (none larger than it)."""
        return tuple(sorted({min(p, batch) for p in self.prefill_rows}))

    @property
    def chunk(self) -> int:
        """The prefill chunk: the table's (one of the buckets), else the largest bucket."""
        return self.prefill_chunk if self.prefill_chunk in self.buckets else self.buckets[-1]

    @property
    def lengths(self) -> tuple[int, ...]:
        """The decode graphs' KV lengths: the table's below max_cache_len, then max_cache_len (a
        decode graph attends over that many positions; a step runs the smallest above its rows')."""
        return tuple(n for n in self.decode_lengths if n < self.max_cache_len) + (self.max_cache_len,)

    def shapes(self, batch: int | None = None) -> Shapes:
        """The graphs' shapes over a cache of `batch` rows (default the table's batch_size): what a
        `GraphRuntime` runs at and an artifact's manifest records."""
        batch = batch or self.batch_size
        return Shapes(batch, self.max_cache_len, self.buckets, self.rows_for(batch), self.chunk, self.lengths)


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
    # the [reader] table: this port's defaults for the channel reader (sidecar, relative paths taken from the
    # port file's folder; budget; recovery_rank), a command-line flag overriding each; every field None: no table
    reader: spec.Reader = spec.Reader()
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def static_spec(self, what: str) -> StaticSpec:
        """The [static] table, or a UserError saying that `what` needs one."""
        if self.static is None:
            raise UserError(
                f"port {self.name!r} has no [static] table (buckets, max_cache_len, batch_size, "
                f"prefill_experts, decode_experts): {what} needs the static graphs it describes"
            )
        return self.static


def _ports_dir():
    """The built-in ports: `neuron_moe.ports` where the project is installed (a wheel, or editable);
    the checkout's own `ports/` where the package is imported from the checkout with nothing
    installed (PYTHONPATH=repo, as the GPU session runs), the one place that package maps to."""
    try:
        return resources.files("neuron_moe.ports")
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parents[1] / "ports"
        if not (checkout / "__init__.py").is_file():
            raise PortError(
                f"no built-in ports: neuron_moe.ports is not installed and {checkout} does not "
                "exist (install the project: pip install .)"
            ) from None
        return checkout


def builtin_path(name: str) -> Path:
    """Where a file or checkpoint directory shipped with the built-in ports is (`name` inside ports/)."""
    return Path(str(_ports_dir() / name))


def builtin_ports() -> list[str]:
    return sorted(p.name[: -len(".toml")] for p in _ports_dir().iterdir() if p.name.endswith(".toml"))


def _port_path(name_or_path: str) -> Path:
    """A port file's path: a built-in port's by its name, else the path given."""
    path = Path(name_or_path)
    is_path = name_or_path.endswith(".toml") or "/" in name_or_path
    res = _ports_dir() / f"{name_or_path}.toml"
    if not is_path and res.is_file():
        return Path(str(res))
    if path.is_dir():  # a checkpoint's folder, given where its port goes
        raise PortError(
            f"{path} is a directory, not a port file (a .toml, or a built-in port's name); "
            "a checkpoint directory is given with --checkpoint"
        )
    if not is_path:
        raise PortError(f"unknown port {name_or_path!r}; built-in ports: {', '.join(builtin_ports())}")
    if not path.is_file():
        raise PortError(f"port file not found: {path}")
    return path


def _require(table: dict, key: str, kind: type | tuple, where: str):
    if key not in table:
        raise PortError(f"{where}: missing field '{key}'")
    return _typed(table, key, kind, where)


def _typed(table: dict, key: str, kind: type | tuple, where: str):
    value = table[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise PortError(f"{where}: field '{key}' must be {names}, got {type(value).__name__} {value!r}")
    return value


def _table(raw: dict, name: str, where: str) -> dict:
    """An optional table with a known set of fields, each a misspelling away from being ignored."""
    table = _typed(raw, name, dict, where) if name in raw else {}
    unknown = sorted(set(table) - _FIELDS[name])
    if unknown:
        raise PortError(f"{where} [{name}]: unknown field(s) {unknown}; expected {sorted(_FIELDS[name])}")
    return table


# Experts implementations a static graph may use (spec.Experts.static: fixed shapes, nothing
# attached), exported in the tests. HF's eager loop, with its data-dependent shapes, is not one.
GRAPH_EXPERTS = tuple(name for name, e in spec.EXPERTS.items() if e.static)

_STATIC_FIELDS = {
    "buckets",
    "max_cache_len",
    "batch_size",
    "prefill_experts",
    "decode_experts",
    "expert_layout",
    "prefill_rows",
    "prefill_chunk",
    "decode_lengths",
}


def _static_spec(table: dict, config: Gemma4TextConfig, where: str) -> StaticSpec:
    where = f"{where} [static]"
    unknown = sorted(set(table) - _STATIC_FIELDS)
    if unknown:
        raise PortError(f"{where}: unknown field(s) {unknown}; expected {sorted(_STATIC_FIELDS)}")
    buckets = _require(table, "buckets", list, where)
    if not 0 < len(buckets) <= MAX_BUCKETS or not all(type(b) is int and b > 0 for b in buckets):
        raise PortError(f"{where}: buckets must be a list of 1 to {MAX_BUCKETS} positive integers, got {buckets}")
    if buckets != sorted(set(buckets)):
        raise PortError(f"{where}: buckets must be strictly increasing, got {buckets}")
    max_cache_len = _require(table, "max_cache_len", int, where)
    if max_cache_len < buckets[-1]:
        raise PortError(f"{where}: max_cache_len {max_cache_len} is shorter than the largest bucket {buckets[-1]}")
    if max_cache_len > config.max_position_embeddings:
        raise PortError(
            f"{where}: max_cache_len {max_cache_len} exceeds max_position_embeddings {config.max_position_embeddings}"
        )
    batch_size = _require(table, "batch_size", int, where)
    if not 1 <= batch_size <= MAX_BATCH:
        raise PortError(f"{where}: batch_size must be in [1, {MAX_BATCH}], got {batch_size}")
    experts = {}
    for key in ("prefill_experts", "decode_experts"):
        experts[key] = _require(table, key, str, where)
        if experts[key] not in GRAPH_EXPERTS:
            raise PortError(
                f"{where}: {key} {experts[key]!r} is not an experts implementation for static "
                f"graphs; choose from {list(GRAPH_EXPERTS)}"
            )
    expert_layout = _typed(table, "expert_layout", str, where) if "expert_layout" in table else DEFAULT_EXPERT_LAYOUT
    if expert_layout not in EXPERT_LAYOUTS:
        raise PortError(f"{where}: expert_layout {expert_layout!r} is not one of {list(EXPERT_LAYOUTS)}")
    rows = _typed(table, "prefill_rows", list, where) if "prefill_rows" in table else [1]
    if (
        not 0 < len(rows) <= MAX_BUCKETS
        or not all(type(p) is int and 1 <= p <= MAX_BATCH for p in rows)
        or rows != sorted(set(rows))
    ):
        raise PortError(
            f"{where}: prefill_rows must be a strictly increasing list of 1 to {MAX_BUCKETS} row counts "
            f"in [1, {MAX_BATCH}], got {rows}"
        )
    chunk = _typed(table, "prefill_chunk", int, where) if "prefill_chunk" in table else buckets[-1]
    if chunk not in buckets:
        raise PortError(f"{where}: prefill_chunk {chunk} is not one of the buckets {buckets}")
    lengths = _typed(table, "decode_lengths", list, where) if "decode_lengths" in table else []
    problem = _lengths_problem(lengths, max_cache_len)
    if problem:
        raise PortError(f"{where}: decode_lengths {problem}, got {lengths}")
    return StaticSpec(
        tuple(buckets),
        max_cache_len,
        batch_size,
        **experts,
        expert_layout=expert_layout,
        prefill_rows=tuple(rows),
        prefill_chunk=chunk,
        decode_lengths=tuple(lengths),
    )


def _lengths_problem(lengths, max_cache_len: int) -> str | None:
    """What is wrong with decode lengths over a cache of `max_cache_len` positions (None: nothing)."""
    if not all(type(n) is int and n > 0 for n in lengths) or list(lengths) != sorted(set(lengths)):
        return "must be strictly increasing positive lengths"
    if len(lengths) > MAX_BUCKETS:
        return f"must be at most {MAX_BUCKETS} lengths"
    if lengths and lengths[-1] > max_cache_len:
        return f"must each be at most max_cache_len ({max_cache_len}; it is added as the last where absent)"
    return None


def with_shapes(port: Port, shapes: Shapes) -> Port:
    """The port with the `[static]` shapes the flags give (`Shapes`: --batch-size, --max-cache-len,
    --buckets, --prefill-rows, --prefill-chunk, --decode-lengths) in place of its table's, held to the
    table's own checks; each refusal names the flag. Without --decode-lengths, the table's lengths
    below the cache's are kept (`StaticSpec.lengths`)."""
    given = shapes.given()
    if not given:
        return port
    spec = port.static_spec(", ".join(given))
    buckets = tuple(shapes.buckets) if shapes.buckets is not None else spec.buckets
    length = spec.max_cache_len if shapes.max_cache_len is None else shapes.max_cache_len
    batch_size = spec.batch_size if shapes.batch_size is None else shapes.batch_size
    if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise PortError(f"--buckets must be strictly increasing positive lengths, got {list(buckets)}")
    if len(buckets) > MAX_BUCKETS:
        raise PortError(f"--buckets: at most {MAX_BUCKETS} prefill lengths, got {len(buckets)}")
    if buckets[-1] > length:
        whose = "--buckets" if shapes.buckets is not None else f"the port's [static] buckets {list(buckets)}"
        raise PortError(
            f"--max-cache-len {length} (the KV cache's positions) is shorter than the largest prefill bucket "
            f"{buckets[-1]} ({whose}): pass --buckets up to {length}, or a longer --max-cache-len"
        )
    if length > port.config.max_position_embeddings:
        raise PortError(
            f"--max-cache-len {length} exceeds the model's max_position_embeddings "
            f"{port.config.max_position_embeddings}"
        )
    if not 1 <= batch_size <= MAX_BATCH:
        raise PortError(f"--batch-size must be in [1, {MAX_BATCH}], got {batch_size}")
    chunk = spec.prefill_chunk if shapes.prefill_chunk is None else shapes.prefill_chunk
    if shapes.prefill_chunk is not None and chunk not in buckets:
        raise PortError(f"--prefill-chunk {chunk} is not one of the port's buckets {list(buckets)}")
    rows = spec.prefill_rows if shapes.prefill_rows is None else tuple(sorted(set(shapes.prefill_rows)))
    decode = spec.decode_lengths if shapes.decode_lengths is None else tuple(shapes.decode_lengths)
    problem = _lengths_problem(decode, length)
    if shapes.decode_lengths is not None and problem:
        raise PortError(f"--decode-lengths {problem.replace('max_cache_len', '--max-cache-len')}, got {list(decode)}")
    changed = dict(buckets=buckets, max_cache_len=length, batch_size=batch_size, prefill_rows=rows, prefill_chunk=chunk)
    changed["decode_lengths"] = decode
    return replace(port, static=replace(spec, **changed))


_READER_FIELDS = {"sidecar": str, "budget": (int, float), "recovery_rank": int}


def _reader_spec(table: dict, folder: Path, where: str) -> spec.Reader:
    where = f"{where} [reader]"
    unknown = sorted(set(table) - set(_READER_FIELDS))
    if unknown:
        raise PortError(f"{where}: unknown field(s) {unknown}; expected {sorted(_READER_FIELDS)}")
    given = {key: _typed(table, key, kind, where) for key, kind in _READER_FIELDS.items() if key in table}
    budget, rank = given.get("budget"), given.get("recovery_rank")
    if budget is not None and not 0 < budget <= 100:
        raise PortError(f"{where}: budget must be in (0, 100] percent, got {budget}")
    if rank is not None and rank < 0:
        raise PortError(f"{where}: recovery_rank must be 0 or more, got {rank}")
    return spec.Reader(
        sidecar=folder / given["sidecar"] if "sidecar" in given else None,
        budget=None if budget is None else float(budget),
        recovery_rank=rank,
    )


def load_port(name_or_path: str = DEFAULT_PORT) -> Port:
    path = _port_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PortError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise PortError(f"{path}: cannot read the port file: {e.strerror}") from None
    where = str(path)
    unknown = sorted(set(raw) - _SECTIONS)
    if unknown:
        raise PortError(f"{where}: unknown field(s) {unknown}; expected {sorted(_SECTIONS)}")

    if "weights" not in raw:
        raise PortError(f"{where}: missing field 'weights'")
    weights = _table(raw, "weights", where)
    source = _require(weights, "source", str, f"{where} [weights]")
    if source not in _WEIGHT_SOURCES:
        raise PortError(f"{where} [weights]: source {source!r} is not one of {_WEIGHT_SOURCES}")
    dtype_name = _typed(weights, "dtype", str, f"{where} [weights]") if "dtype" in weights else "float32"
    if dtype_name not in DTYPES:
        raise PortError(f"{where} [weights]: dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    seed = _require(weights, "seed", int, f"{where} [weights]") if source == "random" else None
    checkpoint = None
    if "checkpoint" in weights:
        checkpoint = (path.parent / _require(weights, "checkpoint", str, f"{where} [weights]")).resolve()
        if not checkpoint.is_dir():  # relative paths are relative to the port file
            raise PortError(f"{where} [weights]: checkpoint directory {checkpoint} not found")

    tokenizer_table = _table(raw, "tokenizer", where)
    tokenizer = _typed(tokenizer_table, "kind", str, f"{where} [tokenizer]") if "kind" in tokenizer_table else "bytes"
    if tokenizer not in _TOKENIZERS:
        raise PortError(f"{where} [tokenizer]: kind {tokenizer!r} is not one of {_TOKENIZERS}")
    reader = _reader_spec(_typed(raw, "reader", dict, where) if "reader" in raw else {}, path.parent, where)

    config = gemma4_moe_config(_require(raw, "config", dict, where), where)
    static = _static_spec(_require(raw, "static", dict, where), config, where) if "static" in raw else None
    return Port(
        name=_require(raw, "name", str, where),
        description=_typed(raw, "description", str, where) if "description" in raw else "",
        path=path,
        config=config,
        weights_source=source,
        dtype=DTYPES[dtype_name],
        seed=seed,
        checkpoint=checkpoint,
        tokenizer=tokenizer,
        static=static,
        reader=reader,
        raw=raw,
    )


def ports_report() -> list[dict]:
    """`neuron-moe ports`: each built-in port's name, weights source and description."""
    rows = []
    for name in builtin_ports():
        port = load_port(name)
        rows.append({"name": name, "weights": port.weights_source, "description": port.description})
    return rows


def render_ports(rows: list[dict]) -> str:
    return table(rows, [("name", "port"), ("weights", "weights"), ("description", "description")])
