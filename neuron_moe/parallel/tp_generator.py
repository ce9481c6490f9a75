"""Greedy generation over the full model at TP t on gloo: trace once, replicate.

The rank module (`parallel/model.py`) wrapped in the static decoder's prefill (per bucket) and
decode graphs is exported once, as rank 0 under a fake process group, exactly as ModelBuilder
traces; then t gloo processes each load those same programs with their own shard, give them one
zero-initialised KV state of their own (as NxD's state initializer does on each rank; the cache is
never in a weight shard) and run the static host loop (`static/loop.py`) in lockstep. Every rank
gathers the full logits and takes the same greedy token; the ranks' tokens are checked to agree.

Backends for `validate`: `tp8` and `tp8-int8` (int8 experts, per-channel scales) in either expert
layout (`--expert-layout`, default the port's [static] expert_layout: channel), and
`tp8-naive-scatter`, always the expert layout: the seed port's Python-int router scatter, which a
graph traced on rank 0 freezes to rank 0's slice (a wrong model, on purpose). `tp8` with a sidecar
directory and a budget (`prep-reader --tp 8`) runs the reader in the decode graph (`reader.py`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import UserError
from ..experts.int8 import quantize_experts
from ..greedy import Generation
from ..model import build_model
from ..reader.prep import model_expert_weights
from ..static.export import checked, example_inputs, functional
from ..static.generator import StaticGenerator
from . import cpu, layout, reader
from .model import rank_model
from .trace import export_rank0, generation_job, run_replicated


class TPGenerator(StaticGenerator):
    """StaticGenerator whose graphs are rank-0 exports of the rank module, run on t processes."""

    def __init__(self, port, tp: int, dtype=None, checkpoint=None, *, expert_layout: str | None = None,
                 int8: bool = False, scatter: str = "spmd", logits: bool = True, sidecar=None,
                 budget: float | None = None, rank: int | None = None):
        port.static_spec(f"the TP {tp} backend")
        dtype = dtype or port.dtype
        expert_layout = expert_layout or port.static.expert_layout
        layout.check_degree(port.config, tp, expert_layout)  # before the weights load
        spec, sides = port.static, None
        if sidecar is not None:  # the reader on decode steps: every check before the weights load
            reader.check_reader(expert_layout, int8, budget)
            rank = port.reader.rank if rank is None else rank  # the port's default, as the one-rank reader's
            sides, k, rank = reader.open_shards(port.config, sidecar, tp, budget, rank)
            spec = dataclasses.replace(spec, decode_experts=reader.READER)
        hf = build_model(port, "eager", dtype, checkpoint)
        if sides is not None:
            sides[0].check_source(model_expert_weights(hf))  # one prep for all ranks: check_shards
        full = layout.parallel_state_dict(hf.state_dict(), hf.config, tp, expert_layout)
        del hf
        if int8:
            full = quantize_experts(full)
        module = rank_model(port.config, tp, cpu, expert_layout=expert_layout, int8=int8, scatter=scatter, dtype=dtype)
        if sides is not None:
            reader.attach(module, sides[0].layout, tp, k, sides[0].scan, rank)
            full.update(reader.full_state(sides))
        shards = cpu.shard_checkpoint(full, module, tp)
        module.load_state_dict(shards[0], strict=True)  # rank 0, as ModelBuilder traces it
        # the graphs (static/decoder.py) hold the model as `.model`
        self.states = [{f"model.{k}": v for k, v in shard.items()} for shard in shards]
        super().__init__(module, spec, logits=logits)
        self.tp, self.expert_layout = tp, expert_layout
        self.reader_k = k if sides is not None else None  # channels per token and rank on decode steps

    def prepare(self, buckets) -> None:
        """Export the programs; they run (and get their state) in the rank processes."""
        for name, bucket in [(f"prefill {b}", b) for b in sorted(set(buckets))] + [("decode", None)]:
            if name not in self.programs:
                graph = self.graph(bucket)
                program = export_rank0(graph, example_inputs(self.spec, bucket), self.tp)
                self.programs[name] = checked(functional(program), graph, name)

    def plan(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> list[tuple]:
        """Check every batch, export what they need; -> [(ids, mask, n), ...]."""
        size = self.spec.batch_size
        batches = [(input_ids[i:i + size], attention_mask[i:i + size]) for i in range(0, len(input_ids), size)]
        self.prepare(set().union(*(self.check(mask, max_new_tokens) for _, mask in batches)))
        return [(ids, mask, max_new_tokens) for ids, mask in batches]

    def generate(self, input_ids, attention_mask, max_new_tokens) -> Generation:
        return generate_replicated({"tp": self}, input_ids, attention_mask, max_new_tokens)["tp"]


def generate_replicated(generators: dict[str, TPGenerator], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        max_new_tokens: int) -> dict[str, Generation]:
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


def tp_backend(tp: int, **variant):
    """A `validate` backend factory: TP `tp` on gloo, `variant` passed to TPGenerator; `expert_layout`
    may be chosen unless the variant fixes it."""
    def make(port, dtype=None, checkpoint=None, expert_layout=None, **reader_options):
        fixed = variant.get("expert_layout")
        if fixed and expert_layout and expert_layout != fixed:
            raise UserError(f"this backend runs the {fixed!r} expert layout only, not {expert_layout!r}")
        options = dict(variant, expert_layout=fixed or expert_layout, **reader_options)  # sidecar, budget, rank
        return TPGenerator(port, tp, dtype, checkpoint, **options).generate

    return make


BACKENDS = {
    "tp8": tp_backend(8),
    # the seed bug lives in the expert layout's router scatter: the channel layout has none
    "tp8-naive-scatter": tp_backend(8, scatter="naive", expert_layout=layout.EXPERT),
    "tp8-int8": tp_backend(8, int8=True),
}
