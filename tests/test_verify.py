"""`neuron-moe verify` and the same checks in `serve --artifacts`, on a dry-run artifact of the tiny
port, on CPU: each tampering refused by the file's (or the field's) name, before any SDK is needed."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_moe import cli
from neuron_moe.neuron import compile as compile_
from neuron_moe.neuron.artifact import FORMAT, MANIFEST, RANK_WEIGHTS

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _build(tmp_path_factory, port, **build):
    """trace-and-compile --dry-run of `port` at `build` (not exported: the files are what is checked)."""
    out = tmp_path_factory.mktemp("built") / "art"
    compile_.trace_and_compile(port, compile_.Build.at(out=out, dtype="float32", dry_run=True, export=False, **build))
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_port):
    return _build(tmp_path_factory, tiny_port, tp=1)


@pytest.fixture
def art(built, tmp_path):
    return shutil.copytree(built, tmp_path / "art")


def _flip(path, offset=-100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _swap_tokenizer(art):
    path = art / "tokenizer" / "tokenizer.json"
    path.write_text(path.read_text().replace('"<eos>"', '"<EOS>"'))


def _other_manifest_field(art):
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["prefill_chunk"] = 3
    (art / MANIFEST).write_text(json.dumps(manifest))


TAMPERINGS = {
    "flipped weight byte": (
        lambda art: _flip(art / RANK_WEIGHTS.format(rank=0)),
        "/weights/tp0_sharded_checkpoint.safetensors: sha256 ",
    ),
    "swapped tokenizer": (_swap_tokenizer, "/tokenizer/tokenizer.json: sha256 "),
    "extra file": (
        lambda art: (art / "weights" / "tp1_sharded_checkpoint.safetensors").write_bytes(b"x"),
        "/weights/tp1_sharded_checkpoint.safetensors: not in the artifact's manifest",
    ),
    "missing file": (
        lambda art: (art / "shard_plan.json").unlink(),
        "/shard_plan.json: missing (the manifest lists it)",
    ),
    "manifest field": (_other_manifest_field, "/manifest.json: 'prefill_chunk' 3 is not one of the buckets"),
}


def test_a_whole_artifact_is_verified(art, capsys):
    assert cli.main(["verify", str(art), "--model", "tiny-gemma4-moe", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    manifest = json.loads((art / MANIFEST).read_text())
    assert report["port"] == "tiny-gemma4-moe" and report["dry_run"] and report["checked_port"] == "tiny-gemma4-moe"
    assert report["files"] == len(manifest["files"]) and report["total_bytes"] == sum(
        f["size"] for f in manifest["files"].values()
    )


@pytest.mark.parametrize("tamper", TAMPERINGS)
def test_verify_refuses_each_tampering_by_name(art, capsys, tamper):
    change, named = TAMPERINGS[tamper]
    change(art)
    assert cli.main(["verify", str(art)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {art}{named}") and err.count("\n") == 1, err


def test_verify_refuses_another_ports_artifact(art, capsys):
    assert cli.main(["verify", str(art), "--model", "gemma4-26b-a4b"]) == 2
    assert capsys.readouterr().err == f"error: {art}: built for port 'tiny-gemma4-moe', not 'gemma4-26b-a4b'\n"


def test_verify_refuses_what_is_not_an_artifact(tmp_path, capsys):
    assert cli.main(["verify", str(tmp_path / "none")]) == 2
    assert "none: not a directory" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path)]) == 2
    assert f"error: {tmp_path}: no manifest.json" in capsys.readouterr().err


@pytest.mark.parametrize("tamper", ["flipped weight byte", "extra file"])
def test_serve_refuses_a_tampered_artifact_before_it_needs_the_sdk(art, capsys, tamper):
    """No Neuron SDK here: the artifact's error, not the SDK's, is what serve says."""
    change, named = TAMPERINGS[tamper]
    change(art)
    assert cli.main(["serve", "--backend", "neuron", "--artifacts", str(art), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {art}{named}") and err.count("\n") == 1, err


def test_serve_checks_the_port_before_the_sdk(art, capsys, tmp_path, tiny_port):
    """An artifact of another port (here: the tiny port's, served as a copy of the port under
    another name) is refused by name, SDK or not."""
    from conftest import port_text_elsewhere

    other = tmp_path / "other-port.toml"
    other.write_text(port_text_elsewhere(tiny_port).replace('name = "tiny-gemma4-moe"', 'name = "other"'))
    assert (
        cli.main(["serve", "--model", str(other), "--backend", "neuron", "--artifacts", str(art), "--port", "0"]) == 2
    )
    err = capsys.readouterr().err
    assert err == f"error: {art}: built for port 'tiny-gemma4-moe', not 'other'\n"


def _python3_here(tmp_path):
    """The environment the entrypoint runs in here: its `python3` is this interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO), PORT="0")


