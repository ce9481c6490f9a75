"""What checking a sidecar layer costs as it loads, at full size (Gemma-4 26B-A4B: 117.9 MB a layer).

One layer of the real geometry (H 2816, 128 experts, I 704, rank 32) is written with `stream_layers`
(valid random codes, random bf16 numbers), then read back warm (in the page cache) `--repeats` times:
the tensors alone (safetensors' `get_tensor`, what loading did before the checks: it maps the file,
so no byte is read until it is used), the same with every byte copied (what a first use costs), then
`Sidecar.layer` (the same read, then the layer's sha256 against the metadata, its code bytes in
0..242 and its numbers finite), and each check on its own. The full model has 30 such layers.

    python -m bench.sidecar_load            # prints a table, writes bench/results/sidecar_load-<host>.json
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from bench.harness import cpu_host
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.hadamard import random_signs
from neuron_moe.reader.sidecar import CODE_BYTES, LAYER_TENSORS, Sidecar, SidecarLayout, _raw, metadata, stream_layers
from neuron_moe.report import table, write_json

LAYERS = 30  # Gemma-4 26B-A4B's MoE layers


def best(fn, repeats: int) -> float:
    """The fastest of `repeats` runs, in seconds (the least disturbed by the other work on the machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def random_layer(layout: SidecarLayout) -> dict[str, torch.Tensor]:
    """One layer's tensors in `layout`: valid random codes, random numbers (the scales and the norms at
    least 0, as `Sidecar.layer` requires of them)."""
    gen = torch.Generator().manual_seed(0)
    layer = {}
    for name, (dtype, shape) in layout.layer_tensors().items():
        if dtype == torch.uint8:
            layer[name] = torch.randint(0, CODE_BYTES, shape, generator=gen, dtype=torch.uint8)
        else:
            numbers = torch.randn(shape, generator=gen)
            layer[name] = (numbers.abs() if name in ("scales", "down_norms") else numbers).to(dtype)
    return layer


def timings(path: Path, repeats: int) -> dict[str, float]:
    """Seconds, the best of `repeats`, of each way of reading the layer at `path` (warm: read once first)."""
    side = Sidecar(path)

    def read():
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(f"layers.0.{name}") for name in LAYER_TENSORS}

    tensors = read()  # and into the page cache

    def digest():
        h = hashlib.sha256()
        for name in LAYER_TENSORS:
            h.update(_raw(tensors[name]))
        return h.hexdigest()

    return {
        "read the tensors (mapped: no byte touched yet)": best(read, repeats),
        "read the tensors and copy every byte": best(lambda: [t.clone() for t in read().values()], repeats),
        "Sidecar.layer (read + every check)": best(lambda: side.layer(0), repeats),
        "  sha256 of the layer's bytes": best(digest, repeats),
        "  code bytes <= 242": best(lambda: int(tensors["codes"].max()), repeats),
        "  numbers finite": best(
            lambda: [bool(torch.isfinite(tensors[n]).all()) for n in ("scales", "down_norms", "basis", "coeffs")],
            repeats,
        ),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="results JSON (default bench/results/sidecar_load-<host>.json)")
    args = p.parse_args()
    layout = SidecarLayout(Geometry(hidden=2816, experts=128, intermediate=704), 32)
    layer = random_layer(layout)
    signs = random_signs(layout.hidden_padded, 0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "layer.safetensors"
        with open(path, "wb") as f:
            stream_layers(f, layout, 1, metadata(layout, 1, 80, 0, "0" * 64), signs, [layer])
        size = path.stat().st_size
        rows = timings(path, args.repeats)
    machine = cpu_host()
    result = {
        "bench": "sidecar_load",
        "layer_bytes": size,
        "repeats": args.repeats,
        "seconds_per_layer": {k.strip(): round(v, 4) for k, v in rows.items()},
        "machine": machine,
    }
    out = args.out or str(Path(__file__).parent / "results" / f"sidecar_load-{socket.gethostname()}.json")
    write_json(result, out)
    title = f"one full-size sidecar layer, {size / 1e6:.1f} MB, warm ({machine['cpu']}, best of {args.repeats})"
    print(
        table(
            [
                {
                    "what": k,
                    "layer": f"{v * 1e3:.0f} ms",
                    "model": f"{v * LAYERS:.1f} s",
                    "rate": f"{size / v / 1e9:.2f} GB/s",
                }
                for k, v in rows.items()
            ],
            [("what", title), ("layer", "per layer"), ("model", f"x {LAYERS} layers"), ("rate", "")],
        )
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
