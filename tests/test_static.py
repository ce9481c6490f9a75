"""The static-shape decoder: exported prefill/decode programs against HF eager with its dynamic cache.

Exporting the tiny decoder takes seconds per graph, so every bucket and the decode graph are
exported once for the module (`generator`) and shared by the tests that need them.
"""

import json

import pytest
import torch

from neuron_moe import cli
from neuron_moe.eval import seq_match
from neuron_moe.generate import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.static.cache import decode_mask, to_ring
from neuron_moe.static import data_dependent_ops, ops_not_lowered, xla_lowered_ops
from neuron_moe.static import generate as static_generate
from neuron_moe.static.generate import StaticGenerator, StaticInputError

from conftest import port_text_elsewhere, random_prompts


@pytest.fixture(scope="module")
def generator(tiny_port):
    gen = StaticGenerator(build_model(tiny_port, "eager"), tiny_port.static)
    gen.prepare(tiny_port.static.buckets)
    return gen


def test_tiny_port_buckets_straddle_the_sliding_window(tiny_port):
    spec, window = tiny_port.static, tiny_port.config.sliding_window
    assert spec.buckets[0] < window < spec.buckets[-1] and spec.buckets[-1] % window  # ring filled partly / rolled
    assert (spec.prefill_experts, spec.decode_experts) == ("dense_masked", "selective")


@pytest.mark.slow
def test_every_graph_exports_strict_with_fixed_shapes_and_no_data_dependent_op(generator, tiny_port):
    spec, config = tiny_port.static, tiny_port.config
    assert sorted(generator.programs) == sorted([f"prefill {b}" for b in spec.buckets] + ["decode"])
    for name, program in generator.programs.items():
        assert not data_dependent_ops(program), name
        inputs = [n for n in program.graph.nodes if n.op == "placeholder"]
        assert all(type(d) is int for n in inputs for d in n.meta["val"].shape), f"{name}: symbolic shape"
        targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        if name == "decode":
            assert {"aten.index_select.default", "aten.index_copy.default"} <= targets  # selective + cache write
            assert len(program.graph_signature.user_inputs) == 4 + 2 * config.num_hidden_layers
        else:
            assert "aten.index_select.default" not in targets  # prefill computes every expert
    # every graph returns the next token, the logits, and the KV buffers: global layers keep
    # max_cache_len slots with their own head_dim / KV heads, sliding layers a window's ring
    outs = list(generator.programs["decode"].graph.find_nodes(op="output"))[0].args[0]
    shapes = [tuple(o.meta["val"].shape) for o in outs]
    B = spec.batch_size
    assert shapes[:2] == [(B, 1), (B, config.vocab_size)]
    for i, kind in enumerate(config.layer_types):
        layer = config.per_layer_config[i]
        length = spec.max_cache_len if kind == "full_attention" else config.sliding_window
        assert shapes[2 + 2 * i] == shapes[3 + 2 * i] == (B, layer.num_key_value_heads, length, layer.head_dim)


def test_every_op_of_the_exported_graphs_lowered_in_the_xla_check(generator):  # instant: shares the export
    """The XLA check (bench/xla_check.py, torch-xla 2.9 on CPU) ran these graphs with no aten
    fallback and one compilation each, and wrote down their ops; a graph that gains an op it
    has not seen lower fails here, without torch-xla. Rerun `make xla-check` after a change."""
    allowed = xla_lowered_ops()
    assert {"aten.index_select.default", "aten.index_copy.default", "aten.einsum.default"} <= allowed
    assert not allowed & {"aten.nonzero.default", "aten.histc.default", "aten._local_scalar_dense.default"}
    for name, program in generator.programs.items():
        assert ops_not_lowered(program) == [], name


def test_an_op_the_xla_check_did_not_see_is_reported():
    """The check has teeth: grouped_mm's expert histogram (`histc`) fell back on XLA:CPU."""
    program = torch.export.export(_Histc(), (torch.rand(8),), strict=True)
    assert ops_not_lowered(program) == ["aten.histc.default"]


class _Histc(torch.nn.Module):
    def forward(self, x):
        return torch.histc(x, bins=4, min=0, max=1)


@pytest.mark.parametrize("lengths,new_tokens", [
    ([39, 25], 33),  # batch of two of different lengths, bucket 56 (ring rolled), both cross the window
    ([5], 33),  # bucket 8 inside the window, decode wraps the ring twice; batch filled with a copy
    ([50], 41),  # the last token's step writes the last cache slot (56 + 41 - 1 = 96)
])
def test_traced_greedy_equals_hf_eager(generator, tiny_eager, lengths, new_tokens):
    ids, mask = left_pad(random_prompts(tiny_eager.config.vocab_size, lengths, seed=sum(lengths)), pad_id=0)
    ref = greedy(tiny_eager, ids, mask, new_tokens)
    got = generator.generate(ids, mask, new_tokens)
    assert torch.equal(ref.tokens, got.tokens)
    # fp32 summation order only: a few ulp of the largest logit (|logit| reaches ~25 on trained weights)
    assert (ref.logits - got.logits).abs().max() <= 2e-6 * ref.logits.abs().max()
    assert ref.logits.std() > 0.05


