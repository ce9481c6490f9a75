"""recipes/inf2-24xlarge/run.sh and the one-chip recipe (recipes/inf2-xlarge/, inf2-8xlarge/) run
against stand-ins for `docker` and `curl` (no Docker engine or device here): they build and run the
project's own image, remove every container they start, never mount the checkout, serve the artifact
alone, and the wait ends when the server's container dies. The one-chip recipe compiles, plans and
publishes on one host and pulls and serves on the other, q4_0 on every linear at TP 2 throughout, from
Google's QAT checkpoint unless CHECKPOINT names another."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "inf2-24xlarge" / "run.sh"
ONE_CHIP = REPO / "recipes" / "inf2-xlarge" / "run.sh"
ONE_CHIP_8X = REPO / "recipes" / "inf2-8xlarge" / "run.sh"
# the one-chip build: its format and the linears in it, its checkpoint and its artifact
ONE_CHIP_FORMAT = ["--quantization", "q4_0", "--quantized-layers", "experts,attention,mlp,lm_head"]
ONE_CHIP_LAYERS = ("experts", "attention", "mlp", "lm_head")
QAT = "google/gemma-4-26B-A4B-it-qat-q4_0-unquantized"
ONE_CHIP_BUILD = "/artifacts/gemma4-26b-a4b-q4_0-all-tp2"
AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION")
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

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {768 * 2**20} kB\n")  # an inf2.48xlarge's host: every compile fits

    def run(*steps, script=RECIPE, **env):
        environ = {
            **os.environ,
            "PATH": f"{stubs}:{os.environ['PATH']}",
            "CALLS": str(calls),
            "ARTIFACTS": str(tmp_path / "artifacts"),
            "HF_HOME": str(tmp_path / "hf"),
            "MEMINFO": str(meminfo),
            **env,
        }
        for var in ("HF_TOKEN", "S3", "INSTANCE", "FORCE_COMPILE", *AWS_VARS):
            if var not in env:
                environ.pop(var, None)
        done = subprocess.run(["bash", str(script), *steps], env=environ, capture_output=True, text=True, timeout=60)
        return done, [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

    return run


def _served(run: list) -> str:
    """The artifact a `docker run ... IMAGE` of the server serves: the image's entrypoint on it alone (no
    checkpoint: the artifact has its tokenizer)."""
    command = run[run.index("neuron-moe:neuron") + 1 :]
    assert command[:-1] == ["--model", "gemma4-26b-a4b", "--backend", "neuron", "--artifacts"], command
    return command[-1]


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
    # the server: the bf16 artifact, on the cores it was compiled for
    assert _served(serve) == "/artifacts/gemma4-26b-a4b-bf16-tp8" and "NEURON_RT_NUM_CORES=8" in serve
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


def _runs(calls):
    return [c for c in calls if c[0] == "run"]


def _command(run: list) -> list:
    """The neuron-moe command of a `docker run --entrypoint neuron-moe IMAGE ...`."""
    return run[run.index("--entrypoint") + 3 :]


def test_the_one_chip_compile_host_plans_compiles_q4_0_everywhere_at_tp2_and_publishes(recipe, tmp_path):
    s3 = "s3://bucket/gemma4-q4_0"
    done, calls = recipe("compile-host", script=ONE_CHIP, S3=s3, AWS_REGION="us-east-2")
    assert done.returncode == 0, done.stderr
    build = calls[0]
    assert build[:3] == ["build", "-f", str(REPO / "docker" / "Dockerfile.neuron")] and build[-1] == str(REPO)
    runs = _runs(calls)
    assert all("--rm" in c and "neuron-moe:neuron" in c for c in runs)
    assert all(str(REPO) not in " ".join(c) for c in runs)  # the image's own package, no checkout mounted
    plan, compile_, publish = (_command(c) for c in runs)
    assert plan == ["plan", "--model", "gemma4-26b-a4b", "--instance", "inf2.xlarge", "--tp", "2", *ONE_CHIP_FORMAT]
    assert compile_[0] == "trace-and-compile"
    flags = compile_.index("--quantization")
    assert compile_[flags : flags + 4] == ONE_CHIP_FORMAT
    assert compile_[compile_.index("--tp") + 1] == "2"
    assert compile_[compile_.index("--out") + 1] == ONE_CHIP_BUILD
    assert compile_[compile_.index("--checkpoint") + 1] == QAT  # this recipe's default: the QAT weights
    assert publish == ["publish", ONE_CHIP_BUILD, s3]
    published = runs[2]
    assert f"{tmp_path / 'artifacts'}:/artifacts:ro" in published  # publishing reads the artifact only
    assert "--network" in published and published[published.index("--network") + 1] == "host"
    assert "AWS_REGION" in published and "AWS_ACCESS_KEY_ID" not in published  # only the variables set


def test_the_one_chip_checkpoint_is_overridable_and_the_others_default_is_unchanged(recipe, tmp_path):
    """CHECKPOINT names another checkpoint for the one-chip recipe (a Hub id, or a local directory
    mounted read-only); the QAT default is that recipe's alone: inf2.24xlarge's is still Google's own."""
    done, calls = recipe("compile", script=ONE_CHIP, CHECKPOINT="google/gemma-4-26B-A4B-it")
    assert done.returncode == 0, done.stderr
    compile_ = _command(_runs(calls)[-1])
    assert compile_[compile_.index("--checkpoint") + 1] == "google/gemma-4-26B-A4B-it"
    checkpoint = tmp_path / "gemma"
    checkpoint.mkdir()
    done, calls = recipe("compile", script=ONE_CHIP, CHECKPOINT=str(checkpoint))
    assert done.returncode == 0, done.stderr
    compile_ = _runs(calls)[-1]
    assert f"{checkpoint}:/checkpoint:ro" in compile_ and compile_[compile_.index("--checkpoint") + 1] == "/checkpoint"
    done, calls = recipe("compile-bf16")
    assert done.returncode == 0, done.stderr
    compile_ = _command(_runs(calls)[-1])
    assert compile_[compile_.index("--checkpoint") + 1] == "google/gemma-4-26B-A4B-it"


