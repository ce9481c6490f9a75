"""How a request is decoded: what it asks (`SamplingParams`), how the tokens its generation takes become
its text (`Output`: a Step per token), and how its Steps become the response's choices.

`Output` is one request's side of generation: sampling (greedy at temperature 0, else
temperature, top-k and top-p from a per-request seeded generator's draws: `static/sampling.py`,
which the runtime runs, in its graphs or on the host), the tokens the next one must not be
(EOS and stop_token_ids until min_tokens), EOS (unless ignore_eos), stop_token_ids, stop sequences
and max_tokens, and the text that is safe to send after each token (a partial stop string or a partial UTF-8
character is held back until it resolves): an id side that decides from the tokens (`take`) and
a text side (`text`), which the engine (`engine.py`) runs beside its runtime's calls.

Above the engine, a request's fields become its generations' SamplingParams (checked against the
engine, its grammar compiled, choice i seeded with seed + i), n and best_of (the generations run, the
most likely answered), the tokens' logprobs and the prompt's in OpenAI's and vLLM's shapes, and vLLM's
beam search. Plain functions and classes over an Engine (`engine.py`) and a parsed request
(`protocol.py`): the HTTP layer (`app.py`) admits the generations, streams or collects their Steps,
and frames the answer; a request the engine cannot serve is an APIError naming the client's field.
"""

from __future__ import annotations

import asyncio
import codecs
import math
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import torch

from ..errors import UserError
from ..static.sampling import GREEDY, GREEDY_BELOW, NOTHING, Processing, mask_words, sampling_row
from .grammar import GrammarError, GrammarSpec, Matcher
from .protocol import APIError

DRAWS = 64  # a sampled request's uniforms drawn at a time (fewer if its max_tokens needs fewer)


class RequestError(UserError):
    """A request the engine cannot serve as asked; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class GenerationError(RuntimeError):
    """The model failed a request mid-way (a server fault: answered 500 or an error event)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    processing: Processing = NOTHING  # logprobs, penalties, logit_bias, min_p (`static/sampling.py`)
    # vLLM's: EOS generated and fed on like any token; generation ends at any of these tokens;
    # no EOS or stop token chosen, and no stop string ending, before this many tokens; the stop
    # string or token kept in the text; the chosen tokens' logprobs summed (best_of's ranking)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    rank: bool = False
    grammar: GrammarSpec | None = None  # structured output: what the text must match (grammar.py)
    # vLLM's: the only tokens that may be chosen (None: any); words whose tokens must not be generated
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's logprob under the model's own distribution, and the most likely tokens' (as many as
    asked, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    # the token's rank in the distribution (1: the most likely; vLLM's, ties ranked alike)
    rank: int


@dataclass(frozen=True)
class Step:
    text: str  # new text since the previous step; "" while text is held back
    finish_reason: str | None  # "stop" | "length" on the last step, else None
    completion_tokens: int  # tokens generated so far (an EOS counts)
    logprobs: TokenLogprobs | None = None  # this step's token's, when the request asked for logprobs
    # the first step of a request that asked for prompt logprobs (echo): one per prompt token, None first
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (EOS: None)
    cumulative_logprob: float | None = None  # the chosen tokens' logprobs summed so far (params.rank), else None


