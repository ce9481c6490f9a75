"""trace-and-compile: the rank modules' graphs, per-rank weights and a manifest, in one directory.

The directory is the artifact contract of `artifact.py`, which serve and pull read.

On Neuron (the SDK present) the keys go through ModelBuilder (`parallel/nxd.py`), compiled for the
target the manifest records (`artifact.TARGET`: inf2, its compiler arguments and environment). `--dry-run`
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
import importlib.metadata
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..formats import quantize_state
from ..model import build_model
from ..parallel import cpu, layout, nxd, reader
from ..parallel.model import check_formats, rank_model
from ..parallel.reader import check_reader, open_shards
from ..parallel.trace import export_rank0
from ..reader.accounting import rank_geometry, solve_rank_k
from ..reader.geometry import Geometry
from ..reader.prep import model_expert_weights
from ..reader.sidecar import SidecarLayout
from ..report import (
    atomic_dir,
    check_output,
    dumps,
    file_digest,
    native_write_errors,
    read_json_object,
    run_lock,
    serializer_file,
    table,
)
from ..run_config import RunConfig
from ..spec import (
    CHANNEL_READER,
    DEFAULT_QUANTIZED_LAYERS,
    NO_QUANTIZATION,
    Reader,
    check_quantization,
    compiled_backend,
)
from ..static.decoder import Copy, Decode, Prefill, ProcessingDecode, ProcessingPrefill, Verify, new_cache, new_counts
from ..static.sampling import CANDIDATES, greedy_sampling
from ..static.export import GraphError, checked, copy_inputs, example_inputs, functional
from ..tokenizer import HFTokenizer
from .artifact import (
    FORMAT,
    GRAPHS,
    MANIFEST,
    MODEL,
    SHARD_PLAN,
    TARGET,
    TOKENIZER,
    RANK_WEIGHTS,
    COPY_KEY,
    SPECULATION_KEY,
    ArtifactError,
    is_processing,
    key_names,
    key_shape,
    key_span,
    speculative_keys,
    tokenizer_files,
)
from .plan import plan
from .preflight import refuse

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # spec.DTYPE_NAMES -> the rank modules' dtype


@dataclass(frozen=True)
class Build:
    """What trace-and-compile builds: the run configuration's backend (the rank modules at its TP
    degree and expert layout, in its compute dtype, the routed experts in its quantization, the
    reader in the decode key where it has one) from its checkpoint, written into `out`. `export=False`
    (dry run only) skips tracing: the shard plan and manifest alone. `logits`: graphs that also return
    the logits (validation), at V·4 bytes per row and step across the host. `prefix_caching`: the
    copy key, every key over the whole-row cache layout (`static/prefix.py`)."""

    config: RunConfig
    out: Path
    dry_run: bool = False
    overwrite: bool = False
    export: bool = True
    logits: bool = False
    prefix_caching: bool = False

    @classmethod
    def at(
        cls,
        tp: int,
        out: Path,
        *,
        dtype: str = "bfloat16",
        quantization: str = NO_QUANTIZATION,
        quantized_layers: tuple[str, ...] = DEFAULT_QUANTIZED_LAYERS,
        expert_layout: str | None = None,
        reader: Reader | None = None,
        checkpoint: Path | None = None,
        **build,
    ) -> Build:
        """A build of the rank modules at TP `tp`, for callers without a command line (tests, benches)."""
        backend = compiled_backend(
            "trace-and-compile", tp, quantization, dtype, expert_layout, reader, quantized_layers=quantized_layers
        )
        return cls(RunConfig(checkpoint=checkpoint, backend=backend), Path(out), **build)

    # what the build reads of its configuration
    tp = property(lambda self: self.config.backend.placement.tp)
    expert_layout = property(lambda self: self.config.backend.placement.expert_layout)
    dtype = property(lambda self: self.config.backend.dtype or "bfloat16")
    quantization = property(lambda self: self.config.backend.quantization)
    quantized_layers = property(lambda self: self.config.backend.quantized_layers)
    checkpoint = property(lambda self: self.config.checkpoint)
    reader = property(lambda self: self.config.backend.reader)


_SDK_DISTS = ("torch", "transformers", "torch-neuronx", "neuronx-distributed", "neuronx-cc", "libneuronxla")


def sdk_versions() -> dict[str, str | None]:
    out = {}
    for dist in _SDK_DISTS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _check_replaceable(out: Path, overwrite: bool) -> None:
    """Refuse an `out` that is not ours to replace: a file, a directory that is not an artifact,
    or an artifact without --overwrite."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        manifest = out / MANIFEST
        if not manifest.is_file():
            raise ArtifactError(
                f"{out} holds files but no manifest: not a trace-and-compile artifact, which "
                "--overwrite never replaces; remove it yourself, or choose another --out"
            )
        raw = read_json_object(manifest, ArtifactError, "")
        if not isinstance(raw.get("format"), int) or not isinstance(raw.get("files"), dict):
            raise ArtifactError(
                f"{manifest} is not a trace-and-compile manifest (no 'format' and 'files'); {out} is "
                "not replaced, --overwrite or not: remove it yourself, or choose another --out"
            )
        if not overwrite:
            raise ArtifactError(
                f"{out} already holds a complete artifact; pass --overwrite to replace it, or choose another --out"
            )


