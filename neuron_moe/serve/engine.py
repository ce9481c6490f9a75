"""The serving engine: what a request may ask, and the tokens and text it gets back.

`Output` is one request's side of generation: sampling (greedy at temperature 0, else
temperature, top-k and top-p from a per-request seeded generator's draws: `static/sampling.py`,
in the graphs or, for a request served alone, on the host), EOS, stop sequences and max_tokens,
and the text that is safe to send after each token (a partial stop string or a partial UTF-8
character is held back until it resolves). `Engine` checks a request against its runtime's limits
and runs one request per calling thread over a runtime with a state per request:
`prefill(ids) -> (logits [V], state)` and `decode(token, state) -> logits [V]` (HF's model on CPU,
`HFRuntime`). The static graphs (`--backend static` on CPU, `neuron` on the device) are served by
`batching.BatchEngine` instead: one step loop over all the rows of the graphs' batch, with the
same `Output` per row.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..errors import UserError
from ..static.sampling import (
    BIAS_WIDTH,
    GREEDY,
    GREEDY_BELOW,
    NOTHING,
    Processing,
    logprobs,
    pick,
    process_host,
    sampling_row,
)
from .grammar import GrammarError, Grammars, GrammarSpec, Matcher


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
    grammar: GrammarSpec | None = None  # structured output: what the text must match (grammar.py)


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's logprob under the model's own distribution, and the most likely tokens' (as many as
    asked, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Step:
    text: str  # new text since the previous step; "" while text is held back
    finish_reason: str | None  # "stop" | "length" on the last step, else None
    completion_tokens: int  # tokens generated so far (an EOS counts)
    logprobs: TokenLogprobs | None = None  # this step's token's, when the request asked for logprobs
    # the first step of a request that asked for prompt logprobs (echo): one per prompt token, None first
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


def sample(logits: torch.Tensor, row: tuple, finite: bool | None = None) -> int:
    """One token from [V] logits on the host: the graphs' own `pick`, every token a candidate
    (nothing capped); -1 for non-finite logits (`finite`: whether the model's logits were, when
    `logits` are processed ones that hold -inf on purpose)."""
    ok = None if finite is None else torch.tensor([finite])
    return int(pick(logits.float()[None], torch.tensor([row], dtype=torch.float32), logits.shape[-1], ok)[0, 0])


def token_logprobs(token: int, chosen: float, top_ids, top, n: int) -> TokenLogprobs:
    """A TokenLogprobs from a graph's (or the host's) scores, the first `n` of the top ones kept."""
    return TokenLogprobs(token, float(chosen), tuple(zip(top_ids[:n].tolist(), top[:n].tolist())))


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

    `sampling()` is the request's row of the graphs' `sampling` input for its next token (its
    temperature, top-k, top-p and a fresh uniform draw from its own seeded generator, so a seeded
    request samples the same whatever runs beside it); `next(logits, token)` takes the token the
    graph chose from it (`token`), or chooses it on the host from the logits [V] with the same
    function — and returns its Step: EOS, a stop string or max_tokens end it, and the text is what
    is safe to send (a partial stop string or a partial UTF-8 character is held back until it
    resolves). The same for a request served alone (`Engine.generate`) and for a row of a batch
    (`batching.BatchEngine`).

    A request with a grammar (`matcher`, grammar.py) has `allowed()`, the next token's bitmask,
    which the host applies to the logits before it samples (and the graphs take as an input); the
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
    ):
        self.tokenizer, self.eos_ids, self.params, self.matcher = tokenizer, eos_ids, params, matcher
        self.prompt = list(prompt)
        self.generated: list[int] = []  # every token generated (an EOS too): what the penalties count
        # the prompt's logprobs while they arrive (the first token has none), handed out with the first Step
        self._prompt_logprobs = None if params.processing.prompt_logprobs is None else [None]
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self.tokens: list[int] = []
        self.count = 0  # tokens generated (an EOS counts)
        self.sent = 0  # characters of the decoded text already handed out
        self.token: int | None = None  # the latest token, which the runtime is fed next

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW

    @property
    def asks(self) -> bool:
        """Whether this request runs in the logits-processing graphs (`static/rows.py`): it asks for
        logprobs, penalties, logit_bias or min_p — or, once their fields exist, bans or a grammar
        (the single place those join: `banned()`, `allowed()`)."""
        return self.params.processing.asks or self.matcher is not None

    def banned(self) -> tuple[int, ...]:
        """Token ids the next token must not be (a ban for this step only); none here."""
        return ()

    def allowed(self) -> torch.Tensor | None:
        """The grammar's bitmask for the next token (int32 [ceil(V/32)], bit t % 32 of word t // 32 set
        = token t allowed: grammar.py), or None: no grammar."""
        return None if self.matcher is None else self.matcher.allowed()

    def processing(self) -> tuple[tuple[float, float, float, float], list[tuple[int, float]], torch.Tensor | None]:
        """This request's row of the logits-processing graphs' inputs for its next token (`static/rows.py`):
        its penalties and min_p, its logit_bias entries then its bans (-inf), its bitmask."""
        processing = self.params.processing
        entries = [*processing.logit_bias, *((token, -float("inf")) for token in self.banned())]
        return processing.values(), entries, self.allowed()

    def prompt_scores(self, start: int, chosen, top_ids, top) -> None:
        """The scores of prompt tokens start+1 .. start+len(chosen), from a prefill chunk (`static/rows.py`)."""
        n = self.params.processing.prompt_logprobs
        if n is None:
            return
        for i in range(len(chosen)):
            token = self.prompt[start + 1 + i]
            self._prompt_logprobs.append(token_logprobs(token, chosen[i], top_ids[i], top[i], n))

    def host_prompt_scores(self, logits: torch.Tensor) -> None:
        """The prompt's scores from its logits [n, V] on the host (`Engine.generate`)."""
        targets = torch.tensor(self.prompt[1:])
        self.prompt_scores(0, *logprobs(logits[:-1].float(), targets))

    def sampling(self) -> tuple[float, float, float, float]:
        """The next token's sampling row; a sampled request draws its uniform here, once per token."""
        if self.greedy:
            return GREEDY
        params = self.params
        u = float(torch.rand((), generator=self.generator))
        return sampling_row(params.temperature, params.top_k, params.top_p, u)

    def next(self, logits: torch.Tensor | None, token: int | None = None, scores=None) -> Step:
        """The Step of the next token: `token` as a graph chose it (with its `scores`, (logprob, top
        ids, top logprobs), from the logits-processing graphs), or chosen here from `logits`."""
        params = self.params
        if token is None:
            token, scores = self._choose(logits)
        if token < 0:  # the graphs' answer to non-finite logits; a token is never picked from NaNs
            raise GenerationError(f"the model produced non-finite logits (NaN or inf) at step {self.count}")
        if self.matcher is not None and not self.matcher.advance(token):
            raise GenerationError(f"token {token} at step {self.count} is not one the grammar allows")
        self.token, self.count = token, self.count + 1
        self.generated.append(token)
        n = params.processing.logprobs
        extra = {"logprobs": None if n is None or scores is None else token_logprobs(token, *scores, n)}
        if self._prompt_logprobs is not None and self.count == 1:
            extra["prompt_logprobs"], self._prompt_logprobs = tuple(self._prompt_logprobs), None
        return self._step(token, extra)

    def _choose(self, logits: torch.Tensor) -> tuple[int, tuple | None]:
        """(the token, its scores) chosen on the host from the model's [V] logits, as the graphs choose it."""
        sampling = self.sampling()
        if not self.asks:
            return sample(logits, sampling), None
        processed = process_host(
            logits, sampling[0], self.params.processing, self.prompt, self.generated, self.banned(), self.allowed()
        )
        token = sample(processed, sampling, bool(torch.isfinite(logits.float().sum())))
        chosen, top_ids, top = logprobs(logits.float(), torch.tensor(max(token, 0)))
        return token, (chosen, top_ids, top)

    def _step(self, token: int, extra: dict) -> Step:
        params = self.params
        if token in self.eos_ids:
            return Step(self._text()[self.sent :], "stop", self.count, **extra)
        self.tokens.append(token)
        # Decoding the whole output each step is what keeps multi-token characters and
        # tokenizers that merge across tokens right; outputs are short enough for it.
        text = self._text()
        # stops are looked for in the complete characters alone: a trailing U+FFFD may be the start of a
        # character still arriving (a stop of U+FFFD would cut it), and it is looked at once it is whole
        complete = text.rstrip("\ufffd")
        cut = min((j for j in (complete.find(s) for s in params.stop) if j >= 0), default=None)
        if cut is not None:
            return Step(text[self.sent : cut], "stop", self.count, **extra)
        if self.matcher is not None and self.matcher.stopped:  # the grammar is complete: nothing may follow
            return Step(text[self.sent :], "stop", self.count, **extra)
        if self.count == params.max_tokens:
            return Step(text[self.sent :], "length", self.count, **extra)
        safe = len(text) - held_back(text, params.stop)
        step = Step(text[self.sent : safe], None, self.count, **extra)
        self.sent = max(self.sent, safe)
        return step

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens) if self.tokens else ""


