"""The serving engine: what a request may ask, and the tokens and text it gets back.

`Output` is one request's side of generation: sampling (greedy at temperature 0, else
temperature, top-k and top-p from a per-request seeded generator's draws: `static/sampling.py`,
in the graphs or, for a request served alone, on the host), EOS, stop sequences and max_tokens,
and the text that is safe to send after each token (a partial stop string or a partial UTF-8
character is held back until it resolves): an id side that decides from the tokens (`take`) and
a text side (`text`), which the batching engine runs beside its graph calls. `Engine` checks a
request against its runtime's limits and runs one request per calling thread over a runtime with a
state per request: `prefill(ids) -> (logits [V], state)` and `decode(token, state) -> logits [V]`
(HF's model on CPU, `HFRuntime`). The static graphs (`--backend static` on CPU, `neuron` on the device) are served by
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
from ..static.sampling import GREEDY, GREEDY_BELOW, pick, sampling_row

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


@dataclass(frozen=True)
class Step:
    text: str  # new text since the previous step; "" while text is held back
    finish_reason: str | None  # "stop" | "length" on the last step, else None
    completion_tokens: int  # tokens generated so far (an EOS counts)


def sample(logits: torch.Tensor, row: tuple) -> int:
    """One token from [V] logits on the host: the graphs' own `pick`, every token a candidate
    (nothing capped); -1 for non-finite logits."""
    return int(pick(logits.float()[None], torch.tensor([row], dtype=torch.float32), logits.shape[-1])[0, 0])


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

    - the id side, `take(logits, token)`: the token the graph chose (or, from the logits [V], the
      one chosen on the host with the graphs' own function) joins the output, and the ids decide
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
    takes the tokens in order, each once. An id-side "stop" token (EOS) is no part of the text.
    `next(logits, token)` is both at once, for a caller that wants the Step at once (a request
    served alone, `Engine.generate`).
    """

    def __init__(self, tokenizer, eos_ids: frozenset[int], params: SamplingParams):
        self.tokenizer, self.eos_ids, self.params = tokenizer, eos_ids, params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self._draws: list[float] = []  # uniforms drawn ahead, next one last
        self._drawn = 0
        # the id side
        self.tokens: list[int] = []  # the generated tokens, EOS not among them
        self.count = 0  # tokens generated (an EOS counts)
        self.token: int | None = None  # the latest token, which the runtime is fed next
        # the text side: the text of tokens[:_read] is _text (final); _window is the text of
        # tokens[_prefix:_read], the decode window's start, whose text a new token's is told from
        self._text, self._window, self._prefix, self._read = "", "", 0, 0
        self._searched = 0  # characters of the text looked through for stop strings
        self._longest = max(map(len, params.stop), default=0)
        self.sent = 0  # characters of the text already handed out

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW

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

    def take(self, logits: torch.Tensor | None, token: int | None = None) -> str | None:
        """The id side of the next token: it joins the output -> its finish reason from the ids
        ("stop": EOS, "length": max_tokens), or None."""
        if token is None:
            token = sample(logits, self.sampling())
        if token < 0:  # the graphs' answer to non-finite logits; a token is never picked from NaNs
            raise GenerationError(f"the model produced non-finite logits (NaN or inf) at step {self.count}")
        self.token, self.count = token, self.count + 1
        if token in self.eos_ids:
            return "stop"
        self.tokens.append(token)
        return "length" if self.count == self.params.max_tokens else None

    def text(self, count: int, finish: str | None) -> Step:
        """The Step of the count-th token, whose id side said `finish`: its new text, and its
        finish reason (a stop string's, if one ends the output here)."""
        params, sent = self.params, self.sent
        pending = self._advance(count - 1 if finish == "stop" else count)
        # Only the text's tail is looked at: stop strings were looked for up to `_searched`, so a new
        # one ends past `_searched` - (longest - 1), and what is held back is at most a stop's length
        # and the incomplete character; `sent` is at most that far back.
        start = max(0, self._searched - self._longest + 1)
        base = min(sent, start, len(self._text))
        recent = self._text[base:] + pending  # the text from `base` on
        if finish == "stop":
            return Step(recent[sent - base :], "stop", count)
        # stops are looked for in the complete characters alone: a trailing U+FFFD may be the start of a
        # character still arriving (a stop of U+FFFD would cut it), and it is looked at once it is whole
        complete = recent.rstrip("\ufffd")
        self._searched = base + len(complete)
        cut = min((j for j in (complete.find(s, start - base) for s in params.stop) if j >= 0), default=None)
        if cut is not None:
            return Step(recent[sent - base : cut], "stop", count)
        if finish == "length":
            return Step(recent[sent - base :], "length", count)
        safe = base + len(recent) - held_back(recent, params.stop)
        self.sent = max(sent, safe)
        return Step(recent[sent - base : safe - base], None, count)

    def next(self, logits: torch.Tensor | None, token: int | None = None) -> Step:
        """Both sides of the next token at once -> its Step."""
        finish = self.take(logits, token)
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
    """What a request may ask of a runtime (its limits, its sampling), and generation of one
    request on the calling thread over a runtime with a state per request."""

    rows: int | None = None  # a batching engine's rows (batching.py); None: one request per thread

    def __init__(self, runtime, tokenizer, max_context: int, eos_ids: set[int]):
        self.runtime, self.tokenizer = runtime, tokenizer
        self.max_context = max_context  # prompt + generated tokens
        self.eos_ids = frozenset(eos_ids)
        # the most top_k the runtime samples from exactly (its graphs' candidate width; None: any)
        self.max_top_k: int | None = getattr(runtime, "candidates", None)

    def check_sampling(self, params: SamplingParams) -> None:
        """A RequestError if the runtime cannot sample this request as asked."""
        if self.max_top_k is not None and params.top_k > self.max_top_k:
            raise RequestError(
                f"this backend's graphs sample among the {self.max_top_k} most likely tokens: top_k "
                f"must be at most {self.max_top_k} (or 0, off), got {params.top_k}",
                "top_k",
            )

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

    def output(self, params: SamplingParams) -> Output:
        """A new request's Output; a RequestError if the runtime cannot sample it."""
        self.check_sampling(params)
        return Output(self.tokenizer, self.eos_ids, params)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, cancelled: threading.Event | None = None
    ) -> Iterator[Step]:
        """One Step per generated token; the last carries the finish reason. Returns early,
        without a final Step, once `cancelled` is set (the consumer went away)."""
        output = self.output(params)
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

    @torch.inference_mode()
    def prefill(self, ids: list[int]):
        cache = DynamicCache(config=self.model.config)
        state = {"cache": cache, "position": len(ids)}
        return self._forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache), state

    @torch.inference_mode()
    def decode(self, token: int, state) -> torch.Tensor:
        position = torch.tensor([[state["position"]]])
        state["position"] += 1
        return self._forward(torch.tensor([[token]]), position, state["cache"])

    def _forward(self, ids, positions, cache) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()


def eos_ids(tokenizer, config) -> set[int]:
    """The tokens that end a generation: the tokenizer's EOS and the model config's."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return {i for i in ids if i is not None}