def test_the_one_chip_box_pulls_and_serves_the_artifact_alone(recipe, tmp_path):
    s3 = "s3://bucket/gemma4-q4_0"
    done, calls = recipe("serve-host", script=ONE_CHIP, S3=s3)
    assert done.returncode == 1  # the server died: the wait ended
    assert "neuron-moe-serve exited before it was ready" in done.stderr and "the device is busy" in done.stderr
    runs = _runs(calls)
    plan, pull = (_command(c) for c in runs[:2])
    assert plan[plan.index("--instance") + 1] == "inf2.xlarge"
    assert pull == ["pull", s3, ONE_CHIP_BUILD]
    serve = runs[2]
    assert _served(serve) == ONE_CHIP_BUILD
    assert "--rm" in serve and "NEURON_RT_NUM_CORES=2" in serve
    assert f"{tmp_path / 'artifacts'}:/artifacts:ro" in serve
    assert calls.index(["rm", "-f", "neuron-moe-serve"]) < calls.index(serve)


def test_a_compile_host_smaller_than_the_plans_estimate_is_refused_naming_it(recipe, tmp_path):
    """An inf2.8xlarge's 128 GiB against the plan's 197 GiB for the largest key of q4_0 on every linear
    at TP 2: refused
    before any container runs; FORCE_COMPILE=1 compiles anyway."""
    small = tmp_path / "meminfo-128"
    small.write_text(f"MemTotal:       {128 * 2**20} kB\nMemFree:        1 kB\n")
    done, calls = recipe("compile", script=ONE_CHIP, MEMINFO=str(small))
    assert done.returncode == 2 and _runs(calls) == []
    assert "this host has 128 GiB of memory; neuron-moe plan estimates neuronx-cc needs at least 197 GiB" in done.stderr
    done, calls = recipe("compile", script=ONE_CHIP, MEMINFO=str(small), FORCE_COMPILE="1")
    assert done.returncode == 0, done.stderr
    assert _command(_runs(calls)[-1])[0] == "trace-and-compile"


