"""The static-shape decoder: exported prefill/decode programs against HF eager with its dynamic cache.

Exporting the tiny decoder takes seconds per graph, so every bucket and the decode graph are
exported once for the module (`generator`) and shared by the tests that need them.
"""

import json

import pytest
import torch

from neuron_moe import cli
from neuron_moe.eval import seq_match
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.static import data_dependent_ops, ops_not_lowered, xla_lowered_ops
from neuron_moe.static import generator as static_generator
from neuron_moe.static.cache import _bucket_columns, decode_mask, state_tensors
from neuron_moe.static.decoder import Decode, new_cache
from neuron_moe.static.export import GraphError, checked, decode_inputs, functional, state_problems
from neuron_moe.static.generator import StaticGenerator, StaticInputError
from neuron_moe.static.rows import prefill_row
from neuron_moe.static.sampling import greedy_sampling

from conftest import expert_reads, port_text_elsewhere, random_prompts


@pytest.fixture(scope="module")
def generator(tiny_port):
    gen = StaticGenerator(build_model(tiny_port, "eager"), tiny_port.static, logits=True)
    gen.prepare(tiny_port.static.buckets)
    return gen


def test_tiny_port_buckets_straddle_the_sliding_window(tiny_port):
    spec, window = tiny_port.static, tiny_port.config.sliding_window
    assert spec.buckets[0] < window < spec.buckets[-1] and spec.buckets[-1] % window  # ring filled partly / rolled
    assert (spec.prefill_experts, spec.decode_experts) == ("dense_masked", "selective")


@pytest.mark.slow
def test_every_graph_exports_strict_with_fixed_shapes_the_cache_as_state_and_no_data_dependent_op(generator, tiny_port):
    spec, config = tiny_port.static, tiny_port.config
    assert sorted(generator.programs) == sorted([f"prefill {b}" for b in spec.buckets] + ["decode"])
    B, V = spec.batch_size, config.vocab_size
    state = {f"cache.{kv}{i}" for i in range(config.num_hidden_layers) for kv in "kv"}
    for name, program in generator.programs.items():
        assert not data_dependent_ops(program), name
        inputs = [n for n in program.graph.nodes if n.op == "placeholder"]
        assert all(type(d) is int for n in inputs for d in n.meta["val"].shape), f"{name}: symbolic shape"
        targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        sig = program.graph_signature
        # the KV cache is mutated state: every tensor of it written back, none among the user inputs/outputs
        assert set(sig.buffers_to_mutate.values()) == state and state <= set(sig.non_persistent_buffers)
        nodes = {n.name: n for n in program.graph.nodes}
        outputs = [tuple(nodes[o].meta["val"].shape) for o in sig.user_outputs]
        if name == "decode":
            assert {"aten.index_select.default", "aten.scatter.src"} <= targets  # selective + per-row cache write
            assert list(sig.user_inputs) == ["input_ids", "position_ids", "sampling"] and outputs == [(B, 1), (B, V)]
        else:
            assert expert_reads(program)["gathered"] == {}  # prefill computes every expert
            assert "aten.index_copy.default" in targets  # writes its row of the cache, by row id
            assert list(sig.user_inputs) == ["input_ids", "attention_mask", "position_ids", "row_ids", "sampling"]
            assert outputs == [(1, 1), (1, V)]
        assert state_problems(program, generator.graph(None if name == "decode" else 8)) == []
    # one state set: global layers keep max_cache_len positions with their own head_dim / KV heads,
    # sliding layers a window's ring; every graph holds the same tensors
    for i, kind in enumerate(config.layer_types):
        layer = config.per_layer_config[i]
        length = spec.max_cache_len if kind == "full_attention" else config.sliding_window
        for kv in "kv":
            assert generator.state[f"cache.{kv}{i}"].shape == (B, layer.num_key_value_heads, length, layer.head_dim)
    for graph in generator._graphs.values():
        assert all(t is generator.state[n] for n, t in state_tensors(graph).items())


def test_a_cache_tensor_returned_as_a_user_output_fails_the_check(tiny_port):  # non-strict export: < 20 s
    """The check has teeth: the decode graph in NxD's form (the cache as parameters, the new cache
    returned as aliased outputs) is, to torch.export, a graph whose KV tensors are user outputs."""
    model = build_model(tiny_port, "eager")
    graph = Decode(
        model, new_cache(model, tiny_port.static.max_cache_len, tiny_port.static.batch_size, aliased=True), "selective"
    )
    with torch.no_grad():
        program = functional(torch.export.export(graph, decode_inputs(tiny_port.static), strict=False))
    problems = state_problems(program, graph)
    assert any("KV state not mutated" in p for p in problems)
    assert any("user outputs" in p and "no KV tensor" in p for p in problems)
    with pytest.raises(GraphError, match="expected the token only, no KV tensor"):
        checked(program, graph, "decode")