def _new_file(path: Path) -> Path:
    """`path` with its folder made. The run's files go straight into its private directory, which
    `atomic_dir` renames into place only when the manifest is written: none needs its own rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class _SpanDecode(Decode):
    """A decode key over the first L positions of the cache (`Decode` of span L) whose last input,
    `kv_length` [L], is never read: ModelBuilder's model routes a call to the key whose example
    inputs' shapes match (NxD's NxDModel.router), and the decode keys' other inputs are the same at
    every length, so this one's shape names L (NxDI's token-generation buckets differ by the length
    of their attention mask alike)."""

    def forward(self, input_ids, position_ids, sampling, kv_length):
        return super().forward(input_ids, position_ids, sampling)


class _SpanProcessingDecode(ProcessingDecode):
    """`ProcessingDecode` over the first L positions, `kv_length` [L] last, as `_SpanDecode`."""

    def forward(self, input_ids, position_ids, sampling, process_row, bias_ids, bias, mask, kv_length):
        return super().forward(input_ids, position_ids, sampling, process_row, bias_ids, bias, mask)


def _graph(model, spec, key: str, cache, logits: bool, counts=None):
    """Key `key`'s graph over `model`, its state `cache` (shared by every key of one model) and, for a
    logits-processing key, `counts` (the token counts every such key shares; made here when None)."""
    if key == SPECULATION_KEY:
        return Verify(model, cache, spec.decode_experts, logits)
    if key == COPY_KEY:
        return Copy(cache)
    decode, span = key_shape(key) is None, key_span(key)
    if is_processing(key):
        counts = counts if counts is not None else new_counts(model, spec.batch_size, cache.aliased)
        if decode:
            graph = ProcessingDecode if span is None else _SpanProcessingDecode
            return graph(model, cache, counts, spec.decode_experts, logits, span=span)
        return ProcessingPrefill(model, cache, counts, spec.prefill_experts)
    if decode:
        return (Decode if span is None else _SpanDecode)(model, cache, spec.decode_experts, logits, span=span)
    return Prefill(model, cache, spec.prefill_experts, logits)


def _example(spec, key: str, vocab: int | None = None, speculative=None) -> tuple:
    """A key's example inputs (a logits-processing key's need the vocabulary's size)."""
    if key == SPECULATION_KEY:
        return verify_inputs(spec.batch_size, speculative.num_speculative_tokens + 1)
    if key == COPY_KEY:
        return copy_inputs()
    shape, span = key_shape(key), key_span(key)
    vocab = vocab if is_processing(key) else None
    if shape is not None:
        return example_inputs(spec, shape[1], shape[0], vocab)
    return example_inputs(spec, None, 1, vocab) + (() if span is None else (torch.zeros(span, dtype=torch.int32),))


