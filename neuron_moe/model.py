"""Build the HF Gemma-4 model for a port, with the chosen experts implementation.

transformers' own Gemma4ForCausalLM is the model; we only choose its weights, which
experts implementation its MoE blocks dispatch to, and which of its linears are held in a weight
format (`quantize.py`). Attention is always HF "eager" so that two models built here differ in
nothing but their experts and their formats.

Also what needs a port's weights for the reader: its sidecar (`prep_port`) and the model with
the reader attached (`reader_model`). The reader itself (`reader/`, `experts/channel_reader.py`)
knows tensors and files, not ports.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Gemma4ForCausalLM

from . import experts as _experts  # noqa: F401 (registers our experts implementations)
from . import spec
from .checkpoint import iter_expert_weights, load_checkpoint, read_config
from .errors import UserError
from .experts.channel_reader import attach_reader, plan_reader, reader_forward, reader_settings
from .parallel.layout import check_degree
from .port import Port
from .quantize import quantize_model
from .reader.accounting import solve_k
from .reader.geometry import Geometry
from .reader.prep import RANK, SCAN, model_expert_weights, write_sidecar
from .reader.shard import WHOLE, write_shards
from .reader.sidecar import Sidecar, SidecarError
from .report import made_dir


def random_model(port: Port) -> Gemma4ForCausalLM:
    """HF's initialisation from the port's seed, plus seeded non-trivial norm and router scales.

    HF initialises every norm weight and the router's scales to exactly 1; left so, a bug that
    scales one expert or drops the per-expert scale would be invisible. The perturbation keeps
    the model generic without changing its architecture.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(port.seed)
        # A copy: HF keeps the config object and set_*_implementation mutates it, so two
        # models built from one shared config would silently share their experts implementation.
        model = Gemma4ForCausalLM(copy.deepcopy(port.config))
        gen = torch.Generator().manual_seed(port.seed + 1)
        with torch.no_grad():
            for name, param in sorted(model.named_parameters()):
                if name.endswith("per_expert_scale"):
                    param.copy_(torch.empty(param.shape).uniform_(0.5, 1.5, generator=gen))
                elif name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", "router.scale")):
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
    return model


def build_model(
    port: Port,
    experts: spec.Experts | str = spec.EAGER,
    dtype: torch.dtype | None = None,
    checkpoint: str | Path | None = None,
    *,
    quantization: str = spec.NO_QUANTIZATION,
    quantized_layers: tuple[str, ...] = spec.DEFAULT_QUANTIZED_LAYERS,
) -> Gemma4ForCausalLM:
    """The port's model in eval mode: `experts` is the implementation (an entry of spec.EXPERTS, or
    its name), `dtype` overrides the port's; the linears of `quantized_layers` in `quantization`'s
    format once loaded (`quantize.quantize_model`)."""
    experts = spec.experts(experts)
    dtype = dtype or port.dtype
    checkpoint = checkpoint or port.checkpoint
    if checkpoint is not None:
        model = load_checkpoint(Path(checkpoint), dtype, expected=port.config, port=port.name)
    elif port.weights_source == "random":
        model = random_model(port).to(dtype)
    else:
        raise UserError(f"port {port.name!r} has no embedded weights: pass --checkpoint DIR")
    model.set_attn_implementation("eager")
    spec.set_experts(model, experts)
    return quantize_model(model, quantization, quantized_layers).eval()


def reader_model(port, dtype=None, checkpoint=None, reader: spec.Reader = spec.Reader()):
    """The port's model with the reader attached, its settings `reader` over the port's [reader] table
    (`reader_settings`). The kernel, sidecar, recovery rank and budget are checked before the weights
    load (minutes, for a large checkpoint). Without a sidecar (none given, none in the port's [reader]
    table) one is prepped from the weights the model loads, at the recovery rank it is read with, as
    eval-reader preps its own."""
    kernel, quantization = reader.kernel or "reference", reader.quantization or spec.NO_QUANTIZATION
    reader_forward(kernel)
    reader = reader_settings(port, reader)
    sidecar, budget, rank = reader.sidecar, reader.budget, reader.recovery_rank
    if sidecar is not None:
        plan_reader(port.config, sidecar, budget, rank, quantization)
    else:
        rank = RANK if rank is None else rank
        settings = spec.Reader(scan=SCAN, recovery_rank=rank, quantization=quantization)
        solve_k(Geometry.from_config(port.config), settings, budget)
    model = build_model(port, spec.EAGER, dtype, checkpoint)
    with tempfile.TemporaryDirectory(prefix="neuron-moe-sidecar-") as tmp:
        if sidecar is None:
            print(
                f"no --sidecar: prepping the reader's sidecar (rank {rank}) from the model's weights; "
                f"`neuron-moe prep-reader --out FILE` writes one to reuse",
                file=sys.stderr,
            )
            sidecar = prep_port(port, Path(tmp) / "sidecar.safetensors", checkpoint, rank=rank, model=model)
        attach_reader(model, sidecar, budget, rank, kernel, quantization)
    return model


