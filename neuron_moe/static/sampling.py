"""The next token, chosen inside a graph: greedy, temperature, top-k and top-p at fixed shapes.

`pick(logits [R, V], sampling [R, 4])` is what the static graphs run (`decoder.py`) and what the
runtime over transformers' model runs on the host (`serve/hf_runtime.py`, every token a candidate). Per row,
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
from dataclasses import dataclass

import torch

CANDIDATES = 256  # the candidate width of top-k / top-p in the graphs (NxD Inference's global top-k)
GREEDY_BELOW = 1e-5  # logits / 1e-300 overflow to inf and softmax to NaN (vLLM draws the line here too)
FIELDS = ("temperature", "top_k", "top_p", "u")  # the columns of `sampling`
GREEDY = (0.0, 0.0, 1.0, 0.0)  # a row that takes the argmax (and a row with nothing to sample)


def greedy_sampling(rows: int) -> torch.Tensor:
    """The `sampling` input of `rows` greedy rows ([rows, 4])."""
    return torch.tensor([GREEDY] * rows)


def pick(
    logits: torch.Tensor, sampling: torch.Tensor, candidates: int = CANDIDATES, finite: torch.Tensor | None = None
) -> torch.Tensor:
    """[R, V] fp32 logits, [R, 4] sampling -> the next token [R, 1] (int64; -1 for non-finite logits).
    `finite` [R] (bool): which rows' model logits were finite, when `logits` are processed ones that
    may hold -inf on purpose (`process`); else the logits themselves are tested."""
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
    finite = torch.isfinite(logits.sum(-1)) if finite is None else finite
    return torch.where(finite, token, torch.full_like(token, -1))[:, None]


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


# ---- logits processing: the variant graphs' inputs (`decoder.ProcessingDecode`, `ProcessingPrefill`) ----
#
# A row that asks for anything beyond temperature/top-k/top-p (logprobs, penalties, logit_bias, min_p,
# banned ids, a grammar's bitmask) runs in the logits-processing variant of the graphs; a step where no
# row asks runs the plain graphs (`Prefill`, `Decode`) with their own inputs. Per row, the variant decode graph reads
#
#   process   [R, 7] fp32 (PROCESS_FIELDS): presence, frequency and repetition penalties, min_p, and three
#             flags the engine step sets: reset (zero the row's token counts: its first step without a
#             prefill before it), fed_prompt (the fed token is the prompt's last: counted as a prompt token),
#             fed_output (the fed token is a generated one: counted as an output token)
#   bias_ids  [R, BIAS_WIDTH] int64 and bias [R, BIAS_WIDTH] fp32: logit_bias entries, then the banned ids
#             (bias -inf); unused entries are id 0 with bias 0
#   mask      [R, ceil(V/32)] int32: the grammar's bitmask, bit t % 32 of word t // 32 set = token t
#             allowed (xgrammar's and llguidance's layout); all bits set for a row without a grammar
#
# and keeps per-row token counts as device state (`TokenCounts`): how often each token was generated
# (presence and frequency penalties count output tokens only, as vLLM), and which tokens the prompt holds
# (the repetition penalty counts prompt and output tokens, as vLLM). The order is vLLM's: the bitmask, the
# bias (and bans), the penalties, then temperature and min_p, then top-k and top-p (`pick`). The logprobs
# the variant returns are the model's own distribution (log_softmax of the raw logits: vLLM's default
# `raw_logprobs`), before any processing: the chosen token's and the TOP_LOGPROBS most likely.

TOP_LOGPROBS = 20  # the top-n width of the variant graphs' logprob outputs (OpenAI's most)
BIAS_WIDTH = 64  # logit_bias entries plus banned ids a row may carry into the variant graphs
PROCESS_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "reset",
    "fed_prompt",
    "fed_output",
)
NEUTRAL = (0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0)  # a row that asks nothing (and a free row) in the variant
ALL_ALLOWED = -1  # an int32 bitmask word with every bit set
# each bit of an int32 word as an int32 value (bit 31 is the sign bit: -2^31)
_BITS = [1 << i if i < 31 else -(1 << 31) for i in range(32)]


def mask_words(vocab: int) -> int:
    """The int32 words of one row's bitmask: ceil(V / 32)."""
    return -(-vocab // 32)


def neutral_inputs(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(process, bias_ids, bias, mask) of `rows` rows that ask nothing."""
    return (
        torch.tensor([NEUTRAL] * rows),
        torch.zeros(rows, BIAS_WIDTH, dtype=torch.long),
        torch.zeros(rows, BIAS_WIDTH),
        torch.full((rows, mask_words(vocab)), ALL_ALLOWED, dtype=torch.int32),
    )


def allowed_tokens(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, V] bool: token t allowed where bit t % 32 of word t // 32 is set."""
    return ~banned_tokens(mask, vocab)


def banned_tokens(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, V] bool: token t ruled out where bit t % 32 of word t // 32 is clear."""
    bits = torch.tensor(_BITS, dtype=torch.int32, device=mask.device)
    banned = ((mask[:, :, None] & bits) == 0).reshape(mask.shape[0], -1)
    return banned if banned.shape[1] == vocab else banned[:, :vocab]  # a whole-width slice is an alias op


def process(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    process_row: torch.Tensor,
    bias_ids: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_seen: torch.Tensor,
) -> torch.Tensor:
    """[R, V] fp32 raw logits -> the logits `pick` samples from (see the section's comment): -inf where
    the bitmask, a ban or min_p rules a token out. A row of neutral inputs comes back bit for bit."""
    vocab = logits.shape[-1]
    presence, frequency, repetition, min_p = process_row[:, :4].unbind(-1)
    x = logits.masked_fill(banned_tokens(mask, vocab), -math.inf)
    x = x.scatter_add(1, bias_ids, bias)
    generated = (output_counts >= 1).float()  # the counts are whole numbers
    seen = (prompt_seen + generated) >= 1
    # vLLM divides a positive logit and multiplies a negative one; 0 is 0 either way
    x = torch.where(seen, torch.where(x >= 0, x / repetition[:, None], x * repetition[:, None]), x)
    x = x - frequency[:, None] * output_counts - presence[:, None] * generated
    # min_p: a token whose probability at the row's temperature is below min_p times the most likely one's
    scale = torch.where(temperature < GREEDY_BELOW, torch.ones_like(temperature), temperature)
    top = x.amax(-1, keepdim=True)
    return x.masked_fill(x < top + (scale * min_p.log())[:, None], -math.inf)


def count_tokens(
    output_counts: torch.Tensor, prompt_seen: torch.Tensor, fed: torch.Tensor, process_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's update of the rows' token counts ([R, V] each) by the fed tokens [R, 1]: rows
    flagged reset start from zero, then the fed token counts as an output or a prompt token as flagged."""
    keep = (process_row[:, 4:5] <= 0).float()
    output_counts = (output_counts * keep).scatter_add(1, fed, process_row[:, 6:7])
    prompt_seen = (prompt_seen * keep).scatter_add(1, fed, process_row[:, 5:6]).clamp(max=1)
    return output_counts, prompt_seen


def logprobs(logits: torch.Tensor, chosen: torch.Tensor, n: int = TOP_LOGPROBS):
    """[..., V] fp32 raw logits and [...] chosen ids -> (the chosen ids' logprobs [...], their ranks [...]
    int64, the n most likely ids [..., n] int64, their logprobs [..., n]): log_softmax of the model's own
    logits. A rank is the count of tokens at least as likely (1: the most likely; ties ranked alike, as
    vLLM counts), over the whole vocabulary. A chosen id of -1 (non-finite logits) reads id 0's."""
    logp = logits - logits.logsumexp(-1, keepdim=True)
    top, ids = logp.topk(min(n, logits.shape[-1]), dim=-1)
    picked = logp.gather(-1, chosen.clamp(min=0)[..., None])
    return picked[..., 0], (logp >= picked).sum(-1), ids, top


@dataclass(frozen=True)
class Processing:
    """What a request asks of the logits beyond temperature/top-k/top-p (neutral defaults: nothing)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), at most BIAS_WIDTH with the bans
    logprobs: int | None = None  # the chosen token's logprob and this many top ones per token (None: none)
    prompt_logprobs: int | None = None  # the same for each prompt token (echo), from the variant prefill

    @property
    def asks(self) -> bool:
        return self != NOTHING

    def values(self) -> tuple[float, float, float, float]:
        """The first four columns of the row's `process` input."""
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.min_p)


NOTHING = Processing()


def process_host(
    logits: torch.Tensor,
    temperature: float,
    processing: Processing,
    prompt: list[int],
    output: list[int],
    banned: tuple[int, ...] = (),
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The host's reference of `process` for one row ([V] fp32 logits -> processed [V]), written from the
    request's own token lists, entry by entry: what `engine.sample` runs for a request served alone
    (`--backend hf`), and what the tests hold the graphs to."""
    x = logits.float().clone()
    vocab = x.shape[0]
    if allowed is not None:
        x[~allowed_tokens(allowed[None].to(torch.int32), vocab)[0]] = -math.inf
    for token, value in processing.logit_bias:
        x[token] = x[token] + torch.tensor(value, dtype=torch.float32)
    for token in banned:
        x[token] = -math.inf
    counts: dict[int, int] = {}
    for token in output:
        counts[token] = counts.get(token, 0) + 1
    repetition = torch.tensor(processing.repetition_penalty, dtype=torch.float32)
    for token in set(prompt) | set(counts):
        x[token] = x[token] / repetition if x[token] > 0 else x[token] * repetition
    frequency = torch.tensor(processing.frequency_penalty, dtype=torch.float32)
    presence = torch.tensor(processing.presence_penalty, dtype=torch.float32)
    for token, count in counts.items():
        x[token] = x[token] - frequency * torch.tensor(float(count)) - presence
    if processing.min_p > 0:
        scale = temperature if temperature >= GREEDY_BELOW else 1.0
        floor = x.max() + torch.tensor(scale, dtype=torch.float32) * torch.tensor(processing.min_p).log()
        x[x < floor] = -math.inf
    return x
