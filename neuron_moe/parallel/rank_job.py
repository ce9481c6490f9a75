"""What every rank module of a TP run is built from, whichever layer library runs it.

`RankJob.prepare` takes a TP backend (`spec.Backend`) whole and makes every check that needs no
weights (the degree, the reader's shards), then the full parallel-layout checkpoint
(`layout.parallel_state_dict`; int8 or int4 experts quantised; the reader's per-rank shards
concatenated) that the shard cutter (`cpu.shard_checkpoint`) cuts for each rank; `rank_module`
builds a rank's module over `parallel.cpu` (trace once and replicate: `tp_generator.py`) or
`parallel.nxd` (NxD's own layers in its CPU mode: `nxd_generator.py`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats import quantize_state
from ..model import build_model
from ..reader.prep import model_expert_weights
from ..port import DTYPES
from ..spec import CHANNEL_READER, EAGER, Backend, Placement, Reader
from . import cpu, layout, reader
from .model import check_formats, rank_model

LIBRARY_CPU = "parallel/cpu.py (NxD's layer names over torch.distributed functional collectives, gloo)"
TP_DEGREE = 8  # a TP backend's degree where its placement names none (validate --backend tp without --tp)


def compute_dtype(port, backend: Backend) -> torch.dtype:
    """The torch dtype the ranks compute in: `backend.dtype`'s, else the port's."""
    return DTYPES[backend.dtype] if backend.dtype else port.dtype


@dataclasses.dataclass
class RankJob:
    """What every rank module of a TP run is built from: the port's static spec (the reader's decode
    experts when one is attached), the options of the rank module, and the full parallel-layout
    checkpoint (its quantized layers in their format, the reader's shards concatenated) that the shard cutter cuts."""

    config: object
    spec: object
    tp: int
    dtype: torch.dtype
    expert_layout: str
    quantization: str
    quantized_layers: tuple[str, ...]
    scatter: str
    full: dict
    reader: tuple | None  # (SidecarLayout of a rank, k per rank, scan, recovery rank)

    @property
    def reader_k(self) -> int | None:
        return None if self.reader is None else self.reader[1]

    @classmethod
    def prepare(cls, port, backend: Backend, checkpoint=None) -> RankJob:
        """Every check that needs no weights first, then the weights. From `backend`: its placement (the
        degree, default TP_DEGREE; the expert layout, default the port's [static]; the scatter), the
        experts' format, the dtype (default the port's) and, with a sidecar directory, the reader."""
        placement, settings = backend.placement or Placement(), backend.reader or Reader()
        tp = placement.degree(TP_DEGREE)
        port.static_spec(f"the TP {tp} backend")
        expert_layout = placement.layout(None) or port.static.expert_layout
        layout.check_degree(port.config, tp, expert_layout)  # before the weights load
        check_formats(port.config, tp, expert_layout, backend.quantization, backend.quantized_layers)
        spec, sides, attached = port.static, None, None
        if settings.sidecar is not None:  # the reader on decode steps: every check before the weights load
            reader.check_reader(expert_layout, backend.quantization, settings.budget)
            # the port's default recovery rank, as the one-rank reader's
            rank = port.reader.recovery_rank if settings.recovery_rank is None else settings.recovery_rank
            sides, k, rank = reader.open_shards(port.config, settings.sidecar, tp, settings.budget, rank)
            spec = dataclasses.replace(spec, decode_experts=CHANNEL_READER.name)
            attached = (sides[0].layout, k, sides[0].scan, rank)
        dtype = compute_dtype(port, backend)
        hf = build_model(port, EAGER, dtype, checkpoint)
        if sides is not None:
            sides[0].check_source(model_expert_weights(hf))  # one prep for all ranks: check_shards
        full = layout.parallel_state_dict(hf.state_dict(), hf.config, tp, expert_layout)
        del hf
        # streamed: each float linear dropped as it is quantized
        full = quantize_state(full, backend.quantization, backend.quantized_layers)
        if sides is not None:
            full.update(reader.full_state(sides))
        return cls(
            port.config,
            spec,
            tp,
            dtype,
            expert_layout,
            backend.quantization,
            backend.quantized_layers,
            placement.scatter,
            full,
            attached,
        )

    def rank_zero(self, layers) -> tuple:
        """(rank 0's module over `layers` with its shard loaded, as ModelBuilder traces it; every rank's
        shard, cut from the full checkpoint by the module's parameter tags)."""
        module = self.rank_module(layers)
        shards = cpu.shard_checkpoint(self.full, module, self.tp)
        module.load_state_dict(shards[0], strict=True)
        return module, shards

    def rank_module(self, layers, device: str = "cpu"):
        """A rank's Gemma4ForCausalLM over `layers` (`parallel.cpu` or `parallel.nxd`), the reader
        attached if there is one; its values are zeros or uninitialised until a shard is loaded."""
        module = rank_model(
            self.config,
            self.tp,
            layers,
            expert_layout=self.expert_layout,
            quantization=self.quantization,
            quantized_layers=self.quantized_layers,
            scatter=self.scatter,
            dtype=self.dtype,
            device=device,
        )
        if self.reader is not None:
            local, k, scan, rank = self.reader
            reader.attach(module, local, self.tp, k, scan, rank)
        return module
