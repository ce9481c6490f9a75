"""`neuron-moe verify` and the same checks in `serve --artifacts`, on a dry-run artifact of the tiny
port, on CPU: each tampering refused by the file's (or the field's) name, before any SDK is needed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_moe import cli
from neuron_moe.neuron import compile as compile_
from neuron_moe.neuron.artifact import MANIFEST, RANK_WEIGHTS

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_port):
    """trace-and-compile --dry-run of the tiny port (not exported: the files are what is checked)."""
    out = tmp_path_factory.mktemp("built") / "art"
    compile_.trace_and_compile(tiny_port, compile_.Build.at(tp=1, out=out, dtype="float32", dry_run=True, export=False))
    return out


@pytest.fixture
def art(built, tmp_path):
    copy = tmp_path / "art"
    shutil.copytree(built, copy)
    return copy


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
