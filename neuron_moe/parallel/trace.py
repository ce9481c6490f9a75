"""Trace once, replicate: what NxD's ModelBuilder does to a rank module, done on CPU.

ModelBuilder traces the rank-0 module once, under a mocked torch.distributed of world size t,
compiles that one graph, and runs it SPMD on every rank; only the weights differ per rank. So
anything the module derives from a Python-int rank is frozen to rank 0's value on every rank.

Here the trace is `torch.export` (strict=False, so that the functional collectives trace into the
graph) under PyTorch's fake process group of world size t at rank 0; the one ExportedProgram is
serialised, and each of t gloo processes loads it, loads its own shard, and runs it. The processes
come from a forkserver that has imported torch once (8 fresh interpreters on 2 cores would spend
most of a test importing torch); this module imports nothing heavier, and the jobs the ranks run
live here so that unpickling them imports nothing more.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch._export.serde.serialize  # noqa: F401  loaded once in the forkserver, not in every rank
import torch.distributed as dist


def export_rank0(module: torch.nn.Module, args: tuple, tp: int, dynamic_shapes=None) -> torch.export.ExportedProgram:
    """Export `module` as rank 0 of a world of `tp` ranks (nothing is communicated)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("export_rank0 needs a process without a process group")
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        with torch.no_grad():
            return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        dist.destroy_process_group()


def run_replicated(programs: dict[str, torch.export.ExportedProgram], rank_states: dict[str, list[dict]],
                   job: Callable, *job_args) -> list:
    """Run `job(modules, rank, *job_args)` in each of t gloo processes, where `modules` maps each
    key of `programs` to that one program with `rank_states[key][rank]` loaded (strict). Returns
    the ranks' results, in rank order. `job` must be a module-level function."""
    (tp,) = {len(states) for states in rank_states.values()}
    blobs = {}
    for key, program in programs.items():
        buf = io.BytesIO()
        torch.export.save(program, buf)
        blobs[key] = buf.getvalue()
    with tempfile.TemporaryDirectory(prefix="neuron-moe-tp-") as tmp:
        torch.multiprocessing.set_forkserver_preload([__name__])
        torch.multiprocessing.start_processes(_rank_main, args=(tp, blobs, rank_states, job, job_args, tmp),
                                              nprocs=tp, start_method="forkserver")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(tp)]


def _rank_main(rank: int, tp: int, blobs: dict[str, bytes], rank_states: dict, job: Callable, job_args: tuple, tmp: str):
    torch.set_num_threads(1)  # t ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=tp)
    try:
        modules = {}
        for key, blob in blobs.items():
            module = torch.export.load(io.BytesIO(blob)).module()
            module.load_state_dict(rank_states[key][rank], strict=True)
            modules[key] = module
        with torch.no_grad():
            result = job(modules, rank, *job_args)
        part = Path(tmp) / f".rank{rank}.pt"
        torch.save(result, part)
        os.replace(part, Path(tmp) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def forward_job(modules: dict[str, torch.nn.Module], rank: int, inputs: list[tuple]) -> dict[str, list[torch.Tensor]]:
    """Each program on each input tuple."""
    return {key: [module(*args) for args in inputs] for key, module in modules.items()}