def test_validate_traced_matches_on_every_prompt(generator, monkeypatch, tmp_path, capsys):
    """The CLI path end to end (prompts in batches of the compiled size), on the module's exported
    programs rather than a second export of the same graphs."""
    monkeypatch.setattr(static_generate, "StaticGenerator", lambda model, spec: generator)
    out = tmp_path / "traced.json"
    assert cli.main(["validate", "--backend", "traced", "--max-new-tokens", "32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "traced" and report["all_match"]
    assert len(report["prompts"]) == len(seq_match.DEFAULT_PROMPTS) == 2 * generator.spec.batch_size
    assert max(len(p) for p in seq_match.DEFAULT_PROMPTS) + 1 > 2 * 16  # crosses the sliding window twice
    for row in report["prompts"]:
        assert row["new_tokens"] == 32 and row["min_cosine"] > 0.9999
    assert "PASS: 4/4 prompts match" in capsys.readouterr().out


def test_ignoring_the_sliding_window_is_caught(tiny_port, tiny_eager):
    """The tolerance has teeth: the same loop with sliding layers attending to everything fails."""
    model = build_model(tiny_port, "eager")
    model.config.sliding_window = tiny_port.static.max_cache_len
    broken = StaticGenerator(model, tiny_port.static, exported=False)
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [39, 25], seed=64), pad_id=0)
    diff = (greedy(tiny_eager, ids, mask, 8).logits - broken.generate(ids, mask, 8).logits).abs().max()
    assert diff > 1e-2


def test_ring_holds_slot_s_at_s_mod_length():
    for slots, length in [(5, 16), (16, 16), (40, 16), (64, 16)]:
        states = torch.arange(slots, dtype=torch.float32).view(1, 1, slots, 1)  # value = slot
        ring = to_ring(states, length).flatten().tolist()
        expected = [0.0] * length
        for s in range(max(0, slots - length), slots):
            expected[s % length] = float(s)
        assert ring == expected, (slots, length)


def test_decode_mask_sees_exactly_the_real_slots_of_the_window():
    window, max_len = 6, 30
    attention_mask = torch.ones(2, max_len, dtype=torch.long)
    attention_mask[1, :4] = 0  # row 1: four pads on the left
    for length, limit in [(window, window), (max_len, max_len)]:  # a sliding ring, a global buffer
        for slot in range(max_len):
            m = decode_mask(attention_mask, torch.tensor([slot]), length, torch.float32)[:, 0, 0]
            for row in range(2):
                seen = {slot - (slot - r) % length for r in range(length) if m[row, r] == 0}
                want = {s for s in range(max(0, slot - limit + 1), slot + 1) if attention_mask[row, s]}
                assert seen == want, (length, slot, row)


def test_bad_input_is_refused_before_any_work(tiny_port):
    spec = tiny_port.static
    gen = StaticGenerator(build_model(tiny_port, "eager"), spec)
    vocab = tiny_port.config.vocab_size
    too_long = left_pad(random_prompts(vocab, [spec.buckets[-1] + 1], seed=1), pad_id=0)
    with pytest.raises(StaticInputError, match=rf"prompt of {spec.buckets[-1] + 1} tokens exceeds the largest "
                                               rf"prefill bucket {spec.buckets[-1]}"):
        gen.generate(*too_long, 4)
    ids, mask = left_pad(random_prompts(vocab, [30], seed=2), pad_id=0)  # bucket 56
    most = spec.max_cache_len - 56 + 1
    with pytest.raises(StaticInputError, match=rf"{most + 1} new tokens .* bucket 56 need {spec.max_cache_len + 1} "
                                               rf"cache slots; max_cache_len is {spec.max_cache_len}"):
        gen.generate(ids, mask, most + 1)
    big = left_pad(random_prompts(vocab, [5] * (spec.batch_size + 1), seed=3), pad_id=0)
    with pytest.raises(StaticInputError, match=rf"batch of {spec.batch_size + 1} prompts exceeds the compiled "
                                               rf"batch size {spec.batch_size}"):
        gen.generate(*big, 4)
    ids, mask = left_pad(random_prompts(vocab, [30, 10], seed=4), pad_id=0)
    with pytest.raises(StaticInputError, match="row 1 is not a left-padded prompt"):
        gen.generate(ids, mask.flip(-1), 4)  # right-padded
    assert gen.programs == {}  # nothing was exported


def test_cli_refuses_bad_traced_input_before_the_reference_runs(monkeypatch, capsys):
    def reference_ran(*args):
        raise AssertionError("the reference ran before the traced backend checked its input")

    monkeypatch.setattr(seq_match, "greedy", reference_ran)
    long_prompt = "x" * 56  # 57 tokens with BOS: over the largest bucket
    assert cli.main(["validate", "--backend", "traced", "--prompt", long_prompt]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: prompt of 57 tokens exceeds the largest prefill bucket 56") and "Traceback" not in err
    assert cli.main(["validate", "--backend", "traced", "--max-new-tokens", "42"]) == 2
    assert "need 97 cache slots; max_cache_len is 96" in capsys.readouterr().err


def test_a_port_without_static_table_has_no_traced_backend(tiny_port, tmp_path, capsys):
    text = port_text_elsewhere(tiny_port)
    path = tmp_path / "no-static.toml"
    path.write_text(text[:text.index("[static]")])
    assert cli.main(["validate", "--backend", "traced", "--model", str(path)]) == 2
    assert "has no [static] table" in capsys.readouterr().err