_INPUTS = {
    (False, True): ("input_ids", "position_ids", "sampling"),
    (False, False): ("input_ids", "attention_mask", "position_ids", "row_ids", "sampling"),
    (True, True): ("input_ids", "position_ids", "sampling", "process", "bias_ids", "bias", "mask"),
    (True, False): ("input_ids", "attention_mask", "position_ids", "row_ids", "targets"),
}


def _key_contract(graph, spec, key: str, speculative=None) -> dict:
    """A key's calls as the manifest records them: input and output names and shapes."""
    if key == SPECULATION_KEY:
        return _verify_contract(graph, spec, speculative)
    if key == COPY_KEY:
        return {"graph": COPY_KEY, "inputs": {"src_row": [1], "dst_row": [1]}, "outputs": {"dst_row": [1, 1]}}
    decode, vocab = key_shape(key) is None, graph.model.config.vocab_size
    example = _example(spec, key, vocab)
    rows = example[0].shape[0]
    if not is_processing(key):
        outputs = {"token": [rows, 1]}
    elif decode:
        outputs = {"token": [rows, 1], "logprob": [rows, 1], "rank": [rows, 1]}
        outputs |= {"top_ids": [rows, 20], "top_logprobs": [rows, 20]}
    else:
        bucket = example[0].shape[1]
        outputs = {"logprob": [rows, bucket], "rank": [rows, bucket]}
        outputs |= {"top_ids": [rows, bucket, 20], "top_logprobs": [rows, bucket, 20]}
    if graph.logits:
        outputs["logits"] = [rows, vocab]
    names = _INPUTS[is_processing(key), decode] + (("kv_length",) if key_span(key) else ())
    return {
        "graph": ("token_generation" if decode else "context_encoding") + ("_processing" if is_processing(key) else ""),
        "inputs": {n: list(x.shape) for n, x in zip(names, example)},
        "outputs": outputs,
    }


def _check_speculative(build: Build):
    """The run's `--speculative-config` (None without one), refused where this build cannot serve it:
    an assistant ("method": "mtp"), whose draft key is not built here yet (its rank modules: its
    attention reads each rank's share of the target's KV heads, so its q_proj and o_proj would be cut
    as the target's are; and its weights would need names of their own beside the target's in the one
    checkpoint every key shares), and --with-logits (the verify key returns no logits)."""
    speculative = build.config.speculative
    if speculative is None:
        return None
    if speculative.method != "ngram":
        raise ArtifactError(
            f"--speculative-config: method {speculative.method!r} (an assistant) has no draft key in an artifact "
            'yet; build with {"method": "ngram", ...} (prompt lookup: the verify key alone), or run the '
            "assistant on CPU (serve or validate --backend static)"
        )
    if build.logits:
        raise ArtifactError("--speculative-config with --with-logits: the verify key returns no logits; drop one")
    return speculative


def _slack(speculative) -> int:
    """The slots every layer of the cache holds past a row's latest (`cache.cache_layout`): the verify
    key writes its k drafts there (as `static_runtime` builds it for prompt lookup)."""
    return speculative.num_speculative_tokens if speculative else 0


def verify_inputs(batch: int, q: int) -> tuple[torch.Tensor, ...]:
    """Example (input_ids, position_ids [batch, q], sampling [batch, 4], drafted [batch], uniforms
    [batch, q]) of the verify key (`decoder.Verify`)."""
    return (
        torch.zeros(batch, q, dtype=torch.long),
        torch.arange(q).expand(batch, q).contiguous(),
        greedy_sampling(batch),
        torch.full((batch,), q - 1, dtype=torch.long),
        torch.zeros(batch, q),
    )


_VERIFY_INPUTS = ("input_ids", "position_ids", "sampling", "drafted", "uniforms")


