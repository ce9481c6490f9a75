"""The reader over a decode step of B tokens (reader/batch.py): the batch rule is today's top-k at
B = 1, the full MoE at 100 %, reads exactly what the accounting charges (each row once), and beats
independent per-token top-k at equal union reads; and `neuron-moe reads --batch`."""

import json

import pytest
import torch

import trained_like
from neuron_moe import cli
from neuron_moe.reader import accounting as A
from neuron_moe.reader import batch, reference
from neuron_moe.reader import selectors as S
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.hadamard import random_signs
from neuron_moe.reader.int8 import Int8Experts
from neuron_moe.formats.int8 import quantize_per_channel
from neuron_moe.reader.prep import prep_layer
from neuron_moe.reader.sidecar import LayerSidecar

E, INTER, HIDDEN, TOP_K = 16, 48, 256, 4
GEO = Geometry(hidden=HIDDEN, experts=E, top_k=TOP_K, intermediate=INTER)


@pytest.fixture(scope="module")
def case():
    ex = trained_like.experts(num_experts=E, inter=INTER, hidden=HIDDEN, seed=0)
    signs = random_signs(HIDDEN, 0)
    sidecar = LayerSidecar.from_tensors(prep_layer(ex.gate_up_proj, ex.down_proj, signs, 32), signs)
    x = trained_like.tokens(ex, count=16, seed=1)
    index, weights = trained_like.routing(16, E, TOP_K)
    return ex, sidecar, x, index, weights, trained_like.full_moe(ex, x, index, weights)


def int8_of(ex) -> Int8Experts:
    return Int8Experts.from_channel_layout(
        *quantize_per_channel(ex.gate_up_proj.mT), *quantize_per_channel(ex.down_proj.mT)
    )


def run(case, rows, settings=A.Reader().resolved(), int8=None, **rule):
    ex, sidecar, x, index, weights, _ = case
    return batch.step(
        x[rows],
        index[rows],
        weights[rows],
        ex.gate_up_proj,
        ex.down_proj.mT,
        sidecar,
        settings,
        ex.act_fn,
        int8=int8,
        **rule,
    )


def total(settings, rows):
    return sum(A.step_reads(GEO, settings, rows).values())


def rel_err(y, want):
    return float((y - want).norm() / want.norm())


@pytest.mark.parametrize(
    "budget,settings",
    [
        (40.0, A.Reader().resolved()),
        (60.0, A.Reader().resolved()),
        (30.0, A.Reader(recovery_rank=0).resolved()),
        (40.0, A.Reader(scan=128, recovery_rank=8).resolved()),
    ],
)
def test_the_batch_rule_at_batch_one_is_todays_top_k(case, budget, settings):
    """One token: the batch rule's budget buys today's k, picks the same channels and gives the same
    output, bit for bit; both are `reference.forward` (the per-token reader) up to summation order."""
    ex, sidecar, x, index, weights, _ = case
    k = A.solve_k(GEO, settings, budget)
    for t in range(6):
        mine = run(case, slice(t, t + 1), settings, rule="batch", limit=budget / 100 * A.full_bytes(GEO))
        today = run(case, slice(t, t + 1), settings, rule="token", k=k)
        assert mine.k == k
        assert torch.equal(mine.keep, today.keep) and torch.equal(mine.out, today.out)
        assert mine.rows == A.token_rows(GEO, settings, k)
        assert A.step_reads(GEO, settings, mine.rows) == A.reads(GEO, settings, k)
        want = reference.forward(
            x[t : t + 1],
            index[t : t + 1],
            weights[t : t + 1],
            ex.gate_up_proj,
            ex.down_proj.mT,
            sidecar,
            k=k,
            scan=settings.scan,
            rank=settings.recovery_rank,
            act_fn=ex.act_fn,
        )
        assert rel_err(mine.out, want) < 2e-6
        score, _ = reference.scores(
            reference.sketch_estimates(x[t : t + 1], index[t : t + 1], sidecar, settings.scan),
            index[t : t + 1],
            weights[t : t + 1],
            sidecar.down_norms,
            ex.act_fn,
        )
        chosen = score.flatten(1).topk(k).indices  # today's selection, as (slot, channel)
        assert torch.equal(mine.keep.flatten(1).nonzero()[:, 1].sort().values, chosen[0].sort().values)


