"""The Neuron backend: a compiled NxD artifact on Inferentia2. Not run here (no device, no SDK).

Written against the NxD runtime API as NxD Inference uses it; the Neuron SDK
(torch-neuronx, neuronx-distributed — in the Neuron DLC for inf2) is imported only when
`--backend neuron` is chosen, and its absence is a clear error.

The artifact directory it expects (the trace-and-compile output, or what `pull` fetched):

    manifest.json  {"port": NAME, "tp": T, "buckets": [prefill lengths], "max_length": L, ...}
    model.pt       torch.jit.save of ModelBuilder.trace(initialize_model_weights=False): a
                   context-encoding graph per bucket and a token-generation graph; NxD routes
                   each call to the graph whose example shapes match its inputs
    weights/tp{r}_sharded_checkpoint.safetensors   rank r's weights (ModelBuilder.shard_checkpoint)

Calls, batch 1: model(input_ids [1, S], attention_mask [1, S], position_ids [1, S]) ->
logits [1, S or 1, V] (or a tuple that starts with them). Prefill pads the prompt on the
right to the smallest bucket; decode passes one token at its position with a mask over
max_length. The KV cache stays on the device (aliased in and out of the graphs), so one
sequence is served at a time.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from ..errors import UserError

MANIFEST = "manifest.json"
MODEL = "model.pt"
WEIGHTS = "weights/tp{rank}_sharded_checkpoint.safetensors"
SDK_MODULES = ("torch_neuronx", "neuronx_distributed")


class NeuronError(UserError):
    pass


def read_manifest(artifacts: Path) -> dict:
    path = Path(artifacts) / MANIFEST
    if not path.is_file():
        raise NeuronError(f"{artifacts}: no {MANIFEST} (expected a trace-and-compile output directory)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NeuronError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise NeuronError(f"{path}: expected a JSON object")
    for key, kind in (("port", str), ("tp", int), ("buckets", list), ("max_length", int)):
        if not isinstance(manifest.get(key), kind):
            raise NeuronError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
    buckets = manifest["buckets"]
    if not buckets or not all(isinstance(b, int) and 0 < b <= manifest["max_length"] for b in buckets):
        raise NeuronError(f"{path}: 'buckets' must be positive lengths up to max_length "
                          f"({manifest['max_length']}), got {buckets}")
    return manifest


def require_sdk() -> None:
    missing = [m for m in SDK_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise NeuronError(f"--backend neuron needs the Neuron SDK (missing {', '.join(missing)}): run it on "
                          "an inf2 instance in the Neuron image (docker/Dockerfile.neuron)")


class NeuronBackend:
    def __init__(self, artifacts: Path, port):
        artifacts = Path(artifacts)
        self.manifest = read_manifest(artifacts)
        if self.manifest["port"] != port.name:
            raise NeuronError(f"{artifacts}: compiled for port {self.manifest['port']!r}, not {port.name!r}")
        require_sdk()
        import torch_neuronx  # noqa: F401 - registers the Neuron classes that torch.jit.load needs
        from safetensors.torch import load_file

        shards = [artifacts / WEIGHTS.format(rank=r) for r in range(self.manifest["tp"])]
        absent = [str(p) for p in shards if not p.is_file()]
        if absent:
            raise NeuronError(f"{artifacts}: missing weight shard(s) {', '.join(absent)}")
        self.model = torch.jit.load(str(artifacts / MODEL))
        self.model.nxd_model.initialize([load_file(p) for p in shards], torch.tensor([0], dtype=torch.int32))
        self.buckets = sorted(self.manifest["buckets"])
        self.max_context = self.manifest["max_length"]
        self.max_prompt = self.buckets[-1]

    def prefill(self, ids: list[int]):
        n = len(ids)
        bucket = next(b for b in self.buckets if b >= n)  # the engine refuses longer prompts
        input_ids = torch.zeros(1, bucket, dtype=torch.long)
        input_ids[0, :n] = torch.tensor(ids)
        mask = torch.zeros(1, bucket, dtype=torch.long)
        mask[0, :n] = 1
        logits = self._call(input_ids, mask, torch.arange(bucket)[None])
        last = logits[0, n - 1] if logits.shape[1] > 1 else logits[0, -1]  # full or last-token logits
        return last.float(), {"position": n}

    def decode(self, token: int, state) -> torch.Tensor:
        position = state["position"]
        state["position"] += 1
        mask = torch.zeros(1, self.max_context, dtype=torch.long)
        mask[0, : position + 1] = 1
        return self._call(torch.tensor([[token]]), mask, torch.tensor([[position]]))[0, -1].float()

    def _call(self, *inputs) -> torch.Tensor:
        out = self.model(*inputs)
        return out[0] if isinstance(out, (tuple, list)) else out
