"""torch.export of the static decoder: a prefill program per bucket, one decode program.

`strict=True` (TorchDynamo) so that anything Python-side that would differ between calls —
a branch on data, a Python int taken from a tensor — fails here rather than in a compiler.
Every exported graph is checked for data-dependent ops before it is handed out.
"""

from __future__ import annotations

import warnings

import torch

from ..port import StaticSpec
from . import data_dependent_ops
from .cache import empty_cache
from .decoder import Decode, Prefill


def prefill_inputs(spec: StaticSpec, bucket: int) -> tuple[torch.Tensor, ...]:
    """Example (input_ids, attention_mask, position_ids): only their shapes matter."""
    shape = (spec.batch_size, bucket)
    return (torch.zeros(shape, dtype=torch.long), torch.ones(shape, dtype=torch.long),
            torch.arange(bucket).expand(shape).contiguous())


def decode_inputs(graph: Decode, spec: StaticSpec) -> tuple[torch.Tensor, ...]:
    """Example (input_ids, position_ids, slot, attention_mask, *cache)."""
    batch = spec.batch_size
    return (torch.zeros(batch, 1, dtype=torch.long), torch.zeros(batch, 1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long), torch.ones(batch, spec.max_cache_len, dtype=torch.long),
            *empty_cache(graph.layout, batch, graph.dtype))


def _export(graph: torch.nn.Module, inputs: tuple, what: str) -> torch.export.ExportedProgram:
    with warnings.catch_warnings(), torch.no_grad():
        # Dynamo reports the Python-side effects it replays (the experts-implementation switch,
        # transformers' output recorder); neither is in the graph. (torch 2.9 says "exporting".)
        warnings.filterwarnings("ignore", message="While (compiling|exporting), we found certain side effects")
        program = torch.export.export(graph, inputs, strict=True)
    bad = data_dependent_ops(program)
    if bad:
        raise RuntimeError(f"{what}: data-dependent ops in the exported graph: {sorted(set(bad))}")
    return program


def export_prefill(model, spec: StaticSpec, bucket: int) -> torch.export.ExportedProgram:
    graph = Prefill(model, spec.max_cache_len, spec.prefill_experts)
    return _export(graph, prefill_inputs(spec, bucket), f"prefill bucket {bucket}")


def export_decode(model, spec: StaticSpec) -> torch.export.ExportedProgram:
    graph = Decode(model, spec.max_cache_len, spec.decode_experts)
    return _export(graph, decode_inputs(graph, spec), "decode")