def _verify_contract(graph, spec, speculative) -> dict:
    """The verify key's calls as the manifest records them."""
    example = verify_inputs(spec.batch_size, speculative.num_speculative_tokens + 1)
    rows, q = example[0].shape
    return {
        "graph": SPECULATION_KEY,
        "inputs": {n: list(x.shape) for n, x in zip(_VERIFY_INPUTS, example)},
        "outputs": {"tokens": [rows, q], "accepted": [rows]},
    }


def check_routes(examples: dict[str, tuple]) -> None:
    """Refuse keys whose example inputs have the very same shapes: ModelBuilder's model routes a call
    by its inputs' shapes alone (NxD's NxDModel.router, a map from the shapes to the key), so such
    keys could not be told apart. (A prefill key of a bucket of 4 and its logits-processing variant are
    one such pair, its targets [P, 4] shaped as the sampling; a verify key of 4 positions over every
    row beside such a prefill key over every row another.)"""
    seen: dict[tuple, str] = {}
    for key, inputs in examples.items():
        shapes = tuple(tuple(x.shape) for x in inputs)
        if shapes in seen:
            raise ArtifactError(
                f"keys {seen[shapes]!r} and {key!r} take inputs of the same shapes {[list(s) for s in shapes]}: "
                "NxD routes a call by its inputs' shapes, so one could not be called; change a bucket, "
                "--speculative-config's num_speculative_tokens or the prefill rows"
            )
        seen[shapes] = key


def shard_plan(module, full: dict | None, tp: int, expert_layout: str) -> dict:
    """Every tensor of the rank module: placement, partition dim and stride, full shape, per-rank
    shape, dtype."""
    plan = {}
    params = dict(module.named_parameters())
    for name, t in module.state_dict().items():
        param = params.get(name)
        split = bool(getattr(param, "tensor_model_parallel", False))
        full_shape = (
            list(full[name].shape)
            if full is not None
            else [n * (tp if split and d == param.partition_dim else 1) for d, n in enumerate(t.shape)]
        )
        plan[name] = {
            "placement": layout.placement(name, expert_layout) if split else layout.REPLICATED,
            "partition_dim": param.partition_dim if split else None,
            "partition_stride": param.partition_stride if split else None,
            "full_shape": full_shape,
            "rank_shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
        }
    return plan