def test_every_op_of_the_exported_graphs_lowered_in_the_xla_check(generator):  # instant: shares the export
    """The XLA check (bench/xla_check.py, torch-xla 2.9 on CPU) ran these graphs with no aten
    fallback and one compilation each, and recorded their ops (the allow-list, written from its
    result by tools/xla_ops.py); a graph that gains an op it has not seen lower fails here, without
    torch-xla. After a change: `make xla-check`, and `make xla-ops` where it reports an op missing."""
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


@pytest.mark.parametrize(
    "lengths,new_tokens",
    [
        ([39, 25], 33),  # bucket 56 for both (ring rolled), both cross the window
        ([39, 5], 33),  # one row in bucket 56, one in bucket 8: the rows sit at different positions throughout
        ([5], 33),  # bucket 8 inside the window, decode wraps the ring twice; the second row idles
        ([50], 47),  # the last token's step writes the last cache position (50 + 47 - 1 = 96)
    ],
)
def test_traced_greedy_equals_hf_eager(generator, tiny_eager, lengths, new_tokens):
    ids, mask = left_pad(random_prompts(tiny_eager.config.vocab_size, lengths, seed=sum(lengths)), pad_id=0)
    ref = greedy(tiny_eager, ids, mask, new_tokens)
    got = generator.generate(ids, mask, new_tokens)
    assert torch.equal(ref.tokens, got.tokens)
    # fp32 summation order only: a few ulp of the largest logit (|logit| reaches ~25 on trained weights)
    assert (ref.logits - got.logits).abs().max() <= 2e-6 * ref.logits.abs().max()
    assert ref.logits.std() > 0.05


def test_a_row_joins_while_another_is_mid_generation(generator, tiny_eager):
    """Continuous batching's pattern on the exported programs: row 0 is prefilled and decodes
    alone, then row 1 is prefilled (a shorter prompt, another bucket) without touching row 0's
    cache, then both decode at once at their own positions; each row's tokens are HF eager's for
    that prompt alone."""
    prompts = random_prompts(tiny_eager.config.vocab_size, [39, 7], seed=7)
    joined_at, total = 5, 12  # row 1 is prefilled once row 0 has 5 tokens; row 1 then makes 12
    refs = [
        greedy(tiny_eager, *left_pad([p], 0), n).tokens[0].tolist()
        for p, n in zip(prompts, (joined_at + total - 1, total))
    ]
    graphs, state = generator._graphs, generator.state
    token = torch.zeros(2, 1, dtype=torch.long)
    out = {0: [], 1: []}
    position = [len(prompts[0]), 0]

    def prefill(row):
        bucket = 56 if len(prompts[row]) > 8 else 8
        (tok, _) = graphs[f"prefill {bucket}"](
            *prefill_row(torch.tensor(prompts[row]), bucket, 0), torch.tensor([row]), greedy_sampling(1)
        )
        token[row] = tok[0]
        out[row].append(int(tok))

    prefill(0)
    for step in range(joined_at + total - 2):
        if step == joined_at - 1:
            before = {n: t.clone() for n, t in state.items()}
            prefill(1)
            position[1] = len(prompts[1])
            for name, t in state.items():
                assert torch.equal(t[0], before[name][0]), f"prefilling row 1 changed row 0 of {name}"
                assert not torch.equal(t[1], before[name][1]), f"prefilling row 1 left {name} alone"
        tok, _ = graphs["decode"](token, torch.tensor(position)[:, None], greedy_sampling(2))
        for row in (0, 1) if step >= joined_at - 1 else (0,):
            out[row].append(int(tok[row]))
            position[row] += 1
        token = tok
    assert out[0] == refs[0] and out[1] == refs[1]


def test_a_prompt_prefilled_in_chunks_through_the_exported_programs_is_the_prompt_prefilled_whole(
    generator, tiny_eager
):
    """Chunked prefill on the exported programs: a 50-token prompt as chunks of 8, 8, 8, 8, 8, 8, 2
    (each at its own start, attending to the row's cache of the ones before) into row 1, then
    decode: HF eager's tokens, and row 0 (prefilled whole, in the 56 bucket) untouched by it."""
    prompts = random_prompts(tiny_eager.config.vocab_size, [50, 50], seed=12)
    prompts[1] = prompts[0]
    graphs = generator._graphs
    reference = greedy(tiny_eager, *left_pad([prompts[0]], 0), 6).tokens[0].tolist()
    token = torch.zeros(2, 1, dtype=torch.long)
    whole = prefill_row(torch.tensor(prompts[0]), 56, 0)
    (tok, _) = graphs["prefill 56"](*whole, torch.tensor([0]), greedy_sampling(1))
    token[0] = tok[0]
    for start in range(0, 50, 8):
        piece = torch.tensor(prompts[1][start : start + 8])
        (tok, _) = graphs["prefill 8"](*prefill_row(piece, 8, 0, start), torch.tensor([1]), greedy_sampling(1))
    token[1] = tok[0]
    out = [token[:, 0].tolist()]
    for step in range(5):
        token, _ = graphs["decode"](token, torch.full((2, 1), 50 + step), greedy_sampling(2))
        out.append(token[:, 0].tolist())
    assert [row[0] for row in out] == [row[1] for row in out] == reference