@pytest.mark.parametrize("spelling", ["--artifacts DIR", "--artifacts=DIR"])
def test_the_image_entrypoint_verifies_the_artifact_before_it_serves(art, tmp_path, spelling):
    """The entrypoint runs `neuron-moe verify` first: a tampered artifact stops it with verify's one
    line (exit 2), and serve never starts (no Neuron SDK needed to see it)."""
    _flip(art / RANK_WEIGHTS.format(rank=0))
    given = ["--artifacts", str(art)] if spelling == "--artifacts DIR" else [f"--artifacts={art}"]
    done = subprocess.run(
        [str(REPO / "docker" / "entrypoint.sh"), "--model", "tiny-gemma4-moe", "--backend", "neuron", *given],
        env=_python3_here(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {art}/weights/tp0_sharded_checkpoint.safetensors: sha256 ")
    assert done.stderr.count("\n") == 1 and "serve" not in done.stdout


# ---- the manifest's contract, field by field, against its ranges and its files ----------------------


@pytest.fixture(scope="module")
def built_tp2(tmp_path_factory, tiny_port):
    """--tp 2 --quantization int4: two rank shards whose experts are packed uint8."""
    return _build(tmp_path_factory, tiny_port, tp=2, quantization="int4")


@pytest.fixture
def art2(built_tp2, tmp_path):
    return shutil.copytree(built_tp2, tmp_path / "art2")


def _edit(art, **fields):
    """manifest.json rewritten with `fields` (None: the field deleted)."""
    manifest = json.loads((art / MANIFEST).read_text())
    for key, value in fields.items():
        manifest.pop(key) if value is None else manifest.__setitem__(key, value)
    (art / MANIFEST).write_text(json.dumps(manifest))


# each field as a careless or hostile edit leaves it -> what the one error line names
CONTRACT = {
    "tp 0": ({"tp": 0}, "/manifest.json: 'tp' 0 is not a TP degree"),
    "tp -1": ({"tp": -1}, "/manifest.json: 'tp' -1 is not a TP degree"),
    "tp 2^70": ({"tp": 2**70}, f"/manifest.json: 'tp' {2**70} is not a TP degree"),
    "tp true": ({"tp": True}, "/manifest.json: 'tp' True is not a TP degree"),
    "tp 4, 2 shards": ({"tp": 4}, "/manifest.json: 'tp' 4 with weights true takes 4 rank shard(s), 'files' lists 2"),
    "tp 1, 2 shards": ({"tp": 1}, "/manifest.json: 'tp' 1 with weights true takes 1 rank shard(s), 'files' lists 2"),
    "no weights, 2 shards": ({"weights": False}, "/manifest.json: 'tp' 2 with weights false takes 0 rank shard(s)"),
    "quantization bogus": ({"quantization": "bogus"}, "/manifest.json: 'quantization' 'bogus' is not one of"),
    "int8 on int4 weights": (
        {"quantization": "int8"},
        "/shard_plan.json: model.layers.0.experts.down_proj.weight is uint8, but the manifest says quantization 'int8'",
    ),
    "none on int4 weights": ({"quantization": "none"}, "experts.down_proj.weight is uint8, but the manifest says"),
    "quantized_layers bogus": (
        {"quantized_layers": ["experts", "bogus"]},
        "/manifest.json: 'quantized_layers' ['experts', 'bogus'] is not a list of layer groups",
    ),
    "quantized_layers empty": ({"quantized_layers": []}, "/manifest.json: 'quantized_layers' [] is not a list"),
    "attention claimed on float attention": (
        {"quantized_layers": ["experts", "attention"]},
        "self_attn.k_proj.weight is float32, but the manifest says quantization 'int4' on experts, attention",
    ),
    "dtype bogus": ({"dtype": "bogus"}, "/manifest.json: 'dtype' 'bogus' is not one of"),
    "port nonexistent": ({"port": "nonexistent"}, ": built for port 'nonexistent', which is not a built-in port"),
    "port a path": ({"port": "../../etc/passwd"}, "/manifest.json: 'port' '../../etc/passwd' is not a port's name"),
    "batch_size 2^40": ({"batch_size": 2**40}, "/manifest.json: 'batch_size' must be a count from 1 to 1024"),
    "max_cache_len 2^40": ({"max_cache_len": 2**40}, "/manifest.json: 'max_cache_len' must be a count from 1 to"),
    "candidates 2^40": ({"candidates": 2**40}, "/manifest.json: 'candidates' must be a count from 1 to 256"),
    "buckets [8, 8, 56]": ({"buckets": [8, 8, 56]}, "/manifest.json: 'buckets' must be 1 to 64 strictly increasing"),
    "dry_run false, no model": (
        {"dry_run": False},
        "/manifest.json: 'dry_run' is false, but 'files' lists no model.pt",
    ),
    "keys deleted": ({"keys": None}, "/manifest.json: field 'keys' is missing"),
    "state deleted": ({"state": None}, "/manifest.json: field 'state' is missing"),
    "a key too few": (
        {"keys": {"token_generation": {"inputs": {}, "outputs": {}}}},
        "/manifest.json: 'keys' must be the graphs of its buckets and prefill_rows; missing ",
    ),
}


@pytest.mark.parametrize("case", CONTRACT)
def test_verify_refuses_each_out_of_contract_field(art2, capsys, case):
    """Each field out of its range, or out of step with the files, is one error line naming it: verify
    never says the files match for a manifest that serve could not honour."""
    fields, named = CONTRACT[case]
    assert cli.main(["verify", str(art2)]) == 0
    capsys.readouterr()
    _edit(art2, **fields)
    assert cli.main(["verify", str(art2)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {art2}") and named in err and err.count("\n") == 1, err


@pytest.mark.parametrize("case", CONTRACT)
def test_serve_refuses_each_out_of_contract_field_before_the_sdk(art2, capsys, case):
    """serve --backend neuron --artifacts makes verify's checks (one shared check), before the SDK's."""
    fields, named = CONTRACT[case]
    _edit(art2, **fields)
    assert cli.main(["serve", "--backend", "neuron", "--artifacts", str(art2), "--port", "0"]) == 2
    err = capsys.readouterr().err
    if case == "port nonexistent":  # served as --model's port (the default): refused for another's artifact
        named = ": built for port 'nonexistent', not 'tiny-gemma4-moe'"
    assert err.startswith(f"error: {art2}") and named in err and err.count("\n") == 1, err


def test_the_report_says_what_was_compared(art2, capsys):
    """Locally the files are compared with the digests manifest.json lists; manifest.json itself is
    checked field by field, having no digest of its own here, and the report says so."""
    assert cli.main(["verify", str(art2)]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((art2 / MANIFEST).read_text())
    assert f"{art2}: {len(manifest['files'])} files (" in out
    assert "match the sizes and sha256 its manifest.json lists, and no other file is there" in out
    assert f"(format {FORMAT}: port tiny-gemma4-moe, TP 2, float32, int4 experts, dry run): every field in range" in out
    assert "a weight shard per rank, 2 in all, the experts' dtypes in the rank shards and shard_plan.json" in out
    assert "manifest.json itself: no digest to compare here (a publication records one)" in out


def test_the_rank_shards_weights_are_checked_not_only_the_plan(art2, capsys):
    """A shard plan that agrees with a lying manifest does not hide the shards' own dtypes."""
    plan = json.loads((art2 / "shard_plan.json").read_text())
    for entry in plan.values():
        entry["dtype"] = "int8" if entry["dtype"] == "uint8" else entry["dtype"]
    (art2 / "shard_plan.json").write_text(json.dumps(plan))
    manifest = json.loads((art2 / MANIFEST).read_text())
    data = (art2 / "shard_plan.json").read_bytes()
    manifest["files"]["shard_plan.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["quantization"] = "int8"
    (art2 / MANIFEST).write_text(json.dumps(manifest))
    assert cli.main(["verify", str(art2)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {art2}/weights/tp0_sharded_checkpoint.safetensors: ") and "is uint8" in err, err


# ---- JSON nested past any manifest --------------------------------------------------------------------

DEEP = "[" * 200_000 + "]" * 200_000


@pytest.mark.parametrize("text", [DEEP, json.dumps({"format": 8, "keys": json.loads("[" * 65 + "]" * 65)})])
def test_a_manifest_nested_too_deep_is_one_line(art, capsys, text):
    (art / MANIFEST).write_text(text)
    for argv in (["verify", str(art)], ["serve", "--backend", "neuron", "--artifacts", str(art), "--port", "0"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"error: {art}/manifest.json: not valid JSON: nested deeper than 64 levels\n", err


# ---- regular files only ----------------------------------------------------------------------------------


def _fifo(art):
    os.mkfifo(art / "tokenizer" / "pipe")
    return art / "tokenizer" / "pipe"


def _zeros(art):
    (art / "weights" / "zeros.bin").symlink_to("/dev/zero")
    return art / "weights" / "zeros.bin"


def _run(argv, env=None):
    """A command in its own process: on a file it would read forever, the deadline fails the test."""
    return subprocess.run(
        [sys.executable, "-m", "neuron_moe", *argv],
        env=env or dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("make", [_fifo, _zeros], ids=["fifo", "link to /dev/zero"])
@pytest.mark.parametrize("command", ["verify", "serve", "sagemaker"])
def test_a_file_that_is_not_regular_is_refused_not_read(art, tmp_path, make, command):
    """A FIFO would block the read, /dev/zero never end it: verify, serve --artifacts and the SageMaker
    entrypoint refuse it by name, one line, exit 2."""
    path = make(art)
    if command == "verify":
        done = _run(["verify", str(art)])
    elif command == "serve":
        done = _run(["serve", "--backend", "neuron", "--artifacts", str(art), "--port", "0"])
    else:
        env = dict(_python3_here(tmp_path), SM_MODEL_DIR=str(art))
        done = subprocess.run(
            [sys.executable, "-m", "neuron_moe.deploy.sagemaker"], env=env, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == f"error: {path}: not a regular file (a FIFO, a device or a socket); remove it\n"


def test_files_reached_through_a_linked_folder_are_read(art, tmp_path, capsys):
    """A `weights/` that is a symbolic link to a folder elsewhere: its files are the artifact's, read
    through the link (as serve loads them); a link to a folder holding it (a loop) is refused by name."""
    elsewhere = tmp_path / "elsewhere"
    shutil.move(art / "weights", elsewhere)
    (art / "weights").symlink_to(elsewhere, target_is_directory=True)
    assert cli.main(["verify", str(art)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    (elsewhere / "loop").symlink_to(art, target_is_directory=True)
    assert cli.main(["verify", str(art)]) == 2
    assert capsys.readouterr().err == f"error: {art}/weights/loop: a symbolic link to a folder that holds it (a loop)\n"
