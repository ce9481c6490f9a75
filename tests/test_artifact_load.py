"""Loading an artifact's weights a load group at a time (`artifact.load_streamed`): the tensors are
the shards' own, and the host's peak grows with one layer's shard, not with the model. The peak is
measured in a fresh process (its resident-set high-water mark) on artifacts laid out as
trace-and-compile writes them (manifest, `weights/tp{r}_sharded_checkpoint.safetensors`, channel
layout experts), their layers made large enough (8 MiB per rank) for the resident set to resolve
one; one with twice the layers must not raise the peak by more than allocator noise."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_moe.neuron import artifact
from neuron_moe.neuron.plan import HOST_LOAD_COPIES

MiB = 2**20
TP = 2
E, H, CHANNELS = 8, 256, 1024  # one rank's gate_up [E, H, CHANNELS] bf16: 4 MiB; its down the same
LAYER = 2 * E * H * CHANNELS * 2  # bytes of one layer of one rank
NOISE = 6 * MiB  # what the resident set moves by beyond the buffers (allocator, the reading itself)


def _artifact(root, layers: int):
    (root / "weights").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"tp": TP, "expert_layout": "channel"}))
    for rank in range(TP):
        state = {"model.embed_tokens.weight": torch.full((64, H), float(rank), dtype=torch.bfloat16)}
        for i in range(layers):
            prefix = f"model.layers.{i}.mlp.experts."
            state[prefix + "gate_up_proj.weight"] = torch.full((E, H, CHANNELS), i + rank / 2, dtype=torch.bfloat16)
            state[prefix + "down_proj.weight"] = torch.full((E, CHANNELS, H), -i, dtype=torch.bfloat16)
            state[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        save_file(state, root / artifact.RANK_WEIGHTS.format(rank=rank))
    return root


# A fresh process: its resident set's high-water mark reset after the imports, read after the load. The "device" reads
# every byte of a tensor, as a copy to the device does, and keeps its shape and a checksum (device
# memory is not the host's). "whole": every rank's shard as `load_shards` returns it, each byte read.
PROBE = """
import json, sys
from pathlib import Path
import torch
from neuron_moe.neuron import artifact
root = Path(sys.argv[1])
manifest = json.loads((root / "manifest.json").read_text())
def device(rank, name, t):
    return tuple(t.shape), int(t.view(-1).view(torch.uint8).max())  # max: no wider copy
def peak():  # VmHWM, kB
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark restarts from the current resident set (Linux)
before = peak()
if sys.argv[2] == "streamed":
    placed = artifact.load_streamed(root, manifest, device)
else:
    shards = artifact.load_shards(root, manifest)
    placed = [{n: device(r, n, t) for n, t in s.items()} for r, s in enumerate(shards)]
after = peak()
print(json.dumps({"growth": (after - before) * 1024, "tensors": sum(len(p) for p in placed)}))
"""


def _peak_growth(root, how: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(root), how], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout)


def test_the_streamed_load_yields_the_shards_tensors(tmp_path):
    root = _artifact(tmp_path, layers=2)
    manifest = json.loads((root / "manifest.json").read_text())
    groups = [g for g, _ in artifact.stream_shard(root / artifact.RANK_WEIGHTS.format(rank=1))]
    assert sorted(groups) == ["layer 0", "layer 1", "model.embed_tokens.weight"]
    placed = artifact.load_streamed(root, manifest, lambda rank, name, t: (rank, t.clone()))
    for rank, shard in enumerate(artifact.load_shards(root, manifest)):
        assert placed[rank].keys() == shard.keys()
        for name, tensor in shard.items():
            assert placed[rank][name][0] == rank and torch.equal(placed[rank][name][1], tensor)
            assert placed[rank][name][1].dtype == tensor.dtype


def test_a_streamed_shard_of_the_other_layout_or_a_broken_file_is_refused(tmp_path):
    root = _artifact(tmp_path, layers=1)
    with pytest.raises(artifact.ArtifactError, match="holds its experts in the 'channel' layout, the manifest says"):
        artifact.load_streamed(root, {"tp": TP, "expert_layout": "expert"}, lambda r, n, t: t)
    path = root / artifact.RANK_WEIGHTS.format(rank=0)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut short
    with pytest.raises(artifact.ArtifactError, match=r"tp0_sharded_checkpoint.safetensors: tensor .* is unreadable"):
        list(artifact.stream_shard(path))


def test_the_host_peak_grows_with_one_layer_not_with_the_model(tmp_path):
    small, large = _artifact(tmp_path / "4", layers=4), _artifact(tmp_path / "8", layers=8)
    assert (
        load_file(large / artifact.RANK_WEIGHTS.format(rank=0)).keys()
        > load_file(small / artifact.RANK_WEIGHTS.format(rank=0)).keys()
    )
    four, eight = _peak_growth(small, "streamed"), _peak_growth(large, "streamed")
    assert (four["tensors"], eight["tensors"]) == (TP * (1 + 3 * 4), TP * (1 + 3 * 8))
    # the plan's host model: HOST_LOAD_COPIES × the largest load group of one rank
    assert four["growth"] <= HOST_LOAD_COPIES * LAYER + NOISE and eight["growth"] <= HOST_LOAD_COPIES * LAYER + NOISE
    assert eight["growth"] - four["growth"] < NOISE  # 4 more layers on each rank (64 MiB in all): no more peak
    # the measurement sees a model held whole: every rank's shard at once grows with the layers
    whole = _peak_growth(large, "whole")["growth"]
    assert whole >= TP * 8 * LAYER - NOISE and whole > 2 * eight["growth"]
