"""`neuron-moe env` (cf. `transformers env`, `vllm collect-env`): what this machine runs the project's
paths on, and which of those paths it supports.

The versions of Python and of every package a path needs, the Neuron devices and cores, any CUDA
GPU; the compile target trace-and-compile builds for and serve requires (`neuron/artifact.TARGET`);
then one row per path that needs more than the CPU install: supported here or not, and why (the
package, version or device missing). Found without importing or running any of them: package
metadata and import specs, `neuron-ls` or `/dev/neuron*`, torch's CUDA query.

Every command that needs one of these paths asks `require(path)` before any work, so its refusal
is the row's reason: one `error:` line, exit 2. Which SDK each path needs on inf2, from the SDK's
own pages: docs/neuron.md.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess

import torch

from .errors import UserError
from .neuron.artifact import TARGET
from .parallel import nxd_source
from .reader.nki.forward import NKI_TARGET, NKI_TARGET_SDK, nki_unsupported

DISTRIBUTIONS = (
    "torch",
    "transformers",
    "torch-xla",
    "torch-neuronx",
    "neuronx-distributed",
    "neuronx-cc",
    "nki",
    "libneuronxla",
    "triton",
)

TRACE_AND_COMPILE = "trace-and-compile"
VALIDATE_NXD = "validate --tp-layers nxd"
READER_NKI = "reader --reader-kernel nki"
READER_TRITON = "reader --reader-kernel triton"
SERVE_NEURON = "serve --backend neuron"
PATHS = (TRACE_AND_COMPILE, VALIDATE_NXD, READER_NKI, READER_TRITON, SERVE_NEURON)

COMPILE_MODULES = ("torch_neuronx", "neuronx_distributed", "neuronxcc")  # ModelBuilder, its tracer, the compiler
SERVE_MODULES = ("torch_neuronx", "neuronx_distributed")  # the runtime that loads a ModelBuilder artifact
IMAGE = "the Neuron image (docker/Dockerfile.neuron: the Neuron SDK 2.31.1 DLC by default; docs/neuron.md)"


def version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {"python": platform.python_version(), **{d: version(d) for d in DISTRIBUTIONS}}


def neuron_devices() -> dict:
    """Neuron devices (chips) and NeuronCores: from `neuron-ls --json-output` when it runs, else the
    device files (cores then unknown)."""
    tool = shutil.which("neuron-ls")
    if tool:
        try:
            out = subprocess.run([tool, "--json-output"], capture_output=True, text=True, timeout=30, check=False)
            devices = json.loads(out.stdout) if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
            devices = None
        if isinstance(devices, list):
            cores = [d.get("nc_count") for d in devices if isinstance(d, dict)]
            return {
                "devices": len(devices),
                "cores": sum(cores) if cores and None not in cores else None,
                "source": "neuron-ls",
            }
    files = sorted(f for f in glob.glob("/dev/neuron*") if f[len("/dev/neuron") :].isdigit())
    return {"devices": len(files), "cores": None, "source": "/dev/neuron*" if files else None}


def gpu() -> dict:
    if not torch.cuda.is_available():
        return {"cuda": torch.version.cuda, "devices": []}
    return {
        "cuda": torch.version.cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def _missing(modules) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _no_device() -> str | None:
    found = neuron_devices()
    return None if found["devices"] else "a Neuron device (none: no neuron-ls device, no /dev/neuron*)"


def support(path: str) -> tuple[bool, str]:
    """(supported here, why): the detail names what is there, or what is missing and how to get it."""
    if path == TRACE_AND_COMPILE:
        missing = _missing(COMPILE_MODULES)
        if missing:
            return False, (
                f"needs the Neuron SDK (missing {', '.join(missing)}): run it on an inf2 instance in {IMAGE}, "
                f"or pass --dry-run to build and export the same rank modules on CPU"
            )
        return True, (
            f"ModelBuilder: torch-neuronx {version('torch-neuronx')}, neuronx-distributed "
            f"{version('neuronx-distributed')}, neuronx-cc {version('neuronx-cc')}"
        )
    if path == VALIDATE_NXD:
        try:
            source = nxd_source.locate()
        except UserError as e:
            return False, str(e)
        if source is None:
            return False, nxd_source.MISSING
        return True, f"{source.describe()}, in NxD's CPU mode over gloo (not Neuron: docs/neuron.md)"
    if path == READER_NKI:
        needs = [
            why
            for why in (
                nki_unsupported(version("nki")),
                "needs torch-neuronx (the Neuron SDK)" if _missing(["torch_neuronx"]) else None,
                "needs " + _no_device() if _no_device() else None,
            )
            if why
        ]
        if needs:
            return False, "; ".join(needs)
        return True, (
            f"nki {version('nki')} (the kernels' target: {NKI_TARGET}.x, {NKI_TARGET_SDK}) on "
            f"{neuron_devices()['devices']} Neuron device(s)"
        )
    if path == READER_TRITON:
        if version("triton") is None or importlib.util.find_spec("triton") is None:
            return False, "needs triton: pip install 'neuron-moe[triton]'"
        if gpu()["devices"]:
            return True, f"triton {version('triton')} on {gpu()['devices'][0]}"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True, f"triton {version('triton')} in its CPU interpreter (TRITON_INTERPRET=1; no CUDA GPU)"
        return False, "needs a CUDA GPU (none here; TRITON_INTERPRET=1 runs the kernels in Triton's CPU interpreter)"
    if path == SERVE_NEURON:
        missing, device = _missing(SERVE_MODULES), _no_device()
        if missing or device:
            needs = " and ".join(
                filter(None, [f"the Neuron SDK (missing {', '.join(missing)})" if missing else None, device])
            )
            return False, f"needs {needs}: run it on an inf2 instance in {IMAGE}"
        return True, (
            f"torch-neuronx {version('torch-neuronx')}, neuronx-distributed {version('neuronx-distributed')}"
            f", {neuron_devices()['devices']} Neuron device(s)"
        )
    raise KeyError(f"unknown path {path!r}; expected one of {', '.join(PATHS)}")


def require(path: str) -> None:
    """Refuse `path` here, before any work, with the reason `neuron-moe env` prints for it."""
    supported, why = support(path)
    if not supported:
        raise UserError(f"{path} {why}")


def env_report() -> dict:
    rows = []
    for path in PATHS:
        supported, why = support(path)
        rows.append({"path": path, "supported": supported, "why": why})
    nxd_src = os.environ.get(nxd_source.ENV)
    return {
        "versions": versions(),
        "platform": platform.platform(),
        "neuron": neuron_devices(),
        "gpu": gpu(),
        "nxd_src": nxd_src,
        "target": TARGET,
        "paths": rows,
    }


def render_env(report: dict) -> str:
    lines = ["versions:"]
    lines += [f"  {name:20} {v or 'not installed'}" for name, v in report["versions"].items()]
    neuron, gpus = report["neuron"], report["gpu"]
    lines.append(f"platform: {report['platform']}")
    if neuron["devices"]:
        cores = (
            f"{neuron['cores']} NeuronCores" if neuron["cores"] is not None else "NeuronCores unknown (no neuron-ls)"
        )
        lines.append(f"Neuron devices: {neuron['devices']} ({cores}; from {neuron['source']})")
    else:
        lines.append("Neuron devices: none (no neuron-ls device, no /dev/neuron*)")
    lines.append(
        f"GPU: {', '.join(gpus['devices'])} (CUDA {gpus['cuda']})"
        if gpus["devices"]
        else f"GPU: none (torch {'built with CUDA ' + gpus['cuda'] if gpus['cuda'] else 'without CUDA'}; "
        f"no CUDA device)"
    )
    lines.append(f"NXD_SRC: {report['nxd_src'] or 'unset'}")
    target = report["target"]
    lines.append(
        f"compile target: {target['name']} (neuronx-cc {' '.join(target['compiler_args'])}; environment "
        + " ".join(f"{k}={v}" for k, v in target["env"].items())
        + ")"
    )
    lines.append("")
    width = max(len(r["path"]) for r in report["paths"])
    lines.append(f"{'path':{width}}  supported  why")
    lines += [f"{r['path']:{width}}  {'yes' if r['supported'] else 'no':9}  {r['why']}" for r in report["paths"]]
    return "\n".join(lines)