def prep_port(
    port,
    out: Path,
    checkpoint: Path | None = None,
    *,
    seed: int = 0,
    rank: int = RANK,
    scan: int = SCAN,
    model: Gemma4ForCausalLM | None = None,
) -> Path:
    """The reader's sidecar of a port's model: streamed layer by layer from a checkpoint (the
    port's or `checkpoint`), or from the seeded model of a random-weights port: `model`, the port's
    model the caller already holds (`build_model`, in any dtype), else built here.

    The random model's weights are prepped in the port's dtype, as `build_model(port)` gives them:
    the same sidecar, byte for byte, whichever dtype the caller's copy is in."""
    config = port.config
    checkpoint = checkpoint or port.checkpoint
    if checkpoint is not None:
        config = read_config(Path(checkpoint), port.config, port.name)
        weights = iter_expert_weights(Path(checkpoint), config)
    elif port.weights_source == "random":
        held = build_model(port) if model is None else model
        weights = ((gate_up.to(port.dtype), down.to(port.dtype)) for gate_up, down in model_expert_weights(held))
    else:
        raise SidecarError(f"port {port.name!r} has no embedded weights: pass --checkpoint DIR")
    return write_sidecar(
        out, weights, Geometry.from_config(config), layers=config.num_hidden_layers, seed=seed, rank=rank, scan=scan
    )


def _whole_sidecar(path: Path) -> Sidecar:
    side = Sidecar(path)
    if side.tp is not None:
        raise UserError(f"{path}: already a TP shard (rank {side.tp_rank} of {side.tp}); shard the whole sidecar")
    return side


def prep_reader(
    port,
    out: Path,
    checkpoint: Path | None = None,
    *,
    tp: int | None = None,
    source: Path | None = None,
    seed: int = 0,
    recovery_rank: int = RANK,
    scan: int = SCAN,
) -> dict:
    """`neuron-moe prep-reader`: the port's sidecar written to `out`; with `tp`, `out` is a directory
    of the whole sidecar (prepped there, or the existing `source`) and each rank's shard at TP `tp`."""
    out = Path(out)
    if tp:  # a directory: the whole sidecar and each rank's shard; one this run made goes if it fails
        check_degree(port.config, tp)
        with made_dir(out):
            path = Path(source) if source else out / WHOLE
            if not source:
                prep_port(port, path, checkpoint, seed=seed, rank=recovery_rank, scan=scan)
            side = _whole_sidecar(path)
            files = [path] + write_shards(side, out, tp)
    else:
        path = prep_port(port, out, checkpoint, seed=seed, rank=recovery_rank, scan=scan)
        side = _whole_sidecar(path)
        files = [path]
    return {
        "model": port.name,
        "sidecar": str(path),
        "bytes": path.stat().st_size,
        "layers": side.layers,
        "scan": side.scan,
        "rank": side.layout.rank,
        "seed": side.seed,
        "source_sha256": side.source_sha256,
        "tp": tp,
        "files": {str(f): f.stat().st_size for f in files},
    }


def render_prep_reader(report: dict, read_source: bool = False) -> str:
    """`read_source`: the whole sidecar was read (prep-reader --from), not written."""
    lines = [
        f"{'read' if read_source and f == report['sidecar'] else 'wrote'} {f}: {size / 2**20:.2f} MiB"
        for f, size in report["files"].items()
    ]
    lines.append(
        f"{report['layers']} layers, scan {report['scan']}, rank {report['rank']}, seed {report['seed']}, "
        f"source sha256 {report['source_sha256'][:16]}…"
        + (f"; shards for TP {report['tp']}, channel expert layout" if report["tp"] else "")
    )
    return "\n".join(lines)
