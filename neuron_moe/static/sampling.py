"""The next token, chosen inside a graph: greedy, temperature, top-k and top-p at fixed shapes.

`pick(logits [R, V], sampling [R, 4])` is what the static graphs run (`decoder.py`) and what the
per-request engine runs on the host (`serve/engine.py`, with every token a candidate). Per row,
`sampling` holds

    temperature   below GREEDY_BELOW: greedy, the argmax of the logits (the same graph)
    top_k         0 (or less): off; else the k most likely tokens
    top_p         1: off; else the smallest set of most likely tokens whose mass reaches top_p
    u             a uniform draw in [0, 1) from the request's own random state (its seeded
                  generator on the host): the graph is a pure function of its inputs, so a seeded
                  request draws the same tokens whatever else is in the batch

temperature first, then top-k, then top-p over the top-k tokens' renormalised distribution (as
HF's warpers and vLLM order them), then the token is the inverse of that distribution's CDF at u.

Static shapes: top-k and top-p work on the `candidates` most likely tokens (`topk`, sorted), the
candidate width; a request with neither (temperature alone) is sampled from the whole vocabulary,
by a two-level inverse CDF (sums of blocks of about sqrt(V) tokens, then one block), so no cumsum
is longer than a block and nothing is capped. What is exact and what is capped, at width C:
temperature alone, top-k <= C, and top-p whose nucleus has at most C tokens are exact (up to fp32
rounding, and u's 24 bits: a token below 2^-24 of the mass is drawn about as often as that); a
nucleus of more than C tokens is cut to the C most likely (renormalised). Top-k above C is
refused before it reaches a graph (`serve/engine.py`).

Logits that are not finite (NaN or inf anywhere in the row) give the token -1, which the host
reports as the model's failure instead of a token picked from NaNs.
"""

from __future__ import annotations

import math

import torch

CANDIDATES = 256  # the candidate width of top-k / top-p in the graphs (NxD Inference's global top-k)
GREEDY_BELOW = 1e-5  # logits / 1e-300 overflow to inf and softmax to NaN (vLLM draws the line here too)
FIELDS = ("temperature", "top_k", "top_p", "u")  # the columns of `sampling`
GREEDY = (0.0, 0.0, 1.0, 0.0)  # a row that takes the argmax (and a row with nothing to sample)


def greedy_sampling(rows: int) -> torch.Tensor:
    """The `sampling` input of `rows` greedy rows ([rows, 4])."""
    return torch.tensor([GREEDY] * rows)


def pick(logits: torch.Tensor, sampling: torch.Tensor, candidates: int = CANDIDATES) -> torch.Tensor:
    """[R, V] fp32 logits, [R, 4] sampling -> the next token [R, 1] (int64; -1 for non-finite logits)."""
    rows, vocab = logits.shape
    width = min(candidates, vocab)
    temperature, top_k, top_p, u = sampling.unbind(-1)
    greedy = temperature < GREEDY_BELOW
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    # the whole vocabulary's weights: for temperature alone, and the normaliser of the probabilities
    top = scaled.amax(-1, keepdim=True)
    whole = (scaled - top).exp()
    lse = whole.sum(-1).log() + top[:, 0]

    # top-k, then top-p, over the candidates (sorted, most likely first)
    values, index = scaled.topk(width, dim=-1)
    rank = torch.arange(width, device=logits.device)[None]
    k_on = top_k >= 1
    k = torch.where(k_on, top_k.clamp(max=width), torch.full_like(top_k, width))
    in_k = rank < k[:, None]
    kept = values.masked_fill(~in_k, -math.inf)
    # with top-k off the nucleus is a share of the whole vocabulary, with it a share of the k kept
    norm = torch.where(k_on, kept.logsumexp(-1), lse)
    probs = (kept - norm[:, None]).exp()
    before = probs.cumsum(-1) - probs  # the mass of the more likely candidates
    nucleus = in_k & ((before < top_p[:, None]) | (rank == 0))  # the top one always stays
    weights = probs * nucleus
    truncated = index.gather(1, _invert(weights, u)[:, None])[:, 0]

    sampled = torch.where(k_on | (top_p < 1), truncated, _sample_vocab(whole, u))
    token = torch.where(greedy, logits.argmax(-1), sampled)
    # NaN or inf anywhere in a row makes its sum so: one reduction instead of a test per logit
    return torch.where(torch.isfinite(logits.sum(-1)), token, torch.full_like(token, -1))[:, None]


def _invert(weights: torch.Tensor, u: torch.Tensor, cumulative: torch.Tensor | None = None) -> torch.Tensor:
    """[R, N] non-negative weights, [R] uniform draws -> [R] the first index whose cumulative weight
    passes u·(their sum): a draw from them. Kept on an index of non-zero weight whatever fp32 rounding
    (between the first and the last non-zero one), and in [0, N) for a row of NaNs too (its token is
    thrown away, but a gather must stay in bounds)."""
    cumulative = weights.cumsum(-1) if cumulative is None else cumulative
    total = cumulative[:, -1:]
    found = (cumulative <= u[:, None] * total).sum(-1)
    first, last = (cumulative <= 0).sum(-1), (cumulative < total).sum(-1)
    return torch.minimum(torch.maximum(found, first), last).clamp(0, weights.shape[-1] - 1)


def _sample_vocab(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R, V] unnormalised weights -> [R] tokens drawn in proportion to them: the block of about
    sqrt(V) tokens whose cumulative sum passes u·total, then the token within it, at the same
    point of the distribution (the draw rescaled to the block)."""
    rows, vocab = weights.shape
    block = 1 << math.ceil(math.log2(max(vocab, 1)) / 2)  # 64 for 2048 tokens, 512 for 262144
    blocks = -(-vocab // block)
    if blocks * block > vocab:
        weights = torch.cat([weights, weights.new_zeros(rows, blocks * block - vocab)], dim=-1)
    weights = weights.view(rows, blocks, block)
    sums = weights.sum(-1)
    cumulative = sums.cumsum(-1)
    which = _invert(sums, u, cumulative)
    before = (cumulative - sums).gather(1, which[:, None])[:, 0]
    inner = weights.gather(1, which[:, None, None].expand(rows, 1, block))[:, 0]
    mass = sums.gather(1, which[:, None])[:, 0]
    within = ((u * cumulative[:, -1] - before) / mass).clamp(0, 1)  # where u falls inside the block
    return which * block + _invert(inner, within)


def sampling_row(temperature: float, top_k: int, top_p: float, u: float) -> tuple[float, float, float, float]:
    """One row of `sampling` (the order of FIELDS)."""
    return (float(temperature), float(top_k), float(top_p), float(u))