class Engine:
    """What a request may ask of a runtime (its limits, its sampling), and generation of one
    request on the calling thread over a runtime with a state per request."""

    rows: int | None = None  # a batching engine's rows (batching.py); None: one request per thread

    def __init__(self, runtime, tokenizer, max_context: int, eos_ids: set[int]):
        self.runtime, self.tokenizer = runtime, tokenizer
        self.max_context = max_context  # prompt + generated tokens
        self.eos_ids = frozenset(eos_ids)
        # the most top_k the runtime samples from exactly (its graphs' candidate width; None: any)
        self.max_top_k: int | None = getattr(runtime, "candidates", None)
        # structured output's grammars, their bitmasks as wide as the runtime's logits (`vocab`; else the
        # tokenizer's vocabulary)
        self.grammars = Grammars(tokenizer, getattr(runtime, "vocab", None), self.eos_ids)

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
        vocab = getattr(self.runtime, "vocab", None) or getattr(self, "vocab_size", None)
        bad = next((t for t, _ in processing.logit_bias if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is not below the vocabulary size {vocab}", "logit_bias")
        if processing.asks and getattr(self.runtime, "processing", True) is False:
            field = _asked_field(processing)
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
        """Nothing to stop: this engine generates on its callers' threads."""

    def output(self, params: SamplingParams, prompt: list[int] = ()) -> Output:
        """A new request's Output; a RequestError if the runtime cannot sample it or its grammar does
        not compile."""
        self.check_sampling(params)
        self.compile_grammar(params)
        matcher = None if params.grammar is None else self.grammars.matcher(params.grammar)
        return Output(self.tokenizer, self.eos_ids, params, prompt, matcher)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, cancelled: threading.Event | None = None
    ) -> Iterator[Step]:
        """One Step per generated token; the last carries the finish reason. Returns early,
        without a final Step, once `cancelled` is set (the consumer went away)."""
        output = self.output(params, prompt_ids)
        if params.processing.prompt_logprobs is not None:
            output.host_prompt_scores(self.runtime.prompt_logits(prompt_ids))
        logits, state = self.runtime.prefill(prompt_ids)
        while True:
            if cancelled is not None and cancelled.is_set():
                return
            step = output.next(logits)
            yield step
            if step.finish_reason:
                return
            logits = self.runtime.decode(output.token, state)


class HFRuntime:
    """transformers' model on CPU (any experts implementation) with a per-request KV cache."""

    def __init__(self, model):
        self.model = model
        self.vocab = model.config.vocab_size

    @torch.inference_mode()
    def prefill(self, ids: list[int]):
        cache = DynamicCache(config=self.model.config)
        state = {"cache": cache, "position": len(ids)}
        return self._forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache), state

    @torch.inference_mode()
    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        """The logits [n, V] after each prompt token (the prompt's logprobs, for echo)."""
        out = self.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None])
        return out.logits[0].float()

    @torch.inference_mode()
    def decode(self, token: int, state) -> torch.Tensor:
        position = torch.tensor([[state["position"]]])
        state["position"] += 1
        return self._forward(torch.tensor([[token]]), position, state["cache"])

    def _forward(self, ids, positions, cache) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()


def _asked_field(processing: Processing) -> str:
    """The request field behind the first thing `processing` asks for (for an error's `param`)."""
    names = ("logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    return next((n for n in names if getattr(processing, n) != getattr(NOTHING, n)), "logit_bias")


def eos_ids(tokenizer, config) -> set[int]:
    """The tokens that end a generation: the tokenizer's EOS and the model config's."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return {i for i in ids if i is not None}
