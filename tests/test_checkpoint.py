"""Strict loading: every layout the loader accepts gives back the exact weights; every way a
checkpoint can be wrong is an error that names the key, shape or file."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_moe.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from neuron_moe.config import ConfigError
from neuron_moe.model import build_model


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].float(), sb[k].float()), k


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_port):
    model = build_model(tiny_port)
    return model, save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "causal")


def test_causal_layout_round_trips(saved, tiny_port):
    model, path = saved
    loaded = load_checkpoint(path)
    assert_same_weights(model, loaded)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied, as the config says
    loaded.set_attn_implementation("eager")
    loaded.set_experts_implementation("eager")
    ids = torch.tensor([[2, 50, 60, 70]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_multimodal_layout_loads_the_text_weights(tmp_path, tiny_port):
    model = build_model(tiny_port)
    path = save_checkpoint(model, tmp_path / "mm", multimodal=True)
    keys = load_file(path / "model.safetensors").keys()
    assert any(k.startswith("model.language_model.layers.0.experts.") for k in keys)
    # the real checkpoint also carries the vision/audio towers; they are not ours to load
    state = load_file(path / "model.safetensors")
    state["model.vision_tower.patch_embedder.weight"] = torch.zeros(4, 4)
    save_file(state, path / "model.safetensors")
    assert json.loads((path / "config.json").read_text())["model_type"] == "gemma4"
    assert_same_weights(model, load_checkpoint(path))


def test_sharded_bf16_checkpoint(tmp_path, tiny_port):
    model = build_model(tiny_port, dtype=torch.bfloat16)
    path = save_checkpoint(model, tmp_path / "sharded", shard_bytes=1 << 20)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = load_checkpoint(path, dtype=torch.bfloat16)
    assert loaded.model.layers[0].experts.down_proj.dtype == torch.bfloat16
    assert_same_weights(model, loaded)


def test_save_replaces_an_existing_checkpoint_whole(tmp_path, tiny_port):
    path = save_checkpoint(build_model(tiny_port), tmp_path / "c", shard_bytes=1 << 20)
    save_checkpoint(build_model(tiny_port), path)  # now a single file
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".c*"))  # no temp or old directory left behind


def _edit(src, dst, edit):
    """Copy a saved checkpoint with its tensors edited by `edit(state)`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")
    return dst


def test_missing_key_is_listed(saved, tmp_path):
    path = _edit(saved[1], tmp_path / "x", lambda s: s.pop("model.layers.2.experts.down_proj"))
    with pytest.raises(CheckpointError, match=r"missing 1 key\(s\): model\.layers\.2\.experts\.down_proj"):
        load_checkpoint(path)


def test_unexpected_key_is_listed(saved, tmp_path):
    path = _edit(saved[1], tmp_path / "x", lambda s: s.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected 1 key\(s\): model\.layers\.0\.extra\.weight"):
        load_checkpoint(path)


def test_wrong_shape_names_tensor_and_both_shapes(saved, tmp_path):
    def edit(s):
        s["model.layers.1.experts.gate_up_proj"] = torch.zeros(16, 128, 64)
    path = _edit(saved[1], tmp_path / "x", edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.experts\.gate_up_proj: shape \(16, 128, 64\) "
                                              r"in model\.safetensors, expected \(16, 128, 128\)"):
        load_checkpoint(path)


def test_truncated_file_is_named(saved, tmp_path):
    path = tmp_path / "t"
    path.mkdir()
    (path / "config.json").write_text((saved[1] / "config.json").read_text())
    data = (saved[1] / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"t/model\.safetensors: not a readable safetensors file"):
        load_checkpoint(path)


def test_non_safetensors_file_is_named(saved, tmp_path):
    path = tmp_path / "g"
    path.mkdir()
    (path / "config.json").write_text((saved[1] / "config.json").read_text())
    (path / "model.safetensors").write_bytes(b"PK\x03\x04 this is a zip, not safetensors" * 10)
    with pytest.raises(CheckpointError, match=r"g/model\.safetensors: not a readable safetensors file"):
        load_checkpoint(path)


def test_index_naming_a_missing_shard(tmp_path, tiny_port):
    path = save_checkpoint(build_model(tiny_port), tmp_path / "s", shard_bytes=1 << 20)
    shard = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"lists shard {shard}, which does not exist"):
        load_checkpoint(path)


def _with_config(saved, tmp_path, edit):
    path = tmp_path / "c"
    path.mkdir()
    cfg = json.loads((saved[1] / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").symlink_to(saved[1] / "model.safetensors")
    return path


def test_dense_gemma4_config_is_not_a_moe(saved, tmp_path):
    path = _with_config(saved, tmp_path, lambda c: c.update(enable_moe_block=False))
    with pytest.raises(ConfigError, match="not a Gemma-4 MoE config"):
        load_checkpoint(path)


def test_other_architecture_config_is_refused(saved, tmp_path):
    path = _with_config(saved, tmp_path, lambda c: c.update(model_type="llama"))
    with pytest.raises(ConfigError, match="model_type 'llama' is not a Gemma-4 model"):
        load_checkpoint(path)


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        load_checkpoint(tmp_path)
