"""The trace-and-compile artifact: what `neuron/compile.py` writes and `serve/neuron.py` reads,
defined here once.

    manifest.json   MANIFEST_FIELDS below (dtype: the compute dtype, quantization: the weight
                    format of the linears quantized_layers names, expert_layout: how the graphs split the experts,
                    `parallel/layout.py`; target: the compile target, TARGET below), plus each
                    key's inputs and outputs, the state, the reader (`--reader`: budget,
                    k_per_rank, scan, recovery_rank, source_sha256; null without), and the files'
                    sizes and sha256
    model.pt        torch.jit.save of ModelBuilder.trace(initialize_model_weights=False): one
                    context-encoding key per prefill bucket and a token-generation key per decode length
    weights/tp{r}_sharded_checkpoint.safetensors   rank r's weights (ModelBuilder.shard_checkpoint),
                    in the manifest's expert layout (`load_streamed` and `load_shards` refuse
                    one of the other); served by `load_streamed`, a load group (a decoder
                    layer) of one rank at a time, so the host never holds a whole shard;
                    with the reader, rank r's sidecar shard too (`<...>.experts.reader.*`)
    shard_plan.json every rank-module tensor: placement, partition dim and stride, full and
                    per-rank shape, dtype
    tokenizer/      the checkpoint's tokenizer files (tokenizer.json or tokenizer.model, its config,
                    the chat template), copied in at build time so that the artifact alone serves;
                    the manifest's `tokenizer` names them ({"kind": "checkpoint", "files": [...]},
                    or {"kind": "bytes"}: the built-in byte tokenizer) and `files` holds their
                    digests, checked before they are read (`check_tokenizer`)

Each key is the static decoder (`static/decoder.py`) over the full-model rank module
(`parallel/model.py`); B = batch_size, the rows of the KV cache, P one of prefill_rows:

    context_encoding_<P>x<b>  (input_ids, attention_mask, position_ids [P, b], row_ids [P],
                              sampling [P, 4]) -> token [P, 1]
                              P chunks of prompts, each left-padded to the bucket, into cache rows
                              row_ids (a chunk that is not a prompt's first attends to its row's cache)
    token_generation          (input_ids [B, 1], position_ids [B, 1], sampling [B, 4]) -> token [B, 1]
                              every row at its own position, attending over the whole cache
    token_generation_<L>      (input_ids [B, 1], position_ids [B, 1], sampling [B, 4], kv_length [L])
                              -> token [B, 1]: the same over the first L positions of the cache, one
                              key per decode length below max_cache_len (the manifest's
                              decode_lengths; NxDI's token-generation buckets); a step runs the
                              smallest above every row's position. kv_length is never read: NxD
                              routes a call by its inputs' shapes alone, and its shape names L
    context_encoding_processing_<P>x<b>  (input_ids, attention_mask, position_ids [P, b], row_ids [P],
                              targets [P, b]) -> logprob, rank [P, b], top_ids, top_logprobs [P, b, 20]
    token_generation_processing  (input_ids, position_ids [B, 1], sampling [B, 4], process [B, 7],
                              bias_ids, bias [B, 64], mask [B, ceil(V/32)] int32) -> token [B, 1],
                              logprob, rank [B, 1], top_ids, top_logprobs [B, 20]
                              the logits-processing variants (`static/decoder.py`), for the rows
                              that ask for logprobs, penalties, logit_bias, min_p, bans or a grammar;
                              they also hold the token counts as state (`counts.output`,
                              `counts.prompt` [B, V] fp32)
    token_generation_processing_<L>  the variant over the first L positions, kv_length [L] last
    prefix_copy               (src_row [1], dst_row [1]) -> dst_row [1, 1]
                              built --enable-prefix-caching (the manifest's `prefix_caching`): a cache
                              row copied whole into another (`static/prefix.py`); every key's cache is
                              then in the whole-row layout (sliding layers keep every position)
    speculation               (input_ids, position_ids [B, q], sampling [B, 4], drafted [B], uniforms
                              [B, q]) -> tokens [B, q], accepted [B] (, hidden [B, q, H])
                              built --speculative-config (the manifest's `speculative`, its JSON as
                              parsed): the target's verify graph (`decoder.Verify`) over q = k + 1
                              positions per row (NxDI's speculation_model); every key's cache is then
                              k slots longer per layer (k + 1 with an assistant: `cache.cache_layout`'s
                              slack), and with an assistant it also returns the final hidden state
    draft                     (last_ids [B], hidden [B, H], positions [B]) -> tokens [B, k], logits
                              [B, k, V]: the assistant's k draft steps over the target's KV
                              (`static/draft.py`), built for an assistant ("method": "mtp"); it reads
                              the state and writes it back unchanged (every key aliases the same state)

Each graph chooses its tokens itself (`static/sampling.py`: per row temperature, top-k, top-p and
a uniform draw; greedy at temperature 0) among `candidates` for top-k / top-p, so per call only
the ids, positions and sampling go in and the tokens come out. A server prefills a prompt longer
than `prefill_chunk` (a bucket) a chunk per call. An artifact built with `logits=True`
(`--with-logits`) also returns the fp32 logits [rows, V] after the token (validation); the default
returns the token alone. The KV cache is the graphs' state, never an input or output:
`cache.k{i}` / `cache.v{i}` per layer, [B, KV heads of the rank, ring length, head_dim], aliased
parameters (`input_output_aliases`) that every key shares and NxD zero-initialises on each rank
(the manifest's `state`). A manifest of another format is refused by its format number alone,
before any other field is read.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import SIZES
from ..errors import UserError
from ..formats import format_of
from ..parallel import layout
from ..parallel.layout import DEFAULT_EXPERT_LAYOUT, EXPERT_LAYOUTS
from ..port import MAX_BATCH, MAX_BUCKETS
from ..report import dumps, file_digest, loads_json, read_json_object
from ..spec import DTYPE_NAMES, LAYER_GROUPS, QUANTIZATIONS, TP_DEGREES, layer_group
from ..speculative import SpeculativeConfig
from ..static.sampling import CANDIDATES
from ..tokenizer import TOKENIZER_FILES, TOKENIZER_MODELS

MANIFEST = "manifest.json"
MODEL = "model.pt"
RANK_WEIGHTS = "weights/tp{rank}_sharded_checkpoint.safetensors"
SHARD_PLAN = "shard_plan.json"
GRAPHS = "graphs/{key}.pt2"  # dry run: the exported rank-0 programs
TOKENIZER = "tokenizer"  # the folder of the tokenizer's files
_SHA256 = re.compile(r"[0-9a-f]{64}")
FORMAT = 10
# The compile target: the instance family neuronx-cc compiles for (its `--target`: "generate code for
# an inf2 instance type", neuronx-cc's CLI reference, which lists inf2, trn1, trn1n and trn2), the
# arguments ModelBuilder hands it (`ModelBuilder.add`'s own default, `append_default_compiler_flags`
# at NxD fbac349, with the target: left to itself the compiler takes the target of the machine it
# runs on, or of an import that sets one, and NxDI's Gemma-4 port met "NEFF arch: v3, instance arch:
# v2" on inf2, aws-neuron/neuronx-distributed-inference PR #106), and the environment the compile and
# the runtime need on it (that PR: NEURON_LOGICAL_NC_CONFIG=1 on inf2; one physical NeuronCore per
# logical one is the only configuration before trn2, neuronx-cc's NCC_EARG001). Written into the
# manifest; the server refuses another target's.
TARGET = {
    "name": "inf2",
    "compiler_args": ["--enable-saturate-infinity", "--auto-cast=none", "--model-type=transformer", "-O1"]
    + ["--target", "inf2"],
    "env": {"NEURON_LOGICAL_NC_CONFIG": "1"},
}
# field -> type; what a server needs to call the graphs and to read and write text
MANIFEST_FIELDS = {
    "format": int,
    "port": str,
    "dtype": str,
    "quantization": str,
    "quantized_layers": list,
    "tp": int,
    "expert_layout": str,
    "buckets": list,
    "max_cache_len": int,
    "batch_size": int,
    "prefill_rows": list,
    "prefill_chunk": int,
    "decode_lengths": list,
    "candidates": int,
    "dry_run": bool,
    "logits": bool,
    "weights": bool,
    "target": dict,
    "tokenizer": dict,
    "keys": dict,
    "state": dict,
    "files": dict,
}
_PORT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a name `load_port` looks up, never a path
_RANK_SHARD = re.compile(re.escape(RANK_WEIGHTS).replace(re.escape("{rank}"), "[0-9]+"))
MAX_CACHE_LEN = SIZES["max_position_embeddings"][1]  # no model's context is longer


class ArtifactError(UserError):
    pass


def read_manifest(artifacts: Path) -> dict:
    """The manifest of an artifact directory, every field of the contract checked."""
    path = Path(artifacts) / MANIFEST
    manifest = read_json_object(
        path, ArtifactError, f"{artifacts}: no {MANIFEST} (expected a trace-and-compile output directory)"
    )
    return check_manifest(manifest, path)


def check_manifest(manifest: dict, path) -> dict:
    """`manifest` (a JSON object read from `path`), every field of the contract checked."""
    if type(manifest.get("format")) is not int:
        raise ArtifactError(f"{path}: field 'format' is missing or not an int")
    if manifest["format"] != FORMAT:
        raise ArtifactError(
            f"{path}: artifact format {manifest['format']}, this version reads {FORMAT} "
            f"(rebuild it with this version's trace-and-compile)"
        )
    for key, kind in MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            raise ArtifactError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
    if manifest["expert_layout"] not in EXPERT_LAYOUTS:
        raise ArtifactError(f"{path}: expert_layout {manifest['expert_layout']!r} is not one of {list(EXPERT_LAYOUTS)}")
    _check_ranges(manifest, path)
    buckets = manifest["buckets"]
    if (
        not 0 < len(buckets) <= MAX_BUCKETS
        or not all(_count(b) and b <= manifest["max_cache_len"] for b in buckets)
        or buckets != sorted(set(buckets))
    ):
        raise ArtifactError(
            f"{path}: 'buckets' must be 1 to {MAX_BUCKETS} strictly increasing positive lengths up to "
            f"max_cache_len ({manifest['max_cache_len']}), got {buckets}"
        )
    rows = manifest["prefill_rows"]
    batch = manifest["batch_size"]
    if not 0 < len(rows) <= MAX_BUCKETS or not all(_count(p) and p <= batch for p in rows) or rows != sorted(set(rows)):
        raise ArtifactError(
            f"{path}: 'prefill_rows' must be increasing row counts of at least 1 and at most "
            f"batch_size ({manifest['batch_size']}), got {rows}"
        )
    if manifest["prefill_chunk"] not in buckets:
        raise ArtifactError(f"{path}: 'prefill_chunk' {manifest['prefill_chunk']} is not one of the buckets {buckets}")
    lengths = manifest["decode_lengths"]
    if (
        not 0 < len(lengths) <= MAX_BUCKETS
        or not all(_count(n) for n in lengths)
        or lengths != sorted(set(lengths))
        or lengths[-1] != manifest["max_cache_len"]
    ):
        raise ArtifactError(
            f"{path}: 'decode_lengths' must be 1 to {MAX_BUCKETS} strictly increasing positive lengths, the last "
            f"max_cache_len ({manifest['max_cache_len']}), got {lengths}"
        )
    if not isinstance(manifest.get("prefix_caching", False), bool):  # absent: built without the copy key
        raise ArtifactError(f"{path}: 'prefix_caching' must be true or false, got {manifest['prefix_caching']!r}")
    check_speculative_field(manifest.get("speculative"), manifest["keys"], path)
    _check_target_field(manifest["target"], path)
    tokenizer = manifest["tokenizer"]
    files = tokenizer.get("files", [])
    if (
        tokenizer.get("kind") not in ("bytes", "checkpoint")
        or not isinstance(files, list)
        or not all(
            isinstance(f, str) and f.startswith(TOKENIZER + "/") and _digest_entry(manifest["files"].get(f))
            for f in files
        )
    ):
        raise ArtifactError(
            f'{path}: \'tokenizer\' must be {{"kind": "bytes"}} or {{"kind": "checkpoint", '
            f"\"files\": [...]}} naming files of {TOKENIZER}/ that 'files' lists, got {tokenizer}"
        )
    for name, entry in manifest["files"].items():
        parts = name.split("/")
        if name == MANIFEST or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ArtifactError(f"{path}: files[{name!r}] is not a plain relative path of a file beside it")
        if not _digest_entry(entry) or entry["size"] < 0 or not _SHA256.fullmatch(entry["sha256"]):
            raise ArtifactError(f'{path}: files[{name!r}] must be {{"size": bytes, "sha256": hex digest}}, got {entry}')
    _check_keys_and_state(manifest, path)
    _check_file_list(manifest, path)
    return manifest


def _check_ranges(manifest: dict, path) -> None:
    """The scalar fields of the contract, each within what this version builds: the words it knows,
    a port's name (never a path: the SageMaker entrypoint serves the port the manifest names), a TP
    degree of TP_DEGREES, and counts within the bounds the command line and port files hold them to."""
    port = manifest["port"]
    if not _PORT_NAME.fullmatch(port) or port.endswith(".toml"):
        raise ArtifactError(f"{path}: 'port' {port!r} is not a port's name (letters, digits, '.', '_' and '-')")
    for key, known in (("dtype", DTYPE_NAMES), ("quantization", QUANTIZATIONS)):
        if manifest[key] not in known:
            raise ArtifactError(f"{path}: {key!r} {manifest[key]!r} is not one of {list(known)}")
    layers = manifest["quantized_layers"]
    if not layers or list(layers) != [group for group in LAYER_GROUPS if group in layers]:
        raise ArtifactError(
            f"{path}: 'quantized_layers' {layers!r} is not a list of layer groups (of {list(LAYER_GROUPS)}, in order)"
        )
    if type(manifest["tp"]) is not int or manifest["tp"] not in TP_DEGREES:
        raise ArtifactError(f"{path}: 'tp' {manifest['tp']!r} is not a TP degree (one of {list(TP_DEGREES)})")
    for key, most in (("max_cache_len", MAX_CACHE_LEN), ("batch_size", MAX_BATCH), ("candidates", CANDIDATES)):
        if not _count(manifest[key]) or manifest[key] > most:
            raise ArtifactError(f"{path}: {key!r} must be a count from 1 to {most}, got {manifest[key]!r}")


def _check_keys_and_state(manifest: dict, path) -> None:
    """`keys`: exactly the graphs the shapes make (`key_names`), each with its inputs and outputs;
    `state`: the KV cache's (and counts') tensors, each a shape of positive sizes and a dtype."""
    spans = manifest["decode_lengths"][:-1]
    want = key_names(manifest["buckets"], manifest["prefill_rows"], manifest.get("prefix_caching") is True, spans)
    want = want + speculative_keys(manifest.get("speculative"))
    keys = manifest["keys"]
    if sorted(keys) != sorted(want):
        missing, extra = sorted(set(want) - set(keys)), sorted(set(keys) - set(want))
        raise ArtifactError(
            f"{path}: 'keys' must be the graphs of its buckets and prefill_rows; "
            + (f"missing {missing}" if missing else f"not one of them: {extra}")
        )
    for name, key in keys.items():
        if not isinstance(key, dict) or not all(isinstance(key.get(k), dict) for k in ("inputs", "outputs")):
            raise ArtifactError(f"{path}: keys[{name!r}] must hold its 'inputs' and 'outputs'")
    state = manifest["state"]
    if not state or not all(
        isinstance(t, dict)
        and isinstance(t.get("dtype"), str)
        and isinstance(t.get("shape"), list)
        and all(_count(n) for n in t["shape"])
        for t in state.values()
    ):
        raise ArtifactError(
            f'{path}: \'state\' must name the graphs\' state tensors, each {{"shape": [...], "dtype": str}}'
        )


def _check_file_list(manifest: dict, path) -> None:
    """The files the contract implies, in the manifest's `files`: a weight shard per rank (none
    without weights), the shard plan, and the compiled model unless a dry run."""
    files = manifest["files"]
    shards = sorted(name for name in files if _RANK_SHARD.fullmatch(name))
    want = [RANK_WEIGHTS.format(rank=r) for r in range(manifest["tp"])] if manifest["weights"] else []
    if shards != sorted(want):
        raise ArtifactError(
            f"{path}: 'tp' {manifest['tp']} with weights {str(manifest['weights']).lower()} takes "
            f"{len(want)} rank shard(s), 'files' lists {len(shards)}: {shards}"
        )
    if SHARD_PLAN not in files:
        raise ArtifactError(f"{path}: 'files' lists no {SHARD_PLAN}")
    if not manifest["dry_run"] and MODEL not in files:
        raise ArtifactError(f"{path}: 'dry_run' is false, but 'files' lists no {MODEL} (the compiled model)")


def check_weight_dtypes(manifest: dict, dtypes: dict, where) -> None:
    """Every linear's weight stored as its format says (`formats.format_of` over the manifest's
    quantization and quantized_layers; unquantized: its compute dtype): `dtypes` is a tensor's name ->
    its dtype (torch's spelling), from the shard plan or a rank shard's header (`where`). Refused where
    no routed experts' weight is there at all."""
    compute = getattr(torch, manifest["dtype"])
    linears = {name: dtype for name, dtype in dtypes.items() if layer_group(name) is not None}
    if not any(layer_group(name) == "experts" for name in linears):
        raise ArtifactError(f"{where}: holds none of the routed experts' weights (*.experts.*_proj.weight)")
    for name, dtype in sorted(linears.items()):
        fmt = format_of(name, manifest["quantization"], manifest["quantized_layers"])
        want = str(fmt.stored(compute)).removeprefix("torch.")
        if dtype != want:
            raise ArtifactError(
                f"{where}: {name} is {dtype}, but the manifest says quantization {manifest['quantization']!r} "
                f"on {', '.join(manifest['quantized_layers'])}, dtype {manifest['dtype']!r} (so {want})"
            )


def _check_target_field(target: dict, path) -> None:
    """The manifest's `target`: {"name": str, "compiler_args": [str, ...], "env": {str: str}}."""
    args, env = target.get("compiler_args"), target.get("env")
    if (
        not isinstance(target.get("name"), str)
        or not isinstance(args, list)
        or not all(isinstance(a, str) for a in args)
        or not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise ArtifactError(
            f'{path}: \'target\' must be {{"name": str, "compiler_args": [str, ...], "env": {{str: str}}}}, '
            f"got {target}"
        )


def check_target(manifest: dict, artifacts, target: dict = TARGET) -> None:
    """Refuse an artifact compiled for another target than `target` (this version's, TARGET), naming both."""
    if manifest["target"]["name"] != target["name"]:
        raise ArtifactError(
            f"{artifacts}: compiled for the {manifest['target']['name']!r} target, served here on "
            f"{target['name']!r}: rebuild it with this version's trace-and-compile, which compiles for "
            f"{target['name']!r}"
        )


def check_files(artifacts, listed: dict[str, dict], found: dict[str, tuple[int, str]]) -> None:
    """The files found in an artifact, or in a part of it (path under it -> (size, sha256), the
    manifest itself aside), against the manifest's entries for them (`listed`: its `files`, or the
    part's): each listed one there with its size and sha256, and nothing else. Refused by the first
    file's name that is not so."""
    where = str(artifacts).rstrip("/")
    extra = sorted(set(found) - set(listed))
    if extra:
        raise ArtifactError(
            f"{where}/{extra[0]}: not in the artifact's manifest (added after trace-and-compile); "
            "remove it or rebuild the artifact"
        )
    for name, want in sorted(listed.items()):
        if name not in found:
            raise ArtifactError(f"{where}/{name}: missing (the manifest lists it); restore the artifact or rebuild it")
        size, sha256 = found[name]
        if (size, sha256) != (want["size"], want["sha256"]):
            raise ArtifactError(
                f"{where}/{name}: sha256 {sha256[:16]}… ({size} bytes) is not the manifest's "
                f"{want['sha256'][:16]}… ({want['size']} bytes): the file changed after "
                "trace-and-compile; restore it or rebuild the artifact"
            )


def check_port(manifest: dict, port, artifacts) -> None:
    """An artifact built for `port`: its name, its tokenizer's kind, its expert layout."""
    if manifest["port"] != port.name:
        raise ArtifactError(f"{artifacts}: built for port {manifest['port']!r}, not {port.name!r}")
    if manifest["tokenizer"]["kind"] != port.tokenizer:
        raise ArtifactError(
            f"{artifacts}: built with the {manifest['tokenizer']['kind']!r} tokenizer, port {port.name!r} "
            f"takes {port.tokenizer!r}"
        )
    check_expert_layout(manifest, port.static.expert_layout if port.static else DEFAULT_EXPERT_LAYOUT, artifacts)


def regular_files(root: Path) -> list[tuple[str, Path]]:
    """Every file under root: (its path under root, its path), sorted. A symbolic link to a file or
    to a folder is followed (what it reaches is read like the rest, by content); anything that is not
    a regular file - a FIFO, a device (a link to /dev/zero), a socket, a dangling link, a link to a
    folder that holds it (a loop) - is refused by name: reading it would block, never end, or fail."""
    root = Path(root)
    found, todo = [], [(root, frozenset({_inode(root)}))]
    while todo:
        folder, above = todo.pop()
        with os.scandir(folder) as entries:
            paths = [Path(e.path) for e in entries]
        for path in paths:
            try:
                st = os.stat(path)
            except OSError as e:
                raise ArtifactError(f"{path}: cannot be read ({e.strerror}; a dangling link?)") from None
            if stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in above:
                    raise ArtifactError(f"{path}: a symbolic link to a folder that holds it (a loop)")
                todo.append((path, above | {(st.st_dev, st.st_ino)}))
            elif stat.S_ISREG(st.st_mode):
                found.append((path.relative_to(root).as_posix(), path))
            else:
                raise ArtifactError(f"{path}: not a regular file (a FIFO, a device or a socket); remove it")
    return sorted(found)


def _inode(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def directory_files(root: Path, progress=None) -> dict[str, tuple[int, str]]:
    """Every file under root but its manifest (`regular_files`): path under root -> (size, sha256)."""
    found = {}
    for rel, path in regular_files(root):
        if rel != MANIFEST:
            digest = file_digest(path, progress)
            found[rel] = (digest.size, digest.sha256)
    return found


def verify(artifacts: Path, port=None, progress=None) -> dict:
    """An artifact directory checked whole, before any of it is used: the manifest's contract, every
    file's size and sha256, no file it does not list, the experts' weights in the manifest's format;
    with `port`, built for that port. Returns the manifest."""
    manifest = read_manifest(artifacts)
    check_files(artifacts, manifest["files"], directory_files(artifacts, progress))
    check_weights(artifacts, manifest)
    if port is not None:
        check_port(manifest, port, artifacts)
    return manifest


def plan_dtypes(plan, where) -> dict[str, str]:
    """A shard plan's (`shard_plan.json`, parsed) tensor name -> dtype."""
    if not isinstance(plan, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("dtype"), str) for e in plan.values()
    ):
        raise ArtifactError(f'{where}: expected {{tensor name: {{..., "dtype": str}}}}')
    return {name: entry["dtype"] for name, entry in plan.items()}


def check_weights(artifacts: Path, manifest: dict) -> None:
    """The experts' weights in the manifest's quantization and dtype (`check_weight_dtypes`), as the
    shard plan records them and as each rank's shard holds them (its safetensors header)."""
    plan = Path(artifacts) / SHARD_PLAN
    check_weight_dtypes(manifest, plan_dtypes(read_json_object(plan, ArtifactError, f"{plan}: missing"), plan), plan)
    for rank in range(manifest["tp"] if manifest["weights"] else 0):
        path = Path(artifacts) / RANK_WEIGHTS.format(rank=rank)
        with open(path, "rb") as f:
            header = _shard_header(f, path, path.stat().st_size)
        dtypes = {n: e.get("dtype") for n, e in header.items() if isinstance(e, dict)}
        check_weight_dtypes(
            manifest, {n: str(_SAFETENSORS_DTYPES.get(d, d)).removeprefix("torch.") for n, d in dtypes.items()}, path
        )


def _digest_entry(entry) -> bool:
    return isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get("sha256"), str)


def tokenizer_files(source: Path) -> list[str]:
    """The tokenizer files of a checkpoint directory that an artifact carries (TOKENIZER_FILES that
    exist); refused without the tokenizer itself (tokenizer.json or tokenizer.model)."""
    names = [n for n in TOKENIZER_FILES if (Path(source) / n).is_file()]
    if not any(n in TOKENIZER_MODELS for n in names):
        raise ArtifactError(f"{source}: no tokenizer ({' or '.join(TOKENIZER_MODELS)}) to copy into the artifact")
    return names


def check_tokenizer(artifacts: Path, manifest: dict, port) -> Path | None:
    """The folder of the tokenizer an artifact carries (None: the byte tokenizer), what
    `tokenizer.load_tokenizer` reads it from, each of its files
    checked against the manifest's size and sha256, and nothing else in it: a file changed, added or
    removed since trace-and-compile is refused by name, before it is read."""
    tokenizer = manifest["tokenizer"]
    if tokenizer["kind"] != port.tokenizer:
        raise ArtifactError(
            f"{artifacts}: built with the {tokenizer['kind']!r} tokenizer, port {port.name!r} takes {port.tokenizer!r}"
        )
    if tokenizer["kind"] == "bytes":
        return None
    folder = Path(artifacts) / TOKENIZER
    listed = tokenizer["files"]
    if not listed:
        raise ArtifactError(
            f"{artifacts}: carries no tokenizer (built without weights); pass --checkpoint DIR for its tokenizer"
        )
    found = {}
    for rel, path in regular_files(folder) if folder.is_dir() else []:
        digest = file_digest(path)
        found[f"{TOKENIZER}/{rel}"] = (digest.size, digest.sha256)
    check_files(artifacts, {name: manifest["files"][name] for name in listed}, found)
    return folder


def _count(value) -> bool:
    return type(value) is int and value > 0


def check_expert_layout(manifest: dict, expert_layout: str, artifacts: Path) -> None:
    """Refuse an artifact built for the other expert layout than the one it is to be served with."""
    if manifest["expert_layout"] != expert_layout:
        raise ArtifactError(
            f"{artifacts}: built with the {manifest['expert_layout']!r} expert layout, served here "
            f"with the {expert_layout!r} layout (the port's [static] expert_layout): rebuild it with "
            f"trace-and-compile --expert-layout {expert_layout}, or set expert_layout = "
            f'"{manifest["expert_layout"]}" in the port'
        )


def _shard_paths(artifacts: Path, manifest: dict) -> list[Path]:
    paths = [Path(artifacts) / RANK_WEIGHTS.format(rank=r) for r in range(manifest["tp"])]
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise ArtifactError(f"{artifacts}: missing weight shard(s) {', '.join(absent)}")
    return paths


def _check_shard_layout(path: Path, tensors: dict, manifest: dict) -> None:
    have = layout.expert_layout_of(tensors)
    if have is not None and have != manifest["expert_layout"]:
        raise ArtifactError(
            f"{path} holds its experts in the {have!r} layout, the manifest says "
            f"{manifest['expert_layout']!r}: the directory mixes two builds; rebuild it"
        )


def load_shards(artifacts: Path, manifest: dict) -> list[dict]:
    """Every rank's weight shard, whole, each checked to be in the manifest's expert layout: host
    memory for the whole model (`load_streamed` holds one load group at a time)."""
    shards = []
    for path in _shard_paths(artifacts, manifest):
        shard = load_file(path)
        _check_shard_layout(path, shard, manifest)
        shards.append(shard)
    return shards


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def load_group(name: str) -> str:
    """The unit the streamed load reads at once: a decoder layer's tensors together
    (`layer 3`), any other tensor (embeddings, lm_head, the final norm) on its own."""
    found = _LAYER.search(name)
    return f"layer {found.group(1)}" if found else name


def stream_shard(path: Path) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """One rank's safetensors shard, a load group at a time (`load_group`, in file order): each
    group's tensors read from the file into fresh memory, so that a caller who drops a group
    before taking the next holds at most one group's bytes (no memory map of the whole file)."""
    path = Path(path)
    with open(path, "rb") as f:
        size = path.stat().st_size
        header = _shard_header(f, path, size)
        start = f.tell()
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        groups: dict[str, list] = {}
        for name, entry in entries:
            groups.setdefault(load_group(name), []).append((name, entry))
        for group, members in groups.items():
            tensors = {}
            for name, entry in members:
                begin, end = entry["data_offsets"]
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None or start + end > size or begin > end:
                    raise ArtifactError(
                        f"{path}: tensor {name!r} ({entry['dtype']}, bytes {begin}..{end}) is unreadable"
                    )
                buffer = bytearray(end - begin)
                f.seek(start + begin)
                if f.readinto(buffer) != len(buffer):
                    raise ArtifactError(f"{path}: tensor {name!r} is cut short")
                flat = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
                tensors[name] = flat.view(dtype).reshape(entry["shape"])
            yield group, tensors


def _shard_header(f, path: Path, size: int) -> dict:
    """A safetensors file's header (tensor name -> entry, its `__metadata__` left out), read from `f`
    at its start, which is left at the first tensor's bytes."""
    head = f.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= size - 8:
        raise ArtifactError(f"{path}: not a safetensors file (header length {length}, file {size} bytes)")
    try:
        header = loads_json(f.read(length))
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not a safetensors file (header: {e})") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return header


def load_streamed(artifacts: Path, manifest: dict, to_device: Callable[[int, str, torch.Tensor], object]) -> list[dict]:
    """Every rank's weights put on the device a load group at a time: `to_device(rank, name, tensor)`
    copies one host tensor to rank's device and returns what stands for it there; the host copy is
    dropped once its group is placed. -> per rank {name: what to_device returned}. The host holds
    one group of one rank at a time (its read buffer, and whatever copy to_device stages), never a
    whole shard; each group holding experts is checked to be in the manifest's expert layout."""
    placed = []
    for rank, path in enumerate(_shard_paths(artifacts, manifest)):
        on_device = {}
        for _, tensors in stream_shard(path):
            _check_shard_layout(path, tensors, manifest)
            for name in list(tensors):
                on_device[name] = to_device(rank, name, tensors.pop(name))
            del tensors
        placed.append(on_device)
    return placed


PROCESSING = "_processing"  # the suffix of the logits-processing variants' graph names
DECODE_KEYS = ("token_generation", "token_generation" + PROCESSING)  # the decode keys of the whole cache


def decode_key(span: int | None = None, processing: bool = False) -> str:
    """The decode key over the first `span` positions of the cache (None: the whole cache)."""
    return DECODE_KEYS[processing] + ("" if span is None else f"_{span}")


def key_span(key: str) -> int | None:
    """The positions a decode key attends over, where fewer than the cache's; None otherwise."""
    tail = key.rsplit("_", 1)[1]
    return int(tail) if key.startswith(DECODE_KEYS[0]) and tail.isdigit() else None


def prefill_key(rows: int, bucket: int, processing: bool = False) -> str:
    return f"context_encoding{PROCESSING if processing else ''}_{rows}x{bucket}"


COPY_KEY = "prefix_copy"


def key_names(buckets, prefill_rows, prefix_caching: bool = False, spans=()) -> list[str]:
    """The plain keys (a prefill per row count and bucket, a decode per length in `spans`, the decode lengths
    below the cache's, then the whole cache's), then their logits-processing variants (`static/decoder.py`
    `ProcessingPrefill`, `ProcessingDecode`) in the same order, then with `prefix_caching` the copy key."""
    decodes = [*spans, None]
    plain = [prefill_key(p, b) for p in prefill_rows for b in buckets] + [decode_key(n) for n in decodes]
    keys = plain + [prefill_key(p, b, True) for p in prefill_rows for b in buckets]
    keys += [decode_key(n, True) for n in decodes]
    return keys + [COPY_KEY] if prefix_caching else keys


def is_processing(key: str) -> bool:
    """Whether `key` is a logits-processing variant."""
    return PROCESSING in key


def key_shape(key: str) -> tuple[int, int] | None:
    """(rows, bucket) of a prefill key; None for a decode key and the copy key."""
    if key.startswith(DECODE_KEYS[0]) or key == COPY_KEY:
        return None
    rows, bucket = key.rsplit("_", 1)[1].split("x")
    return int(rows), int(bucket)


SPECULATION_KEY = "speculation"  # the target's verify graph (NxDI's speculation_model)
DRAFT_KEY = "draft"  # the assistant's draft graph
SPECULATIVE_KEYS = (SPECULATION_KEY, DRAFT_KEY)


def speculative_keys(speculative: dict | None) -> list[str]:
    """The keys a manifest's `speculative` adds (none without it): the verify graph, and with an
    assistant (method "mtp") the draft graph."""
    if not speculative:
        return []
    return [SPECULATION_KEY] + ([DRAFT_KEY] if speculative.get("method") == "mtp" else [])


def check_speculative_field(speculative, keys: dict, path) -> None:
    """The manifest's `speculative`: absent or null (built without it), else the JSON object of a
    `--speculative-config` as trace-and-compile parsed it (`speculative.SpeculativeConfig`), checked
    by that same parser, its verify key (in `keys`) over k + 1 positions."""
    if speculative is None:
        return
    try:
        if not isinstance(speculative, dict):
            raise UserError(f"expected a JSON object, got {speculative!r}")
        k = SpeculativeConfig.from_json(dumps(speculative)).num_speculative_tokens
    except UserError as e:
        raise ArtifactError(f"{path}: 'speculative' is not a speculative config: {e}") from None
    shape = keys.get(SPECULATION_KEY, {}).get("inputs", {}).get("input_ids")
    if shape is not None and shape[1:] != [k + 1]:
        raise ArtifactError(f"{path}: the {SPECULATION_KEY} key takes input_ids {shape}, not k + 1 = {k + 1} per row")
