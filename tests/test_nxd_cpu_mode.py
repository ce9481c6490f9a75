"""The rank modules over NxD's real layers: neuronx-distributed's own classes, run in NxD's CPU mode
(`parallel/nxd_generator.py`), one forked gloo process per rank, each loading the shard the shard
cutter cuts by NxD's own parameter tags.

Runs wherever NxD is importable: installed (a Neuron box), or the source tree NXD_SRC names (its
root or its src/). Skipped elsewhere: CI has no NxD, as it has no Neuron device. Every case runs in
one set of 2 processes (NxD imported and its parallel state initialised once per rank); the whole
tier takes 4-14 s on 2 shared cores.

- TP 2, channel and expert layouts: HF eager's tokens, its step-0 logits to the fp32 bound.
- Every quantized format's experts in both layouts: the same model on one rank (its rank module at
  TP 1). int8 on NxD's quantized layers, built on meta around NxD's quantized row-parallel CPU init
  (documented below as upstream behaviour); int4 and q4_0 on NxD parallel linears carrying NxD's
  tags on the format's tensors (NxD has no 4-bit layer for inf2).
- The reader at TP 2, each rank its sidecar shard: the per-rank reader emulated in one process.
- Negative control: rank 1 loading rank 0's shard must fail the same comparison.
- What ran: NxD's classes, from the tree located, with only the absent packages stood in for.
"""

import pytest
import torch
from neuron_moe.spec import Reader, tp_backend
from conftest import random_prompts

from neuron_moe.experts.channel_reader import attach_reader
from neuron_moe.formats import FORMATS
from neuron_moe.formats.int8 import INT8
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model, prep_port
from neuron_moe.parallel import cpu, layout, nxd, nxd_source
from neuron_moe.parallel.rank_job import RankJob
from neuron_moe.parallel.nxd_generator import NxDGenerator, generate_nxd
from neuron_moe.parallel.trace import run_ranks
from neuron_moe.reader import shard
from neuron_moe.reader.sidecar import Sidecar

SOURCE = nxd_source.locate()  # a bad NXD_SRC is an error here, not a skip
pytestmark = pytest.mark.skipif(
    SOURCE is None,
    reason="neuronx-distributed is not importable: not installed, and NXD_SRC names no source tree "
    "(CI has no NxD, as it has no Neuron device)",
)

NEW_TOKENS = 6
BUDGET = 40.0  # above the tiny port's per-rank floor at TP 2 with recovery rank 32 (27.9 %)
RANK = 32  # the sidecar's; given to both sides (the TP backend's default is the port's [reader] rank, 0)


@pytest.fixture(scope="module")
def prompts(tiny_port):
    """23 tokens (the 56 bucket, past the sliding window of 16) and 7 (the 8 bucket): the rows decode
    at different positions."""
    return left_pad(random_prompts(tiny_port.config.vocab_size, [23, 7], seed=44), 0)


@pytest.fixture(scope="module")
def shards(tiny_port, tmp_path_factory):
    """`prep-reader --tp 2`: the whole sidecar and each rank's shard."""
    out = tmp_path_factory.mktemp("nxd-reader")
    shard.write_shards(Sidecar(prep_port(tiny_port, out / shard.WHOLE)), out, 2, progress=False)
    return out


QUANTIZED = [(q, expert_layout) for q in FORMATS if q != "none" for expert_layout in layout.EXPERT_LAYOUTS]
CASES = {  # name -> the tp backend's options (`shards`: NxDGenerator's), all at TP 2
    "channel": {},
    "expert": {"expert_layout": layout.EXPERT},
    **{f"{e}-{q}": {"expert_layout": e, "quantization": q} for q, e in QUANTIZED},
    "wrong-shard": {"shards": (0, 0)},  # rank 1 loads rank 0's shard
}


def _nxd_generator(port, shards=None, **options):
    return NxDGenerator(port, tp_backend(2, layers="nxd", **options), shards=shards)


@pytest.fixture(scope="module")
def runs(tiny_port, prompts, shards):
    gens = {name: _nxd_generator(tiny_port, **options) for name, options in CASES.items()}
    gens["reader"] = _nxd_generator(tiny_port, reader=Reader(sidecar=shards, budget=BUDGET, recovery_rank=RANK))
    return generate_nxd(gens, *prompts, NEW_TOKENS), gens


@pytest.fixture(scope="module")
def reference(tiny_eager, prompts):
    return greedy(tiny_eager, *prompts, NEW_TOKENS)


def _on_one_rank(port, prompts, quantization: str, expert_layout: str):
    """The experts in `quantization` as `expert_layout` holds them, on one rank of the gloo stand-in:
    the numbers every degree holds (int8's expert layout scales down per hidden channel over all
    experts, the same at every degree; the grouped formats' groups lie along the input dim)."""
    job = RankJob.prepare(port, tp_backend(1, quantization=quantization, expert_layout=expert_layout))
    return greedy(job.rank_zero(cpu)[0], *prompts, NEW_TOKENS)


