"""What the benchmarks record and write the same way: the machine and the checkout a run was made on,
the command line that ran, and the results as JSON with their markdown page, made from that JSON,
beside it. (What a GPU run records besides, the device and its driver, is bench.gpu_env's.)"""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

from neuron_moe.report import atomic_write, write_json

ROOT = Path(__file__).resolve().parents[1]


def command(module: str, argv: list[str]) -> str:
    """The command line that ran, as it is typed from the repository root."""
    return " ".join(["python", "-m", module, *argv])


def cpu_model(otherwise: str | None = None) -> str:
    """The CPU's model name, from /proc/cpuinfo; else `otherwise` (default: `platform.processor()`)."""
    cpuinfo = Path("/proc/cpuinfo")
    found = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text()) if cpuinfo.exists() else None
    if found:
        return found.group(1).strip()
    return platform.processor() if otherwise is None else otherwise


def uptime() -> str:
    """`uptime`'s line: how long the machine has run, and its load averages."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"uptime failed: {e}"


def code(root: Path = ROOT) -> str:
    """The checkout that ran: branch, commit, and whether its tree had changes (a run's own results,
    bench/results, are no change to the code); "" where `root` is no git checkout."""

    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=root).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return ""
    changed = git("status", "--porcelain", "--", ".", ":!bench/results")
    return f"{git('rev-parse', '--abbrev-ref', 'HEAD')} {commit}" + (" + changes" if changed else "")


def machine() -> dict:
    """The host a serving load runs on, taken before the load: the CPU, its cores and load, the threads
    the server's torch may take (OMP_NUM_THREADS) and the checkout."""
    return {
        "cpu": cpu_model("unknown"),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "uptime": uptime(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "code": code(),
    }


def cpu_host() -> dict:
    """The host a measurement in this process ran on, taken at its end: the CPU, its cores and load,
    torch's threads and versions."""
    import torch

    return {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_end": os.getloadavg(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": "CPU",
    }


def write_results(data: dict, dest: str | Path, page: Callable[[dict], str], page_path: Path | None = None) -> None:
    """`data` as JSON to `dest` ('-': stdout, and no page), and `page(data)` beside it (`page_path`,
    default the same name in .md), both written atomically: the page is made from the JSON alone, so
    it can be made again from a recorded JSON."""
    write_json(data, str(dest))
    if str(dest) == "-":
        return
    with atomic_write(page_path or Path(dest).with_suffix(".md")) as f:
        f.write(page(data))
