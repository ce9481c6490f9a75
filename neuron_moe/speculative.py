"""Speculative decoding as vLLM offers it: its `--speculative-config` JSON, the prompt-lookup proposer,
and the verify step's acceptance rule, which keeps the target's distribution.

Two methods, with vLLM's names and defaults (vLLM's `vllm/config/speculative.py`):

    {"model": NAME|PATH, "num_speculative_tokens": k}      Gemma-4's own assistant (a multi-token-
        prediction drafter reading the target's KV); vLLM detects its `gemma4_assistant` config as
        method "mtp", so that is the method here, given or not; k defaults to 1 (vLLM: the draft's
        n_predict, which it sets to 1 for Gemma-4's assistant)
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}
        prompt lookup, no model: k required; neither bound given, both are 5; one given, the other
        is the same

A drafted token is checked by the target's verify step (`static/decoder.Verify`), which keeps the
drafts `accepted_drafts` chooses: for greedy rows exactly the target's argmax tokens, for sampled rows
rejection sampling (Leviathan et al. 2023, vLLM's rejection sampler), so the tokens follow the
target's distribution. It is a pure function of its inputs at static shapes, so the graph calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import UserError
from .report import loads_json

FLAG = "--speculative-config"
MAX_SPECULATIVE_TOKENS = 16  # drafts per step: the verify graph's k + 1 positions stay a handful
NGRAM_DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
MTP_DEFAULT_TOKENS = 1  # vLLM's num_speculative_tokens for Gemma-4's assistant when not given (its n_predict)
METHODS = ("mtp", "ngram")
KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def _error(message: str) -> UserError:
    """The flag's error: one line (a library's message may span several)."""
    return UserError(f"{FLAG}: {' '.join(message.split())}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """One run's speculative decoding, resolved: the method, k drafts per step, and the method's own
    settings (the assistant's `model` for mtp; the lookup bounds for ngram, None otherwise)."""

    method: str  # one of METHODS
    num_speculative_tokens: int  # k, in 1..MAX_SPECULATIVE_TOKENS
    model: str | None = None  # mtp: the assistant, a built-in name or a directory
    prompt_lookup_max: int | None = None  # ngram: the longest n-gram matched
    prompt_lookup_min: int | None = None  # ngram: the shortest

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """`--speculative-config`'s JSON text, parsed and checked: one `UserError` line naming the key
        for bad JSON, an unknown key, a wrong type, k outside 1..16, an unknown method, a setting of
        the other method, or prompt_lookup_min > prompt_lookup_max."""
        try:
            raw = loads_json(text)
        except ValueError as e:
            raise _error(f"not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise _error(f"expected a JSON object, got {text.strip()!r}")
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise _error(f"unknown key {unknown[0]!r} (the keys: {', '.join(KEYS)})")
        given = {key: value for key, value in raw.items() if value is not None}  # null: not given, as vLLM
        for key in ("method", "model"):
            if key in given and not isinstance(given[key], str):
                raise _error(f"{key} must be a string, got {given[key]!r}")
        if given.get("model") == "":
            raise _error("model must not be empty")
        for key in KEYS[2:]:
            if key in given and (not isinstance(given[key], int) or isinstance(given[key], bool)):
                raise _error(f"{key} must be an integer, got {given[key]!r}")
        method = _method(given)
        k = given.get("num_speculative_tokens", MTP_DEFAULT_TOKENS if method == "mtp" else None)
        if k is None:
            raise _error("num_speculative_tokens is required with method 'ngram'")
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise _error(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
        if method == "mtp":
            lookup = [key for key in KEYS[3:] if key in given]
            if lookup:
                raise _error(f"{lookup[0]} is a setting of method 'ngram', not of an assistant model")
            return cls("mtp", k, model=given["model"])
        if "model" in given and given["model"] not in ("ngram", "[ngram]"):
            raise _error(f"model {given['model']!r} is not used by method 'ngram' (prompt lookup has no model)")
        high, low = _lookups(given)
        return cls("ngram", k, prompt_lookup_max=high, prompt_lookup_min=low)


def _method(given: dict) -> str:
    """The method, as vLLM infers it: given, else 'ngram' for the model names "ngram" and "[ngram]",
    else 'mtp' with a model (vLLM reads the model's config; Gemma-4's assistant is 'mtp')."""
    method = given.get("method")
    model = given.get("model")
    if method is None:
        if model is None:
            raise _error("give 'model' (an assistant) or 'method': 'ngram' (prompt lookup)")
        return "ngram" if model in ("ngram", "[ngram]") else "mtp"
    if method == "[ngram]":
        return "ngram"
    if method not in METHODS:
        raise _error(f"method {method!r} is not supported (supported: {', '.join(METHODS)})")
    if method == "mtp" and model is None:
        raise _error("method 'mtp' needs 'model': Gemma-4's assistant is a checkpoint of its own")
    return method


def _lookups(given: dict) -> tuple[int, int]:
    """(prompt_lookup_max, prompt_lookup_min), checked: each at least 1, min <= max; one absent, the
    other's value (vLLM), both absent 5."""
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        if given.get(key, 1) < 1:
            raise _error(f"{key} must be at least 1, got {given[key]}")
    low = given.get("prompt_lookup_min", given.get("prompt_lookup_max", NGRAM_DEFAULT_LOOKUP))
    high = given.get("prompt_lookup_max", low)
    if low > high:
        raise _error(f"prompt_lookup_min ({low}) must be at most prompt_lookup_max ({high})")
    return high, low


# ---- the assistant: where it is, and whether it fits the target ----


# ---- prompt lookup ----


def ngram_propose(context, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k drafted tokens by prompt lookup, vLLM's NgramProposer: the longest n-gram, n in
    [lookup_min, lookup_max], that ends the context and also occurs earlier in it (the occurrence may
    overlap the suffix, but not be it); of several occurrences of that length, the EARLIEST (vLLM's
    rule); the draft is the tokens that followed it, at most k and at most to the context's end. []
    when no n-gram of lookup_min tokens recurs. The caller caps k by the room left in the cache (vLLM:
    max_model_len - len(context)).

    `context`: token ids, a list or an int64 array (taken as it is: an engine passes a view of a
    row's tokens). The search is `bytes.find` over the tokens' bytes (a match counts only at a token's
    boundary), n rising from lookup_min while the suffix recurs (an n-gram recurs only if its own
    suffix does): a few calls in C a step, where an engine runs it between two graph calls."""
    tokens = np.asarray(context, dtype=np.int64)
    ends = len(tokens) - 1  # an earlier occurrence ends at 0 .. len - 2
    longest = min(lookup_max, ends)
    if k < 1 or longest < lookup_min:
        return []
    data, width = tokens.tobytes(), tokens.itemsize
    found = None  # (the earliest occurrence's first token, n) of the longest n so far
    for n in range(lookup_min, longest + 1):
        at = _earliest(data, data[(ends + 1 - n) * width :], width, ends * width)
        if at < 0:
            break
        found = (at // width, n)
    if found is None:
        return []
    start = found[0] + found[1]
    return tokens[start : start + k].tolist()


def _earliest(data: bytes, pattern: bytes, width: int, end: int) -> int:
    """The first offset, a multiple of `width`, at which `pattern` occurs within data[:end]; -1 if none."""
    at = data.find(pattern, 0, end)
    while at > 0 and at % width:
        at = data.find(pattern, at + 1, end)
    return at


# ---- verification: which drafts a verify step keeps ----


def accepted_drafts(fed_and_drafts: torch.Tensor, tokens: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """The drafts a verify step keeps, at static shapes (the verify graph calls it: `static/decoder.Verify`).

    fed_and_drafts [B, q]: each row's fed token then its drafts, `drafted` [B] of them (the rest pads);
    tokens [B, q]: the target's token at each column, the one the decode graph would pick after the
    row's input up to that column (`static/sampling.pick`) -> accepted [B] int64: the leading drafts
    equal to the target's token before them, never a pad. The row keeps tokens[:, :accepted + 1].

    Greedy rows: exactly greedy decoding's tokens. Sampled rows: rejection sampling (Leviathan et al.
    2023; vLLM's rejection sampler) against a deterministic draft (prompt lookup, an assistant's
    argmax), in its coupled form: the draft d is kept with probability p(d), the chance that the
    target's own draw is d, and on a miss the token is that draw, which given it is not d follows
    max(0, p - onehot(d)), renormalised: the residual the rejection sampler draws from. So every
    row's tokens follow the target's distribution as `pick` processes it (temperature, top-k, top-p).
    """
    column = torch.arange(tokens.shape[1] - 1, device=tokens.device)[None]
    missed = ((fed_and_drafts[:, 1:] != tokens[:, :-1]) | (column >= drafted[:, None])).long()
    return (missed.cumsum(-1) == 0).sum(-1)  # the drafts before the first miss