def token_logprobs(token: int, chosen: float, rank: int, top_ids, top, n: int) -> TokenLogprobs:
    """A TokenLogprobs from a graph's (or the host's) scores (`sampling.logprobs`), the first `n` of the
    top ones kept."""
    return TokenLogprobs(token, float(chosen), tuple(zip(top_ids.tolist()[:n], top.tolist()[:n])), int(rank))


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters must wait: an incomplete character at the end (decoders show a
    partial UTF-8 sequence as U+FFFD), and before it a suffix that may grow into a stop string —
    the stop may go on in that very character, so what precedes it waits with it."""
    body = text.rstrip("\ufffd")
    n = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(body)), n, -1):
            if body.endswith(stop[:k]):
                n = k
                break
    return n + len(text) - len(body)


class Output:
    """One request's output: the token it takes from each step, and the text a client is sent.

    Two sides, so that a batch's step loop can run them on two threads (`engine.Engine`):

    - the id side, `take(token, scores)`: the token the runtime chose (with its scores, from the
      logits-processing variants, for a request that asks for them) joins the output, and the ids decide
      at once whether it is the last: EOS ("stop") or max_tokens ("length"); a token of -1 (the
      graphs' answer to non-finite logits) raises GenerationError. It returns that finish reason
      (None: go on). `sampling()` belongs to this side too: the request's row of the graphs'
      `sampling` input for its next token (its temperature, top-k, top-p and a uniform from its own
      seeded generator, drawn in order a block at a time, so a seeded request samples the same
      whatever runs beside it). State a next step depends on (what the next token may be) lives
      here;
    - the text side, `text(count, finish)`: the Step of the count-th token, whose id side said
      `finish`. Its text is what is safe to send: a partial stop string or a partial UTF-8
      character is held back until it resolves, and a stop string ends the output there ("stop",
      nothing of the stop sent). It runs the tokens' text incrementally (a window of the last
      tokens is decoded, vLLM's and TGI's way, not the whole output), and the texts are those of
      decoding the whole output after each token, for any tokenizer whose decode of a longer
      sequence begins with its decode of a shorter one at a complete character.

    The text side may run behind the id side (it reads the tokens the id side has appended); it
    takes the tokens in order, each once. An id-side "stop" token (EOS, a stop token) is no part of the
    text, unless include_stop_str_in_output keeps it.
    `next(token, scores)` is both at once, for a caller that wants the Step at once.

    A request with a grammar (`matcher`, grammar.py) has `allowed()`, the next token's bitmask,
    which the runtime applies to the logits before it samples (an input of its variants); the
    chosen token advances the matcher, and once the grammar takes nothing more the request ends
    ("stop"). `allowed()` is None for a request without one.
    """

    def __init__(
        self,
        tokenizer,
        eos_ids: frozenset[int],
        params: SamplingParams,
        prompt: list[int] = (),
        matcher: Matcher | None = None,
        allowed: torch.Tensor | None = None,
        bad_words: tuple[tuple[int, ...], ...] = (),
    ):
        self.tokenizer, self.eos_ids, self.params, self.matcher = tokenizer, eos_ids, params, matcher
        self._allowed = allowed  # allowed_token_ids as a bitmask (`allowed_mask`), or None
        self._bad_words = bad_words  # bad_words' token sequences (`bad_word_ids`)
        self.prompt = list(prompt)
        self.generated: list[int] = []  # every token generated (an EOS too): what the penalties count
        self.scores: list[TokenLogprobs | None] = []  # each generated token's logprobs, when asked
        # the prompt's logprobs while they arrive (the first token has none), handed out with the first Step
        self._prompt_logprobs = None if params.processing.prompt_logprobs is None else [None]
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self._draws: list[float] = []  # uniforms drawn ahead, next one last
        self._drawn = 0
        # the id side
        self.tokens: list[int] = []  # the generated tokens, a stop token (EOS) not among them unless kept
        self.count = 0  # tokens generated (an EOS counts)
        self.token: int | None = None  # the latest token, which the runtime is fed next
        self.stop_token: int | None = None  # a stop_token_ids token that ended it (vLLM's stop_reason)
        self._kept = False  # whether the token that ended it is in `tokens` (include_stop_str_in_output, a grammar)
        self._banned = ends(params, eos_ids)  # banned before min_tokens
        self._bans = bool(self._banned and params.min_tokens)
        # the chosen tokens' logprobs (the model's own) summed after each token, for best_of's ranking
        self._cumulative: list[float] | None = [] if params.rank else None
        # the text side: the text of tokens[:_read] is _text (final); _window is the text of
        # tokens[_prefix:_read], the decode window's start, whose text a new token's is told from
        self._text, self._window, self._prefix, self._read = "", "", 0, 0
        self._searched = 0  # characters of the text looked through for stop strings
        self._stop_from = 0  # characters before which no stop string may end (the first min_tokens tokens' text)
        self._longest = max(map(len, params.stop), default=0)
        self.sent = 0  # characters of the text already handed out

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW

    @property
    def asks(self) -> bool:
        """Whether this request runs in the logits-processing graphs (`static/rows.py`): it asks for
        logprobs, penalties, logit_bias or min_p, bans (min_tokens: `banned()`), each token's logprob
        (best_of's ranking), or a grammar (`allowed()`)."""
        params = self.params
        return (
            params.processing.asks
            or self._bans
            or params.rank
            or self.matcher is not None
            or self._allowed is not None
            or bool(self._bad_words)
        )

    def banned(self) -> tuple[int, ...]:
        """The token ids the next token must not be: EOS (unless ignore_eos) and stop_token_ids while
        fewer than min_tokens have been generated (vLLM's min_tokens), and bad_words' (vLLM's): the
        last token of each of their token sequences whose tokens before it were the last generated
        (a one-token word's, always)."""
        banned = list(self._banned) if self.count < self.params.min_tokens else []
        generated = self.generated
        for sequence in self._bad_words:
            before = len(sequence) - 1
            if before == 0 or (before <= len(generated) and tuple(generated[-before:]) == sequence[:-1]):
                banned.append(sequence[-1])
        return tuple(dict.fromkeys(banned))

    def allowed(self) -> torch.Tensor | None:
        """The bitmask for the next token (int32 [ceil(V/32)], bit t % 32 of word t // 32 set = token t
        allowed: grammar.py): the grammar's, and allowed_token_ids' (both: the tokens both allow), or
        None: neither."""
        grammar = None if self.matcher is None else self.matcher.allowed()
        if self._allowed is None:
            return grammar
        return self._allowed if grammar is None else grammar & self._allowed

    def processing(self) -> tuple[tuple[float, float, float, float], list[tuple[int, float]], torch.Tensor | None]:
        """This request's row of the logits-processing graphs' inputs for its next token (`static/rows.py`):
        its penalties and min_p, its logit_bias entries then its bans (-inf), its bitmask."""
        processing = self.params.processing
        entries = [*processing.logit_bias, *((token, -float("inf")) for token in self.banned())]
        return processing.values(), entries, self.allowed()

    def prompt_scores(self, start: int, chosen, ranks, top_ids, top) -> None:
        """The scores of prompt tokens start+1 .. start+len(chosen), from a prefill chunk (`static/rows.py`)."""
        n = self.params.processing.prompt_logprobs
        if n is None:
            return
        for i in range(len(chosen)):
            token = self.prompt[start + 1 + i]
            self._prompt_logprobs.append(token_logprobs(token, chosen[i], ranks[i], top_ids[i], top[i], n))

    def sampling(self) -> tuple[float, float, float, float]:
        """The next token's sampling row; a sampled request takes its next uniform here, once per
        token (the generator's draws in order: a block of them is one call's worth of the same)."""
        if self.greedy:
            return GREEDY
        if not self._draws:
            n = min(DRAWS, max(1, self.params.max_tokens - self._drawn))
            self._draws = torch.rand(n, generator=self.generator).tolist()[::-1]
            self._drawn += n
        params = self.params
        return sampling_row(params.temperature, params.top_k, params.top_p, self._draws.pop())

    def take(self, token: int, scores=None) -> str | None:
        """The id side of the next token: `token` as the runtime chose it (with its `scores`, (logprob,
        rank, top ids, top logprobs), from the logits-processing variants); it joins the output -> its
        finish reason from the ids ("stop": EOS unless ignore_eos, or a stop token; "length":
        max_tokens), or None."""
        if token < 0:  # the graphs' answer to non-finite logits; a token is never picked from NaNs
            raise GenerationError(f"the model produced non-finite logits (NaN or inf) at step {self.count}")
        self._check_allowed(token)
        try:
            allowed = self.matcher is None or self.matcher.advance(token)
        except GrammarError as e:  # the grammar admits no output here, or passed a limit: the client's
            raise RequestError(f"{e} (at token {self.count + 1})", e.field) from None
        if not allowed:
            raise GenerationError(f"token {token} at step {self.count} is not one the grammar allows")
        self.token, self.count = token, self.count + 1
        self.generated.append(token)
        n = self.params.processing.logprobs
        if n is not None:  # the count-th token's, for its Step (the text side may run behind)
            self.scores.append(None if scores is None else token_logprobs(token, *scores, n))
        if self._cumulative is not None:  # the token's logprob under the model's own distribution
            before = self._cumulative[-1] if self._cumulative else 0.0
            self._cumulative.append(before + (float(scores[0]) if scores is not None else math.nan))
        params = self.params
        eos = token in self.eos_ids and not params.ignore_eos
        if eos or token in params.stop_token_ids:
            self.stop_token = None if eos else token
            if params.include_stop_str_in_output:
                self.tokens.append(token)
                self._kept = True
            return "stop"
        self.tokens.append(token)
        if self.matcher is not None and self.matcher.stopped:  # the grammar is complete: nothing may follow
            self._kept = True  # the token is the grammar's last, part of the text
            return "stop"
        return "length" if self.count == self.params.max_tokens else None

    def _check_allowed(self, token: int) -> None:
        """A RequestError naming the field when allowed_token_ids and bad_words (and a grammar) left the
        token no choice: a token they rule out is chosen only when every token was ruled out."""
        if self._allowed is None and not self._bad_words:
            return
        mask = self.allowed()
        if (mask is None or int(mask[token // 32]) >> (token % 32) & 1) and token not in self.banned():
            return
        field = "allowed_token_ids" if self._allowed is not None else "bad_words"
        raise RequestError(
            f"{field}: at token {self.count + 1} no token is left to choose: allowed_token_ids, bad_words and the "
            "structured output (where given) rule out every one",
            field,
        )

    def text(self, count: int, finish: str | None) -> Step:
        """The Step of the count-th token, whose id side said `finish`: its new text, and its
        finish reason (a stop string's, if one ends the output here)."""
        params, sent = self.params, self.sent
        pending = self._advance(count - 1 if finish == "stop" and not self._kept else count)
        # Only the text's tail is looked at: stop strings were looked for up to `_searched`, so a new
        # one ends past `_searched` - (longest - 1), and what is held back is at most a stop's length
        # and the incomplete character; `sent` is at most that far back.
        start = max(0, self._searched - self._longest + 1)
        base = min(sent, start, len(self._text))
        recent = self._text[base:] + pending  # the text from `base` on
        # stops are looked for in the complete characters alone: a trailing U+FFFD may be the start of a
        # character still arriving (a stop of U+FFFD would cut it), and it is looked at once it is whole.
        # An output the ids ended (a grammar's last token, a kept stop token) is still cut at a stop
        # string in its last token's text, as vLLM cuts it, the stop string its stop_reason.
        complete = recent.rstrip("\ufffd")
        self._searched = base + len(complete)
        if count <= params.min_tokens:  # vLLM's: no stop string ends within the first min_tokens tokens' text
            self._stop_from = self._searched
        else:
            froms = [max(start, self._stop_from - len(s) + 1) - base for s in params.stop]
            found = [(j, s) for s, f in zip(params.stop, froms) if (j := complete.find(s, f)) >= 0]
            if found:
                cut, stop = min(found)
                end = cut + len(stop) if params.include_stop_str_in_output else cut
                return self._step(recent[sent - base : end], "stop", count, stop)
        if finish == "stop":
            return self._step(recent[sent - base :], "stop", count, self.stop_token)
        if finish == "length":
            return self._step(recent[sent - base :], "length", count)
        safe = base + len(recent) - held_back(recent, () if params.include_stop_str_in_output else params.stop)
        self.sent = max(sent, safe)
        return self._step(recent[sent - base : safe - base], None, count)

    def _step(self, text: str, finish: str | None, count: int, stop_reason: int | str | None = None) -> Step:
        """The count-th token's Step, with its logprobs (and, the first, the prompt's) where asked, the
        stop string or token that ended it, and its tokens' logprobs summed (best_of)."""
        extra = {"stop_reason": stop_reason}
        if self._cumulative is not None and count <= len(self._cumulative):
            extra["cumulative_logprob"] = self._cumulative[count - 1]
        if self.params.processing.logprobs is not None and count <= len(self.scores):
            extra["logprobs"] = self.scores[count - 1]
        if count == 1 and self._prompt_logprobs is not None:
            extra["prompt_logprobs"] = tuple(self._prompt_logprobs)
        return Step(text, finish, count, **extra)

    def next(self, token: int, scores=None) -> Step:
        """Both sides of the next token at once -> its Step."""
        finish = self.take(token, scores)
        return self.text(self.count, finish)

    def _advance(self, n: int) -> str:
        """The text side takes tokens[:n] -> the text past `_text` (what is not final yet: a
        character still arriving, or nothing)."""
        if n <= self._read:
            return ""
        decode, tokens = self.tokenizer.decode, self.tokens
        whole = decode(tokens[self._prefix : n])
        new = whole[len(self._window) :]
        if not new or whole.endswith("\ufffd"):  # nothing yet, or a character still arriving
            return new
        self._text += new
        self._prefix, self._read = self._read, n
        self._window = decode(tokens[self._prefix : n])
        return ""


def ends(params: SamplingParams, eos_ids) -> tuple[int, ...]:
    """The tokens that end a request, sorted: EOS (unless ignore_eos) and its stop_token_ids."""
    return tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))))


