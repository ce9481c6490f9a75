"""The serving engine: what a request may ask, and the tokens and text it gets back.

`Output` is one request's side of generation: sampling (greedy at temperature 0, else
temperature and top-p with a per-request seeded generator), EOS, stop sequences and max_tokens,
and the text that is safe to send after each token (a partial stop string or a partial UTF-8
character is held back until it resolves). `Engine` checks a request against the backend's limits
and runs one request per calling thread over a backend with a state per request:
`prefill(ids) -> (logits [V], state)` and `decode(token, state) -> logits [V]` (HF's model on CPU,
`HFBackend`). The static graphs (`--backend static` on CPU, `neuron` on the device) are served by
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
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Step:
    text: str  # new text since the previous step; "" while text is held back
    finish_reason: str | None  # "stop" | "length" on the last step, else None
    completion_tokens: int  # tokens generated so far (an EOS counts)


# Below this temperature, sampling is greedy: logits / 1e-300 overflow to inf and softmax to NaN
# (vLLM draws the line at the same place).
GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from [V] logits: argmax at temperature 0 (or below GREEDY_BELOW), else nucleus sampling."""
    if temperature < GREEDY_BELOW:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep a token while the mass of the tokens before it is still short of top_p:
        # the smallest prefix whose mass reaches top_p (the top token always stays)
        keep = (sorted_p.cumsum(0) - sorted_p) < top_p
        keep[0] = True  # also when top_p underflows in float32 (5e-324 is 0 there)
        return int(order[torch.multinomial(sorted_p * keep, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


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

    `next(logits, token)` picks the request's next token — the graph's own greedy pick (`token`,
    where the graphs return one) at temperature 0, else from the logits [V]: argmax at temperature
    0, temperature and top-p with the request's own seeded generator otherwise, so a seeded request
    samples the same whatever runs beside it — and returns its Step: EOS, a stop string or
    max_tokens end it, and the text is what is safe to send (a partial stop string or a partial
    UTF-8 character is held back until it resolves). The same for a request served alone
    (`Engine.generate`) and for a row of a batch (`batching.BatchEngine`).
    """

    def __init__(self, tokenizer, eos_ids: frozenset[int], params: SamplingParams):
        self.tokenizer, self.eos_ids, self.params = tokenizer, eos_ids, params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self.tokens: list[int] = []
        self.count = 0  # tokens generated (an EOS counts)
        self.sent = 0  # characters of the decoded text already handed out
        self.token: int | None = None  # the latest token, which the backend is fed next

    def next(self, logits: torch.Tensor | None, token: int | None = None) -> Step:
        params = self.params
        if logits is not None and not torch.isfinite(logits).all():  # else argmax picks a NaN, sampling fails
            raise GenerationError(f"the model produced non-finite logits (NaN or inf) at step {self.count}")
        if token is None or params.temperature != 0:
            token = sample(logits, params.temperature, params.top_p, self.generator)
        self.token, self.count = token, self.count + 1
        if token in self.eos_ids:
            return Step(self._text()[self.sent:], "stop", self.count)
        self.tokens.append(token)
        # Decoding the whole output each step is what keeps multi-token characters and
        # tokenizers that merge across tokens right; outputs are short enough for it.
        text = self._text()
        cut = min((j for j in (text.find(s) for s in params.stop) if j >= 0), default=None)
        if cut is not None:
            return Step(text[self.sent:cut], "stop", self.count)
        if self.count == params.max_tokens:
            return Step(text[self.sent:], "length", self.count)
        safe = len(text) - held_back(text, params.stop)
        step = Step(text[self.sent:safe], None, self.count)
        self.sent = max(self.sent, safe)
        return step

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens) if self.tokens else ""


class Engine:
    """What a request may ask of a backend (its limits, its sampling), and generation of one
    request on the calling thread over a backend with a state per request."""

    rows: int | None = None  # a batching engine's rows (batching.py); None: one request per thread

    def __init__(self, backend, tokenizer, max_context: int, eos_ids: set[int], max_prompt: int | None = None):
        self.backend, self.tokenizer = backend, tokenizer
        self.max_context = max_context
        self.max_prompt = max_prompt  # a static backend's largest prefill bucket (None: any prompt that fits)
        self.eos_ids = frozenset(eos_ids)
        self.greedy_only = getattr(backend, "greedy_only", False)

    def check_sampling(self, temperature: float) -> None:
        """A RequestError if the backend cannot sample this request."""
        if self.greedy_only and temperature != 0:
            raise RequestError(f"this backend's graphs return the greedy token only (an artifact built without "
                               f"--with-logits): temperature must be 0, got {temperature}", "temperature")

    def max_tokens_for(self, n_prompt: int, requested: int | None) -> int:
        """The request's token budget: what it asked for, or what is left of the context (a request
        that runs to the end of the cache ends with "length")."""
        if self.max_prompt is not None and n_prompt > self.max_prompt:
            raise RequestError(f"the prompt is {n_prompt} tokens; this backend's largest prefill bucket holds "
                               f"{self.max_prompt}", "prompt")
        room = self.max_context - n_prompt
        if room < 1:
            raise RequestError(f"the prompt is {n_prompt} tokens; this model's context is {self.max_context} "
                               f"tokens, which leaves no room to generate", "prompt")
        if requested is None:
            return room
        if requested > room:
            raise RequestError(f"this model's context is {self.max_context} tokens: the prompt ({n_prompt}) "
                               f"plus max_tokens ({requested}) exceeds it by {requested - room}", "max_tokens")
        return requested

    def close(self) -> None:
        """Nothing to stop: this engine generates on its callers' threads."""

    def output(self, params: SamplingParams) -> Output:
        """A new request's Output; a RequestError if the backend cannot sample it."""
        self.check_sampling(params.temperature)
        return Output(self.tokenizer, self.eos_ids, params)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 cancelled: threading.Event | None = None) -> Iterator[Step]:
        """One Step per generated token; the last carries the finish reason. Returns early,
        without a final Step, once `cancelled` is set (the consumer went away)."""
        output = self.output(params)
        logits, state = self.backend.prefill(prompt_ids)
        while True:
            if cancelled is not None and cancelled.is_set():
                return
            step = output.next(logits)
            yield step
            if step.finish_reason:
                return
            logits = self.backend.decode(output.token, state)


class HFBackend:
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
