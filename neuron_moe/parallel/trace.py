"""Trace once, replicate: what NxD's ModelBuilder does to a rank module, done on CPU.

ModelBuilder traces the rank-0 module once, under a mocked torch.distributed of world size t,
compiles that one graph, and runs it SPMD on every rank; only the weights differ per rank. So
anything the module derives from a Python-int rank is frozen to rank 0's value on every rank.

Here the trace is `torch.export` (strict=False, so that the functional collectives trace into the
graph) under PyTorch's fake process group of world size t at rank 0. Then t gloo processes are
forked from this one: each starts with that one ExportedProgram, loads its own shard into it, and
runs it. (That the programs serialise is checked where they are written: `neuron/compile.py`.)
Forked, not spawned: 8 fresh interpreters would spend most of a test importing torch and
deserialising the graphs (seconds per program per rank); the ranks set one intra-op thread before
they compute.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from ..greedy import Generation
from ..static.cache import share_state
from ..static.rows import generate, graph_runtime


def export_rank0(module: torch.nn.Module, args: tuple, tp: int, dynamic_shapes=None) -> torch.export.ExportedProgram:
    """Export `module` as rank 0 of a world of `tp` ranks (nothing is communicated)."""
    if dist.is_initialized():
        raise RuntimeError("export_rank0 needs a process without a process group")
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        with torch.no_grad():
            return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        dist.destroy_process_group()


def run_replicated(
    programs: dict[str, torch.export.ExportedProgram], rank_states: dict[str, list[dict]], job: Callable, *job_args
) -> list:
    """Run `job(modules, rank, *job_args)` in each of t gloo processes, where `modules` maps each
    key of `programs` to that one program with `rank_states[key][rank]` loaded (strict). Returns
    the ranks' results, in rank order. `job` must be a module-level function."""
    (tp,) = {len(states) for states in rank_states.values()}
    templates = {key: program.module() for key, program in programs.items()}
    return run_ranks(tp, _replicated, templates, rank_states, job, job_args)


def _replicated(rank: int, templates: dict[str, torch.nn.Module], rank_states: dict, job: Callable, job_args: tuple):
    modules = {}
    for key, module in templates.items():  # this process's copy of the one program
        module.load_state_dict(rank_states[key][rank], strict=True)
        modules[key] = module
    return job(modules, rank, *job_args)


def run_ranks(tp: int, job: Callable, *job_args) -> list:
    """`job(rank, *job_args)` in each of `tp` gloo processes forked from this one (a world of `tp`
    ranks, one intra-op thread each), under no_grad; the ranks' results in rank order. `job` must
    be a module-level function; its result travels back through torch.save."""
    with tempfile.TemporaryDirectory(prefix="neuron-moe-tp-") as tmp:
        torch.multiprocessing.start_processes(_rank_main, args=(tp, job, job_args, tmp), nprocs=tp, start_method="fork")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(tp)]


def _rank_main(rank: int, tp: int, job: Callable, job_args: tuple, tmp: str):
    torch.set_num_threads(1)  # t ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=tp)
    try:
        with torch.no_grad():
            result = job(rank, *job_args)
        part = Path(tmp) / f".rank{rank}.pt"
        torch.save(result, part)
        os.replace(part, Path(tmp) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def forward_job(
    modules: dict[str, torch.nn.Module], rank: int, inputs: dict[str, list[tuple]]
) -> dict[str, list[torch.Tensor]]:
    """Each program on each of its input tuples, `inputs[key]`."""
    return {key: [module(*args) for args in inputs[key]] for key, module in modules.items()}


def generation_job(modules: dict[str, torch.nn.Module], rank: int, runs: list[tuple]) -> dict[str, tuple]:
    """Greedy generation through static graphs on every rank, SPMD (the engine step, `static/rows.py`):
    each run is (name, batch, pad_id, [(input_ids, attention_mask, max_new_tokens), ...]) over the
    programs keyed "<name>/prefill <bucket>" and "<name>/decode", which get one zero-initialised KV
    state per name in this rank's process (NxD's state initializer). -> {name: (tokens, logits or None)}."""
    out = {}
    for name, batch, pad_id, batches in runs:
        graphs = {key.split("/", 1)[1]: m for key, m in modules.items() if key.split("/", 1)[0] == name}
        share_state(graphs.values())
        runtime = graph_runtime(graphs, batch, pad_id)
        parts = [Generation(*generate(runtime, *b)) for b in batches]
        whole = Generation.cat(parts)
        out[name] = (whole.tokens, whole.logits)
    return out