def eos_ids(tokenizer, config) -> set[int]:
    """The tokens that end a generation: the tokenizer's EOS and the model config's."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return {i for i in ids if i is not None}


def bad_word_ids(tokenizer, words: tuple[str, ...], vocab: int | None = None) -> tuple[tuple[int, ...], ...]:
    """bad_words as token sequences, vLLM's way: each word (its leading spaces stripped) tokenized as it
    is and after a space (a word at the start of the text and within it), the spaced one kept when it
    starts with another token and does not merely put space tokens before the plain one (which bans it
    already). vLLM keeps it only when it is as long, too, and so misses a word whose spaced form is a
    token shorter (" Paris" one token, "Paris" two): banned here. A RequestError for a word of no token
    or beyond `vocab`."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise RequestError(f"bad_words: {word!r} tokenizes to no token", "bad_words")
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and spaced[-len(plain) :] != plain:
            sequences.append(spaced)
    bad = next((t for s in sequences for t in s if vocab is not None and t >= vocab), None)
    if bad is not None:
        raise RequestError(f"bad_words: token {bad} is not below the vocabulary size {vocab}", "bad_words")
    return tuple(sequences)


def allowed_mask(ids: tuple[int, ...], vocab: int) -> torch.Tensor:
    """allowed_token_ids as a bitmask (int32 [ceil(V/32)], bit t % 32 of word t // 32 set = token t
    allowed: the layout of `Output.allowed`)."""
    bits = torch.zeros(mask_words(vocab) * 32, dtype=torch.bool)
    bits[list(ids)] = True
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (bits.view(-1, 32).long() * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ---- a request's fields into engine calls, its Steps into choices ----------------------------------


@dataclass(frozen=True)
class Echo:
    """What goes back before each choice's text (`echo`): a completion's prompt (its text and ids, whose
    logprobs come with the choice's first Step when asked), or chat's last assistant turn (no ids)."""

    text: str
    ids: list[int]


def refused(e: RequestError, chat: bool, max_tokens_field: str = "max_tokens") -> APIError:
    """The 400 for what the engine cannot serve, naming the field as the client sent it (chat's prompt
    is its `messages`)."""
    where = {"prompt": "messages" if chat else "prompt", "max_tokens": max_tokens_field}
    return APIError(400, str(e), param=where.get(e.param, e.param))


async def sampling_params(engine, req, n_prompt: int, extra_stops: tuple, chat: bool) -> SamplingParams:
    """The SamplingParams of the request's generations (before `seeded`), checked against the engine,
    its grammar compiled (or found in the cache) off the event loop; a 400 naming the field it cannot serve."""
    try:
        max_tokens = engine.max_tokens_for(n_prompt, req.requested_max_tokens)
        params = SamplingParams(
            max_tokens,
            **req.sampling,
            **req.stopping,
            stop=tuple(req.stop or ()) + extra_stops,
            processing=req.asked_processing,
            rank=req.candidates > req.choices,
            grammar=req.grammar,
            **req.vocabulary,
        )
        engine.check_sampling(params)
        if params.grammar is not None:
            await asyncio.to_thread(engine.compile_grammar, params)
    except RequestError as e:
        raise refused(e, chat, "max_completion_tokens" if req.max_completion_tokens else "max_tokens") from None
    return params


def check_runs(req, running: int, queued: int) -> None:
    """A 400 when the request asks for more generations (n, or best_of) than the server runs and queues."""
    runs, most = req.candidates, running + queued
    if runs > most:
        name = "best_of" if runs > req.choices else "n"
        raise APIError(
            400,
            f"{name}={runs}: this server runs {running} generation(s) and queues {queued}, so a request may "
            f"ask for at most {most}",
            param=name,
        )


def seeded(params: SamplingParams, runs: int) -> list[SamplingParams]:
    """One SamplingParams per generation, generation i seeded with seed + i (as vLLM seeds them)."""
    return [replace(params, seed=None if params.seed is None else params.seed + i) for i in range(runs)]


def choice(
    chat: bool,
    stream: bool,
    text: str | None,
    finish: str | None,
    role: bool = False,
    index: int = 0,
    stop_reason: int | str | None = None,
    logprobs: dict | None = None,
) -> dict:
    """One choice of a response or a chunk; `stop_reason` is vLLM's (the stop string or stop token id
    that ended it, null for EOS and length)."""
    tail = {"logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}
    if not chat:
        return {"index": index, "text": text or "", **tail}
    if not stream:
        return {"index": index, "message": {"role": "assistant", "content": text}, **tail}
    delta = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    return {"index": index, "delta": delta, **tail}


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Logprobs:
    """A choice's tokens' logprobs in OpenAI's shapes: chat's `{"content": [{token, logprob, bytes,
    top_logprobs}]}`, completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (the chosen
    token among its top ones, as vLLM's; a prompt's first token, with echo, has none: null). Made
    for the whole answer or a stream's chunk at a time (`text_offset` runs on across chunks).

    A token's `bytes` are its own (`tokenizer.token_bytes`), also for a token that holds part of a
    character, whose `token` text is U+FFFD: OpenAI's, so that a client joins a character's tokens.
    `text_offset` is where the token begins in the returned text, in characters: the characters its
    tokens' bytes complete before it (a token that begins inside a character: that character's)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # characters of the text before the next token
        self._characters = codecs.getincrementaldecoder("utf-8")("replace")  # the tokens' bytes into characters

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def __call__(self, entries: list[tuple[int, TokenLogprobs | None]]) -> dict | None:
        """[(token id, its logprobs or None)] -> the logprobs object of those tokens."""
        if self.chat:
            return {"content": [self._chat(entry) for _, entry in entries]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in entries:
            text = self.text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            top = None if entry is None else {self.text(t): lp for t, lp in entry.top}
            if top is not None:
                top.setdefault(text, entry.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(self._characters.decode(self.tokenizer.token_bytes(token)))
        return out

    def _chat(self, entry: TokenLogprobs) -> dict:
        def one(token: int, logprob: float) -> dict:
            return {"token": self.text(token), "logprob": logprob, "bytes": list(self.tokenizer.token_bytes(token))}

        return {**one(entry.token, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}


def logprobs_for(tokenizer, params: SamplingParams, chat: bool, runs: int) -> list[Logprobs] | None:
    """Each generation's own Logprobs (text_offset runs on per choice); None when none were asked."""
    if params.processing.logprobs is None:
        return None
    return [Logprobs(tokenizer, chat) for _ in range(runs)]


def prompt_entries(prompt_ids: list[int], item: Step, n: int | None = None) -> list:
    """A first Step's prompt logprobs (echo) as (token, logprobs) entries, the `n` most likely kept (None:
    all); [] when it has none."""
    if item.prompt_logprobs is None:
        return []
    kept = [e if e is None or n is None else replace(e, top=e.top[:n]) for e in item.prompt_logprobs]
    return list(zip(prompt_ids, kept))


def step_entries(item: Step) -> list:
    return [(item.logprobs.token, item.logprobs)] if item.logprobs is not None else []


def vllm_prompt_logprobs(tokenizer, scores: tuple | None, n: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}, the prompt's token first, then the n most likely (rank: the token's in the
    distribution, 1 the most likely)."""
    if scores is None:
        return None

    def one(logprob: float, rank: int, token: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token])}

    out: list = []
    for entry in scores:
        if entry is None:
            out.append(None)
            continue
        position = {str(entry.token): one(entry.logprob, entry.rank, entry.token)}
        for i, (token, logprob) in enumerate(entry.top[:n]):
            position.setdefault(str(token), one(logprob, i + 1, token))
        out.append(position)
    return out


def stream_choices(
    chat: bool, index: int, item: Step, first: bool, echo: Echo | None, scores: Logprobs | None
) -> list[dict]:
    """A Step's choices in a stream, one chunk each: (the generation's first Step, with `echo`: its
    text, with the prompt's logprobs), the text delta with its token's logprobs (when it has either),
    the finish."""
    out = []
    if first and echo is not None and echo.text:
        prompt = scores and scores(prompt_entries(echo.ids, item))
        out.append(choice(chat, True, echo.text, None, index=index, logprobs=prompt))
    entries = scores(step_entries(item)) if scores is not None else None
    if item.text or entries:
        out.append(choice(chat, True, item.text, None, index=index, logprobs=entries))
    if item.finish_reason:
        end = None if chat else ""
        out.append(choice(chat, True, end, item.finish_reason, index=index, stop_reason=item.stop_reason))
    return out


@dataclass
class Result:
    """One generation's whole answer, its Steps added as they come."""

    finish: str | None = None
    stop_reason: int | str | None = None
    completion: int = 0
    logprob: float | None = None
    entries: list = field(default_factory=list)  # [(token, its logprobs)]: the prompt's (echo), then the choice's
    prompt_logprobs: tuple | None = None  # the first Step's: each prompt token's logprobs, None first
    parts: list[str] = field(default_factory=list)  # each Step's text

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, item: Step, echo: Echo | None = None, logprobs_n: int | None = None) -> None:
        """The generation's next Step; its first brings the prompt's logprobs (with `echo`, as entries:
        the `logprobs_n` most likely kept per prompt token)."""
        if not self.parts:
            self.prompt_logprobs = item.prompt_logprobs
            if echo is not None:
                self.entries += prompt_entries(echo.ids, item, logprobs_n)
        self.entries += step_entries(item)
        self.parts.append(item.text)
        self.finish, self.completion = item.finish_reason or self.finish, item.completion_tokens
        self.stop_reason, self.logprob = item.stop_reason, item.cumulative_logprob


