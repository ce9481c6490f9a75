"""The Neuron backend: a compiled NxD artifact on Inferentia2. Not run here (no device, no SDK).

Written against the NxD runtime API as NxD Inference uses it; the Neuron SDK
(torch-neuronx, neuronx-distributed — in the Neuron DLC for inf2) is imported only when
`--backend neuron` is chosen, and its absence is a clear error.

The artifact directory is what `neuron-moe trace-and-compile` writes; its contract (file names,
manifest fields, the graphs' signatures) is defined once, in `neuron_moe/neuron/artifact.py`:
manifest.json, model.pt (a context-encoding key per bucket, a token-generation key per decode
length; NxD routes each call to the key whose example inputs match), weights/tp{r}_sharded_checkpoint.safetensors.
An artifact compiled for another target than this version's (`artifact.TARGET`) is refused, naming
both; the target's environment is set before the runtime starts.

Served by the engine (`engine.py`) as a `GraphRuntime` (`static/rows.py`), B = the
manifest's batch_size rows, each request in its own cache row:
  prefill  model(input_ids, attention_mask, position_ids [P, bucket], row_ids [P], sampling [P, 4]),
           P of the manifest's prefill_rows chunks of prompts, each left-padded to the bucket
           -> token [P, 1] (, logits [P, V])
  decode   model(input_ids [B, 1], position_ids [B, 1], sampling [B, 4]) -> token [B, 1] (, logits [B, V]),
           the key of the smallest decode length above every row's position: a shorter key's call
           with kv_length [L] appended, whose shape routes it (`artifact.py`)
and their logits-processing variants (`static/decoder.py`, the artifact's `*_processing` keys) for
the rows that ask for logprobs, penalties, logit_bias, min_p, bans or a grammar's bitmask; and, in
an artifact built --enable-prefix-caching, its `prefix_copy` key:
  copy     model(src_row [1], dst_row [1]) -> dst_row [1, 1]: a held prefix copied into another row
and, in an artifact built --speculative-config (the manifest's `speculative`), its `speculation` key:
  verify   model(input_ids, position_ids [B, k + 1], sampling [B, 4], drafted [B], uniforms [B, k + 1])
           -> tokens [B, k + 1], accepted [B]: each step's drafts checked in one call (`Rows._speculate`)
The KV cache is the artifact's state: it stays on the device (NxD's input_output_aliases) and
never crosses the call. The graphs choose each row's token themselves, greedy or sampled
(temperature, top-k among the manifest's `candidates`, top-p: `static/sampling.py`), so an artifact
without logits (the default) serves every request; one built --with-logits also returns them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .. import environment
from ..neuron.artifact import (
    DECODE_KEYS,
    MODEL,
    SPECULATION_KEY,
    ArtifactError,
    check_expert_layout,
    check_target,
    load_shards,
    load_streamed,
    read_manifest,
)
from ..parallel.layout import DEFAULT_EXPERT_LAYOUT
from ..run_config import Shapes
from ..speculative import SpeculativeConfig
from ..static.rows import GraphRuntime, with_kv_length

log = logging.getLogger(__name__)
DEVICE = "privateuseone:{rank}"  # a NeuronCore as torch-neuronx names it (NxD's state initializer)
SDK_MODULES = environment.SERVE_MODULES
# one artifact contract, one error for it
NeuronError = ArtifactError


def require_sdk() -> None:
    """The Neuron SDK's runtime and a Neuron device, or the reason `neuron-moe env` gives."""
    supported, why = environment.support(environment.SERVE_NEURON)
    if not supported:
        raise NeuronError(f"--backend neuron {why}")


def target_environment(env: dict[str, str]) -> None:
    """The environment the artifact's target needs at run time (its manifest's `target.env`:
    NEURON_LOGICAL_NC_CONFIG=1 on inf2), set for this process before the runtime starts and kept
    while it serves; a variable set otherwise is replaced, and said so."""
    for name, value in env.items():
        if os.environ.get(name, value) != value:
            log.warning("%s=%s replaced by the artifact target's %s", name, os.environ[name], value)
        os.environ[name] = value