def matches(got, want) -> bool:
    """The same tokens, the step-0 logits to the fp32 bound (a few ulp of the largest logit), every
    step's within 1e-4 of it (the runs agree on every token, so the logits compared are comparable)."""
    scale = want.logits.abs().max()
    return (
        torch.equal(got.tokens, want.tokens)
        and bool((got.logits[:, 0] - want.logits[:, 0]).abs().max() <= 2e-6 * want.logits[:, 0].abs().max())
        and bool((got.logits - want.logits).abs().max() <= 1e-4 * scale)
    )


@pytest.mark.parametrize("name", ["channel", "expert"])
def test_both_layouts_are_hf_eager(runs, reference, name):
    assert matches(runs[0][name], reference)


@pytest.mark.parametrize("quantization, expert_layout", QUANTIZED)
def test_quantized_experts_at_tp2_are_the_same_model_on_one_rank(tiny_port, runs, prompts, quantization, expert_layout):
    """NxD's quantized layers (int8) and NxD parallel linears carrying a format's tensors (int4, q4_0:
    NxD has no 4-bit layer for inf2), cut by NxD's own tags, give the one-rank model of that format."""
    want = _on_one_rank(tiny_port, prompts, quantization, expert_layout)
    assert matches(runs[0][f"{expert_layout}-{quantization}"], want)
    assert not matches(want, _on_one_rank(tiny_port, prompts, "none", expert_layout))  # teeth: it is quantized


def test_reader_per_rank_at_tp2_is_the_one_process_emulation(tiny_port, runs, shards, prompts, reference):
    emulated = build_model(tiny_port, "eager")
    k = attach_reader(emulated, shards / shard.WHOLE, BUDGET, RANK, tp=2)
    want = greedy(emulated, *prompts, NEW_TOKENS)
    got = runs[0]["reader"]
    assert runs[1]["reader"].job.reader_k == k
    assert torch.equal(got.tokens, want.tokens)
    assert (got.logits - want.logits).abs().max() <= 1e-4 * want.logits.abs().max()
    assert not matches(got, reference)  # teeth: 40 % of a rank's channels is not the full model (its logits move)


def test_negative_control_a_rank_on_another_ranks_shard_fails(runs, reference):
    got = runs[0]["wrong-shard"]
    assert not matches(got, reference)
    assert (got.logits[:, 0] - reference.logits[:, 0]).abs().max() > 1.0  # not a rounding matter


def test_what_ran_is_nxds_own_layers(runs):
    gens = runs[1]
    for name, gen in gens.items():
        assert gen.ran["layers_file"].startswith(str(SOURCE.package)), name
    ran = {name: set(gen.ran["classes"]) for name, gen in gens.items()}
    common = {
        f"neuronx_distributed.parallel_layers.layers.{c}"
        for c in ("ColumnParallelLinear", "RowParallelLinear", "ParallelEmbedding", "SPMDRank")
    }
    assert all(common <= classes for classes in ran.values())
    moe = "neuronx_distributed.modules.moe.moe_parallel_layers."
    quantized = "neuronx_distributed.quantization.quantization_layers."
    assert {moe + "ExpertFusedColumnParallelLinear", moe + "ExpertFusedRowParallelLinear"} <= ran["channel"]
    assert {quantized + "QuantizedExpertFusedColumnParallel", quantized + "QuantizedExpertFusedRowParallel"} <= ran[
        "channel-int8"
    ]
    assert {quantized + "QuantizedColumnParallel", quantized + "QuantizedRowParallel"} <= ran["expert-int8"]
    stood_in = set(gens["channel"].ran["stand_ins"])
    assert stood_in <= {"torch_xla", "torch_neuronx", "neuronxcc"}
    assert all(nxd_source.importlib.util.find_spec(p) is None for p in stood_in)  # never a real package


def _quantized_row_parallel(rank: int, source, device: str):
    """NxD's QuantizedRowParallel (int8, per output channel, input already parallel: the expert
    layout's down) built at TP 2 on `device`: its local weight's shape, or the error it raised."""
    nxd_source.activate(source)
    nxd.initialize_model_parallel(2)
    try:
        with torch.device(device):
            layer = nxd.RowParallelLinear(8, 4, tp=2, fmt=INT8)
    except (RuntimeError, ValueError) as e:  # torch raises the empty-cat error as a ValueError since 2.x
        return str(e)
    return tuple(layer.weight.shape)


@pytest.mark.upstream
def test_nxd_quantized_row_parallel_cpu_init_crashes_on_ranks_above_0():
    """NxD fbac349 (and 73ab227, Release 2.28.0): built on CPU, QuantizedRowParallel fails on every rank
    above 0 (docs/neuron.md, "An NxD bug"). `_initialize_parameter_cpu` scales the master weight's
    partition dim by TP, then, for a quantized dtype, overwrites its last dim with the local size ×
    the packed count; for a row-parallel weight [out, in/t] the partition dim is the last, so the
    master is never TP times larger, splits into one chunk, and ranks > 0 get none to cat. When this
    turns red NxD has fixed it: build on CPU again and drop `model.materialize`'s meta round trip."""
    assert run_ranks(2, _quantized_row_parallel, SOURCE, "cpu") == [
        (4, 4),
        "torch.cat(): expected a non-empty list of Tensors",
    ]
    assert run_ranks(2, _quantized_row_parallel, SOURCE, "meta") == [(4, 4), (4, 4)]  # the workaround's half