def trace_and_compile(port, build: Build) -> dict:
    """Write the artifact directory `build.out` (see the module docstring); returns the manifest.
    `build.reader` (its sidecar, the DIR of `prep-reader --tp`, budget and recovery rank; the port's [reader]
    table where not given): the decode key reads through each rank's sidecar shard
    (`parallel/reader.py`), which goes into that rank's weights; a port without weights takes the
    geometry's shapes (`scan`, `recovery_rank`; no sidecar)."""
    reader = build.reader
    expert_layout, has_weights = _check_build(port, build)
    tp, out, dry_run, checkpoint, logits = build.tp, build.out, build.dry_run, build.checkpoint, build.logits
    torch_dtype, quantization = DTYPES[build.dtype], build.quantization
    spec = port.static
    speculative = _check_speculative(build)
    keys = key_names(spec.buckets, spec.rows_for(spec.batch_size), build.prefix_caching, spec.lengths[:-1])
    keys += speculative_keys(speculative and dataclasses.asdict(speculative))
    check_routes({k: _example(spec, k, port.config.vocab_size, speculative) for k in keys})
    whole_rows = build.prefix_caching
    tokenizer = _tokenizer_source(port, checkpoint, has_weights)
    sides, reads = None, None
    if reader is not None:  # every check of the reader before any weight loads
        sides, reads = _plan_reader(port, tp, quantization, expert_layout, reader, has_weights)
        spec = dataclasses.replace(spec, decode_experts=CHANNEL_READER.name)
    _check_fits(port, build, expert_layout, reads)
    check_output(out, directory=True)
    out = Path(out).resolve()
    with run_lock(out, "trace-and-compile"):
        _check_replaceable(out, build.overwrite)
        with atomic_dir(out, sweep=True) as tmp:  # sweep: holding the lock, partial siblings are dead runs'
            full = (
                _full_state(port, tp, torch_dtype, build.config.backend, checkpoint, expert_layout, sides)
                if has_weights
                else None
            )
            modules = dict(
                expert_layout=expert_layout,
                quantization=quantization,
                quantized_layers=build.quantized_layers,
                dtype=torch_dtype,
                reader=reads,
            )
            if dry_run:
                module, files, exported = _dry_run(
                    port, spec, keys, tp, full, tmp, build.export, logits, modules, whole_rows, speculative
                )
            else:
                module, files, exported = _neuron(
                    port, spec, keys, tp, full, tmp, logits, modules, whole_rows, speculative
                )
            plan = shard_plan(module, full, tp, expert_layout)
            (tmp / SHARD_PLAN).write_text(dumps(plan, indent=1))
            copied = _copy_tokenizer(tokenizer, tmp)
            files = [*files, SHARD_PLAN, *copied]
            contract, state = _contract(module, spec, keys, logits, whole_rows, speculative)
            digests = {f: file_digest(tmp / f) for f in sorted(files)}
            manifest = {
                "format": FORMAT,
                "port": port.name,
                "dtype": build.dtype,
                "quantization": build.quantization,
                "quantized_layers": list(build.quantized_layers),
                "tp": tp,
                "expert_layout": expert_layout,
                **spec.shapes().manifest_fields(),
                "candidates": min(CANDIDATES, port.config.vocab_size),
                "logits": logits,
                "prefix_caching": whole_rows,
                "speculative": speculative and dataclasses.asdict(speculative),
                "keys": {k: dict(contract[k], exported=exported) for k in keys},
                "state": state,
                "dry_run": dry_run,
                "target": TARGET,  # a dry run records the target its graphs would be compiled for
                "weights": full is not None,
                "versions": sdk_versions(),
                "reader": None if reads is None else {k: v for k, v in reads.items() if k != "layout"},
                "tokenizer": {"kind": port.tokenizer, **({} if port.tokenizer == "bytes" else {"files": copied})},
                "files": {f: {"size": d.size, "sha256": d.sha256} for f, d in digests.items()},
            }
            (tmp / MANIFEST).write_text(dumps(manifest, indent=1) + "\n")
    return dict(manifest, out=str(out))


def _check_build(port, build: Build) -> tuple[str, bool]:
    """(the expert layout, whether weights are at hand): the checks of `build` that need no model, made
    before any work: the dtype and quantization, the port's [static] table, the TP degree in the layout
    (and the weight format's groups), the Neuron SDK unless a dry run, and weights unless a dry run."""
    if build.dtype not in DTYPES:
        raise ArtifactError(f"dtype {build.dtype!r} is not one of {sorted(DTYPES)}")
    check_quantization(build.quantization)
    port.static_spec("trace-and-compile")
    expert_layout = build.expert_layout or port.static.expert_layout
    layout.check_degree(port.config, build.tp, expert_layout)
    check_formats(port.config, build.tp, expert_layout, build.quantization, build.quantized_layers)
    if not build.dry_run and not nxd.sdk_available():
        raise nxd.NeuronSDKMissing(
            "trace-and-compile needs the Neuron SDK (neuronx-distributed, torch-neuronx), which is not installed "
            "here: run it on an inf2 instance in the Neuron DLC (recipes/inf2-24xlarge/), or pass --dry-run to "
            "build and export the same rank modules on CPU"
        )
    has_weights = build.checkpoint is not None or port.checkpoint is not None or port.weights_source == "random"
    if not build.dry_run and not has_weights:
        raise ArtifactError(f"port {port.name!r} has no embedded weights: pass --checkpoint DIR")
    return expert_layout, has_weights


