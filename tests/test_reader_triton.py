"""The reader's Triton kernels against the PyTorch reference, on the CPU through Triton's
interpreter: rotate+scan, screen, select, exact, recover and down, on a hidden size that is not
a multiple of 128 and on a batch-1 token one of whose experts gets no channel, in fp32 (rtol
1e-3) and with bf16 weights; and the one-launch kernel (`persistent.py`), whose select runs
across programs, on the same cases."""

import functools

import pytest
import torch
from transformers.activations import ACT2FN

import trained_like
from neuron_moe import cli
from neuron_moe.experts.channel_reader import attach_reader
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.errors import UserError
from neuron_moe.reader import reference
from neuron_moe.reader.hadamard import padded, random_signs
from neuron_moe.reader.prep import prep_layer
from neuron_moe.reader.sidecar import BLOCK, LayerSidecar
from neuron_moe.reader.triton import forward as triton_reader  # interpreted: conftest sets TRITON_INTERPRET=1
from neuron_moe.reader.triton import kernels, persistent

from conftest import random_prompts

# the interpreter evaluates sigmoid(z) = 1/(1 + exp(-z)) in numpy: exp overflows to inf for very
# negative z, which gives the right 0 (the GPU's exp does the same without a warning)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def close(got, want, rtol=1e-3):
    """rtol relative to the output's scale: elementwise rtol breaks on entries that cancel to ~0."""
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rtol * want.float().abs().max().item(), err
    return err


class Case:
    """One layer, its sidecar, tokens and routing; `dtype` is that of the weights and tokens."""

    def __init__(
        self, experts, inter, hidden, tokens, top_k, k, scan, rank, act="gelu_pytorch_tanh", seed=0, dtype=torch.float32
    ):
        self.ex = trained_like.experts(num_experts=experts, inter=inter, hidden=hidden, seed=seed)
        signs = random_signs(padded(hidden, BLOCK), seed)
        self.layer = LayerSidecar.from_tensors(prep_layer(self.ex.gate_up_proj, self.ex.down_proj, signs, rank), signs)
        self.gate_up = self.ex.gate_up_proj.to(dtype).contiguous()
        self.down_rows = self.ex.down_proj.mT.to(dtype).contiguous()  # attach_reader's layout
        self.x = trained_like.tokens(self.ex, count=tokens).to(dtype)
        self.index, self.weights = trained_like.routing(tokens, experts, top_k)
        self.act_fn, self.k, self.scan, self.rank = ACT2FN[act], k, scan, rank

    def run(self, impl, **kw):
        kw = {"k": self.k, "scan": self.scan, "rank": self.rank, "act_fn": self.act_fn, **kw}
        return impl(self.x, self.index, self.weights, self.gate_up, self.down_rows, self.layer, **kw)


@pytest.fixture(scope="module")
def odd():
    """Hidden 200 (two blocks, the second 72/128 padding), 2I = 80 rows (strips padded to 160), 3 tokens."""
    return Case(experts=4, inter=40, hidden=200, tokens=3, top_k=2, k=30, scan=48, rank=16)


@pytest.fixture(scope="module")
def starved():
    """Batch 1, silu (Qwen3's activation), 2I = 200 rows (strips of 64 bytes: two screen column tiles);
    the third routed expert has weight 0, so its score is 0 for every channel and it gets none of the k."""
    case = Case(experts=5, inter=100, hidden=256, tokens=1, top_k=3, k=50, scan=80, rank=8, act="silu", seed=4)
    case.weights[:, 2] = 0.0
    return case


@pytest.fixture(params=["odd", "starved"])
def case(request):
    return request.getfixturevalue(request.param)


def test_rotate_scan_matches_the_reference(case):
    """The same coordinates in the same order (descending |Rx|), and their rotated values."""
    want_coords, want_values = reference.scanned(case.x.float(), case.layer, case.scan)
    coords, values = triton_reader.rotate_scan(case.x, case.layer.signs, case.scan)
    assert torch.equal(coords.long(), want_coords)
    close(values, want_values)


