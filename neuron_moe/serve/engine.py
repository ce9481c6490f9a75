"""The serving engine: what a request may ask, and the tokens and text it gets back.

`Output` is one request's side of generation: sampling (greedy at temperature 0, else
temperature, top-k and top-p from a per-request seeded generator's draws: `static/sampling.py`,
which the runtime runs, in its graphs or on the host), the tokens the next one must not be
(EOS and stop_token_ids until min_tokens), EOS (unless ignore_eos), stop_token_ids, stop sequences
and max_tokens, and the text that is safe to send after each token (a partial stop string or a partial UTF-8
character is held back until it resolves): an id side that decides from the tokens (`take`) and
a text side (`text`), which the engine runs beside its runtime's calls. `Engine` is what the
engine asks of a request before it runs: the runtime's limits (its context, its candidate width, its
logits-processing variants), the grammar compiled, the request's `Output`. The engine itself is
`batching.BatchEngine`: one step loop (`static.rows.Rows.step`) over the rows of a runtime with Rows'
protocol, whichever runs the model: the static graphs on CPU (`static/runtime.py`), the compiled
artifact on Inferentia2 (`neuron.py`) or transformers' model (`hf_runtime.py`).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..static.sampling import BIAS_WIDTH, GREEDY, GREEDY_BELOW, NOTHING, Processing, mask_words, sampling_row
from .grammar import GrammarError, Grammars, GrammarSpec, Matcher

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

    Two sides, so that a batch's step loop can run them on two threads (`batching.BatchEngine`):

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


class Engine:
    """What a request may ask of a runtime (its limits, its sampling), checked before it runs, and its
    Output: the engine's side of admission (`batching.BatchEngine` runs the requests)."""

    def __init__(self, runtime, tokenizer, max_context: int, eos_ids: set[int]):
        self.runtime, self.tokenizer = runtime, tokenizer
        self.max_context = max_context  # prompt + generated tokens
        self.eos_ids = frozenset(eos_ids)
        # the most top_k the runtime samples from exactly (its graphs' candidate width; None: any)
        self.max_top_k: int | None = getattr(runtime, "candidates", None)
        # structured output's grammars, their bitmasks as wide as the runtime's logits (`vocab`; else the
        # tokenizer's vocabulary)
        self.grammars = Grammars(tokenizer, getattr(runtime, "vocab", None), self.eos_ids)

    @property
    def vocab(self) -> int | None:
        """The logits' width: the runtime's vocabulary, else the tokenizer's (None: unknown)."""
        runtime = getattr(self.runtime, "vocab", None) or getattr(self, "vocab_size", None)
        return runtime or self.grammars.vocab_size or getattr(self.tokenizer, "vocab_size", None)

    def check_sampling(self, params: SamplingParams) -> None:
        """A RequestError if the runtime cannot sample this request as asked."""
        if self.max_top_k is not None and params.top_k > self.max_top_k:
            raise RequestError(
                f"this backend's graphs sample among the {self.max_top_k} most likely tokens: top_k "
                f"must be at most {self.max_top_k} (or 0, off), got {params.top_k}",
                "top_k",
            )
        processing = params.processing
        if len(processing.logit_bias) > BIAS_WIDTH:
            raise RequestError(
                f"logit_bias: at most {BIAS_WIDTH} entries (the graphs' fixed width per row), got "
                f"{len(processing.logit_bias)}",
                "logit_bias",
            )
        vocab = self.vocab
        bad = next((t for t, _ in processing.logit_bias if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is not below the vocabulary size {vocab}", "logit_bias")
        if params.min_tokens > params.max_tokens:
            raise RequestError(
                f"min_tokens ({params.min_tokens}) must be at most max_tokens ({params.max_tokens})", "min_tokens"
            )
        banned = ends(params, self.eos_ids) if params.min_tokens else ()
        if len(processing.logit_bias) + len(banned) > BIAS_WIDTH:
            raise RequestError(
                f"stop_token_ids: with min_tokens, the ids banned until then (EOS and these: {len(banned)}) and "
                f"logit_bias ({len(processing.logit_bias)}) are at most {BIAS_WIDTH} (the graphs' fixed width per row)",
                "stop_token_ids",
            )
        if params.allowed_token_ids is not None:
            bad = next((t for t in params.allowed_token_ids if vocab is not None and t >= vocab), None)
            if bad is not None:
                raise RequestError(
                    f"allowed_token_ids: token id {bad} is not below the vocabulary size {vocab}", "allowed_token_ids"
                )
        words = bad_word_ids(self.tokenizer, params.bad_words, vocab)
        if len(processing.logit_bias) + len(banned) + len(words) > BIAS_WIDTH:
            raise RequestError(
                f"bad_words: their token sequences ({len(words)}: each word with and without a leading space), "
                f"logit_bias ({len(processing.logit_bias)}) and the ids min_tokens bans ({len(banned)}) are at "
                f"most {BIAS_WIDTH} (the graphs' fixed width of banned ids per row)",
                "bad_words",
            )
        asked = next(
            (
                field
                for field, asks in (
                    ("min_tokens", banned),
                    ("best_of", params.rank),
                    ("allowed_token_ids", params.allowed_token_ids is not None),
                    ("bad_words", params.bad_words),
                )
                if asks
            ),
            None,
        )
        if (processing.asks or asked) and getattr(self.runtime, "processing", True) is False:
            field = _asked_field(processing) if processing.asks else asked
            raise RequestError(
                f"{field}: this backend's graphs have no logits-processing variant (an artifact built "
                "before it); serve it with --backend static or hf, or rebuild the artifact",
                field,
            )
        if params.grammar is not None and getattr(self.runtime, "processing", True) is False:
            field = params.grammar.field
            raise RequestError(
                f"{field}: this backend's graphs have no logits-processing variant to take a grammar's token mask "
                "(an artifact built before it); serve it with --backend static or hf, or rebuild the artifact",
                field,
            )

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar into the cache (slow for a large schema: a caller off the step
        loop's thread calls this first); a RequestError naming its field if it does not compile."""
        if params.grammar is not None:
            try:
                self.grammars.compile(params.grammar)
            except GrammarError as e:
                raise RequestError(str(e), e.field) from None

    def max_tokens_for(self, n_prompt: int, requested: int | None) -> int:
        """The request's token budget: what it asked for, or what is left of the context (a request
        that runs to the end of the cache ends with "length")."""
        if n_prompt < 1:  # a tokenizer that adds no BOS, and an empty prompt: nothing to prefill
            raise RequestError("the prompt has no tokens", "prompt")
        room = self.max_context - n_prompt
        if room < 1:
            raise RequestError(
                f"the prompt is {n_prompt} tokens; this model's context is {self.max_context} "
                f"tokens, which leaves no room to generate",
                "prompt",
            )
        if requested is None:
            return room
        if requested > room:
            raise RequestError(
                f"this model's context is {self.max_context} tokens: the prompt ({n_prompt}) "
                f"plus max_tokens ({requested}) exceeds it by {requested - room}",
                "max_tokens",
            )
        return requested

    def close(self) -> None:
        """Stop what the engine runs (`batching.BatchEngine`: its step loop)."""

    def __enter__(self):
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def output(self, params: SamplingParams, prompt: list[int] = ()) -> Output:
        """A new request's Output; a RequestError if the runtime cannot sample it or its grammar does
        not compile."""
        self.check_sampling(params)
        self.compile_grammar(params)
        matcher = None if params.grammar is None else self.grammars.matcher(params.grammar)
        vocab = self.vocab
        allowed = None if params.allowed_token_ids is None else allowed_mask(params.allowed_token_ids, vocab)
        words = bad_word_ids(self.tokenizer, params.bad_words, vocab)
        return Output(self.tokenizer, self.eos_ids, params, prompt, matcher, allowed, words)


def _asked_field(processing: Processing) -> str:
    """The request field behind the first thing `processing` asks for (for an error's `param`)."""
    names = ("logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    return next((n for n in names if getattr(processing, n) != getattr(NOTHING, n)), "logit_bias")


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