def test_the_recipes_compile_host_figures_are_the_plans():
    """Each recipe's COMPILE_HOST_GIB is its build's `plan` compile-host figure (the largest key's),
    rounded up, and the figure is the one its comments (and the one-chip README) quote."""
    from neuron_moe.neuron.plan import GiB, plan_keys, port_plan
    from neuron_moe.port import load_port
    from neuron_moe.run_config import RunConfig
    from neuron_moe.spec import compiled_backend

    port = load_port("gemma4-26b-a4b")
    readme = " ".join((ONE_CHIP.parent / "README.md").read_text().split())
    builds = {
        (2, "q4_0", ONE_CHIP_LAYERS): "COMPILE_HOST_GIB={}\n",
        (8, "none", None): "[bf16]={} ",
        (8, "int8", None): "[int8]={})",
    }
    for (tp, quantization, layers), held in builds.items():
        backend = compiled_backend("plan", tp, quantization, "bfloat16", None, None, layers)
        estimate = port_plan(port, RunConfig(backend=backend), None)["compile_host"]
        assert [k["key"] for k in estimate["keys"]] == list(plan_keys(1, 4096, port.static))
        script = (ONE_CHIP if tp == 2 else RECIPE).read_text()
        assert held.format(math.ceil(estimate["largest_bytes"] / GiB)) in script
        assert f"{estimate['largest_bytes'] / GiB:.1f} GiB" in script
        if tp == 2:
            assert f"at least {estimate['largest_bytes'] / GiB:.1f} GiB for the largest key" in readme


def test_the_8xlarge_recipe_is_the_one_chip_recipe_for_its_instance(recipe):
    done, calls = recipe("plan", script=ONE_CHIP_8X)
    assert done.returncode == 0, done.stderr
    (plan,) = (_command(c) for c in _runs(calls))
    assert plan[plan.index("--instance") + 1] == "inf2.8xlarge" and plan[-4:] == ONE_CHIP_FORMAT


def test_the_one_chip_recipe_refuses_without_steps_or_a_publication(recipe):
    done, calls = recipe(script=ONE_CHIP)
    assert done.returncode == 2 and "usage: run.sh compile-host | serve-host" in done.stderr and calls == []
    done, calls = recipe("publish", script=ONE_CHIP)
    assert done.returncode == 2 and "set S3 to the publication's s3://BUCKET/PREFIX" in done.stderr
    assert _runs(calls) == []
    done, _ = recipe("deploy", script=ONE_CHIP)
    assert done.returncode == 2 and "unknown step deploy" in done.stderr


@pytest.mark.parametrize("instance", ["inf2.xlarge", "inf2.8xlarge"])
def test_the_one_chip_readme_figures_are_the_plans(instance):
    """The figures the recipes' READMEs quote are what `plan` says for them today."""
    from neuron_moe.neuron.plan import GB, GiB, plan
    from neuron_moe.port import load_port

    r = plan(
        load_port("gemma4-26b-a4b").config, instance, 2, "q4_0", batch=1, seq=4096, quantized_layers=ONE_CHIP_LAYERS
    )
    page = ONE_CHIP.parent / "README.md" if instance == "inf2.xlarge" else ONE_CHIP_8X.parent / "README.md"
    text = " ".join(page.read_text().split())
    total, spare = r["per_rank_total_bytes"] / GB, r["margin_per_core_bytes"] / GB
    assert f"{total:.2f}" in text and f"{spare:.2f} spare" in text
    assert f"{r['host']['peak_bytes'] / GiB:.2f}" in text
    if instance == "inf2.xlarge":
        shapes = {row["batch"]: row["context"] for row in r["largest_shapes"]}
        assert f"batch 1 is {shapes[1]:,} positions" in text and f"batch 8 {shapes[8]:,}" in text
        floor = r["decode"][0]
        assert f"{floor['floor_ms']:.2f} ms per token ({floor['GB_per_token']:.2f} GB read" in text
        held = r["per_rank_bytes"]
        assert f"| {held['experts'] / GB:.2f} |" in text and f"| {held['embeddings'] / GB:.2f} |" in text
        quantized = " + ".join(f"{held[group] / GB:.2f}" for group in ("attention", "dense_mlp", "lm_head"))
        assert f"| {quantized} |" in text
