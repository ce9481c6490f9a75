"""What a GPU benchmark ran on, recorded beside its numbers: the device, its driver, and the
versions of torch, CUDA, triton and transformers (bench/gpu_reader.py, bench/gpu_decode.py)."""

from __future__ import annotations

import datetime
import subprocess


def driver_version() -> str:
    """The NVIDIA driver, from nvidia-smi ("unknown" where there is none)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def machine(dry_run: bool) -> dict:
    import torch
    import transformers
    import triton

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "dry_run": dry_run,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if dry_run or not torch.cuda.is_available():
        info.update(device="cpu (Triton interpreter)", driver="none")
    else:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, driver=driver_version(), memory_GiB=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)
    return info


def header(info: dict) -> str:
    """One markdown line naming the machine and versions."""
    return (f"Ran on: {info['device']} (driver {info['driver']}), torch {info['torch']} (CUDA {info['cuda']}), "
            f"triton {info['triton']}, transformers {info['transformers']}; {info['date']}"
            + (" — a dry run on the CPU: no GPU figure here." if info["dry_run"] else ""))