@pytest.mark.parametrize("int8", [False, True])
def test_at_budget_100_every_rule_is_the_full_moe(case, int8):
    ex, _, x, index, weights, full = case
    settings = A.Reader(quantization="int8" if int8 else "none").resolved()
    q = int8_of(ex) if int8 else None
    if int8:
        gate_up, down = q.dequantized()
        full = trained_like.full_moe(
            type(ex)(gate_up_proj=gate_up, down_proj=down, act_fn=ex.act_fn), x, index, weights
        )
    for B in (1, 8):
        rows = slice(0, B)
        experts = len(index[rows].unique())
        for rule in (
            {"rule": "token", "k": GEO.channels},
            {"rule": "batch", "limit": A.full_reads(GEO, settings, experts)},
        ):
            got = run(case, rows, settings, q, **rule)
            assert rel_err(got.out, full[rows]) < 1e-5, rule
            assert got.rows == A.StepRows(experts, 0, experts * INTER, 0)  # the union's experts whole, no screen
            assert total(settings, got.rows) == A.full_reads(GEO, settings, experts)
    union = len(index[:8].unique())
    one_short = run(case, slice(0, 8), rule="batch", limit=A.full_reads(GEO, A.Reader().resolved(), union) - 1)
    assert one_short.rows.strips > 0 and rel_err(one_short.out, full[:8]) > 1e-4  # teeth: a byte less screens


def poisoned(case, read, int8=None):
    """Copies of every tensor the step may read with everything outside `read` made garbage (NaN, or
    random codes), so an output that is still the same was computed from `read` alone."""
    ex, sidecar, *_ = case
    gen = torch.Generator().manual_seed(7)
    rows = torch.ones(E, INTER, dtype=torch.bool)
    rows[read["exact"][:, 0], read["exact"][:, 1]] = False  # channels not read exactly
    gate_up = ex.gate_up_proj.clone()
    gate_up[:, :INTER][rows] = float("nan")
    gate_up[:, INTER:][rows] = float("nan")
    down = ex.down_proj.mT.clone()
    down[rows] = float("nan")
    screened = torch.zeros(E, dtype=torch.bool)
    if len(read["strips"]):
        screened[read["experts"]] = True
    codes = sidecar.codes.clone()
    strips = torch.ones(codes.shape[:3], dtype=torch.bool)
    strips[read["strips"][:, 0], read["strips"][:, 1], read["strips"][:, 2]] = False
    codes[strips] = torch.randint(0, 243, (int(strips.sum()), codes.shape[-1]), generator=gen, dtype=torch.uint8)
    scales, norms = sidecar.scales.clone(), sidecar.down_norms.clone()
    scales[~screened], norms[~screened] = float("nan"), float("nan")
    coeffs = sidecar.coeffs.clone()
    kept = torch.ones(E, INTER, dtype=torch.bool)
    kept[read["coeffs"][:, 0], read["coeffs"][:, 1]] = False
    coeffs[kept] = float("nan")
    side = LayerSidecar(codes, scales, norms, sidecar.basis, coeffs, sidecar.signs)
    if int8 is not None:
        used = torch.zeros(E, dtype=torch.bool)
        used[read["experts"]] = True
        pairs, dscale, qdown = int8.gate_up_scale.clone(), int8.down_scale.clone(), int8.down.clone()
        pairs[rows], dscale[~used] = float("nan"), float("nan")
        qdown[rows] = torch.randint(-127, 128, (int(rows.sum()), HIDDEN), generator=gen, dtype=torch.int8)
        int8 = Int8Experts(int8.gate_up, pairs, qdown, dscale)
        gate_up, down = torch.full_like(gate_up, float("nan")), torch.full_like(down, float("nan"))
    return gate_up, down, side, int8


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("B", [1, 4, 8, 16])
@pytest.mark.parametrize("rule", ["token", "batch"])
def test_a_step_reads_what_the_accounting_charges(case, quantization, B, rule):
    """Each row once: the output is computed from the rows the step says it read (everything else
    garbage), and the accounting's plan of those rows is the step's reads, to the sector. The batch
    rule's plan follows from the union's size and K alone, and fits its limit with no room for one
    more channel."""
    ex, _, x, index, weights_, _ = case
    settings = A.Reader(quantization=quantization).resolved()
    q = int8_of(ex) if quantization == "int8" else None
    k = A.solve_k(GEO, settings, 40.0)
    experts = len(index[:B].unique())
    floor = total(settings, A.batch_rows(GEO, settings, experts, 0))
    limit = (floor + A.full_reads(GEO, settings, experts)) / 2  # half-way from the union's screen to its full read
    args = {"rule": "token", "k": k} if rule == "token" else {"rule": "batch", "limit": limit}
    got = run(case, slice(0, B), settings, q, **args)
    gate_up, down, side, q2 = poisoned(case, got.read, q)
    again = batch.step(x[:B], index[:B], weights_[:B], gate_up, down, side, settings, ex.act_fn, int8=q2, **args)
    assert torch.equal(again.out, got.out) and torch.equal(again.keep, got.keep)
    for part in ("strips", "exact", "coeffs"):  # each row once
        assert len(got.read[part].unique(dim=0)) == len(got.read[part])
    if rule == "batch":
        assert got.rows == A.batch_rows(GEO, settings, experts, got.k)
        plan = A.step_reads(GEO, settings, A.batch_rows(GEO, settings, experts, got.k))
        assert A.step_reads(GEO, settings, got.rows) == plan
        more = A.step_reads(GEO, settings, A.batch_rows(GEO, settings, experts, got.k + 1))
        assert sum(plan.values()) <= limit < sum(more.values())
    elif B == 1:
        assert A.step_reads(GEO, settings, got.rows) == A.reads(GEO, settings, k)
    else:  # independent top-k reads the union: less than B tokens apart, more than one
        one = sum(A.reads(GEO, settings, k).values())
        assert one < total(settings, got.rows) < B * one


