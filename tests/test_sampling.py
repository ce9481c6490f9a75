"""The sampler inside the graphs (static/sampling.py) against a host reference written here in
float64: the distribution of 10,000 seeded draws from one step's logits of the tiny model (a
chi-square test per setting), the exact distribution through a grid of draws, and the sets that
top-k and top-p keep, within the candidate width and past it. The draws are one vectorised call
of `pick` over 10,000 rows, as a graph would run them."""

import numpy as np
import pytest
import torch

from neuron_moe.greedy import left_pad
from neuron_moe.static.sampling import CANDIDATES, pick

from conftest import random_prompts

DRAWS = 10_000


@pytest.fixture(scope="module")
def step_logits(tiny_eager):
    """One step's logits [V] of the trained tiny model (after a prompt of its own vocabulary)."""
    ids, mask = left_pad(random_prompts(tiny_eager.config.vocab_size, [20], seed=5), 0)
    with torch.no_grad():
        return tiny_eager(input_ids=ids, attention_mask=mask).logits[0, -1].float()


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution a request asks for, in float64: softmax(logits / T), the k most likely
    kept and renormalised, then the smallest most-likely-first set whose mass reaches top_p."""
    scaled = logits.double().numpy() / temperature
    probs = np.exp(scaled - scaled.max())
    order = np.argsort(-probs, kind="stable")
    p = probs[order] / probs.sum()
    if top_k > 0:
        p[top_k:] = 0
        p /= p.sum()
    if top_p < 1:
        before = np.cumsum(p) - p
        p[1:][before[1:] >= top_p] = 0  # the most likely token always stays
        p /= p.sum()
    out = np.zeros_like(p)
    out[order] = p
    return out


def draws(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: torch.Tensor) -> np.ndarray:
    rows = u.shape[0]
    sampling = torch.tensor([[temperature, top_k, top_p, 0.0]]).repeat(rows, 1)
    sampling[:, 3] = u
    return pick(logits[None].expand(rows, -1), sampling)[:, 0].numpy()


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test, the categories expected fewer than 5 times merged into one."""
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


# temperature alone; nuclei of 34 and 2 tokens; top-k; top-k and top-p; top-k near the cap, then top-p
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 40, 1.0), (0.8, 0, 0.5), (1.0, 5, 0.8), (1.0, 200, 0.99)]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_seeded_draws_follow_the_requested_distribution(step_logits, temperature, top_k, top_p):
    expected = reference(step_logits, temperature, top_k, top_p)
    assert (expected > 0).sum() <= CANDIDATES or (top_k == 0 and top_p == 1)  # within the cap, or not truncated
    u = torch.rand(DRAWS, generator=torch.Generator().manual_seed(17))
    got = np.bincount(draws(step_logits, temperature, top_k, top_p, u), minlength=len(expected))
    assert not got[expected == 0].any(), "a token outside the kept set was drawn"
    assert chi_square_p(got, DRAWS * expected) > 1e-3


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_the_inverse_cdf_is_the_distribution_itself(step_logits, temperature, top_k, top_p):
    """Draws at u = (i + 1/2) / N hit each token about N·p times: off by at most one draw (and
    fp32 rounding of the cumulative sums)."""
    expected = reference(step_logits, temperature, top_k, top_p)
    u = (torch.arange(DRAWS, dtype=torch.float64) + 0.5) / DRAWS
    got = np.bincount(draws(step_logits, temperature, top_k, top_p, u.float()), minlength=len(expected))
    assert np.abs(got - DRAWS * expected).max() <= 1 + DRAWS * 1e-5


def test_top_p_keeps_exactly_the_smallest_set_that_reaches_p():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log()
    # cumulative masses 0.4, 0.65, 0.8, 0.9, 0.96, 1 (p just off them: at p itself fp32 rounding decides)
    for top_p, size in [(0.39, 1), (0.41, 2), (0.64, 2), (0.66, 3), (0.79, 3), (0.81, 4), (0.95, 5), (0.97, 6)]:
        u = (torch.arange(DRAWS) + 0.5) / DRAWS
        kept = set(np.unique(draws(logits, 1.0, 0, top_p, u)).tolist())
        assert kept == set(range(size)), (top_p, kept)
    # top-p over the top-k tokens' renormalised distribution: of the top two, 0.4 / 0.65 = 0.62
    # reaches 0.6 alone (over the whole vocabulary 0.4 would not)
    u = (torch.arange(DRAWS) + 0.5) / DRAWS
    assert set(np.unique(draws(logits, 1.0, 2, 0.6, u)).tolist()) == {0}
    assert set(np.unique(draws(logits, 1.0, 0, 0.6, u)).tolist()) == {0, 1}


def test_a_nucleus_wider_than_the_candidates_is_cut_to_them_and_temperature_alone_is_not():
    """Flat logits over 2048 tokens: a top-p of 0.99 would keep ~2028 of them; the graph keeps its
    256 candidates (renormalised). Temperature alone has no cut: every token can be drawn."""
    logits = torch.linspace(0.0, -0.5, 2048)  # decreasing: token i is the i-th most likely
    u = (torch.arange(DRAWS) + 0.5) / DRAWS
    nucleus = draws(logits, 1.0, 0, 0.99, u)
    assert set(np.unique(nucleus).tolist()) == set(range(CANDIDATES))
    capped = reference(logits, 1.0, CANDIDATES, 1.0)  # the top 256, renormalised: what is drawn
    assert np.abs(np.bincount(nucleus, minlength=2048) - DRAWS * capped).max() <= 1 + DRAWS * 1e-5
    whole = draws(logits, 1.0, 0, 1.0, torch.rand(DRAWS, generator=torch.Generator().manual_seed(3)))
    assert (whole >= CANDIDATES).mean() > 0.8  # 87 % of the mass is past the top 256
    assert chi_square_p(np.bincount(whole, minlength=2048), DRAWS * reference(logits, 1.0, 0, 1.0)) > 1e-3


def test_greedy_is_the_argmax_and_rows_do_not_see_each_other():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 2048, generator=gen) * 4
    rows = torch.tensor([[0.0, 0, 1.0, 0.5], [1e-300, 0, 1.0, 0.9], [0.9, 0, 0.95, 0.3], [1.5, 20, 1.0, 0.7]] * 16)
    rows[:, 3] = torch.rand(64, generator=gen)
    together = pick(logits, rows)[:, 0]
    alone = torch.cat([pick(logits[i : i + 1], rows[i : i + 1])[:, 0] for i in range(64)])
    assert torch.equal(together, alone)  # a row's token depends on its own logits and draw only
    greedy = rows[:, 0] < 1e-5
    assert torch.equal(together[greedy], logits[greedy].argmax(-1))


def test_non_finite_logits_give_no_token():
    logits = torch.randn(3, 300)
    logits[1, 7] = float("nan")
    logits[2, 0] = float("inf")
    for row in ([0.0, 0, 1.0, 0.5], [1.0, 0, 1.0, 0.5], [1.0, 10, 0.9, 0.5]):
        tokens = pick(logits, torch.tensor([row] * 3))[:, 0].tolist()
        assert tokens[1:] == [-1, -1] and 0 <= tokens[0] < 300