def test_rotate_scan_zeroes_the_workspace_it_is_given(odd):
    """`forward(fuse=True)` has no memset: rotate+scan's programs zero the whole buffer, whatever its
    size against the programs' count (6 programs here), and the coordinates are unchanged."""
    want_coords, _ = triton_reader.rotate_scan(odd.x, odd.layer.signs, odd.scan)
    for n in (1, 6, 1000, 7000):  # 7000: more than one 1024-wide step per program
        buf = torch.full((n + 7,), float("nan"))
        coords, _ = triton_reader.rotate_scan(odd.x, odd.layer.signs, odd.scan, zero=buf[:n])
        assert torch.equal(buf[:n], torch.zeros(n)) and buf[n:].isnan().all()  # nothing past the end
        assert torch.equal(coords, want_coords)


# every variant of the select kernel (search: bisection or radix; placement: two scans or one), and the
# one-launch kernel's pivot and place phases alone, in chunks of 16 channels (several place programs)
SELECTORS = {name: functools.partial(triton_reader.select, **kw) for name, kw in triton_reader.SELECT_VARIANTS.items()}
SELECTORS["persistent"] = functools.partial(persistent.select, shape=persistent.Tiles(chunk=16))
SELECT_VARIANTS = pytest.mark.parametrize("variant", list(SELECTORS))


@SELECT_VARIANTS
def test_select_matches_the_reference(case, variant):
    """The same k channels (as a set: the kernel writes them in channel order), their experts and
    router weights, and the recovery weights q of the others."""
    est = reference.sketch_estimates(case.x.float(), case.index, case.layer, case.scan)
    chosen, p = reference.select(est, case.index, case.weights, case.layer.down_norms, case.k, case.act_fn)
    inter = est.shape[-1] // 2
    expert, channel, weight = reference.chosen_rows(chosen, case.index, case.weights, inter)
    got = SELECTORS[variant](
        est, case.index, case.weights, case.layer.down_norms, case.k, triton_reader.activation(case.act_fn)
    )
    for t in range(est.shape[0]):
        want_rows = sorted(zip(expert[t].tolist(), channel[t].tolist(), weight[t].tolist()))
        got_rows = sorted(zip(got[0][t].tolist(), got[1][t].tolist(), got[2][t].tolist()))
        assert want_rows == got_rows
    close(got[3], reference.unchosen_weights(p, chosen, case.weights))


@SELECT_VARIANTS
def test_select_takes_exactly_k_among_tied_scores(variant):
    """Scores tied at the k-th value (here: all of them zero) still give exactly k distinct channels."""
    est = torch.zeros(2, 3, 20)
    index, weights = torch.tensor([[0, 1, 2], [2, 1, 0]]), torch.full((2, 3), 1 / 3)
    expert, channel, _, q = SELECTORS[variant](est, index, weights, torch.ones(3, 10), 7, kernels.SILU)
    for t in range(2):
        picks = set(zip(expert[t].tolist(), channel[t].tolist()))
        assert len(picks) == 7 and all(e in index[t].tolist() and 0 <= c < 10 for e, c in picks)
    assert torch.equal(q, torch.zeros(2, 3, 10))


