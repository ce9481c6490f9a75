"""The reader at TP t on the channel layout, one process: a rank's sidecar shard is the whole
sidecar's rows of its channels (in whole 32-byte strips), its estimates are the whole sidecar's, the
per-rank reader (each rank `reference.forward` on its shard, summed) is the mask-based per-rank
selector eval-reader runs, the global top-k over all ranks is the one-rank reader at the same total k,
TP 1 is the one-rank reader bit for bit, and a rank's reads are charged on its own geometry."""

import pytest
import torch

import trained_like
from neuron_moe.cli import main
from neuron_moe.reader import reference, shard
from neuron_moe.reader import selectors as S
from neuron_moe.reader.accounting import BudgetError, rank_geometry, reads, solve_k, solve_rank_k
from neuron_moe.spec import Reader
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.hadamard import random_signs
from neuron_moe.reader.prep import prep_layer
from neuron_moe.reader.sidecar import SECTOR, LayerSidecar, unpack_codes

E, I, H, TOP_K, RANK, SCAN = 8, 48, 256, 4, 16, 64


@pytest.fixture(scope="module")
def case():
    ex = trained_like.experts(num_experts=E, inter=I, hidden=H, seed=0)
    signs = random_signs(H, 0)
    layer = LayerSidecar.from_tensors(prep_layer(ex.gate_up_proj, ex.down_proj, signs, RANK), signs)
    x = trained_like.tokens(ex, count=24, seed=1)
    index, weights = trained_like.routing(24, E, TOP_K)
    return ex, layer, x, index, weights