def _check_fits(port, build: Build, expert_layout: str, reads: dict | None) -> None:
    """The planner's verdict (`plan.py`) on what each NeuronCore would hold at these shapes, before
    any work; float32 (a CPU dtype, for checks) is not planned."""
    if build.dtype == "float32":
        return
    spec, tp = port.static, build.tp
    reader = (
        None
        if reads is None
        else Reader(budget=reads["budget"], scan=reads["scan"], recovery_rank=reads["recovery_rank"])
    )
    verdict = plan(
        port.config,
        None,
        tp,
        build.quantization,
        spec.batch_size,
        spec.max_cache_len,
        model=port.name,
        expert_layout=expert_layout,
        decode_experts=spec.decode_experts,
        reader=reader,
        prefix_caching=build.prefix_caching,
        quantized_layers=build.quantized_layers,
    )
    if not verdict["fits"]:
        quantized = ", ".join(build.quantized_layers)
        raise ArtifactError(
            f"port {port.name!r} at TP {tp}, {build.dtype}"
            f"{'' if build.quantization == NO_QUANTIZATION else f', {build.quantization} {quantized}'}, batch "
            f"{spec.batch_size}, seq "
            f"{spec.max_cache_len}: {verdict['reason']} (`neuron-moe plan` shows what each "
            "NeuronCore holds)"
        )


def _tokenizer_source(port, checkpoint, has_weights: bool) -> Path | None:
    """The checkpoint directory whose tokenizer the artifact carries, checked to load before any work;
    None for the byte tokenizer, or for a port without weights here (shapes only: no tokenizer)."""
    if port.tokenizer == "bytes" or not has_weights:
        return None
    source = Path(checkpoint or port.checkpoint)
    tokenizer_files(source)
    HFTokenizer(source)  # a tokenizer that does not load is refused now, not by the server that reads it
    return source


def _copy_tokenizer(source: Path | None, tmp: Path) -> list[str]:
    """The tokenizer's files copied into the artifact (TOKENIZER/), as the manifest names them."""
    if source is None:
        return []
    names = [f"{TOKENIZER}/{n}" for n in tokenizer_files(source)]
    for name in names:
        shutil.copyfile(source / Path(name).name, _new_file(tmp / name))
    return names


def _full_state(port, tp, torch_dtype, backend, checkpoint, expert_layout, sides=None) -> dict:
    """The whole model in the parallel layout (the backend's quantized layers in its format), named as
    the rank module;
    with the reader's shards `sides`, their entries too (checked against these weights)."""
    hf = build_model(port, "eager", torch_dtype, checkpoint)
    if sides is not None:
        sides[0].check_source(model_expert_weights(hf))
    full = layout.parallel_state_dict(hf.state_dict(), hf.config, tp, expert_layout)
    # tensor by tensor, each float linear dropped after
    full = quantize_state(full, backend.quantization, backend.quantized_layers)
    return full if sides is None else {**full, **reader.full_state(sides)}


def _plan_reader(port, tp: int, quantization: str, expert_layout: str, options: Reader, has_weights: bool):
    """(each rank's shard or None, the settings the graphs are built with) of `--reader`."""
    check_reader(expert_layout, quantization, options.budget)
    options = options.over(port.reader)
    if has_weights:
        if options.sidecar is None:
            raise ArtifactError(
                "--reader needs --sidecar DIR (from `neuron-moe prep-reader --tp "
                f"{tp} --out DIR`) for a port with weights"
            )
        sides, k, rank = open_shards(port.config, options.sidecar, tp, options.budget, options.recovery_rank)
        scan, local, digest = sides[0].scan, sides[0].layout, sides[0].source_sha256
    else:  # shapes only (the meta device): the geometry's sidecar layout
        if options.sidecar is not None:
            raise ArtifactError(
                f"port {port.name!r} has no weights here: --reader builds shapes only (meta device), "
                f"a sidecar is not read; drop --sidecar or pass --checkpoint DIR"
            )
        geo, settings = Geometry.from_config(port.config), options.resolved()
        rank, scan = settings.recovery_rank, settings.scan
        k, sides, digest = solve_rank_k(geo, settings, options.budget, tp), None, None
        local = SidecarLayout(rank_geometry(geo, tp), rank)
    return sides, {
        "budget": options.budget,
        "k_per_rank": k,
        "scan": scan,
        "recovery_rank": rank,
        "source_sha256": digest,
        "layout": local,
    }