@SELECT_VARIANTS
def test_select_breaks_ties_inside_the_kth_value_to_the_lower_channel(variant):
    """Scores of a few distinct values, the k-th inside a run of equal ones (and the values' bit
    patterns differ in every digit a radix pass reads): all channels above it, then the tied ones
    of lowest index n = slot·I + j, exactly k, written in that order; and k = every channel."""
    gen = torch.Generator().manual_seed(3)
    inter, ke = 30, 3
    levels = torch.tensor([1e-30, 0.37, 1.0, 3.0e5])  # u: the score is proportional to it
    u = levels[torch.randint(0, 4, (ke * inter,), generator=gen)]
    u = torch.stack([u, u.flip(0)]).view(2, ke, inter)  # the same counts per value, tied channels elsewhere
    est = torch.cat([torch.full((2, ke, inter), 2.0), u], dim=-1)  # ĝ = 2 everywhere: φ(ĝ) one constant
    index, weights = torch.tensor([[0, 1, 2], [2, 1, 0]]), torch.full((2, ke), 0.25)
    score = u.flatten(1)
    for k in (1, int((score[0] >= 1.0).sum()) + 5, int((score[0] >= 0.37).sum()) + 3, ke * inter):
        expert, channel, _, _ = SELECTORS[variant](est, index, weights, torch.ones(3, inter), k, kernels.SILU)
        for t in range(2):
            order = sorted(range(ke * inter), key=lambda n: (-score[t, n].item(), n))[:k]
            kth = score[t, order[-1]]
            assert k == ke * inter or (score[t] == kth).sum() > (score[t, order] == kth).sum()  # inside a tie
            want = sorted(order)  # the kernel writes the chosen in channel order
            assert expert[t].tolist() == [index[t, n // inter].item() for n in want]
            assert channel[t].tolist() == [n % inter for n in want]


@pytest.mark.parametrize("variant", list(triton_reader.SELECT_VARIANTS))
def test_select_never_writes_past_k_when_scores_are_nan(variant):
    """NaN estimates (from NaN input) sort above +inf in the bit patterns the search reads: more
    than k of them must still give exactly k distinct channels and nothing written past the row."""
    ke, inter, k, guard = 2, 16, 5, 64
    est = torch.ones(1, ke, 2 * inter)
    est[0, :, :inter] = float("nan")  # every ĝ: every score NaN
    index, weights = torch.tensor([[0, 1]]), torch.full((1, ke), 0.5)
    out = {
        name: torch.full((k + guard,), -7, dtype=dtype)
        for name, dtype in (("expert", torch.int32), ("channel", torch.int32), ("weight", torch.float32))
    }
    q = torch.empty(1, ke, inter)
    v = triton_reader.SELECT_VARIANTS[variant]
    kernels.select_kernel[(1,)](
        est,
        index,
        weights,
        torch.ones(ke, inter),
        out["expert"],
        out["channel"],
        out["weight"],
        q,
        ke,
        inter,
        k,
        ACT=kernels.SILU,
        HAS_RECOVERY=True,
        N_P2=32,
        SEARCH=v.get("search", kernels.BISECT),
        RADIX_BITS=v.get("radix_bits", 8),
        PLACE=v.get("place", kernels.TWO_SCANS),
    )
    for name, buf in out.items():
        assert (buf[k:] == -7).all(), name  # the guard past the row is untouched
        assert (buf[:k] != -7).all(), name  # and the row is written
    assert len(set(zip(out["expert"][:k].tolist(), out["channel"][:k].tolist()))) == k


def test_persistent_select_takes_exactly_k_when_scores_are_nan():
    """The pivot's first digit of a NaN score is that of +inf: more than k of them still give k channels."""
    est = torch.ones(1, 2, 32)
    est[0, :, :16] = float("nan")
    expert, channel, _, _ = SELECTORS["persistent"](
        est, torch.tensor([[0, 1]]), torch.full((1, 2), 0.5), torch.ones(2, 16), 5, kernels.SILU
    )
    assert len(set(zip(expert[0].tolist(), channel[0].tolist()))) == 5


def test_one_scan_placement_refuses_more_channels_than_its_packing_holds():
    """ONE_SCAN packs two counts of up to N_P2 into one int32: beyond 32768 channels it is refused
    before a launch (the kernel's static_assert would be a compile error)."""
    est, index = torch.zeros(1, 8, 2 * 4097), torch.arange(8)[None]
    with pytest.raises(UserError, match="one-scan placement packs two counts of up to 65536"):
        triton_reader.select(
            est, index, torch.full((1, 8), 0.125), torch.ones(8, 4097), 10, kernels.SILU, place=kernels.ONE_SCAN
        )


def test_screen_matches_the_reference(case):
    coords, values = reference.scanned(case.x.float(), case.layer, case.scan)
    got = triton_reader.screen(values, coords, case.index, case.layer.codes, case.layer.scales)
    want = reference.sketch_estimates(case.x.float(), case.index, case.layer, case.scan)
    close(got, want)
    # teeth: scanning one coordinate fewer per block is outside the tolerance
    fewer = reference.sketch_estimates(case.x.float(), case.index, case.layer, case.scan - 1)
    assert (got - fewer).abs().max() > 1e-3 * want.abs().max()


def test_exact_and_down_match_the_reference(case):
    """Without recovery the output is Σ_{j∈K} w_e a_j d_j: the exact kernel then the down kernel."""
    got, want = case.run(triton_reader.forward, rank=0), case.run(reference.forward, rank=0)
    close(got, want)
    # teeth: one chosen channel fewer is outside the tolerance
    assert (case.run(reference.forward, rank=0, k=case.k - 1) - got).abs().max() > 1e-3 * want.abs().max()


def test_recover_matches_the_reference(case):
    """z = Σ_{j∉K} w_e p_j b_j per token (the recover kernel), then y += U z (the down kernel's epilogue)."""
    estimates = reference.sketch_estimates(case.x.float(), case.index, case.layer, case.scan)
    chosen, p = reference.select(estimates, case.index, case.weights, case.layer.down_norms, case.k, case.act_fn)
    unchosen = reference.unchosen_weights(p, chosen, case.weights)
    z = triton_reader.recover(unchosen, case.index, case.layer.coeffs, case.rank)[:, : case.rank]
    close(z, torch.einsum("tki,tkir->tr", unchosen, case.layer.coeffs[case.index][..., : case.rank].float()))
    got, want = case.run(triton_reader.forward), case.run(reference.forward)
    close(got, want)
    recovery = want - case.run(reference.forward, rank=0)
    assert recovery.abs().max() > 2e-3 * want.abs().max()  # a missing recovery would be outside the tolerance


def test_fused_launches_give_the_reference_output(case):
    """`forward(fuse=True)`: the workspace zeroed by rotate+scan, exact and recover in one launch."""
    close(case.run(triton_reader.forward, fuse=True), case.run(reference.forward))
    close(case.run(triton_reader.forward, fuse=True, rank=0), case.run(reference.forward, rank=0))


def test_persistent_gives_the_reference_output(case):
    """One launch: rotate, screen, pivot and place, exact, recover, down, the output cast; every wait
    met (no fault counted) and the counters back to zero for the next call. The fault line is not
    reset (it counts over the process's calls: a test before this one may have counted a fault)."""
    before = persistent.faults("cpu")
    close(case.run(persistent.forward), case.run(reference.forward))
    assert persistent.faults("cpu") == before
    lines = persistent._COUNTERS[torch.device("cpu")][-1].view(-1, persistent.LINE)[:, 0]
    assert not torch.cat([lines[: persistent.FAULT_LINE], lines[persistent.FAULT_LINE + 1 :]]).any()


def test_persistent_without_recovery_in_small_tiles(odd):
    """Other tiles (16-channel place chunks, 8 × 64-byte screen tiles, a 128-wide exact tile over a
    200-wide hidden, 256-wide down tiles) and acq_rel reductions give the same output; rank 0 has no
    recover phase."""
    shape = persistent.Tiles(chunk=16, bq=64, sc=8, exact_bh=128, bh=256, atomics="acq_rel")
    close(odd.run(persistent.forward, rank=0, shape=shape), odd.run(reference.forward, rank=0))


def test_a_wait_that_cannot_be_met_counts_a_fault_instead_of_hanging(monkeypatch):
    """Producers that never run: the kernel is told of two screen programs, but the ticket starts past
    them, so the pivot's wait for them gives up after SPIN_LIMIT polls and counts a fault."""
    monkeypatch.setattr(persistent, "SPIN_LIMIT", 3)
    real = persistent._launch

    def screen_never_runs(shape, T, counts, pointers, sizes, constexprs, dev):
        ctr = persistent._counters(dev, 16)
        ctr[0] = 2  # the ticket: ids 0 and 1, the screen programs, are never taken
        real(shape, T, counts, pointers, {**sizes, "screen_tiles": 1, "screen_shares": 1}, constexprs, dev)
        ctr.view(-1, persistent.LINE)[[0, 1, 3, 4, 5, 6]] = 0  # the call never ends, so it resets nothing

    monkeypatch.setattr(persistent, "_launch", screen_never_runs)
    before = persistent.faults("cpu")
    persistent.select(
        torch.randn(1, 2, 32), torch.tensor([[0, 1]]), torch.full((1, 2), 0.5), torch.ones(2, 16), 5, kernels.SILU
    )
    assert persistent.faults("cpu") == before + 1  # the pivot's one wait (the place programs' is met)


def test_relaxed_reductions_give_the_reference_output(starved):
    """`forward(atomics="relaxed")`: every reduction a fire-and-forget add (kernel ends order them)."""
    close(starved.run(triton_reader.forward, atomics="relaxed", fuse=True), starved.run(reference.forward))
    with pytest.raises(UserError, match="unknown atomics 'seq_cst'"):
        starved.run(triton_reader.forward, atomics="seq_cst")


def test_an_expert_with_no_selected_channel(starved):
    estimates = reference.sketch_estimates(starved.x, starved.index, starved.layer, starved.scan)
    chosen, _ = reference.select(
        estimates, starved.index, starved.weights, starved.layer.down_norms, starved.k, starved.act_fn
    )
    slots = (chosen // 100).flatten().tolist()
    assert 2 not in slots and {0, 1} <= set(slots)  # the case the other tests run is the one named
    close(starved.run(triton_reader.forward), starved.run(reference.forward))


def test_forward_takes_a_select_variant_by_name(starved):
    """`forward(select_variant=...)`, as bench/gpu_reader.py calls it: the reference's output; a name
    that is not a variant is refused."""
    close(starved.run(triton_reader.forward, select_variant="radix5+1scan"), starved.run(reference.forward))
    with pytest.raises(UserError, match="unknown select variant 'radix'"):
        starved.run(triton_reader.forward, select_variant="radix")


@pytest.mark.parametrize("split", [1, 3])
def test_down_split_shares_sum_to_the_same_rows(odd, split):
    """The down kernel's shares of the k rows meet through atomic adds; any split is the same sum.
    The activation is applied in the kernel: coef_j = w_j·φ(g_j)·u_j."""
    gen = torch.Generator().manual_seed(0)
    expert = odd.index.gather(1, torch.randint(0, 2, (3, 30), generator=gen))
    channel = torch.randint(0, 40, (3, 30), generator=gen)
    gu, weight = torch.randn(3, 30, 2, generator=gen), torch.rand(3, 30, generator=gen)
    got = triton_reader.down(
        gu, weight, expert, channel, odd.down_rows, triton_reader.activation(odd.act_fn), split=split
    )
    coef = weight * odd.act_fn(gu[..., 0]) * gu[..., 1]
    close(got, torch.einsum("tk,tkh->th", coef, odd.down_rows[expert, channel]))


def test_bf16_weights():
    """bf16 weights, sidecar and tokens, batch 8: every load converted to fp32 in the kernels; the
    output is the reference's to bf16 rounding."""
    case = Case(
        experts=4, inter=40, hidden=200, tokens=8, top_k=2, k=30, scan=48, rank=16, seed=2, dtype=torch.bfloat16
    )
    got, want = case.run(triton_reader.forward), case.run(reference.forward)
    assert got.dtype == torch.bfloat16
    close(got, want, rtol=2**-7)


def test_an_unsupported_activation_is_refused(odd):
    with pytest.raises(UserError, match="activation ReLU not supported"):
        odd.run(triton_reader.forward, act_fn=torch.nn.ReLU())


def test_the_hf_model_on_the_triton_kernels(tiny_port, tmp_path, capsys):
    """`attach_reader(..., kernel="triton")`: the decode steps' logits are the reference kernel's."""
    sidecar = tmp_path / "tiny.safetensors"
    assert cli.main(["prep-reader", "--out", str(sidecar)]) == 0
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [5, 3], seed=4), pad_id=0)
    logits = {}
    for kernel in ("reference", "triton"):
        model = build_model(tiny_port)
        attach_reader(model, sidecar, budget=60, kernel=kernel)
        logits[kernel] = greedy(model, ids, mask, 2).logits[:, 1]  # a decode step (step 0 is the prefill)
    close(logits["triton"], logits["reference"])
    with pytest.raises(UserError, match="unknown reader kernel 'cuda'"):
        attach_reader(build_model(tiny_port), sidecar, budget=60, kernel="cuda")
    assert cli.main(["validate", "--reader-kernel", "triton"]) == 2
    assert "--reader-kernel apply to --backend reader only" in capsys.readouterr().err


def test_the_triton_backend_refuses_cpu_tensors_outside_the_interpreter(odd, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UserError, match="needs CUDA tensors"):
        odd.run(triton_reader.forward)
