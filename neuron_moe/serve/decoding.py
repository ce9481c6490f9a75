"""How a request is decoded: its fields turned into engine calls, their Steps into the response's choices.

The sampling parameters of a request's generations (checked against the engine, its grammar compiled,
choice i seeded with seed + i), n and best_of (the generations run, the most likely answered), the
tokens' logprobs and the prompt's in OpenAI's and vLLM's shapes, and vLLM's beam search. Plain
functions and classes over an Engine and a parsed request (`protocol.py`): the HTTP layer (`app.py`)
admits the generations, streams or collects their Steps, and frames the answer; a request the engine
cannot serve is an APIError naming the client's field.
"""

from __future__ import annotations

import asyncio
import codecs
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from ..static.sampling import Processing
from .engine import Engine, RequestError, SamplingParams, Step, TokenLogprobs
from .protocol import APIError


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


async def sampling_params(engine: Engine, req, n_prompt: int, extra_stops: tuple, chat: bool) -> SamplingParams:
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

    def __init__(self, engine: Engine, req, n_prompt: int, chat: bool, running: int, queued: int):
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
