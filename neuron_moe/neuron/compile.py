"""trace-and-compile: the rank modules' graphs, per-rank weights and a manifest, in one directory.

The artifact contract (what `serve/neuron.py` and `pull` read) is defined here, once:

    manifest.json   MANIFEST_FIELDS below (expert_layout: how the graphs split the experts,
                    `parallel/layout.py`), plus each key's inputs and outputs, the state, the
                    reader (`--reader`: budget, k_per_rank, scan, rank, source_sha256; null
                    without), and the files' sizes and sha256
    model.pt        torch.jit.save of ModelBuilder.trace(initialize_model_weights=False): one
                    context-encoding key per prefill bucket and one token-generation key
    weights/tp{r}_sharded_checkpoint.safetensors   rank r's weights (ModelBuilder.shard_checkpoint),
                    in the manifest's expert layout (`load_shards` refuses one of the other);
                    with the reader, rank r's sidecar shard too (`<...>.experts.reader.*`)
    shard_plan.json every rank-module tensor: placement, partition dim and stride, full and
                    per-rank shape, dtype

Each key is the static decoder (`static/decoder.py`) over the full-model rank module
(`parallel/model.py`); B = batch_size, the rows of the KV cache:

    context_encoding_<b>  (input_ids, attention_mask, position_ids [1, b], row_ids [1]) -> token [1, 1]
                          one prompt, left-padded to the bucket, into cache row row_ids[0]
    token_generation      (input_ids [B, 1], position_ids [B, 1]) -> token [B, 1]
                          every row at its own position

An artifact built with `logits=True` (`--with-logits`) also returns the fp32 logits [rows, V] after
the token (validation, host-side sampling); the default returns the token alone. The KV cache is
the graphs' state, never an input or output: `cache.k{i}` / `cache.v{i}` per layer, [B, KV heads of
the rank, ring length, head_dim], aliased parameters (`input_output_aliases`) that every key
shares and NxD zero-initialises on each rank (the manifest's `state`). Formats 1 and 2 (the cache
in and out of every call) are refused.

On Neuron (the SDK present) the keys go through ModelBuilder (`parallel/nxd.py`). `--dry-run`
builds the same rank modules on CPU over the gloo backend (`parallel/cpu.py`), exports every key
as rank 0 (torch.export under a fake process group, what ModelBuilder's trace sees), and writes
the exported programs under graphs/ in place of model.pt; for a port without weights (the
full-size one) it builds the modules on the meta device and exports each key there (a graph
without weights: nothing under graphs/), then writes the manifest and shard plan.

Nothing is half-written: the directory is built as a hidden sibling and renamed into place when
complete. An existing DIR is refused unless --overwrite, and --overwrite replaces only an artifact
(a directory with our manifest), never another directory. A run holds a lock on DIR (`.DIR.lock`
beside it) from start to end: a second run on the same DIR is refused, so the hidden siblings a
run finds are an interrupted run's leftovers, and it removes them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import UserError
from ..parallel.layout import EXPERT_LAYOUTS
from ..parallel.reader import READER, check_reader, open_shards
from ..reader.accounting import ReaderSettings, rank_geometry, solve_rank_k
from ..reader.geometry import Geometry
from ..reader.prep import RANK, SCAN
from ..reader.sidecar import SidecarLayout
from ..report import check_output, dumps, read_json_object, run_lock

MANIFEST = "manifest.json"
MODEL = "model.pt"
WEIGHTS = "weights/tp{rank}_sharded_checkpoint.safetensors"
SHARD_PLAN = "shard_plan.json"
GRAPHS = "graphs/{key}.pt2"  # dry run: the exported rank-0 programs
FORMAT = 3
# field -> type; what a server needs to call the graphs
MANIFEST_FIELDS = {"format": int, "port": str, "dtype": str, "tp": int, "expert_layout": str, "buckets": list,
                   "max_length": int, "batch_size": int, "dry_run": bool, "logits": bool}
DTYPES = {"bf16": (torch.bfloat16, False), "int8": (torch.bfloat16, True), "fp32": (torch.float32, False)}
_PARTIAL = ".{name}.partial-"
_SDK_DISTS = ("torch", "transformers", "torch-neuronx", "neuronx-distributed", "neuronx-cc", "libneuronxla")


class ArtifactError(UserError):
    pass


def read_manifest(artifacts: Path) -> dict:
    """The manifest of an artifact directory, every field of the contract checked."""
    path = Path(artifacts) / MANIFEST
    manifest = read_json_object(
        path, ArtifactError, f"{artifacts}: no {MANIFEST} (expected a trace-and-compile output directory)")
    for key, kind in MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            raise ArtifactError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
    if manifest["format"] != FORMAT:
        raise ArtifactError(f"{path}: artifact format {manifest['format']}, this version reads {FORMAT} "
                            f"(rebuild it with this version's trace-and-compile)")
    if manifest["expert_layout"] not in EXPERT_LAYOUTS:
        raise ArtifactError(f"{path}: expert_layout {manifest['expert_layout']!r} is not one of {list(EXPERT_LAYOUTS)}")
    buckets = manifest["buckets"]
    if not buckets or not all(isinstance(b, int) and 0 < b <= manifest["max_length"] for b in buckets):
        raise ArtifactError(f"{path}: 'buckets' must be positive lengths up to max_length "
                           f"({manifest['max_length']}), got {buckets}")
    return manifest


def check_expert_layout(manifest: dict, expert_layout: str, artifacts: Path) -> None:
    """Refuse an artifact built for the other expert layout than the one it is to be served with."""
    if manifest["expert_layout"] != expert_layout:
        raise ArtifactError(f"{artifacts}: built with the {manifest['expert_layout']!r} expert layout, served here "
                            f"with the {expert_layout!r} layout (the port's [static] expert_layout): rebuild it with "
                            f"trace-and-compile --expert-layout {expert_layout}, or set expert_layout = "
                            f"\"{manifest['expert_layout']}\" in the port")


def load_shards(artifacts: Path, manifest: dict) -> list[dict]:
    """Every rank's weight shard, each checked to be in the manifest's expert layout."""
    from safetensors.torch import load_file

    from ..parallel import layout

    paths = [Path(artifacts) / WEIGHTS.format(rank=r) for r in range(manifest["tp"])]
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise ArtifactError(f"{artifacts}: missing weight shard(s) {', '.join(absent)}")
    shards = []
    for path in paths:
        shard = load_file(path)
        have = layout.expert_layout_of(shard)
        if have is not None and have != manifest["expert_layout"]:
            raise ArtifactError(f"{path} holds its experts in the {have!r} layout, the manifest says "
                                f"{manifest['expert_layout']!r}: the directory mixes two builds; rebuild it")
        shards.append(shard)
    return shards


def key_names(buckets) -> list[str]:
    return [f"context_encoding_{b}" for b in buckets] + ["token_generation"]


def sdk_versions() -> dict[str, str | None]:
    out = {}
    for dist in _SDK_DISTS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _prepare_out(out: Path, overwrite: bool) -> Path:
    """A fresh hidden sibling of `out` to build in; stale ones of earlier runs removed (call it
    holding the run lock of `out`: then every other sibling is a dead run's)."""
    out = out.resolve()
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        manifest = out / MANIFEST
        if not manifest.is_file():
            raise ArtifactError(f"{out} holds files but no manifest: not a trace-and-compile artifact, which "
                                "--overwrite never replaces; remove it yourself, or choose another --out")
        raw = read_json_object(manifest, ArtifactError, "")
        if not isinstance(raw.get("format"), int) or not isinstance(raw.get("files"), dict):
            raise ArtifactError(f"{manifest} is not a trace-and-compile manifest (no 'format' and 'files'); {out} is "
                                "not replaced, --overwrite or not: remove it yourself, or choose another --out")
        if not overwrite:
            raise ArtifactError(f"{out} already holds a complete artifact; pass --overwrite to replace it, "
                                "or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = _PARTIAL.format(name=out.name)
    for stale in out.parent.glob(prefix + "*"):
        shutil.rmtree(stale, ignore_errors=True)  # a dead run's leftovers (a live one would hold the lock)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would become the published directory's mode
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished directory into place; an old one is moved aside first, then removed."""
    out = out.resolve()
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=_PARTIAL.format(name=out.name) + "old-", dir=out.parent))
        os.rename(out, old / "x")
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _atomic_write(path: Path, write) -> None:
    """write(tmp_path), then rename: a reader never sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(".tmp-" + path.name)  # same suffix: torch.export.save wants .pt2
    write(part)
    os.replace(part, path)


def _graph(model, spec, key: str, cache, logits: bool):
    """Key `key`'s graph over `model`, its state `cache` (shared by every key of one model)."""
    from ..static.decoder import Decode, Prefill

    if key == "token_generation":
        return Decode(model, cache, spec.decode_experts, logits)
    return Prefill(model, cache, spec.prefill_experts, logits)


def _example(spec, key: str) -> tuple:
    from ..static.export import example_inputs

    return example_inputs(spec, None if key == "token_generation" else int(key.rsplit("_", 1)[1]))


def _key_contract(graph, spec, key: str) -> dict:
    """A key's calls as the manifest records them: input and output names and shapes."""
    names = ("input_ids", "position_ids") if key == "token_generation" else \
        ("input_ids", "attention_mask", "position_ids", "row_ids")
    example = _example(spec, key)
    rows = example[0].shape[0]
    outputs = {"token": [rows, 1]}
    if graph.logits:
        outputs["logits"] = [rows, graph.model.config.vocab_size]
    return {"graph": "token_generation" if key == "token_generation" else "context_encoding",
            "inputs": {n: list(x.shape) for n, x in zip(names, example)}, "outputs": outputs}


def shard_plan(module, full: dict | None, tp: int, expert_layout: str) -> dict:
    """Every tensor of the rank module: placement, partition dim and stride, full shape, per-rank
    shape, dtype."""
    from ..parallel import layout

    plan = {}
    params = dict(module.named_parameters())
    for name, t in module.state_dict().items():
        param = params.get(name)
        split = bool(getattr(param, "tensor_model_parallel", False))
        full_shape = list(full[name].shape) if full is not None else \
            [n * (tp if split and d == param.partition_dim else 1) for d, n in enumerate(t.shape)]
        plan[name] = {"placement": layout.placement(name, expert_layout) if split else layout.REPLICATED,
                      "partition_dim": param.partition_dim if split else None,
                      "partition_stride": param.partition_stride if split else None,
                      "full_shape": full_shape, "rank_shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    return plan


def trace_and_compile(port, dtype: str, tp: int, out: Path, *, dry_run: bool, overwrite: bool = False,
                      checkpoint=None, export: bool = True, expert_layout: str | None = None,
                      logits: bool = False, reader: dict | None = None) -> dict:
    """Write the artifact directory `out` (see the module docstring); returns the manifest.
    `expert_layout` defaults to the port's [static] expert_layout. `export=False` (dry run only)
    skips tracing: the shard plan and manifest alone. `logits=True`: graphs that also return the
    logits (validation, host-side sampling), at V·4 bytes per row and step across the host.
    `reader` ({"sidecar": DIR of `prep-reader --tp`, "budget", "rank"}): the decode key reads through
    each rank's sidecar shard (`parallel/reader.py`), which goes into that rank's weights; a port
    without weights takes the geometry's shapes (`scan`, `rank`; no sidecar)."""
    from ..parallel import layout, nxd

    if dtype not in DTYPES:
        raise ArtifactError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    port.static_spec("trace-and-compile")
    expert_layout = expert_layout or port.static.expert_layout
    layout.check_degree(port.config, tp, expert_layout)
    if not dry_run and not nxd.sdk_available():
        raise nxd.NeuronSDKMissing(
            "trace-and-compile needs the Neuron SDK (neuronx-distributed, torch-neuronx), which is not installed "
            "here: run it on an inf2 instance in the Neuron DLC (recipes/inf2-24xlarge/), or pass --dry-run to "
            "build and export the same rank modules on CPU")
    torch_dtype, int8 = DTYPES[dtype]
    spec, keys = port.static, key_names(port.static.buckets)
    has_weights = checkpoint is not None or port.checkpoint is not None or port.weights_source == "random"
    if not dry_run and not has_weights:
        raise ArtifactError(f"port {port.name!r} has no embedded weights: pass --checkpoint DIR")
    sides, reads = None, None
    if reader is not None:  # every check of the reader before any weight loads
        sides, reads = _plan_reader(port, tp, int8, expert_layout, reader, has_weights)
        spec = dataclasses.replace(spec, decode_experts=READER)
    out = Path(out)
    check_output(out, directory=True)
    with run_lock(out.resolve(), "trace-and-compile"):
        tmp = _prepare_out(out, overwrite)
        try:
            full = _full_state(port, tp, torch_dtype, int8, checkpoint, expert_layout, sides) if has_weights else None
            build = dict(expert_layout=expert_layout, int8=int8, dtype=torch_dtype, reader=reads)
            if dry_run:
                module, files, exported = _dry_run(port, spec, keys, tp, full, tmp, export, logits, build)
            else:
                module, files, exported = _neuron(port, spec, keys, tp, full, tmp, logits, build)
            plan = shard_plan(module, full, tp, expert_layout)
            _atomic_write(tmp / SHARD_PLAN, lambda p: p.write_text(dumps(plan, indent=1)))
            files = [*files, SHARD_PLAN]
            contract, state = _contract(module, spec, keys, logits)
            manifest = {
                "format": FORMAT, "port": port.name, "dtype": dtype, "tp": tp, "expert_layout": expert_layout,
                "buckets": list(spec.buckets),
                "max_length": spec.max_cache_len, "batch_size": spec.batch_size, "logits": logits,
                "keys": {k: dict(contract[k], exported=exported) for k in keys}, "state": state,
                "dry_run": dry_run, "weights": full is not None, "versions": sdk_versions(),
                "reader": None if reads is None else {k: v for k, v in reads.items() if k != "layout"},
                "files": {f: {"size": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in sorted(files)},
            }
            _atomic_write(tmp / MANIFEST, lambda p: p.write_text(dumps(manifest, indent=1) + "\n"))
            _publish(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dict(manifest, out=str(out.resolve()))


def _full_state(port, tp, torch_dtype, int8, checkpoint, expert_layout, sides=None) -> dict:
    """The whole model in the parallel layout (int8 experts quantised), named as the rank module;
    with the reader's shards `sides`, their entries too (checked against these weights)."""
    from ..experts.int8 import quantize_experts
    from ..model import build_model
    from ..parallel import layout, reader
    from ..reader.prep import model_expert_weights

    hf = build_model(port, "eager", torch_dtype, checkpoint)
    if sides is not None:
        sides[0].check_source(model_expert_weights(hf))
    full = layout.parallel_state_dict(hf.state_dict(), hf.config, tp, expert_layout)
    full = quantize_experts(full) if int8 else full
    return full if sides is None else {**full, **reader.full_state(sides)}


def _plan_reader(port, tp: int, int8: bool, expert_layout: str, options: dict, has_weights: bool):
    """(each rank's shard or None, the settings the graphs are built with) of `--reader`."""
    check_reader(expert_layout, int8, options.get("budget"))
    if has_weights:
        if options.get("sidecar") is None:
            raise ArtifactError("--reader needs --sidecar DIR (from `neuron-moe prep-reader --tp "
                                f"{tp} --out DIR`) for a port with weights")
        sides, k, rank = open_shards(port.config, options["sidecar"], tp, options["budget"], options.get("rank"))
        scan, local, digest = sides[0].scan, sides[0].layout, sides[0].source_sha256
    else:  # shapes only (the meta device): the geometry's sidecar layout
        if options.get("sidecar") is not None:
            raise ArtifactError(f"port {port.name!r} has no weights here: --reader builds shapes only (meta device), "
                                f"a sidecar is not read; drop --sidecar or pass --checkpoint DIR")
        geo, rank = Geometry.from_config(port.config), options.get("rank")
        rank, scan = RANK if rank is None else rank, options.get("scan") or SCAN
        k, sides, digest = solve_rank_k(geo, ReaderSettings(scan=scan, rank=rank), options["budget"], tp), None, None
        local = SidecarLayout(rank_geometry(geo, tp), rank)
    return sides, {"budget": options["budget"], "k_per_rank": k, "scan": scan, "rank": rank,
                   "source_sha256": digest, "layout": local}


def _rank_module(port, tp, backend, build: dict, device="cpu"):
    """One rank's model (`parallel/model.py`), with the reader's shard module when `build` has one."""
    from ..parallel import reader
    from ..parallel.model import rank_model

    options = {k: v for k, v in build.items() if k != "reader"}
    model = rank_model(port.config, tp, backend, device=device, **options)
    reads = build.get("reader")
    if reads is not None:
        reader.attach(model, reads["layout"], tp, reads["k_per_rank"], reads["scan"], reads["rank"])
    return model


def _dry_run(port, spec, keys, tp, full, tmp: Path, export: bool, logits: bool, build: dict):
    from safetensors.torch import save_file

    from ..parallel import cpu
    from ..parallel.trace import export_rank0
    from ..static.decoder import new_cache
    from ..static.export import GraphError, checked, functional

    device = "cpu" if full is not None else "meta"  # no weights: shapes only, nothing allocated
    module = _rank_module(port, tp, cpu, build, device)
    files = []
    if full is not None:
        shards = cpu.shard_checkpoint(full, module, tp)
        module.load_state_dict(shards[0], strict=True)  # rank 0, as ModelBuilder traces it
    cache = new_cache(module, spec.max_cache_len, spec.batch_size)  # the one state set every key mutates
    for key in tqdm(keys if export else [], desc="export", unit="key"):
        graph = _graph(module, spec, key, cache, logits)
        program = functional(export_rank0(graph, tuple(x.to(device) for x in _example(spec, key)), tp))
        try:
            checked(program, graph, key)
        except GraphError as e:
            raise ArtifactError(str(e)) from None
        if full is not None:  # a meta program has no weights to save
            name = GRAPHS.format(key=key)
            _atomic_write(tmp / name, lambda p: torch.export.save(program, p))
            files.append(name)
    if full is None:
        return module, files, export
    for rank, shard in enumerate(tqdm(shards, desc="shards", unit="rank")):
        name = WEIGHTS.format(rank=rank)
        # the graphs hold the model as `.model`: their parameters are named model.<rank-module name>;
        # the KV cache is state, not a weight: it is in no shard (each rank zero-initialises its own)
        state = {f"model.{k}": v.contiguous() for k, v in shard.items()}
        _atomic_write(tmp / name, lambda p: save_file(state, str(p)))
        files.append(name)
    return module, files, True


def _neuron(port, spec, keys, tp, full, tmp: Path, logits: bool, build: dict):
    """ModelBuilder: one key per bucket and the token-generation key, traced as rank 0, compiled."""
    from ..parallel import cpu, nxd
    from ..static.decoder import new_cache

    def factory(key):
        def make():  # each key's own module; its state names (cache.k0, ...) are every key's
            model = _rank_module(port, tp, nxd, build)
            return _graph(model, spec, key, new_cache(model, spec.max_cache_len, spec.batch_size, aliased=True),
                          logits)
        return make

    # the shard plan comes from a meta-device module of the same layout
    shapes = _rank_module(port, tp, cpu, build, device="meta")

    # weights only: the state is not in it. NxD cuts only its own layers' parameters and replicates the
    # rest, so the reader's split tensors go in at one rank's shape and each rank's are written after.
    own = _reader_split(full)
    checkpoint = {f"model.{k}": (_rank_piece(v, tp, 0) if k in own else v) for k, v in full.items()}
    builder, traced = nxd.trace_keys({key: (factory(key), [_example(spec, key)]) for key in keys},
                                     checkpoint_loader=lambda: checkpoint, tp=tp, workdir=tmp / "compiler")
    _atomic_write(tmp / MODEL, lambda p: torch.jit.save(traced, str(p)))
    nxd.shard_checkpoint(builder, tmp / "weights")
    shutil.rmtree(tmp / "compiler", ignore_errors=True)
    files = [MODEL] + [WEIGHTS.format(rank=r) for r in range(tp)]
    missing = [f for f in files if not (tmp / f).is_file()]
    if missing:
        raise ArtifactError(f"ModelBuilder did not write {missing}")
    if own:
        _write_reader_shards(tmp, {k: full[k] for k in own}, tp)
    return shapes, files, True  # NxD's layers carry the same partition tags as the CPU ones


def _reader_split(full: dict) -> list[str]:
    """The reader's per-rank entries of a full checkpoint (the ranks' shards concatenated on dim 0)."""
    from ..parallel import layout

    return [k for k in full if layout.placement(k) == layout.READER_SHARD]


def _rank_piece(tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    from ..parallel import layout

    return layout.split(tensor, 0, tp, rank).contiguous()


def _write_reader_shards(tmp: Path, entries: dict, tp: int) -> None:
    """Each rank's reader shard into its weights file (NxD's shard_checkpoint wrote rank 0's in all)."""
    from safetensors.torch import load_file, save_file

    for rank in range(tp):
        path = tmp / WEIGHTS.format(rank=rank)
        state = load_file(path)
        state.update({f"model.{k}": _rank_piece(v, tp, rank) for k, v in entries.items()})
        _atomic_write(path, lambda p: save_file(state, str(p)))


def _contract(module, spec, keys, logits: bool) -> tuple[dict, dict]:
    """(each key's inputs and outputs, the KV state per rank) as the manifest records them."""
    from ..static.decoder import new_cache

    cache = new_cache(module, spec.max_cache_len, spec.batch_size)
    state = {f"cache.{n}": {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
             for n, t in zip(cache.names, cache.tensors())}
    return {k: _key_contract(_graph(module, spec, k, cache, logits), spec, k) for k in keys}, state