def token_err(y, want):
    """Mean over tokens of each token's relative error: what a token's KL follows."""
    return float(((y - want).norm(dim=1) / want.norm(dim=1)).mean())


@pytest.mark.parametrize("B", [4, 8, 16])
def test_the_batch_rule_beats_independent_top_k_at_equal_union_reads(case, B):
    """At the bytes independent top-k's union costs, the batch rule (each expert's scan, one set of
    channels, shared) is closer to the full MoE per token on every step size (measured 0.110 / 0.088
    / 0.038 against 0.123 / 0.147 / 0.163), and summing shares beats summing raw scores (0.142 /
    0.097 / 0.043): raw sums hand the channels to the loudest tokens."""
    _, _, _, _, _, full = case
    k = A.solve_k(GEO, A.Reader().resolved(), 40.0)
    token = run(case, slice(0, B), rule="token", k=k)
    limit = total(A.Reader().resolved(), token.rows)
    mine = run(case, slice(0, B), rule="batch", limit=limit)
    raw = run(case, slice(0, B), rule="batch", limit=limit, weigh="raw")
    assert total(A.Reader().resolved(), mine.rows) <= limit
    assert token_err(mine.out, full[:B]) < 0.92 * token_err(token.out, full[:B])
    assert token_err(mine.out, full[:B]) < 0.92 * token_err(raw.out, full[:B])


def test_the_selectors_step_rule_runs_the_batch_step(case):
    ex, sidecar, x, index, weights, _ = case
    layer = S.MoeLayer(ex.gate_up_proj, ex.down_proj, ex.act_fn, TOP_K, sidecar)
    k = A.solve_k(GEO, layer.settings, 40.0)
    token = S.run("reader", layer, x[:8], index[:8], weights[:8], S.Step("token", k=k))
    matched = S.run("reader", layer, x[:8], index[:8], weights[:8], S.Step("batch", k=k))  # limit: token's reads
    direct = run(case, slice(0, 8), rule="batch", limit=int(token.reads[0]))
    assert torch.equal(matched.out, direct.out) and matched.step == direct.rows
    assert torch.all(matched.reads == total(A.Reader().resolved(), direct.rows))
    narrow = S.run("reader", layer, x[:8], index[:8], weights[:8], S.Step("batch", limit=int(token.reads[0]), scan=40))
    direct = run(case, slice(0, 8), A.Reader(scan=40).resolved(), rule="batch", limit=int(token.reads[0]))
    assert torch.equal(narrow.out, direct.out) and narrow.step.strips == narrow.step.experts * 2 * 40
    assert narrow.step.exact > matched.step.exact  # half the sketch buys exact channels
    # independent top-k through the Step rule: the per-token reader's output (each token its own k)
    per_token = S.run("reader", layer, x[:8], index[:8], weights[:8], S.top_k("reader", layer, 40.0))
    assert rel_err(token.out, per_token.out) < 2e-6


