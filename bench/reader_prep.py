"""Reader prep of one full-size Gemma-4 26B-A4B MoE layer: wall time and peak memory.

Random bf16 weights of the real shape (gate_up [128, 1408, 2816], down [128, 2816, 704]:
1.52 GB) go through `write_sidecar` exactly as `neuron-moe prep-reader` runs it (digest,
rotation, ternary sketch, norms, recovery map, streaming write). Peak RSS is the process's
high-water mark (VmHWM); the weights themselves are resident before prep starts, so the
figure to watch is the peak *added* by prep.

    python -m bench.reader_prep            # prints a table, writes bench/results/reader_prep-<host>.json
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import cpu_host
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.prep import write_sidecar
from neuron_moe.reader.sidecar import Sidecar
from neuron_moe.report import table, write_json


def proc_status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def random_layer(experts: int, inter: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 weights ~ N(0, 0.02²), filled one expert at a time (no fp32 copy of the layer)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16)
    down = torch.empty(experts, hidden, inter, dtype=torch.bfloat16)
    for e in range(experts):
        gate_up[e] = torch.randn(2 * inter, hidden, generator=gen) * 0.02
        down[e] = torch.randn(hidden, inter, generator=gen) * 0.02
    return gate_up, down


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--hidden", type=int, default=2816)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/reader_prep-<host>.json)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    gate_up, down = random_layer(args.experts, args.intermediate, args.hidden, seed=0)
    weight_bytes = (gate_up.numel() + down.numel()) * 2
    rss_before = proc_status("VmRSS")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        geometry = Geometry(hidden=args.hidden, experts=args.experts, intermediate=args.intermediate)
        path = write_sidecar(Path(tmp) / "layer.safetensors", [(gate_up, down)], geometry, layers=1)
        seconds = time.perf_counter() - start
        peak = proc_status("VmHWM")
        sidecar_bytes = path.stat().st_size
        Sidecar(path)  # the file it wrote opens and checks

    result = {
        "bench": "reader_prep",
        "shape": {"gate_up": list(gate_up.shape), "down": list(down.shape), "dtype": "bfloat16"},
        "weights_bytes": weight_bytes,
        "sidecar_bytes": sidecar_bytes,
        "seconds": round(seconds, 1),
        "rss_before_prep_bytes": rss_before,
        "peak_rss_bytes": peak,
        "peak_added_by_prep_bytes": peak - rss_before,
        "machine": cpu_host(),
    }
    out = args.out or str(Path(__file__).parent / "results" / f"reader_prep-{socket.gethostname()}.json")
    write_json(result, out)
    gib = 2**30
    print(
        table(
            [
                {"what": "expert weights (bf16, resident before prep)", "value": f"{weight_bytes / gib:.2f} GiB"},
                {"what": "sidecar written", "value": f"{sidecar_bytes / 2**20:.1f} MiB"},
                {"what": "prep wall time", "value": f"{seconds:.1f} s"},
                {"what": "RSS before prep", "value": f"{rss_before / gib:.2f} GiB"},
                {"what": "peak RSS", "value": f"{peak / gib:.2f} GiB"},
                {"what": "peak added by prep", "value": f"{(peak - rss_before) / gib:.2f} GiB"},
            ],
            [
                (
                    "what",
                    f"reader prep, one Gemma-4 26B-A4B layer ({result['machine']['cpu']}, "
                    f"{torch.get_num_threads()} threads)",
                ),
                ("value", ""),
            ],
        )
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
