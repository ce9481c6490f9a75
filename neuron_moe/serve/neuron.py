"""The Neuron backend: a compiled NxD artifact on Inferentia2. Not run here (no device, no SDK).

Written against the NxD runtime API as NxD Inference uses it; the Neuron SDK
(torch-neuronx, neuronx-distributed — in the Neuron DLC for inf2) is imported only when
`--backend neuron` is chosen, and its absence is a clear error.

The artifact directory is what `neuron-moe trace-and-compile` writes; its contract (file names,
manifest fields, the graphs' signatures) is defined once, in `neuron_moe/neuron/compile.py`:
manifest.json, model.pt (a context-encoding key per bucket, a token-generation key; NxD routes
each call to the key whose example inputs match), weights/tp{r}_sharded_checkpoint.safetensors.

Calls (the static decoder's graphs, `static/decoder.py`), batch = the manifest's batch_size, one
sequence served at a time (the other rows are copies, dropped):
  prefill  model(input_ids, attention_mask, position_ids), each [batch, bucket], the prompt
           left-padded to the smallest bucket -> (token, logits [batch, V], *kv_cache)
  decode   model(input_ids [batch, 1], position_ids [batch, 1], slot [1],
           attention_mask [batch, max_length], *kv_cache) -> (token, logits, *kv_cache)
The KV cache comes back from each call and goes into the next (host-side here: correct, not yet
the device-resident aliasing a fast deployment wants).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..neuron.compile import (MANIFEST, MODEL, WEIGHTS, ArtifactError, check_expert_layout,  # noqa: F401  (the contract)
                               load_shards, read_manifest)
from ..parallel.layout import DEFAULT_EXPERT_LAYOUT
from ..static.loop import pad_to_bucket

SDK_MODULES = ("torch_neuronx", "neuronx_distributed")
# one artifact contract, one error for it
NeuronError = ArtifactError


def require_sdk() -> None:
    missing = [m for m in SDK_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise NeuronError(f"--backend neuron needs the Neuron SDK (missing {', '.join(missing)}): run it on "
                          "an inf2 instance in the Neuron image (docker/Dockerfile.neuron)")


class NeuronBackend:
    def __init__(self, artifacts: Path, port):
        artifacts = Path(artifacts)
        self.manifest = read_manifest(artifacts)
        if self.manifest["dry_run"]:
            raise NeuronError(f"{artifacts}: a --dry-run output (exported on CPU, not compiled; no {MODEL})")
        if self.manifest["port"] != port.name:
            raise NeuronError(f"{artifacts}: compiled for port {self.manifest['port']!r}, not {port.name!r}")
        check_expert_layout(self.manifest, port.static.expert_layout if port.static else DEFAULT_EXPERT_LAYOUT,
                            artifacts)
        require_sdk()
        import torch_neuronx  # noqa: F401 - registers the Neuron classes that torch.jit.load needs

        shards = load_shards(artifacts, self.manifest)  # each in the manifest's expert layout
        self.model = torch.jit.load(str(artifacts / MODEL))
        self.model.nxd_model.initialize(shards, torch.tensor([0], dtype=torch.int32))
        self.buckets = sorted(self.manifest["buckets"])
        self.batch, self.max_length = self.manifest["batch_size"], self.manifest["max_length"]
        self.max_prompt = self.buckets[-1]
        # A prompt of n tokens fills its bucket's slots, then each new token but the last takes one:
        # bucket(n) + new - 1 <= max_length for every n the engine admits (new <= max_context - n)
        # holds when max_context leaves room for the widest gap between buckets.
        gap = max(b - a for a, b in zip([0, *self.buckets], self.buckets))
        self.max_context = self.max_length + 2 - gap

    def prefill(self, ids: list[int]):
        n = len(ids)
        bucket = next(b for b in self.buckets if b >= n)  # the engine refuses longer prompts
        ids_, mask, positions = pad_to_bucket(torch.tensor([ids]), torch.ones(1, n, dtype=torch.long),
                                              bucket, self.batch, 0)
        _, logits, *cache = self.model(ids_, mask, positions)
        mask = torch.cat([mask, torch.ones(self.batch, self.max_length - bucket, dtype=torch.long)], dim=1)
        return logits[0].float(), {"slot": bucket, "position": n, "mask": mask, "cache": cache}

    def decode(self, token: int, state) -> torch.Tensor:
        if state["slot"] >= self.max_length:
            raise NeuronError(f"the KV cache holds {self.max_length} slots; this sequence has used them all")
        ids = torch.full((self.batch, 1), token, dtype=torch.long)
        position = torch.full((self.batch, 1), state["position"], dtype=torch.long)
        _, logits, *state["cache"] = self.model(ids, position, torch.tensor([state["slot"]]), state["mask"],
                                                *state["cache"])
        state["slot"] += 1
        state["position"] += 1
        return logits[0].float()