def _rank_module(port, tp, layers, build: dict, device="cpu"):
    """One rank's model (`parallel/model.py`), with the reader's shard module when `build` has one."""
    options = {k: v for k, v in build.items() if k != "reader"}
    model = rank_model(port.config, tp, layers, device=device, **options)
    reads = build.get("reader")
    if reads is not None:
        reader.attach(model, reads["layout"], tp, reads["k_per_rank"], reads["scan"], reads["recovery_rank"])
    return model


def _dry_run(
    port, spec, keys, tp, full, tmp: Path, export: bool, logits: bool, build: dict, whole_rows: bool, speculative=None
):
    device = "cpu" if full is not None else "meta"  # no weights: shapes only, nothing allocated
    module = _rank_module(port, tp, cpu, build, device)
    files = []
    if full is not None:
        shards = cpu.shard_checkpoint(full, module, tp)
        module.load_state_dict(shards[0], strict=True)  # rank 0, as ModelBuilder traces it
    slack = _slack(speculative)
    cache = new_cache(module, spec.max_cache_len, spec.batch_size, whole_rows=whole_rows, slack=slack)  # every key's
    counts = new_counts(module, spec.batch_size)  # and the one the logits-processing keys mutate too
    vocab = port.config.vocab_size
    for key in tqdm(keys if export else [], desc="export", unit="key"):
        graph = _graph(module, spec, key, cache, logits, counts)
        example = _example(spec, key, vocab, speculative)
        program = functional(export_rank0(graph, tuple(x.to(device) for x in example), tp))
        try:
            checked(program, graph, key)
        except GraphError as e:
            raise ArtifactError(str(e)) from None
        refuse(program, key, TARGET["name"])  # what neuronx-cc documents it refuses, before it is written
        if full is not None:  # a meta program has no weights to save
            name = GRAPHS.format(key=key)
            with serializer_file(_new_file(tmp / name)) as f:
                torch.export.save(program, f)
            files.append(name)
    if full is None:
        return module, files, export
    for rank, shard in enumerate(tqdm(shards, desc="shards", unit="rank")):
        name = RANK_WEIGHTS.format(rank=rank)
        # the graphs hold the model as `.model`: their parameters are named model.<rank-module name>;
        # the KV cache is state, not a weight: it is in no shard (each rank zero-initialises its own)
        state = {f"model.{k}": v.contiguous() for k, v in shard.items()}
        with native_write_errors(tmp / name):
            save_file(state, _new_file(tmp / name))
        files.append(name)
    return module, files, True


def _neuron(port, spec, keys, tp, full, tmp: Path, logits: bool, build: dict, whole_rows: bool, speculative=None):
    """ModelBuilder: one key per bucket and per decode length (and the verify key), traced as rank 0,
    compiled."""

    def factory(key):
        def make():  # each key's own module; its state names (cache.k0, ..., counts.output, ...) are every key's
            model = _rank_module(port, tp, nxd, build)
            slack = _slack(speculative)
            cache = new_cache(
                model, spec.max_cache_len, spec.batch_size, aliased=True, whole_rows=whole_rows, slack=slack
            )
            return _graph(model, spec, key, cache, logits)

        return make

    # the shard plan comes from a meta-device module of the same layout
    shapes = _rank_module(port, tp, cpu, build, device="meta")

    # weights only: the state is not in it. NxD cuts only its own layers' parameters and replicates the
    # rest, so the reader's split tensors go in at one rank's shape and each rank's are written after.
    own = _reader_split(full)
    checkpoint = {f"model.{k}": (_rank_piece(v, tp, 0) if k in own else v) for k, v in full.items()}
    with _environment(TARGET["env"]):  # neuronx-cc runs in processes that inherit it
        builder, traced = nxd.trace_keys(
            {key: (factory(key), [_example(spec, key, port.config.vocab_size, speculative)]) for key in keys},
            checkpoint_loader=lambda: checkpoint,
            tp=tp,
            workdir=tmp / "compiler",
            compiler_args=" ".join(TARGET["compiler_args"]),
        )
    with serializer_file(tmp / MODEL) as f:
        torch.jit.save(traced, f)
    nxd.shard_checkpoint(builder, tmp / "weights")
    shutil.rmtree(tmp / "compiler", ignore_errors=True)
    files = [MODEL] + [RANK_WEIGHTS.format(rank=r) for r in range(tp)]
    missing = [f for f in files if not (tmp / f).is_file()]
    if missing:
        raise ArtifactError(f"ModelBuilder did not write {missing}")
    if own:
        _write_reader_shards(tmp, {k: full[k] for k in own}, tp)
    return shapes, files, True  # NxD's layers carry the same partition tags as the CPU ones