def load_weights(nxd_model, artifacts: Path, manifest: dict) -> None:
    """Every rank's weights onto its NeuronCore a load group (a decoder layer) at a time
    (`artifact.load_streamed`), so the host holds one group of one rank at a time, not the model:
    each tensor is copied to `privateuseone:<rank>` (the device NxD's state initializer places the
    KV cache on), the per-rank dicts become the NxDModel's weights, and
    `initialize_with_saved_weights` hands them to every key. An artifact whose graphs expect NxD's
    weight layout transformation (a `weight_loader`) takes the whole shards through `initialize`,
    which transforms them: host memory for every rank's shard at once, logged."""
    start = torch.tensor([0], dtype=torch.int32)
    if getattr(nxd_model, "weight_loader", None) is not None:
        log.warning("%s: the graphs transform their weights' layout on load; every shard is read whole", artifacts)
        nxd_model.initialize(load_shards(artifacts, manifest), start)
        return
    nxd_model.weights = load_streamed(artifacts, manifest, lambda rank, _, t: t.to(DEVICE.format(rank=rank)))
    nxd_model.initialize_with_saved_weights(start)


def by_length(model, shapes: Shapes) -> dict:
    """The artifact's decode keys by KV length (`artifact.decode_key`), as the runtime calls them: the
    whole cache's with the inputs as they are, each shorter one's with its `kv_length` [L] appended
    (`with_kv_length`: the input whose shape alone routes the call to that key)."""
    return {n: with_kv_length(model, n) for n in shapes.decode_lengths[:-1]} | {shapes.max_cache_len: model}


def neuron_runtime(artifacts: Path, port, prefix_caching: bool | None = None) -> GraphRuntime:
    """The compiled artifact in `artifacts`, loaded onto the device, as the batching engine's runtime;
    with prefix caching where the artifact has the copy key (`prefix_caching` None: then; False: never;
    True: an artifact without it is refused)."""
    artifacts = Path(artifacts)
    manifest = read_manifest(artifacts)
    check_target(manifest, artifacts)
    if manifest["dry_run"]:
        raise NeuronError(f"{artifacts}: a --dry-run output (exported on CPU, not compiled; no {MODEL})")
    if manifest["port"] != port.name:
        raise NeuronError(f"{artifacts}: compiled for port {manifest['port']!r}, not {port.name!r}")
    check_expert_layout(manifest, port.static.expert_layout if port.static else DEFAULT_EXPERT_LAYOUT, artifacts)
    built = manifest.get("prefix_caching", False)
    if prefix_caching and not built:
        raise NeuronError(
            f"{artifacts}: built without the copy key prefix caching needs (trace-and-compile --enable-prefix-caching)"
        )
    require_sdk()
    target_environment(manifest["target"]["env"])
    import torch_neuronx  # noqa: F401 - registers the Neuron classes that torch.jit.load needs

    model = torch.jit.load(str(artifacts / MODEL))
    load_weights(model.nxd_model, artifacts, manifest)
    # one callable: NxD routes each call to the key whose example inputs match its shapes; an artifact
    # with the logits-processing keys serves the requests that ask for them (their inputs differ from
    # the plain keys' in count or shape), one without refuses them (`Engine.check_sampling`)
    shapes = Shapes.from_manifest(manifest)
    processing = model if DECODE_KEYS[1] in manifest.get("keys", {}) else None
    return GraphRuntime(
        model,
        by_length(model, shapes),
        shapes,
        logits=manifest["logits"],
        candidates=manifest["candidates"],
        pad_id=port.config.pad_token_id or 0,
        prefill_processing=processing,
        decode_processing=None if processing is None else by_length(processing, shapes),
        vocab=port.config.vocab_size,
        copy=model if built and prefix_caching is not False else None,  # the prefix_copy key, routed by shape
        **speculation(model, manifest),
    )


def speculation(model, manifest: dict) -> dict:
    """The runtime's verify graph and its config, as the artifact was built (`speculative`): its
    `speculation` key, routed by the shapes of its inputs as the others are (trace-and-compile refuses
    keys whose inputs have the same shapes); nothing for an artifact built without it."""
    if SPECULATION_KEY not in manifest["keys"] or not manifest.get("speculative"):
        return {}
    return {"verify": model, "speculative": SpeculativeConfig(**manifest["speculative"])}