def best(results: list[Result], n: int) -> list[int]:
    """Which n of best_of generations are answered: the most likely (the highest sum of their tokens'
    logprobs, vLLM's ranking), most likely first; all of them, in order, when there are only n."""
    order = range(len(results))
    return list(order) if len(results) == n else sorted(order, key=lambda i: results[i].logprob, reverse=True)[:n]


def answer(
    tokenizer, req, results: list[Result], chat: bool, echo: Echo | None, logprobs: list[Logprobs] | None, n_prompt: int
) -> dict:
    """A whole response's choices (the `req.choices` most likely generations, `echo` before each one's
    text, with their logprobs and vLLM's prompt_logprobs when asked) and its usage."""
    before = echo.text if echo is not None else ""
    prompt_n = req.answered_prompt_logprobs
    answered = []
    for i, j in enumerate(best(results, req.choices)):
        result = results[j]
        one = choice(
            chat,
            False,
            before + result.text,
            result.finish,
            index=i,
            stop_reason=result.stop_reason,
            logprobs=logprobs[j](result.entries) if logprobs is not None else None,
        )
        if prompt_n is not None and not chat:  # vLLM's: a completion choice's
            one["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, result.prompt_logprobs, prompt_n)
        answered.append(one)
    extra = {}
    if prompt_n is not None and chat:  # vLLM's: the chat response's, once (the prompt is the choices' own)
        extra["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, results[0].prompt_logprobs, prompt_n)
    # usage as OpenAI counts it: the prompt once, every generated token (best_of's candidates too)
    return {"choices": answered, "usage": usage(n_prompt, sum(r.completion for r in results)), **extra}


class BeamSearch:
    """vLLM's beam search, as vLLM runs it above its engine: each step, every live beam is a one-token
    request whose prompt is the beam's whole sequence, asking the 2·n most likely tokens' logprobs
    (the model's own); each beam goes on with each of those (and the token drawn), an EOS (unless
    ignore_eos) completing it; the n best by cumulative logprob / length^length_penalty (the length
    counting the prompt, not a final EOS: vLLM's score) live on. After max_tokens, the n best of the
    completed and the live are the choices. Every step prefills every beam again (a request that asks
    for logprobs takes no prefix from the prefix cache)."""

    def __init__(self, engine, req, n_prompt: int, chat: bool, running: int, queued: int):
        """The search a request asks for; a 400 when the engine or the server cannot run it."""
        self.width = req.choices
        try:
            self.max_tokens = engine.max_tokens_for(n_prompt, req.requested_max_tokens)
        except RequestError as e:
            raise refused(e, chat) from None
        if self.width > running + queued:
            raise APIError(400, f"n={self.width}: more beams than this server runs and queues", param="n")
        temperature = 1.0 if req.temperature is None else req.temperature
        self.penalty = 1.0 if req.length_penalty is None else req.length_penalty
        # each step's request for every beam
        self.params = SamplingParams(1, temperature=temperature, processing=Processing(logprobs=2 * self.width))
        try:
            engine.check_sampling(self.params)  # the logprobs it reads need the logits-processing graphs
        except RequestError as e:
            raise APIError(400, f"use_beam_search reads logprobs: {e}", param="use_beam_search") from None
        self.eos, self.keep_eos, self.ignore_eos = engine.eos_ids, bool(req.include_stop_str_in_output), req.ignore_eos

    def score(self, tokens: list[int], cumulative: float) -> float:
        """cumulative / length^penalty (≤ 0), worked out in logs so that no power overflows."""
        length = max(1, len(tokens) - (1 if tokens[-1] in self.eos else 0))
        if cumulative >= 0:
            return 0.0
        return -math.exp(min(700.0, math.log(-cumulative) - self.penalty * math.log(length)))

    async def run(
        self, prompt_ids: list[int], step: Callable[[list[list[int]]], Awaitable[list[Result] | None]]
    ) -> list[tuple[list[int], float, str]] | None:
        """The best beams (tokens, cumulative logprob, finish), best first; `step` runs one step of the
        beams' sequences (a Result each), None when the client left (then so does this)."""
        beams: list[tuple[list[int], float]] = [(list(prompt_ids), 0.0)]
        completed: list[tuple[list[int], float, str]] = []
        for _ in range(self.max_tokens):
            results = await step([tokens for tokens, _ in beams])
            if results is None:
                return None
            grown = []
            for (tokens, cumulative), result in zip(beams, results):
                entry = result.entries[-1][1]
                for token, logprob in dict([*entry.top, (entry.token, entry.logprob)]).items():
                    if token in self.eos and not self.ignore_eos:
                        ended = tokens + [token] if self.keep_eos else tokens
                        completed.append((ended, cumulative + logprob, "stop"))
                    else:
                        grown.append((tokens + [token], cumulative + logprob))
            beams = sorted(grown, key=lambda b: self.score(*b), reverse=True)[: self.width]
            if not beams:
                break
        completed += [(tokens, cumulative, "length") for tokens, cumulative in beams]
        return sorted(completed, key=lambda b: self.score(b[0], b[1]), reverse=True)[: self.width]

    @staticmethod
    async def choices(
        tokenizer, beams: list[tuple[list[int], float, str]], n_prompt: int, stops: tuple, chat: bool
    ) -> tuple[list[dict], list[int]]:
        """The beams' choices and each one's generated tokens. A chat template's own stop string
        (`stops`: the plain fallback's) cuts a choice's text, as it ends any other answer."""
        out, counts = [], []
        for i, (tokens, _, finish) in enumerate(beams):
            generated = tokens[n_prompt:]
            text = await asyncio.to_thread(tokenizer.decode, generated)
            cut = min((j for j in (text.find(stop) for stop in stops) if j >= 0), default=None)
            text, finish = (text, finish) if cut is None else (text[:cut], "stop")
            out.append(choice(chat, False, text, finish, index=i))
            counts.append(len(generated))
        return out, counts
