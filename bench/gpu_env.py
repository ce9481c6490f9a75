"""What a GPU benchmark ran on, recorded beside its numbers: the device, its driver, and the
versions of torch, CUDA, triton and transformers (bench.gpu_reader, bench.gpu_decode); and the
Triton interpreter their dry runs need on the CPU."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

from bench.harness import ROOT


def default_json(name: str, dry_run: bool) -> Path:
    """Where a benchmark writes `name`.json (and .md beside it) without --json: $OUT where the device
    call sets it; else a dry run's goes to build/dry-run/ (its numbers are the CPU interpreter's and never
    replace a recorded run) and a real run's to bench/results/."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / f"{name}.json"
    return (ROOT / "build" / "dry-run" if dry_run else ROOT / "bench" / "results") / f"{name}.json"


def interpret_on_cpu(module: str, argv: list[str]) -> None:
    """Make sure Triton's interpreter runs the kernels (a dry run, on the CPU). Triton chooses it when a
    kernel is defined, at import, from TRITON_INTERPRET: where that is not yet "1", run `python -m
    module argv` again in this process's place with it set (the arguments and everything else unchanged)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], {**os.environ, "TRITON_INTERPRET": "1"})


def driver_version() -> str:
    """The NVIDIA driver, from nvidia-smi ("unknown" where there is none)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def machine(dry_run: bool) -> dict:
    import torch
    import transformers
    import triton

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "dry_run": dry_run,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if dry_run or not torch.cuda.is_available():
        info.update(device="cpu (Triton interpreter)", driver="none")
    else:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            driver=driver_version(),
            memory_GiB=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
        )
    return info


def header(info: dict) -> str:
    """One markdown line naming the machine and versions."""
    return (
        f"Ran on: {info['device']} (driver {info['driver']}), torch {info['torch']} (CUDA {info['cuda']}), "
        f"triton {info['triton']}, transformers {info['transformers']}; {info['date']}"
        + (" — a dry run on the CPU: no GPU figure here." if info["dry_run"] else "")
    )
