"""Trace once, replicate, on t gloo processes: the MoE block of the tiny port exported once as
rank 0, then run by every rank with its own shard, in both expert layouts.

Channel layout: HF's output on every rank, over all experts (prefill-shaped input, T·k ≥ E) and
gathering each token's k experts (decode-shaped, T·k < E); int8 gives the single-rank int8
implementation's output. Expert layout: the SPMDRank scatter gives HF's output; the Python-int
scatter reproduces its frozen-rank bug exactly (rank 0's slice traced into every rank's graph);
int8 gives its own quantisation's output (down per hidden channel, shared by the experts). One
spawn per TP degree runs every program."""

import pytest
import torch

from neuron_moe import spec
from neuron_moe.experts.dense_masked import router_weight_matrix
from neuron_moe.experts.int8 import int8_forward, quantize_per_channel
from neuron_moe.formats import FORMATS, quantize_state
from neuron_moe.parallel import cpu, layout
from neuron_moe.parallel.moe import ParallelMoE
from neuron_moe.parallel.trace import export_rank0, forward_job, run_replicated

from conftest import expert_reads
from test_parallel_layout import LAYER, block_state

# key -> (expert layout, ParallelMoE options, input shape, gathers)
PROGRAMS = {
    "channel": (layout.CHANNEL, {}, "prefill", False),
    "channel decode": (layout.CHANNEL, {}, "decode", True),
    "channel int8 decode": (layout.CHANNEL, {"quantization": "int8"}, "decode", True),
    "expert spmd": (layout.EXPERT, {}, "prefill", False),
    "expert naive": (layout.EXPERT, {"scatter": "naive"}, "prefill", False),
    "expert int8": (layout.EXPERT, {"quantization": "int8"}, "prefill", False),
}


def _uses_rank(program) -> bool:
    """Whether the graph reads the SPMDRank parameter at all."""
    names = [s.arg.name for s in program.graph_signature.input_specs if s.target == "experts.spmd_rank.rank"]
    return any(len(n.users) for n in program.graph.nodes if n.name in names)


def _per_expert(x, gate_up, down, act_fn):
    """Every expert's output for every token [T, E, H], from HF-layout weights."""
    gate, up = torch.einsum("th,eoh->teo", x, gate_up).chunk(2, dim=-1)
    return torch.einsum("tei,ehi->teh", act_fn(gate) * up, down)


def _expert_layout_int8(experts):
    """The expert layout's int8 weights, dequantised, back in HF's layout: gate_up per (expert, output
    channel), down per hidden channel shared by the experts."""
    E, rows, H = experts.gate_up_proj.shape
    q, s = quantize_per_channel(layout.gate_up_2d(experts.gate_up_proj))
    gate_up = (q.float() * s).view(E, rows, H)
    q, s = quantize_per_channel(layout.down_2d(experts.down_proj))
    return gate_up, (q.float() * s).view(H, E, -1).permute(1, 0, 2)


@pytest.fixture(scope="module")
def block(tiny_eager):
    config, layer = tiny_eager.config, tiny_eager.model.layers[LAYER]
    gen = torch.Generator().manual_seed(4)
    H, E = config.hidden_size, config.num_experts
    shapes = {"prefill": (2, 9), "decode": (2, 1)}  # T = 18 and 2 tokens: T·k = 72 and 8 against E = 16
    inputs = {
        name: [tuple(torch.randn(*shape, H, generator=gen) for _ in range(2)) for _ in range(2)]
        for name, shape in shapes.items()
    }
    refs = {name: {"hf": [], "int8": [], "expert int8": [], "per_expert": []} for name in shapes}
    int8_weights = _expert_layout_int8(layer.experts)
    with torch.no_grad():
        for name, pairs in inputs.items():
            for router_in, experts_in in pairs:
                _, w, idx = layer.router(router_in.reshape(-1, H))
                x, dense = experts_in.reshape(-1, H), router_weight_matrix(idx, w, E)
                ref = refs[name]
                ref["hf"].append(layer.experts(x, idx, w).view_as(experts_in))  # HF eager
                ref["int8"].append(int8_forward(layer.experts, x, idx, w).view_as(experts_in))
                per_expert = _per_expert(x, layer.experts.gate_up_proj, layer.experts.down_proj, layer.experts.act_fn)
                ref["per_expert"].append((per_expert, dense))  # for the bug's exact prediction below
                ref["expert int8"].append(
                    torch.einsum("teh,te->th", _per_expert(x, *int8_weights, layer.experts.act_fn), dense).view_as(
                        experts_in
                    )
                )
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
    decode_config = spec.dispatching(config, spec.SELECTIVE)  # what a decode graph's view holds
    hf_state = tiny_eager.state_dict()
    programs, states = {}, {}
    for key, (expert_layout, options, shape, gathers) in PROGRAMS.items():
        full = layout.parallel_state_dict(hf_state, config, tp, expert_layout)
        quantization = options.get("quantization", "none")
        full = block_state(quantize_state(full, quantization))
        module_options = {k: v for k, v in options.items() if k != "quantization"}
        module = ParallelMoE(
            decode_config if shape == "decode" else config,
            tp,
            cpu,
            expert_layout=expert_layout,
            fmt=FORMATS[quantization],
            **module_options,
        )
        states[key] = cpu.shard_checkpoint(full, module, tp)
        module.load_state_dict(states[key][0])
        programs[key] = export_rank0(module, inputs[shape][0], tp)  # traced once, as rank 0
        assert bool(expert_reads(programs[key])["gathered"]) == gathers, key
    # the Python-int rank became a constant: the naive graph never reads the SPMDRank; the channel
    # layout has none to read
    assert _uses_rank(programs["expert spmd"]) and _uses_rank(programs["expert int8"])
    assert not _uses_rank(programs["expert naive"])
    assert not any(s.target == "experts.spmd_rank.rank" for s in programs["channel"].graph_signature.input_specs)

    results = run_replicated(programs, states, forward_job, {k: inputs[p[2]] for k, p in PROGRAMS.items()})

    for rank, out in enumerate(results):
        for key, (_, options, shape, _) in PROGRAMS.items():
            for i, got in enumerate(out[key]):
                ref = refs[shape]
                want = ref["hf"][i]
                scale = want.abs().max()
                if key == "expert naive":
                    # wrong on every rank, and wrong exactly as the bug predicts
                    assert (got - want).abs().max() > 0.3 * scale, (rank, i)
                    bug = _bug_prediction(*ref["per_expert"][i], tp, want.shape)
                    assert (got - bug).abs().max() <= 1e-5 * scale, (rank, i)
                    continue
                if options.get("quantization") == "int8":
                    assert (got - want).abs().max() > 1e-4 * scale, (key, rank, i)  # it is int8: not the float result
                    want = ref["expert int8" if key == "expert int8" else "int8"][i]
                assert (got - want).abs().max() <= 1e-5 * scale, (key, rank, i)
    # the expert layout's int8 is the coarser quantisation, not the one-rank implementation's
    assert (results[0]["expert int8"][0] - refs["prefill"]["int8"][0]).abs().max() > 1e-4
