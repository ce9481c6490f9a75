"""recipes/inf2-24xlarge/run.sh run against stand-ins for `docker` and `curl` (no Docker engine or
device here): it builds and runs the project's own image, removes every container it starts, never
mounts the checkout, serves the artifact alone, and its wait ends when the server's container dies."""

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "inf2-24xlarge" / "run.sh"
# Each call's arguments, one JSON list a line. `docker ps` finds no container (the server died while
# loading), `docker logs -f` prints its last words; curl never connects.
DOCKER = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "logs":
    print("ERROR:     neuron_moe.serve: model failed to load: the device is busy")
elif sys.argv[1] == "run" and "-d" in sys.argv:
    print("0123456789ab")
"""


@pytest.fixture
def recipe(tmp_path):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "docker").write_text(DOCKER)
    (stubs / "curl").write_text("#!/bin/sh\nexit 7\n")  # connection refused
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    calls = tmp_path / "calls.jsonl"

    def run(*steps, **env):
        environ = {
            **os.environ,
            "PATH": f"{stubs}:{os.environ['PATH']}",
            "CALLS": str(calls),
            "ARTIFACTS": str(tmp_path / "artifacts"),
            "HF_HOME": str(tmp_path / "hf"),
            **env,
        }
        environ.pop("HF_TOKEN", None)
        done = subprocess.run(["bash", str(RECIPE), *steps], env=environ, capture_output=True, text=True, timeout=60)
        return done, [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

    return run


def test_it_builds_the_image_and_runs_every_step_in_it(recipe, tmp_path):
    done, calls = recipe("image", "plan", "compile-bf16", "serve")
    assert done.returncode == 1  # the server died: the wait ended, it did not loop on
    assert "neuron-moe-serve exited before it was ready" in done.stderr and "the device is busy" in done.stderr
    build = calls[0]
    assert build[:3] == ["build", "-f", str(REPO / "docker" / "Dockerfile.neuron")] and build[-1] == str(REPO)
    assert build[3:7] == ["--build-arg", "NEURON_SDK=2.31.1", "-t", "neuron-moe:neuron"]  # the pinned SDK
    runs = [c for c in calls if c[0] == "run"]
    assert runs and all("--rm" in c for c in runs)  # nothing left behind, a rerun never meets its own name
    assert all(str(REPO) not in " ".join(c) for c in runs)  # the image's own package, no checkout mounted
    assert all("neuron-moe:neuron" in c for c in runs)
    plan, compile_, serve = runs
    assert plan[plan.index("--entrypoint") + 1 :][:2] == ["neuron-moe", "neuron-moe:neuron"] and "plan" in plan
    assert compile_[compile_.index("--checkpoint") + 1] == "google/gemma-4-26B-A4B-it"  # a Hub id, into HF_HOME
    assert f"{tmp_path / 'hf'}:/hf" in compile_ and "HF_HOME=/hf" in compile_
    # the server: the image's entrypoint on the bf16 artifact alone (no checkpoint: the artifact has its tokenizer)
    assert serve[serve.index("neuron-moe:neuron") + 1 :] == [
        "--model",
        "gemma4-26b-a4b",
        "--backend",
        "neuron",
        "--artifacts",
        "/artifacts/gemma4-26b-a4b-bf16-tp8",
    ]
    assert ["rm", "-f", "neuron-moe-serve"] in calls
    assert calls.index(["rm", "-f", "neuron-moe-serve"]) < calls.index(serve)
    assert serve[serve.index("--name") + 1] == "neuron-moe-serve" and "-d" in serve


def test_a_local_checkpoint_is_mounted_read_only_and_a_built_artifact_kept(recipe, tmp_path):
    checkpoint = tmp_path / "gemma"
    checkpoint.mkdir()
    built = tmp_path / "artifacts" / "gemma4-26b-a4b-int8-tp8"
    built.mkdir(parents=True)
    (built / "manifest.json").write_text("{}")
    done, calls = recipe("compile-bf16", "compile-int8", CHECKPOINT=str(checkpoint))
    assert done.returncode == 0, done.stderr
    (compile_,) = [c for c in calls if c[0] == "run"]  # int8 exists: kept
    assert f"{checkpoint}:/checkpoint:ro" in compile_ and compile_[compile_.index("--checkpoint") + 1] == "/checkpoint"
    assert "gemma4-26b-a4b-int8-tp8 exists: kept (OVERWRITE=1 rebuilds it)" in done.stdout


def test_the_nki_sdk_builds_its_own_image_and_runs_in_it(recipe):
    """NEURON_SDK=2.28.0 (the reader's NKI kernels, docs/neuron.md): that SDK's DLC, under its own tag."""
    done, calls = recipe("image", "plan", NEURON_SDK="2.28.0")
    assert done.returncode == 0, done.stderr
    build, plan = calls
    assert build[3:7] == ["--build-arg", "NEURON_SDK=2.28.0", "-t", "neuron-moe:neuron-sdk2.28.0"]
    assert "neuron-moe:neuron-sdk2.28.0" in plan