def ranks(ex, layer, tp):
    down_rows = ex.down_proj.mT.contiguous()
    return [
        (*shard.shard_weights(ex.gate_up_proj, down_rows, tp, r), shard.rank_sidecar(layer, tp, r)) for r in range(tp)
    ]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_shard_is_the_sidecars_rows_in_whole_sectors(case, tp):
    ex, layer, x, index, _ = case
    whole_codes = unpack_codes(layer.codes)[..., : 2 * I]
    whole_est = reference.sketch_estimates(x, index, layer, SCAN)
    for r in range(tp):
        part = shard.rank_sidecar(layer, tp, r)
        assert part.codes.shape[-1] % SECTOR == 0  # each strip whole sectors, its rows padded
        codes = unpack_codes(part.codes)
        assert torch.equal(codes[..., : 2 * I // tp], shard.rank_rows(whole_codes, -1, tp, r))
        assert not codes[..., 2 * I // tp :].any()  # padding rows: zero codes
        assert torch.equal(part.scales, shard.rank_rows(layer.scales, -1, tp, r))
        assert torch.equal(part.down_norms, layer.down_norms[:, r * I // tp : (r + 1) * I // tp])
        assert torch.equal(part.coeffs, layer.coeffs[:, r * I // tp : (r + 1) * I // tp])
        assert part.basis is layer.basis  # the layer's whole U on every rank
        # its sketch estimates are the whole sidecar's of its rows
        got = reference.sketch_estimates(x, index, part, SCAN)
        want = shard.rank_rows(whole_est, -1, tp, r)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # rank r holds gate channel j = r·I/t + i and up channel I + j: they pair
    gate, up = shard.rank_rows(ex.gate_up_proj, 1, tp, 1).chunk(2, dim=1)
    assert torch.equal(gate, ex.gate_up_proj[:, I // tp : 2 * I // tp]) and torch.equal(
        up, ex.gate_up_proj[:, I + I // tp : I + 2 * I // tp]
    )


def test_tp1_is_the_one_rank_reader_bit_for_bit(case):
    ex, layer, x, index, weights = case
    (only,) = ranks(ex, layer, 1)
    for name in ("codes", "scales", "down_norms", "basis", "coeffs"):
        assert torch.equal(getattr(only[2], name), getattr(layer, name)), name
    kw = dict(k=40, scan=SCAN, rank=RANK, act_fn=ex.act_fn)
    want = reference.forward(x, index, weights, ex.gate_up_proj, ex.down_proj.mT.contiguous(), layer, **kw)
    assert torch.equal(shard.forward_ranks(x, index, weights, [only], **kw), want)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_per_rank_reader_is_the_per_rank_selector(case, tp):
    """eval-reader's selector (scores masked per rank) = each rank's reference.forward on its shard,
    summed; every rank keeps its k and reads its plan; full budget = the full MoE."""
    ex, layer, x, index, weights = case
    k = 10  # of each rank's 4·48/t candidates
    shards = ranks(ex, layer, tp)
    kw = dict(scan=SCAN, rank=RANK, act_fn=ex.act_fn)
    want = shard.forward_ranks(x, index, weights, shards, k=k, **kw)
    settings = Reader(scan=SCAN, recovery_rank=RANK).resolved()
    moe = S.MoeLayer(ex.gate_up_proj, ex.down_proj, ex.act_fn, TOP_K, layer, settings, tp=tp)
    got = S.run("reader", moe, x, index, weights, S.RankTopK({"channel": k}, tp, I))
    assert (got.out - want).abs().max() <= 1e-5 * want.abs().max()
    plan = sum(reads(rank_geometry(moe.geo, tp), moe.settings, k).values())
    assert got.rank_reads.shape == (len(x), tp) and (got.rank_reads == plan).all()  # 0 bytes off, every rank
    # teeth: a selection without the quota is another output
    free = S.run("reader", moe, x, index, weights, S.TopK({"channel": tp * k}))
    assert (free.out - want).abs().max() > 1e-3 * want.abs().max()
    # the global top-k over all ranks' gathered scores is the one-rank reader at the same total k,
    # and the ranks then read unevenly
    one = reference.forward(x, index, weights, ex.gate_up_proj, ex.down_proj.mT.contiguous(), layer, k=tp * k, **kw)
    assert (free.out - one).abs().max() <= 1e-5 * one.abs().max()
    assert (free.rank_reads.max(1).values > plan).any() and (free.rank_reads.min(1).values < plan).any()
    # every channel of every rank: the full MoE
    full = trained_like.full_moe(ex, x, index, weights)
    assert (
        shard.forward_ranks(x, index, weights, shards, k=TOP_K * I // tp, **kw) - full
    ).abs().max() <= 1e-5 * full.abs().max()


def test_a_ranks_reads_at_full_size():
    """Gemma-4 26B-A4B at TP 8: a rank's 176 gate/up rows pad to 320 per strip (64 B, against 288 B for
    1,408 rows on one rank), so its sketch is 8.10 % of its reads, not 4.78 %, every rank reads the whole
    U (1.52 % of its share), and 17.8 % buys 55 exact channels per rank (440 in all) instead of the
    one-rank reader's 703."""
    geo, settings = Geometry(hidden=2816, experts=128, top_k=8, intermediate=704), Reader().resolved()
    local = rank_geometry(geo, 8)
    assert local == Geometry(hidden=2816, experts=128, top_k=8, intermediate=88)
    parts = reads(local, settings, 0)
    full = 8 * 3 * 88 * 2816 * 2
    assert parts["sketch"] == 8 * (22 * 80 * 64 + 22 * 176 * 2)
    assert round(100 * parts["sketch"] / full, 2) == 8.10
    assert round(100 * 2816 * 32 * 2 / full, 2) == 1.52 and parts["recovery"] == 2816 * 32 * 2 + 8 * 88 * 64
    assert solve_rank_k(geo, settings, 17.8, 8) == 55 and solve_k(geo, settings, 17.8) == 703
    total = sum(reads(local, settings, 55).values())
    assert total <= 0.178 * full < sum(reads(local, settings, 56).values())
    assert solve_rank_k(geo, settings, 17.8, 1) == solve_k(geo, settings, 17.8)


def test_a_budget_below_a_ranks_floor_is_refused_with_it(capsys):
    """The tiny port (hidden 128, I 64) at TP 8: 8 channels per expert and rank; its 16 gate/up rows
    take a whole 32-byte strip, so the sketch alone is 42.19 % of a rank's reads."""
    geo = Geometry(hidden=128, experts=16, top_k=4, intermediate=64)
    with pytest.raises(
        BudgetError,
        match=r"per rank at TP 8 .*below what the reader reads before any exact channel "
        r"\(43\.23%: sketch 42\.19%",
    ):
        solve_rank_k(geo, Reader(recovery_rank=0).resolved(), 17.8, 8)
    assert main(["reads", "--budget", "17.8", "--tp", "8", "--recovery-rank", "0"]) == 2
    assert "per rank at TP 8" in capsys.readouterr().err
    assert main(["reads", "--model", "gemma4-26b-a4b", "--tp", "8", "--json", "-"]) == 0
    out = capsys.readouterr().out
    assert '"k": 55' in out and '"tp": 8' in out
