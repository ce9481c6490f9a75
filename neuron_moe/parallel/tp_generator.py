"""Greedy generation over the full model at TP t on gloo: trace once, replicate.

The rank module (`parallel/model.py`) wrapped in the static decoder's prefill (per bucket) and
decode graphs is exported once, as rank 0 under a fake process group, exactly as ModelBuilder
traces; then t gloo processes each load those same programs with their own shard, give them one
zero-initialised KV state of their own (as NxD's state initializer does on each rank; the cache is
never in a weight shard) and run the engine step (`static/rows.py`) in lockstep. Every rank
gathers the full logits and takes the same greedy token; the ranks' tokens are checked to agree.

`validate --backend tp` (with `--quantization int8`: int8 experts, per-channel scales;
`--quantization int4`: group-wise int4 experts) in either expert layout (`--expert-layout`, default
the port's [static] expert_layout: channel). A placement with the naive scatter (`spec.NAIVE`,
always the expert layout) is a Python-int router scatter (NxD's
`scatter_to_tensor_model_parallel_region`), which a graph traced on rank 0 freezes to rank 0's
slice: a wrong model, kept as a test (tests/test_tp_model.py) that SEQ_MATCH catches it. `tp` with a
sidecar directory and a budget (`prep-reader --tp T`) runs the reader in the decode graph
(`reader.py`). `--tp T` sets the degree (default 8); `--tp-layers nxd` runs the same rank modules
over NxD's own layers instead (`nxd_generator.py`), eagerly on every rank.
"""

from __future__ import annotations

import torch

from ..errors import UserError
from ..greedy import Generation
from ..static.export import checked, example_inputs, functional
from ..static.generator import StaticGenerator
from ..spec import Backend, Placement
from . import cpu
from .nxd_generator import NxDGenerator
from .rank_job import LIBRARY_CPU, RankJob
from .trace import export_rank0, generation_job, run_replicated


class TPGenerator(StaticGenerator):
    """StaticGenerator whose graphs are rank-0 exports of the rank module, run on t processes."""

    def __init__(self, port, backend: Backend, checkpoint=None, *, logits: bool = True):
        job = RankJob.prepare(port, backend, checkpoint)
        module, shards = job.rank_zero(cpu)
        # the graphs (static/decoder.py) hold the model as `.model`
        self.states = [{f"model.{k}": v for k, v in shard.items()} for shard in shards]
        super().__init__(module, job.spec, logits=logits)
        self.tp, self.expert_layout = job.tp, job.expert_layout
        self.reader_k = job.reader_k  # channels per token and rank on decode steps (None: no reader)

    def details(self) -> dict:
        return {"layers": "cpu", "layer_library": LIBRARY_CPU, "tp": self.tp, "expert_layout": self.expert_layout}

    def prepare(self, buckets) -> None:
        """Export the programs; they run (and get their state) in the rank processes."""
        for name, bucket in [(f"prefill {b}", b) for b in sorted(set(buckets))] + [("decode", None)]:
            if name not in self.programs:
                graph = self.graph(bucket)
                program = export_rank0(graph, example_inputs(self.spec, bucket), self.tp)
                self.programs[name] = checked(functional(program), graph, name)

    def plan(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> list[tuple]:
        """Check the prompts, export what they need; -> [(ids, mask, n)], generation_job's batches."""
        self.prepare(self.check(attention_mask, max_new_tokens))
        return [(input_ids, attention_mask, max_new_tokens)]

    def generate(self, input_ids, attention_mask, max_new_tokens) -> Generation:
        return generate_replicated({"tp": self}, input_ids, attention_mask, max_new_tokens)["tp"]


def generate_replicated(
    generators: dict[str, TPGenerator], input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int
) -> dict[str, Generation]:
    """Several TP generators (same degree) over the same prompts in one set of t processes."""
    programs, states, runs = {}, {}, []
    for name, gen in generators.items():
        batches = gen.plan(input_ids, attention_mask, max_new_tokens)
        for key, program in gen.programs.items():
            programs[f"{name}/{key}"], states[f"{name}/{key}"] = program, gen.states
        runs.append((name, gen.spec.batch_size, gen.pad_id, batches))
    results = run_replicated(programs, states, generation_job, runs)
    out = {}
    for name in generators:
        tokens, logits = results[0][name]
        for rank, result in enumerate(results[1:], 1):
            if not torch.equal(result[name][0], tokens):  # one graph, the same all-reduced inputs
                raise RuntimeError(f"{name}: rank {rank} generated other tokens than rank 0")
        out[name] = Generation(tokens, logits)
    return out


GENERATORS = {"cpu": TPGenerator, "nxd": NxDGenerator}  # by the layer library the rank modules are built over


def tp_generator(port, backend: Backend, checkpoint=None):
    """A `validate` generator of TP ranks (`backend.placement`) over a layer library (`cpu`: trace once
    and replicate on gloo; `nxd`: NxD's own layers in its CPU mode, `nxd_generator.py`), at the
    placement's degree (default `rank_job.TP_DEGREE`), with int8 or int4 experts and the reader in the
    decode graph as `backend` asks. The returned callable's `details` name the layers and the degree."""
    library = (backend.placement or Placement()).library
    if library not in GENERATORS:
        raise UserError(f"unknown layer library {library!r}; expected one of {', '.join(GENERATORS)}")
    gen = GENERATORS[library](port, backend, checkpoint)

    def run(input_ids, attention_mask, max_new_tokens):
        return gen.generate(input_ids, attention_mask, max_new_tokens)

    run.details = gen.details()
    return run