def test_validate_traced_matches_on_every_prompt(generator, monkeypatch, tmp_path, capsys):
    """The CLI path end to end (prompts in batches of the compiled size), on the module's exported
    programs rather than a second export of the same graphs."""
    monkeypatch.setattr(static_generator, "StaticGenerator", lambda model, spec, logits: generator)
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
    broken = StaticGenerator(model, tiny_port.static, exported=False, logits=True)
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [39, 25], seed=64), pad_id=0)
    diff = (greedy(tiny_eager, ids, mask, 8).logits - broken.generate(ids, mask, 8).logits).abs().max()
    assert diff > 1e-2


def test_prefill_puts_position_q_at_ring_index_q_mod_length():
    """From a left-padded bucket, each ring index takes the latest prompt position that maps to it
    (the column of position q is q + pads); an index no position has reached yet is hidden by the
    decode mask until its position is decoded."""
    for bucket, n, length in [(8, 5, 16), (16, 16, 16), (56, 40, 16), (56, 20, 96), (8, 8, 96)]:
        _, _, positions = prefill_row(torch.arange(n), bucket, 0)
        column = _bucket_columns(positions, length)[1][0].tolist()
        for r in range(length):
            held = max((q for q in range(n) if q % length == r), default=None)
            if held is not None:
                assert column[r] == held + bucket - n, (bucket, n, length, r)
            hidden = decode_mask(torch.tensor([[n]]), length, torch.float32)[0, 0, 0, r] != 0
            assert hidden == (held is None and r != n % length), (bucket, n, length, r)


def test_decode_mask_sees_exactly_each_rows_positions_of_the_window():
    window, max_len = 6, 30
    for length, limit in [(window, window), (max_len, max_len)]:  # a sliding ring, a global buffer
        for p in range(max_len):
            positions = torch.tensor([[p], [max(p - 7, 0)]])  # two rows at different positions
            m = decode_mask(positions, length, torch.float32)[:, 0, 0]
            for row, q in enumerate(positions[:, 0].tolist()):
                seen = {q - (q - r) % length for r in range(length) if m[row, r] == 0}
                assert seen == set(range(max(0, q - limit + 1), q + 1)), (length, p, row)


def test_bad_input_is_refused_before_any_work(tiny_port):
    spec = tiny_port.static
    gen = StaticGenerator(build_model(tiny_port, "eager"), spec)
    vocab = tiny_port.config.vocab_size
    too_long = left_pad(random_prompts(vocab, [spec.buckets[-1] + 1], seed=1), pad_id=0)
    with pytest.raises(
        StaticInputError,
        match=rf"prompt of {spec.buckets[-1] + 1} tokens exceeds the largest "
        rf"prefill bucket {spec.buckets[-1]}",
    ):
        gen.generate(*too_long, 4)
    ids, mask = left_pad(random_prompts(vocab, [30, 12], seed=2), pad_id=0)
    most = spec.max_cache_len - 30 + 1
    with pytest.raises(
        StaticInputError,
        match=rf"{most + 1} new tokens after a prompt of 30 tokens need "
        rf"{spec.max_cache_len + 1} cache slots; max_cache_len is "
        rf"{spec.max_cache_len} \(at most {most} new tokens",
    ):
        gen.generate(ids, mask, most + 1)
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
    assert cli.main(["validate", "--backend", "traced", "--max-new-tokens", "71"]) == 2  # longest prompt: 27 tokens
    assert (
        "71 new tokens after a prompt of 27 tokens need 97 cache slots; max_cache_len is 96" in capsys.readouterr().err
    )


def test_a_port_without_static_table_has_no_traced_backend(tiny_port, tmp_path, capsys):
    text = port_text_elsewhere(tiny_port)
    path = tmp_path / "no-static.toml"
    path.write_text(text[: text.index("[static]")])
    assert cli.main(["validate", "--backend", "traced", "--model", str(path)]) == 2
    assert "has no [static] table" in capsys.readouterr().err