@contextmanager
def _environment(env: dict[str, str]):
    """`env` set in this process's environment while the block runs (the compile target's), then
    each variable put back as it was."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _reader_split(full: dict) -> list[str]:
    """The reader's per-rank entries of a full checkpoint (the ranks' shards concatenated on dim 0)."""
    return [k for k in full if layout.placement(k) == layout.READER_SHARD]


def _rank_piece(tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return layout.split(tensor, 0, tp, rank).contiguous()


def _write_reader_shards(tmp: Path, entries: dict, tp: int) -> None:
    """Each rank's reader shard into its weights file (NxD's shard_checkpoint wrote rank 0's in all)."""
    for rank in range(tp):
        path = tmp / RANK_WEIGHTS.format(rank=rank)
        state = load_file(path)
        state.update({f"model.{k}": _rank_piece(v, tp, rank) for k, v in entries.items()})
        with native_write_errors(path):
            save_file(state, path)


def _contract(module, spec, keys, logits: bool, whole_rows: bool, speculative=None) -> tuple[dict, dict]:
    """(each key's inputs and outputs, the KV state per rank) as the manifest records them."""
    cache = new_cache(module, spec.max_cache_len, spec.batch_size, whole_rows=whole_rows, slack=_slack(speculative))
    counts = new_counts(module, spec.batch_size)
    state = {
        f"{prefix}.{n}": {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for prefix, held in (("cache", cache), ("counts", counts))
        for n, t in zip(held.names, held.tensors())
    }
    contracts = {k: _key_contract(_graph(module, spec, k, cache, logits, counts), spec, k, speculative) for k in keys}
    return contracts, state


def render_trace_and_compile(report: dict) -> str:
    rows = [{"file": f, "bytes": v["size"], "sha256": v["sha256"]} for f, v in report["files"].items()]
    what = "dry run (CPU, gloo layers; exported, not compiled)" if report["dry_run"] else "compiled for Neuron"
    lines = [
        table(rows, [("file", "file"), ("bytes", "bytes"), ("sha256", "sha256")]),
        f"\n{report['out']}: {report['port']} {report['dtype']} TP {report['tp']}, {report['expert_layout']} "
        f"expert layout, keys {', '.join(report['keys'])}; {what}"
        + ("" if report["weights"] else "; no weights (meta device): exported, manifest and shard plan only"),
    ]
    if report.get("speculative"):
        k = report["speculative"]["num_speculative_tokens"]
        lines.append(
            f"speculation key: the verify graph over k + 1 = {k + 1} positions per row "
            f"({report['speculative']['method']}), every layer of the cache {k} slots longer"
        )
    if report.get("reader"):
        r = report["reader"]
        lines.append(
            f"decode key reads through the reader: budget {r['budget']:g} %, {r['k_per_rank']} exact "
            f"channels per token and rank, scan {r['scan']}, recovery rank {r['recovery_rank']} (each rank's "
            f"sidecar shard in its weights)"
        )
    return "\n".join(lines)
