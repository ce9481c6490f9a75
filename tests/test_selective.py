"""Selective experts (top-k weights gathered per token) against HF's eager experts loop."""

import torch

from neuron_moe.experts.selective import gather_forward
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.static import data_dependent_ops
from transformers.integrations.moe import ExpertsInterface

from conftest import MoEBlock, prefill_logits, random_prompts, reseeded


def test_fp32_logits_match_eager_over_prefill_and_32_decode_steps(tiny_port):
    port = reseeded(tiny_port, 2024)
    eager, selective = build_model(port, "eager"), build_model(port, "selective")
    ids, mask = left_pad(random_prompts(port.config.vocab_size, [37, 4, 21], seed=4), pad_id=0)

    real = mask.bool()
    p_ref, p_got = prefill_logits(eager, ids, mask), prefill_logits(selective, ids, mask)
    assert (p_ref[real] - p_got[real]).abs().max() <= 1e-5

    ref, got = greedy(eager, ids, mask, 32), greedy(selective, ids, mask, 32)
    assert torch.equal(ref.tokens, got.tokens)
    assert (ref.logits - got.logits).abs().max() <= 1e-5
    assert ref.logits.std() > 0.05


def test_a_wrong_gather_is_caught(tiny_port):
    """Pairing each token's weights with the wrong expert (top-k order reversed) fails the tolerance."""

    def misrouted(self, hidden_states, top_k_index, top_k_weights):
        return gather_forward(self, hidden_states, top_k_index.flip(-1), top_k_weights)

    ExpertsInterface.register("test_misrouted", misrouted)
    broken = build_model(tiny_port, "eager")
    broken.set_experts_implementation("test_misrouted")
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [30], seed=3), pad_id=0)
    eager = build_model(tiny_port, "eager")
    assert (prefill_logits(eager, ids, mask) - prefill_logits(broken, ids, mask)).abs().max() > 1e-2


def test_selective_block_exports_with_fixed_shapes_and_gathers_k_slices(tiny_port):
    block = MoEBlock(build_model(tiny_port, "selective").model.layers[0])
    x = torch.randn(2, block.router.hidden_size)  # a decode step of batch 2
    ep = torch.export.export(block, (x,), strict=True)
    assert not data_dependent_ops(ep)
    gathers = [n for n in ep.graph.nodes if str(n.target) == "aten.index_select.default"]
    c = tiny_port.config
    # gate_up and down, each [T*k] slices of one expert: never all E experts
    assert sorted(tuple(n.meta["val"].shape) for n in gathers) == sorted(
        [
            (2 * c.top_k_experts, 2 * c.moe_intermediate_size, c.hidden_size),
            (2 * c.top_k_experts, c.hidden_size, c.moe_intermediate_size),
        ]
    )
    with torch.no_grad():
        assert (ep.module()(x) - block(x)).abs().max() <= 1e-6


def test_a_block_of_as_many_tokens_as_experts_over_k_computes_every_expert(tiny_port):
    """At T*k >= E gathering would copy more than the weights: the graph computes all experts (NxD's
    rule, fixed when it is traced), one token fewer still gathers; both match HF's experts loop."""
    c = tiny_port.config
    eager = MoEBlock(build_model(tiny_port, "eager").model.layers[0])
    block = MoEBlock(build_model(tiny_port, "selective").model.layers[0])
    edge = c.num_experts // c.top_k_experts
    for tokens, gathered in ((edge - 1, True), (edge, False)):
        x = torch.randn(tokens, c.hidden_size, generator=torch.Generator().manual_seed(tokens))
        ep = torch.export.export(block, (x,), strict=True)
        ops = {str(n.target) for n in ep.graph.nodes}
        assert ("aten.index_select.default" in ops) == gathered, tokens
        with torch.no_grad():
            assert (ep.module()(x) - eager(x)).abs().max() <= 1e-5, tokens
