"""Decode graphs by KV length (NxDI's token-generation buckets): each step runs the smallest graph above
every row's position, and what it computes is the whole cache's decode, token for token."""

import dataclasses

import pytest
import torch

from neuron_moe.greedy import left_pad
from neuron_moe.model import build_model
from neuron_moe.port import PortError, with_shapes
from neuron_moe.run_config import Shapes
from neuron_moe.static import ops_not_lowered
from neuron_moe.static.decoder import Decode, ProcessingDecode, new_cache, new_counts
from neuron_moe.static.export import decode_inputs, export
from neuron_moe.static.rows import Chunk, generate
from neuron_moe.static.runtime import static_runtime
from neuron_moe.static.sampling import GREEDY, neutral_inputs

from conftest import random_prompts

# fp32 graphs: the shorter graph sums the same products as the whole cache's, its masked positions
# adding exact zeros, but in another order: a few hundred ulps of fp32 after 4 layers, far below a
# token's margin
LOGITS = dict(rtol=0, atol=500 * torch.finfo(torch.float32).eps)


@pytest.fixture(scope="module")
def model(tiny_port):
    return build_model(tiny_port, tiny_port.static.decode_experts, torch.float32)


def _runtime(model, tiny_port, lengths, **kw):
    spec = dataclasses.replace(tiny_port.static, decode_lengths=lengths)
    return static_runtime(model, spec, 2, logits=True, **kw)


def _generate(runtime, prompts, n):
    ran = []
    choose = runtime.decode_length
    runtime.decode_length = lambda positions: ran.append(choose(positions)) or ran[-1]
    ids, mask = left_pad(prompts, 0)
    tokens, logits = generate(runtime, ids, mask, n)
    return tokens, logits, ran


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["window-rings", "whole-rows"])
def test_each_length_decodes_the_whole_caches_tokens_and_logits(model, tiny_port, prefix_caching):
    """Rows crossing each boundary (the sliding window's 16, 24, 64) in one generation: the runtime with
    graphs of 16, 24, 64 and 96 positions gives the tokens and logits of the one graph of 96, in both
    cache layouts (whole rows: the sliding layers' rings are the cache's length, cut to the span too)."""
    prompts = random_prompts(tiny_port.config.vocab_size, [13, 6], seed=3)
    whole = _generate(_runtime(model, tiny_port, (), prefix_caching=prefix_caching), prompts, 60)
    cut = _generate(_runtime(model, tiny_port, (16, 24, 64), prefix_caching=prefix_caching), prompts, 60)
    assert torch.equal(cut[0], whole[0])
    torch.testing.assert_close(cut[1], whole[1], **LOGITS)
    assert set(whole[2]) == {96}
    # 59 steps (the first token is the prefill's), the longest row at 13, 14, ..., 71: 16 up to position
    # 15, 24 up to 23, 64 up to 63
    longest = [13 + step for step in range(59)]
    assert cut[2] == [16 if p < 16 else 24 if p < 24 else 64 if p < 64 else 96 for p in longest]


def test_the_length_a_step_runs_is_the_smallest_above_every_rows_position(model, tiny_port):
    runtime = _runtime(model, tiny_port, (16, 64))
    at = lambda *p: runtime.decode_length(torch.tensor(p).reshape(-1, 1))  # noqa: E731
    assert [at(0, 0), at(15, 3), at(16, 3), at(3, 63), at(64, 0), at(95, 95)] == [16, 16, 64, 64, 96, 96]
    assert _runtime(model, tiny_port, ()).decode_length(torch.tensor([[0], [0]])) == 96


def test_the_processing_variant_runs_by_length_too(model, tiny_port):
    """The logits-processing decode of each length, neutral inputs: the whole cache's token and scores."""
    out = {}
    for lengths in ((), (24,)):
        runtime = _runtime(model, tiny_port, lengths)
        prompts = random_prompts(tiny_port.config.vocab_size, [20, 9], seed=5)
        runtime.prefill([Chunk(p, 0, row, GREEDY) for row, p in enumerate(prompts)])
        ids, positions = torch.tensor([[7], [9]]), torch.tensor([[20], [9]])
        assert runtime.decode_length(positions) == (24 if lengths else 96)
        out[lengths] = runtime.decode_processing(ids, positions, torch.tensor([GREEDY] * 2), *neutral_inputs(2, 2048))
    (tokens, scores, logits), (want, want_scores, want_logits) = out[(24,)], out[()]
    assert torch.equal(tokens, want) and torch.equal(scores[3 - 1], want_scores[2])  # top ids
    torch.testing.assert_close(logits, want_logits, **LOGITS)
    torch.testing.assert_close(scores[0], want_scores[0], **LOGITS)


def test_a_shorter_graph_exports_with_the_same_inputs_and_only_lowered_ops(model, tiny_port):
    """Static shapes per graph (the span is a constructor argument, not data), the cache whole as state,
    and every op one the XLA check saw lower (`static.ops_not_lowered`), the variant's too."""
    spec = tiny_port.static
    cache = new_cache(model, spec.max_cache_len, spec.batch_size)
    for graph, inputs in (
        (Decode(model, cache, spec.decode_experts, span=64), decode_inputs(spec)),
        (
            ProcessingDecode(model, cache, new_counts(model, spec.batch_size), spec.decode_experts, span=64),
            decode_inputs(spec) + neutral_inputs(spec.batch_size, tiny_port.config.vocab_size),
        ),
    ):
        program = export(graph, inputs, f"decode 64 ({type(graph).__name__})")
        assert ops_not_lowered(program) == []
        slices = [n for n in program.graph.nodes if str(n.target) == "aten.slice.Tensor" and n.args[1:3] == (2, 0)]
        assert {n.args[3] for n in slices} >= {64}  # the global layers' ring cut to the span


def test_the_ports_decode_lengths_and_the_flag_over_them(tiny_port):
    assert tiny_port.static.lengths == (64, 96) and tiny_port.static.shapes().decode_lengths == (64, 96)
    assert with_shapes(tiny_port, Shapes(decode_lengths=(8, 32))).static.lengths == (8, 32, 96)  # the cache's added
    assert with_shapes(tiny_port, Shapes(max_cache_len=60)).static.lengths == (60,)  # the table's below it kept
    assert with_shapes(tiny_port, Shapes(max_cache_len=80)).static.lengths == (64, 80)
    for lengths, why in (
        ((32, 16), "be strictly increasing"),
        ((16, 16), "be strictly increasing"),
        ((0, 16), "be strictly increasing positive"),
        ((16, 97), r"each be at most --max-cache-len \(96;"),
    ):
        with pytest.raises(PortError, match=f"^--decode-lengths must {why}"):
            with_shapes(tiny_port, Shapes(decode_lengths=lengths))


def test_a_manifest_without_decode_lengths_reads_as_one_graph_of_the_whole_cache():
    manifest = {"batch_size": 2, "max_cache_len": 96, "buckets": [8], "prefill_rows": [1], "prefill_chunk": 8}
    assert Shapes.from_manifest(manifest).decode_lengths == (96,)
    assert Shapes.from_manifest({**manifest, "decode_lengths": [32, 96]}).decode_lengths == (32, 96)
    assert Shapes.from_manifest({**manifest, "decode_lengths": [32, 96]}).manifest_fields()["decode_lengths"] == [
        32,
        96,
    ]
