"""Greedy generation over the full model at TP t through NxD's own parallel layers, in NxD's CPU mode.

`validate --backend tp --tp-layers nxd`: t gloo processes forked from this one, each of which makes
itself an NxD CPU-mode process (`nxd_source.activate`: the installed neuronx-distributed, or the
source tree NXD_SRC names), initialises NxD's parallel state for t ranks, and builds its rank module
over `parallel.nxd`: NxD's ColumnParallelLinear, RowParallelLinear, ParallelEmbedding, SPMDRank and
mappings, its expert-fused layers in the channel layout, its quantized layers for int8 experts and,
for int4 experts, `parallel/cpu.py`'s int4 layers as NxD parallel linears (`parallel/nxd.py`: NxD
has no int4 layer for inf2). Each rank loads the shard the shard cutter (`cpu.shard_checkpoint`)
cuts by the tensor-parallel tags NxD's layers set on their parameters, gives the static decoder's
graphs a zeroed KV state of its own, and runs them as modules, eagerly, in lockstep: in CPU mode
NxD's collectives are torch.distributed calls over gloo, which run but do not trace. Every rank
gathers the full logits; the ranks' tokens are checked to agree.

Rank modules are built on the meta device and then allocated (`model.materialize`): on CPU, NxD
initialises a quantized row-parallel layer by splitting a master weight whose size it computes
wrongly, which crashes on every rank above 0 (docs/neuron.md, "An NxD bug"); on meta it only tags
the parameters, and every value comes from the shard anyway.

What this proves, and what it cannot (the XLA lowering of NxD's collectives, ModelBuilder's trace
on rank 0 replicated to every rank): docs/neuron.md.
"""

from __future__ import annotations

import sys
import time

import torch

from ..errors import UserError
from ..greedy import Generation
from ..spec import SPMD, Backend, Placement
from ..static.generator import StaticGenerator, choose_buckets, prompt_lengths
from . import cpu, nxd, nxd_source
from .model import materialize
from .rank_job import TP_DEGREE, RankJob, compute_dtype
from .trace import run_ranks


class NxDGenerator:
    """The TP backend over NxD's layers. `shards`: which rank's shard each rank loads (default its
    own; a negative control loads another's)."""

    def __init__(self, port, backend: Backend, checkpoint=None, *, shards: tuple[int, ...] | None = None):
        placement = backend.placement or Placement()
        if placement.scatter != SPMD:
            raise UserError(
                "the Python-int router scatter is wrong only in a graph traced once on rank 0; "
                "--tp-layers nxd runs NxD's layers eagerly on every rank (its CPU mode), where it is "
                "right: the cpu layer library shows the bug"
            )
        dtype = compute_dtype(port, backend)
        if dtype != torch.float32:
            raise UserError(
                f"--tp-layers nxd runs float32 only, not {str(dtype).removeprefix('torch.')}:"
                " NxD's CPU mode reduces over gloo, which has no bfloat16 sum"
            )
        self.source = nxd_source.require()  # before the weights load
        tp = placement.degree(TP_DEGREE)
        shards = tuple(range(tp)) if shards is None else tuple(shards)
        if len(shards) != tp or not all(0 <= s < tp for s in shards):
            raise ValueError(f"shards must name one of {tp} ranks' shards per rank, got {shards}")
        self.job = RankJob.prepare(port, backend, checkpoint)
        self.tp, self.spec, self.shards = tp, self.job.spec, shards
        self.ran: dict | None = None  # after a run, rank 0's account of it (`_rank`)

    def details(self) -> dict:
        return {
            "layers": "nxd",
            "tp": self.tp,
            "expert_layout": self.job.expert_layout,
            "layer_library": f"{self.source.describe()}, NxD's CPU mode over gloo",
            "nxd_version": self.source.version,
            "nxd_commit": self.source.commit,
        }

    def check(self, attention_mask: torch.Tensor, max_new_tokens: int) -> None:
        """Every prompt checked against the graphs, before any process starts."""
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        choose_buckets(self.spec, prompt_lengths(attention_mask), max_new_tokens)

    def generate(self, input_ids, attention_mask, max_new_tokens) -> Generation:
        return generate_nxd({"tp": self}, input_ids, attention_mask, max_new_tokens)["tp"]


def generate_nxd(
    generators: dict[str, NxDGenerator], input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int
) -> dict[str, Generation]:
    """Several NxD generators (same degree, same NxD) over the same prompts in one set of t
    processes: NxD is imported and its parallel state initialised once per rank."""
    (tp,) = {gen.tp for gen in generators.values()}
    (source,) = {gen.source for gen in generators.values()}
    for gen in generators.values():
        gen.check(attention_mask, max_new_tokens)
    runs = [(name, gen.job, gen.shards) for name, gen in generators.items()]
    results = run_ranks(tp, _rank, source, runs, input_ids, attention_mask, max_new_tokens)
    out = {}
    for name, gen in generators.items():
        tokens, logits, gen.ran = results[0][name]
        for rank, result in enumerate(results[1:], 1):
            if not torch.equal(result[name][0], tokens):  # the same all-reduced logits on every rank
                raise RuntimeError(f"{name}: rank {rank} generated other tokens than rank 0")
        out[name] = Generation(tokens, logits)
    return out


def _rank(
    rank: int,
    source: nxd_source.NxDSource,
    runs: list[tuple],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
) -> dict[str, tuple]:
    """One rank process: NxD's CPU mode, its parallel state, then each run's rank module (its
    shard loaded) through the static graphs. -> {name: (tokens, logits, what ran)}, what ran being
    the packages stood in for, the NxD classes the module is built of, the file they came from and
    the run's seconds (build, shard, generate)."""
    stand_ins = nxd_source.activate(source)
    (tp,) = {job.tp for _, job, _ in runs}
    nxd.initialize_model_parallel(tp)
    out = {}
    for name, job, shards in runs:
        started = time.perf_counter()
        module = job.rank_module(nxd, device="meta")
        state = cpu.shard_checkpoint(job.full, module, tp)[shards[rank]]
        materialize(module, job.config, tp, job.expert_layout)
        module.load_state_dict(state, strict=True)
        generator = StaticGenerator(module, job.spec, exported=False, logits=True)
        generation = generator.generate(input_ids, attention_mask, max_new_tokens)
        classes = sorted(
            {
                f"{type(m).__module__}.{type(m).__name__}"
                for m in module.modules()
                if type(m).__module__.startswith(nxd_source.PACKAGE)
            }
        )
        ran = {
            "stand_ins": stand_ins,
            "classes": classes,
            "seconds": time.perf_counter() - started,
            "layers_file": sys.modules[f"{nxd_source.PACKAGE}.parallel_layers.layers"].__file__,
        }
        out[name] = (generation.tokens, generation.logits, ran)
        del module, generator
    return out