def test_expected_union_under_uniform_routing():
    assert A.expected_union(GEO, 1) == pytest.approx(TOP_K)
    gen = torch.Generator().manual_seed(0)
    samples = [len(torch.rand(8, E, generator=gen).argsort(-1)[:, :TOP_K].unique()) for _ in range(4000)]
    assert sum(samples) / len(samples) == pytest.approx(A.expected_union(GEO, 8), abs=0.05)  # 14.4 of 16


def test_reads_cli_batch(capsys):
    args = ["reads", "--model", "gemma4-26b-a4b", "--batch-size", "8", "--json", "-"]
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    batch8 = report["batch"]
    gemma = Geometry(hidden=2816, experts=128, top_k=8, intermediate=704)
    assert batch8["union_experts"] == round(A.expected_union(gemma, 8))  # 52 of 128
    assert batch8["routing"] == "uniform"
    rule = batch8["rules"]["batch"]
    assert rule["bytes"] <= batch8["limit_bytes"] and rule["k"] > 0
    assert batch8["rules"]["token"]["bytes"] > rule["bytes"]  # independent top-k's union, no sharing inside an expert
    assert cli.main(["reads", "--model", "gemma4-26b-a4b", "--batch-size", "8"]) == 0
    printed = capsys.readouterr().out
    assert "batch 8" in printed and "uniform routing" in printed
    with pytest.raises(SystemExit) as exit:
        cli.main(["reads", "--batch-size", "0"])
    assert exit.value.code == 2 and "argument --batch-size: must be in [1, 1024]" in capsys.readouterr().err


# ---- decode batches inside the model (eval/reader_batch.py) ----


@pytest.fixture(scope="module")
def short_sequences(tiny_port):
    from neuron_moe.eval.reader_eval import Sequence
    from neuron_moe.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_port, None)
    texts = [
        "The capital of France is Paris.",
        "Q: Reverse: red fox\nA: fox red",
        "A short text about owls.",
        "Q: cat=41 owl=17. What is owl?\nA: 17",
        "Lima is in Peru.",
    ]
    return [Sequence(tokenizer.encode(t), "x", start) for t, start in zip(texts, (4, 6, 0, 9, 2))]


def test_decode_batches_teacher_forced_are_the_full_model(tiny_eager, short_sequences):
    """Rows at their own positions over the per-row cache, prompts prefilled, rows refilled as
    sequences end: with the full experts, each scored position's log-probs are the plain forward's."""
    from neuron_moe.eval import reader_batch as RB
    from neuron_moe.eval.reader_eval import teacher_forced

    want = teacher_forced(tiny_eager, short_sequences)
    for B in (1, 3, 8):  # 8 rows for 5 sequences: the fillers repeat them, unscored
        got = RB.decode(tiny_eager, short_sequences, B)
        for (ref, _), lp in zip(want, got.logprobs):
            assert lp.shape == ref.shape and float((lp - ref).abs().max()) < 1e-4


def test_every_step_holds_b_tokens_and_generation_is_greedy(tiny_port, tiny_eager, short_sequences, tmp_path):
    from neuron_moe.eval import reader_batch as RB
    from neuron_moe.experts.selector_experts import moe_layers
    from neuron_moe.greedy import greedy
    from neuron_moe.model import prep_port
    from neuron_moe.reader.sidecar import Sidecar

    layers = moe_layers(tiny_eager, Sidecar(prep_port(tiny_port, tmp_path / "s.safetensors")), 0)
    k = A.solve_k(layers[0].geo, layers[0].settings, 30.0)
    got = RB.run_rule(tiny_eager, short_sequences, 3, "reader", layers, [S.Step("batch", k=k)] * len(layers))
    assert got.steps and all(s["tokens"] == 3 for s in got.steps)  # fillers keep the step full
    assert sum(len(lp) for lp in got.logprobs) == sum(len(s.ids) - 1 - s.start for s in short_sequences)
    assert all(layer["bytes"] > 0 and layer["experts"] >= 4 for s in got.steps for layer in s["layers"])
    # greedy generation through the same loop, full experts: the reference loop's tokens
    prompts = [s.ids[: s.start + 1] for s in short_sequences]
    seqs = [type(s)(p, s.source, len(p) - 1) for s, p in zip(short_sequences, prompts)]
    gen = RB.decode(tiny_eager, seqs, 2, new_tokens=[6] * len(seqs))
    for p, picks in zip(prompts, gen.picks):
        ids = torch.tensor([p])
        assert picks == greedy(tiny_eager, ids, torch.ones_like(ids), 6).tokens[0].tolist()
