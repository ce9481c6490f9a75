"""The Neuron backend: a compiled NxD artifact on Inferentia2. Not run here (no device, no SDK).

Written against the NxD runtime API as NxD Inference uses it; the Neuron SDK
(torch-neuronx, neuronx-distributed — in the Neuron DLC for inf2) is imported only when
`--backend neuron` is chosen, and its absence is a clear error.

The artifact directory is what `neuron-moe trace-and-compile` writes; its contract (file names,
manifest fields, the graphs' signatures) is defined once, in `neuron_moe/neuron/compile.py`:
manifest.json, model.pt (a context-encoding key per bucket, a token-generation key; NxD routes
each call to the key whose example inputs match), weights/tp{r}_sharded_checkpoint.safetensors.

Calls (the static decoder's graphs, `static/decoder.py`), batch B = the manifest's batch_size, one
sequence served at a time, in cache row 0 (the other rows idle at position 0, in their own rows):
  prefill  model(input_ids, attention_mask, position_ids [1, bucket], row_ids [1]), the prompt
           left-padded to the smallest bucket -> token [1, 1] (, logits [1, V])
  decode   model(input_ids [B, 1], position_ids [B, 1]) -> token [B, 1] (, logits [B, V])
The KV cache is the artifact's state: it stays on the device (NxD's input_output_aliases) and
never crosses the call. An artifact built without --with-logits returns the greedy token alone:
it serves temperature 0 only (on-device sampling is the batching engine's, issue 21); one built
with it returns the logits too, and the engine samples on the host.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..neuron.compile import (MANIFEST, MODEL, WEIGHTS, ArtifactError, check_expert_layout,  # noqa: F401  (the contract)
                               load_shards, read_manifest)
from ..parallel.layout import DEFAULT_EXPERT_LAYOUT
from ..static.loop import bucket_for, prefill_row

SDK_MODULES = ("torch_neuronx", "neuronx_distributed")
# one artifact contract, one error for it
NeuronError = ArtifactError
ROW = 0  # the cache row the one served sequence lives in


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
        # A prompt of n tokens holds positions 0..n-1 and each new token but the last takes the next:
        # n + new - 1 <= max_length, which is the engine's n + new <= max_context.
        self.max_context = self.max_length + 1
        self.greedy_only = not self.manifest["logits"]  # the graphs pick the token: prefill/decode return it

    def _out(self, outputs) -> torch.Tensor:
        """Row 0's logits [V], or (a token-only artifact) its token as a 0-dim tensor."""
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)  # one output may come bare
        return outputs[0][0, 0] if self.greedy_only else outputs[1][0].float()

    def prefill(self, ids: list[int]):
        n = len(ids)
        inputs = prefill_row(torch.tensor(ids), bucket_for(n, self.buckets), 0)  # the engine refuses longer prompts
        return self._out(self.model(*inputs, torch.tensor([ROW]))), {"position": n}

    def decode(self, token: int, state) -> torch.Tensor:
        if state["position"] >= self.max_length:
            raise NeuronError(f"the KV cache holds {self.max_length} positions; this sequence has used them all")
        ids = torch.zeros(self.batch, 1, dtype=torch.long)
        positions = torch.zeros(self.batch, 1, dtype=torch.long)
        ids[ROW], positions[ROW] = token, state["position"]
        state["position"] += 1
        return self._out(self.model(ids, positions))
