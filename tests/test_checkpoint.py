"""Strict loading: every layout the loader accepts gives back the exact weights; every way a
checkpoint can be wrong is an error that names the key, shape or file."""

import json
import re
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_moe import cli
from neuron_moe.checkpoint import CheckpointError, load_checkpoint, read_config, save_checkpoint
from neuron_moe.config import ConfigError, gemma4_moe_config
from neuron_moe.model import build_model
from neuron_moe.port import load_port


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


def test_every_file_gets_the_mode_open_would_give(tmp_path, tiny_port, umask_027):
    """safetensors' save_file makes its files 0600: a checkpoint built by one user would be
    unreadable by a server running as another."""
    path = save_checkpoint(build_model(tiny_port), tmp_path / "c", shard_bytes=1 << 20)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    assert sum(name.endswith(".safetensors") for name in modes) > 1 and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o640) and stat.S_IMODE(path.stat().st_mode) == 0o750


def _edit(src, dst, edit):
    """Copy a saved checkpoint with its tensors edited by `edit(state)`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).symlink_to(load_port("tiny-gemma4-moe").checkpoint / name)
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
    with pytest.raises(
        CheckpointError,
        match=r"model\.layers\.1\.experts\.gate_up_proj: shape \(16, 128, 64\) "
        r"in model\.safetensors, expected \(16, 128, 128\)",
    ):
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
    for name in ("tokenizer.json", "tokenizer_config.json"):  # what a command needs beside the weights
        (path / name).symlink_to(load_port("tiny-gemma4-moe").checkpoint / name)
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


def one_error_line(capsys, message: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err and "Traceback" not in err, err
    return err


# ---- a checkpoint of another model never stands in for the port's --------------------------------------


def test_a_checkpoint_of_another_model_is_refused_naming_the_fields(tiny_port, capsys):
    """The full-size port with the tiny checkpoint: refused, or it would pass validation and serve as
    gemma4-26b-a4b."""
    tiny = str(tiny_port.checkpoint)
    assert cli.main(["validate", "--model", "gemma4-26b-a4b", "--checkpoint", tiny, "--max-new-tokens", "2"]) == 2
    err = one_error_line(capsys, "not the model of port 'gemma4-26b-a4b'")
    assert "hidden_size 128 (expected 2816)" in err and "num_experts 16 (expected 128)" in err
    assert cli.main(["serve", "--model", "gemma4-26b-a4b", "--checkpoint", tiny]) == 2  # before the socket is bound
    one_error_line(capsys, "hidden_size 128 (expected 2816)")
    with pytest.raises(CheckpointError, match=r"layer 1 head_dim, key-value heads 64, 2 \(expected 64, 1\)"):
        read_config(
            tiny_port.checkpoint,
            gemma4_moe_config(dict(tiny_port.raw["config"], num_global_key_value_heads=1), "p.toml"),
            "p",
        )


# ---- non-finite weights are an error at load (item 4) -------------------------------------------------


def test_nan_or_inf_weights_are_refused_at_load(saved, tmp_path, capsys):
    def poison(s):
        s["model.layers.1.experts.down_proj"][3, 5, 7] = float("nan")
        s["model.layers.1.experts.down_proj"][0, 0, 0] = float("inf")

    path = _edit(saved[1], tmp_path / "nan", poison)
    with pytest.raises(
        CheckpointError,
        match=r"model\.layers\.1\.experts\.down_proj in model\.safetensors: 2 "
        r"non-finite value\(s\) \(NaN or inf\)",
    ):
        load_checkpoint(path)
    # one error line, not PASS with max|Δlogit| nan (exit 0)
    assert cli.main(["validate", "--checkpoint", str(path), "--max-new-tokens", "2"]) == 2
    one_error_line(capsys, "non-finite value(s)")


# ---- wrong fields in config.json and the index (item 6) ------------------------------------------------


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.update(hidden_size=0), "hidden_size = 0 is outside [1, 65536]"),
        (lambda c: c.update(num_experts=[16]), "num_experts must be an integer, got [16]"),
        (lambda c: c.update(layer_types=c["layer_types"][:2]), "must be equal to the number of `layer_types` (2)"),
        (lambda c: c.update(hidden_activation=5), "Validation error for field 'hidden_activation'"),
        (lambda c: c.update(rope_parameters="default"), "Validation error for field 'rope_parameters'"),
        (lambda c: c.update(num_hidden_layers=10**8), "num_hidden_layers = 100000000 is outside [1, 256]"),
        (lambda c: c.update(enable_moe_block="yes"), "not a Gemma-4 MoE config"),
    ],
)
def test_wrong_config_fields_are_one_error_line(saved, tmp_path, capsys, edit, message):
    path = _with_config(saved, tmp_path, edit)
    assert cli.main(["validate", "--checkpoint", str(path), "--max-new-tokens", "2"]) == 2
    one_error_line(capsys, message)
    assert cli.main(["serve", "--checkpoint", str(path)]) == 2  # checked before binding, not in the load thread
    one_error_line(capsys, message)


@pytest.mark.parametrize(
    "weight_map,message",
    [
        ([], "need a 'weight_map' object of key -> file name"),
        ({"model.embed_tokens.weight": 3}, "need a 'weight_map' object of key -> file name"),
        ({"model.embed_tokens.weight": ["a.safetensors"]}, "need a 'weight_map' object of key -> file name"),
        ({"model.embed_tokens.weight": "../outside.safetensors"}, "is not a file name in"),
        ({"model.embed_tokens.weight": "/etc/passwd"}, "is not a file name in"),
    ],
)
def test_a_bad_weight_map_is_named(saved, tmp_path, capsys, weight_map, message):
    path = _with_config(saved, tmp_path, lambda c: None)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_checkpoint(path)


# ---- one checkpoint check, one message, whichever command meets the mistake ------------------------------


def _broken(kind, saved, tmp_path):
    path = tmp_path / kind
    if kind == "absent":
        return path
    path.mkdir()
    if kind in ("no weights", "no tokenizer"):
        (path / "config.json").write_text((saved[1] / "config.json").read_text())
    if kind == "no tokenizer":
        (path / "model.safetensors").symlink_to(saved[1] / "model.safetensors")
    return path


@pytest.mark.parametrize(
    "kind,message",
    [
        ("absent", "checkpoint {path}: no such directory"),
        ("empty", "checkpoint {path}: no config.json (an HF-layout checkpoint holds config.json"),
        ("no weights", "{path}: neither model.safetensors nor model.safetensors.index.json"),
        (
            "no tokenizer",
            "checkpoint {path}: no tokenizer (tokenizer.json or tokenizer.model); port "
            "'tiny-gemma4-moe' takes its tokenizer from its checkpoint",
        ),
    ],
)
def test_every_command_says_the_same_about_a_broken_checkpoint(saved, tmp_path, capsys, kind, message):
    """validate, serve, info, eval-tasks, prep-reader and trace-and-compile: the same one line, before
    any work (serve: before its socket is bound), never transformers' tokenizer message."""
    path = _broken(kind, saved, tmp_path)
    commands = [
        ["validate"],
        ["serve"],
        ["info"],
        ["eval-tasks"],
        ["prep-reader", "--out", str(tmp_path / "s")],
        ["trace-and-compile", "--tp", "2", "--dry-run", "--out", str(tmp_path / "art")],
    ]
    if kind == "no tokenizer":  # what reads no text (info, prep-reader) needs no tokenizer
        commands = [c for c in commands if c[0] not in ("info", "prep-reader")]
    errors = set()
    for command in commands:
        assert cli.main([*command, "--checkpoint", str(path)]) == 2, command
        err = one_error_line(capsys, message.format(path=path))
        assert "sentencepiece" not in err.lower() and "tiktoken" not in err.lower()
        errors.add(err)
    assert len(errors) == 1
    assert not (tmp_path / "s").exists() and not (tmp_path / "art").exists()
