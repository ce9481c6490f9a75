"""Trace once, replicate, on t gloo processes: the MoE block of the tiny port exported once as
rank 0, then run by every rank with its own shard. The SPMDRank scatter gives HF's output on every
rank; the Python-int scatter reproduces the seed port's bug exactly; int8 experts under TP give
the single-rank int8 implementation's output. One spawn per TP degree runs all three programs."""

import pytest
import torch

from neuron_moe.experts.dense_masked import router_weight_matrix
from neuron_moe.experts.int8 import int8_forward, quantize_experts
from neuron_moe.parallel import cpu, layout
from neuron_moe.parallel.moe import ParallelMoE
from neuron_moe.parallel.trace import export_rank0, forward_job, run_replicated

from test_parallel_layout import LAYER, block_state


def _uses_rank(program) -> bool:
    """Whether the graph reads the SPMDRank parameter at all."""
    name = next(s.arg.name for s in program.graph_signature.input_specs if s.target == "experts.spmd_rank.rank")
    return any(len(n.users) for n in program.graph.nodes if n.name == name)


@pytest.fixture(scope="module")
def block(tiny_eager):
    config, layer = tiny_eager.config, tiny_eager.model.layers[LAYER]
    gen = torch.Generator().manual_seed(4)
    inputs = [tuple(torch.randn(2, 9, config.hidden_size, generator=gen) for _ in range(2)) for _ in range(2)]
    H, E = config.hidden_size, config.num_experts
    refs = {"spmd": [], "int8": [], "per_expert": []}
    with torch.no_grad():
        for router_in, experts_in in inputs:
            _, w, idx = layer.router(router_in.reshape(-1, H))
            x = experts_in.reshape(-1, H)
            refs["spmd"].append(layer.experts(x, idx, w).view_as(experts_in))  # HF eager
            refs["int8"].append(int8_forward(layer.experts, x, idx, w).view_as(experts_in))
            # every expert's output, for the bug's exact prediction below
            gate, up = torch.einsum("th,eoh->teo", x, layer.experts.gate_up_proj).chunk(2, dim=-1)
            per_expert = torch.einsum("tei,ehi->teh", layer.experts.act_fn(gate) * up, layer.experts.down_proj)
            refs["per_expert"].append((per_expert, router_weight_matrix(idx, w, E)))
    return config, inputs, refs


def _bug_prediction(per_expert, dense, tp, shape):
    """The seed bug: in the graph traced on rank 0, rank r weights its experts r·n + j with the router
    weights of experts j (columns 0:n) instead of r·n + j."""
    n = dense.shape[1] // tp
    wrong = dense[:, torch.arange(dense.shape[1]) % n]
    return torch.einsum("teh,te->th", per_expert, wrong).view(shape)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_trace_once_replicate(tiny_eager, block, tp):
    config, inputs, refs = block
    hf_state = tiny_eager.state_dict()
    full = block_state(layout.parallel_state_dict(hf_state, config, tp))
    full8 = block_state(quantize_experts(layout.parallel_state_dict(hf_state, config, tp)))
    programs, states = {}, {}
    for key, kwargs, checkpoint in (("spmd", {}, full), ("naive", {"scatter": "naive"}, full),
                                    ("int8", {"int8": True}, full8)):
        module = ParallelMoE(config, tp, cpu, **kwargs)
        states[key] = cpu.shard_checkpoint(checkpoint, module, tp)
        module.load_state_dict(states[key][0])
        programs[key] = export_rank0(module, inputs[0], tp)  # traced once, as rank 0
    # the Python-int rank became a constant: the naive graph never reads the SPMDRank
    assert _uses_rank(programs["spmd"]) and _uses_rank(programs["int8"]) and not _uses_rank(programs["naive"])

    results = run_replicated(programs, states, forward_job, inputs)

    for rank, out in enumerate(results):
        for i in range(len(inputs)):
            ref, scale = refs["spmd"][i], refs["spmd"][i].abs().max()
            assert (out["spmd"][i] - ref).abs().max() <= 1e-5 * scale, (rank, i)
            assert (out["int8"][i] - refs["int8"][i]).abs().max() <= 1e-5 * scale, (rank, i)
            assert (out["int8"][i] - ref).abs().max() > 1e-4 * scale  # it is int8: not the float result
            # the naive scatter is wrong on every rank, and wrong exactly as the bug predicts
            assert (out["naive"][i] - ref).abs().max() > 0.3 * scale, (rank, i)
            bug = _bug_prediction(*refs["per_expert"][i], tp, ref.shape)
            assert (out["naive"][i] - bug).abs().max() <= 1e-5 * scale, (rank, i)
