"""The HTTP surface: OpenAI-compatible routes over an Engine, in vLLM's dialect.

POST /v1/chat/completions and /v1/completions (SSE when `stream`), GET /v1/models and
/v1/models/{id}, and vLLM's POST /tokenize and /detokenize — behind the bearer key when one is
set — and GET /health, /ping, /version and /metrics, open for load balancers, Docker's
HEALTHCHECK and a Prometheus scraper (as vLLM's are: /metrics holds counts and latencies, no
request's content). A body that is not sent as JSON gets 415. The model loads in a
thread once the socket is bound; until it is ready, /health, /ping and the model's routes
answer 503 + Retry-After. Every error is OpenAI's `{"error": {...}}` with 400 for an invalid
request (never FastAPI's 422). Each request that generates logs one line when it ends: its
prompt and completion tokens, time to first token and duration.

Nothing slow runs on the event loop, so /health answers under any request mix: a body over
`max_body_bytes` is refused (413) before it is read, a body that has not all come within
`body_timeout` seconds gets 408 (a request's headers have their own deadline: `connection.py`),
tokenizing runs in a thread, and a prompt longer in bytes than the longest prompt the model takes
could be in tokens is refused untokenized. No schema or docs pages are served (`/openapi.json`,
`/docs`): the API is OpenAI's, documented by OpenAI, and a server behind a key shows nothing without it.
Draining (SIGTERM) refuses new requests; past the drain timeout the requests still in flight are
ended properly: a stream with an error event and [DONE], a plain request with a 503 JSON body.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .. import __version__
from ..report import dumps
from .chat import render_chat
from ..static.sampling import Processing
from .engine import Engine, RequestError, SamplingParams, TokenLogprobs
from .invocations import invocation_request
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    TokenizeRequest,
    error_body,
)
from .scheduler import Scheduler

log = logging.getLogger("neuron_moe.serve")
LOADING_RETRY_AFTER_S = 5
DRAINING_RETRY_AFTER_S = 5
KEEPALIVE_S = 15.0  # an SSE comment while a streamed request waits in the queue
MAX_BODY_BYTES = 4 * 2**20  # a full 262144-token context is about 1 MiB of text; 4 leaves room for JSON escapes
BODY_TIMEOUT_S = 30.0  # 4 MiB in 30 s is 140 kB/s: a client slower than that is holding the connection


class ServerState:
    """Loading -> ready (or failed); draining once the server was told to stop."""

    def __init__(self, load: Callable[[], Engine], on_load_error: Callable[[BaseException], None] | None):
        self.load, self.on_load_error = load, on_load_error
        self.phase = "loading"
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.draining = False
        self.cut = asyncio.Event()  # set at the drain deadline: what still runs is ended
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs
        self._loading: threading.Thread | None = None

    def start_loading(self) -> None:
        self._loading = threading.Thread(target=self._load, name="load-model", daemon=True)
        self._loading.start()

    def close(self) -> None:
        """Stop the engine's own threads — the batching engine's step loop — once the server is done,
        from the thread that runs it: a thread still inside torch when the interpreter exits aborts
        the process. A load still running is waited for, then its engine closed."""
        if self._loading is not None and self._loading.is_alive():
            log.info("waiting for the model to finish loading, to close it")
            self._loading.join()
        if self.engine is not None:
            self.engine.close()

    def _load(self) -> None:
        try:
            engine = self.load()
        except BaseException as e:  # reported, and the server told to exit
            log.error("model failed to load: %s", e)
            self.error, self.phase = e, "failed"
            if self.on_load_error:
                self.on_load_error(e)
            return
        self.engine, self.phase = engine, "ready"
        log.info("model ready")

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests now, and end those in flight after `timeout_s`. From any thread,
        or a signal handler."""
        self.draining = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, timeout_s, self.cut.set)

    def unavailable(self) -> APIError | None:
        if self.draining:
            return APIError(
                503,
                "the server is shutting down",
                "service_unavailable",
                code="draining",
                retry_after=DRAINING_RETRY_AFTER_S,
            )
        if self.phase == "loading":
            return APIError(
                503,
                "the model is loading",
                "service_unavailable",
                code="model_loading",
                retry_after=LOADING_RETRY_AFTER_S,
            )
        if self.phase == "failed":
            return APIError(
                503, f"the model failed to load: {self.error}", "service_unavailable", code="model_load_failed"
            )
        return None


OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")  # what a load balancer, a health check or a scraper calls


class BearerAuth:
    """Pure ASGI (a BaseHTTPMiddleware would break disconnect detection of streams): every
    route but OPEN_PATHS needs `Authorization: Bearer <key>`."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                body = error_body(
                    "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Pure ASGI: a request body over `max_bytes` gets 413 in OpenAI's shape — at once when its
    Content-Length says so, else as soon as the chunks received pass it — and is never read whole;
    one that has not all come `timeout_s` after the app began to read it gets 408."""

    def __init__(self, app, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    def _message(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            body = error_body(self._message(), "invalid_request_error", code="request_too_large")
            return await JSONResponse(body, 413, headers={"Connection": "close"})(scope, receive, send)
        received, deadline, complete = 0, None, False

        async def limited():
            nonlocal received, deadline, complete
            if complete:  # what comes after the body (a disconnect) has no deadline
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not all arrive within {self.timeout_s:g} s",
                    headers={"Connection": "close"},
                ) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # an HTTPException passes FastAPI's body parsing as it is
                raise HTTPException(413, self._message(), headers={"Connection": "close"})
            return message

        await self.app(scope, limited, send)


async def _api_error(_request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), e.status, headers=e.headers)


def _param(loc) -> str | None:
    """The field an error's location names: 'messages.0.content', without pydantic's tags for the
    member of a union it tried ('str', 'list[str]', 'function-after[...]')."""
    parts = []
    for p in loc:
        if isinstance(p, str) and (not p.isidentifier() or p in ("str", "int", "float", "bool", "list", "dict")):
            break
        if p != "body":
            parts.append(str(p))
    return ".".join(parts) or None


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    if tuple(err.get("loc", ())) == ("body",) and isinstance(err.get("input"), bytes):
        # FastAPI parses a body as JSON only under a JSON Content-Type; any other leaves it bytes
        given = request.headers.get("content-type")
        return JSONResponse(
            error_body(
                "the request body must be JSON, sent with 'Content-Type: application/json'; this request's "
                f"Content-Type is {repr(given) if given else 'missing'}",
                "invalid_request_error",
                code="unsupported_media_type",
            ),
            415,
        )
    if tuple(err.get("loc", ())) == ("body",) and err.get("type") == "missing":
        return JSONResponse(
            error_body("the request has no body: send it as a JSON object", "invalid_request_error"), 400
        )
    if err.get("type") == "json_invalid":
        return JSONResponse(
            error_body(f"the request body is not valid JSON: {err.get('msg')}", "invalid_request_error"), 400
        )
    cause = (err.get("ctx") or {}).get("error")
    param = cause.field if isinstance(cause, FieldError) else _param(err.get("loc", ()))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return JSONResponse(error_body(f"{param}: {msg}" if param else msg, "invalid_request_error", param), 400)


async def _http_error(_request, exc: HTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {408: "request_timeout", 413: "request_too_large"}.get(exc.status_code)
    return JSONResponse(error_body(str(exc.detail), kind, code=code), exc.status_code, headers=exc.headers)


async def _server_error(_request, exc: Exception) -> JSONResponse:
    # Starlette re-raises it after this answer, so the server logs the traceback
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), 500)


def _choice(
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


class _Logprobs:
    """A choice's tokens' logprobs in OpenAI's shapes: chat's `{"content": [{token, logprob, bytes,
    top_logprobs}]}`, completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (the chosen
    token among its top ones, as vLLM's; a prompt's first token, with echo, has none: null). Made
    for the whole answer or a stream's chunk at a time (`text_offset` runs on across chunks)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat, self.offset = tokenizer, chat, 0

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
            self.offset += len(text)
        return out

    def _chat(self, entry: TokenLogprobs) -> dict:
        def one(token: int, logprob: float) -> dict:
            text = self.text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {**one(entry.token, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}


def _prompt_entries(prompt_ids: list[int], item, n: int | None = None) -> list:
    """A first Step's prompt logprobs (echo) as (token, logprobs) entries, the `n` most likely kept (None:
    all); [] when it has none."""
    if item.prompt_logprobs is None:
        return []
    kept = [e if e is None or n is None else replace(e, top=e.top[:n]) for e in item.prompt_logprobs]
    return list(zip(prompt_ids, kept))


def _vllm_prompt_logprobs(tokenizer, scores: tuple | None, n: int) -> list | None:
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


def _step_entries(item) -> list:
    return [(item.logprobs.token, item.logprobs)] if item.logprobs is not None else []


@dataclass(frozen=True)
class _Echo:
    """What goes back before each choice's text (`echo`): a completion's prompt (its text and ids, whose
    logprobs come with the choice's first Step when asked), or chat's last assistant turn (no ids)."""

    text: str
    ids: list[int]


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj) -> str:
    return f"data: {dumps(obj)}\n\n"


class _Record:
    """One generating request, for its log line: when it came, when its first token did, its size
    (its choices' tokens summed)."""

    def __init__(self, rid: str, n_prompt: int, started: float):
        self.rid, self.n_prompt = rid, n_prompt
        self.started, self.first = started, None  # perf_counter() when the request came in
        self.tokens: dict[int, int] = {}  # completion tokens, per choice
        self.finish = None

    @property
    def completion(self) -> int:
        return sum(self.tokens.values())

    def step(self, index: int, item) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.tokens[index], self.finish = item.completion_tokens, item.finish_reason or self.finish

    def log(self, outcome: str | None = None) -> None:
        ttft = "-" if self.first is None else f"{self.first - self.started:.3f} s"
        log.info(
            "request %s: prompt %d tokens, completion %d tokens, TTFT %s, duration %.3f s, %s",
            self.rid,
            self.n_prompt,
            self.completion,
            ttft,
            time.perf_counter() - self.started,
            outcome or f"finish {self.finish}",
        )


class _Quiet(_Record):
    """A request's part that logs nothing of its own (a step of beam search: the request logs once)."""

    def log(self, outcome: str | None = None) -> None:
        pass


class _Cut(Exception):
    """The drain deadline passed while a request was still in flight."""


CUT_MESSAGE = "the server shut down before this request finished (drain timeout); retry it"


def _drop(task: asyncio.Future | None) -> None:
    """Cancel a task whose outcome nobody will read, and read it when it comes: one that ends with an
    exception unread (the events' StopAsyncIteration once the client has left) is otherwise logged as
    'Task exception was never retrieved', once per client that left."""
    if task is not None:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _until_cut(events, cut: asyncio.Event):
    """`events` as they come, until `cut` is set: then _Cut. Closed early (the client left), it
    leaves no task behind."""
    stop = asyncio.ensure_future(cut.wait())
    it = events.__aiter__()
    step = None
    try:
        while True:
            step = asyncio.ensure_future(it.__anext__())
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise _Cut
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        _drop(stop)
        _drop(step)


class _Choices:
    """The Jobs of one request's generations (n, or best_of), their events merged as (index, item)."""

    def __init__(self, jobs: list):
        self.jobs = jobs
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.ensure_future(self._pump(i, job)) for i, job in enumerate(jobs)] if len(jobs) > 1 else []

    async def _pump(self, index: int, job) -> None:
        async for item in job.events():
            self._queue.put_nowait((index, item))
        self._queue.put_nowait((index, _ENDED))

    async def events(self, keepalive_s: float | None = None):
        """(index, Step or Exception) as they come; None every `keepalive_s` of silence from all."""
        if not self._pumps:  # one generation: its own events, unmerged
            async for item in self.jobs[0].events(keepalive_s):
                yield None if item is None else (0, item)
            return
        left = len(self.jobs)
        while left:
            try:
                index, item = await asyncio.wait_for(self._queue.get(), keepalive_s)
            except asyncio.TimeoutError:
                yield None
                continue
            if item is _ENDED:
                left -= 1
            else:
                yield index, item

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()
        for pump in self._pumps:
            _drop(pump)


_ENDED = object()


async def _stream(
    choices: _Choices,
    head: dict,
    chat: bool,
    include_usage: bool,
    record: _Record,
    cut: asyncio.Event,
    echo: _Echo | None = None,
    logprobs: list[_Logprobs] | None = None,
):
    """SSE events: (chat: a role delta per choice), then per choice as its rows produce them: (`echo`:
    its text, with the prompt's logprobs), text deltas (with their tokens' logprobs when asked) and a
    finish chunk, each naming the choice's `index`; (usage), [DONE]. A failure mid-stream, or the
    drain deadline, is an `{"error": ...}` event, then [DONE]. Leaving this generator early — the
    client disconnected — cancels the jobs, which frees their slots."""
    usage = {"usage": None} if include_usage else {}
    n = len(choices.jobs)
    finished, started, outcome = set(), set(), "client gone"
    try:
        for index in range(n) if chat else ():
            yield _sse({**head, "choices": [_choice(True, True, "", None, role=True, index=index)], **usage})
        async for got in _until_cut(choices.events(KEEPALIVE_S), cut):
            if got is None:
                yield ": keep-alive\n\n"
                continue
            index, item = got
            if isinstance(item, RequestError):  # what the request asked admits no token: the client's
                outcome = f"refused: {item}"
                yield _sse(error_body(str(item), "invalid_request_error", item.param))
                break
            if isinstance(item, Exception):
                outcome = f"failed: {type(item).__name__}"
                yield _sse(error_body(f"generation failed: {type(item).__name__}: {item}", "server_error"))
                break
            record.step(index, item)
            scores = logprobs[index] if logprobs is not None else None
            if index not in started and echo is not None and echo.text:
                prompt = scores and scores(_prompt_entries(echo.ids, item))
                echoed = _choice(chat, True, echo.text, None, index=index, logprobs=prompt)
                yield _sse({**head, "choices": [echoed], **usage})
            started.add(index)
            entries = scores(_step_entries(item)) if scores is not None else None
            if item.text or entries:
                chunk = _choice(chat, True, item.text, None, index=index, logprobs=entries)
                yield _sse({**head, "choices": [chunk], **usage})
            if item.finish_reason:
                finished.add(index)
                end = _choice(
                    chat, True, None if chat else "", item.finish_reason, index=index, stop_reason=item.stop_reason
                )
                yield _sse({**head, "choices": [end], **usage})
        done = len(finished) == n
        if done and include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(record.n_prompt, record.completion)})
        outcome = None if done else outcome
        yield "data: [DONE]\n\n"
    except _Cut:
        outcome = "cut at the drain deadline"
        yield _sse(error_body(CUT_MESSAGE, "service_unavailable", code="draining"))
        yield "data: [DONE]\n\n"
    finally:
        choices.cancel()
        record.log(outcome)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class _Result:
    """One generation's whole answer."""

    text: str = ""
    finish: str | None = None
    stop_reason: int | str | None = None
    completion: int = 0
    logprob: float | None = None
    entries: list = field(default_factory=list)  # [(token, its logprobs)]: the prompt's (echo), then the choice's
    prompt_logprobs: tuple | None = None  # the first Step's: each prompt token's logprobs, None first


async def _collect(
    choices: _Choices,
    request: Request,
    cut: asyncio.Event,
    record: _Record,
    echo: _Echo | None,
    logprobs_n: int | None = None,
):
    """Each generation's _Result, in order, or None when the client left first; a 503 APIError at
    the drain deadline. `logprobs_n`: the most likely tokens kept per echoed prompt token."""

    async def consume():
        results = [_Result() for _ in choices.jobs]
        parts = [[] for _ in choices.jobs]
        async for index, item in _until_cut(choices.events(), cut):
            if isinstance(item, RequestError):  # what the request asked admits no token: the client's
                raise APIError(400, str(item), param=item.param)
            if isinstance(item, Exception):
                raise APIError(500, f"generation failed: {type(item).__name__}: {item}", "server_error")
            record.step(index, item)
            result = results[index]
            if not parts[index]:
                result.prompt_logprobs = item.prompt_logprobs
                if echo is not None:
                    result.entries += _prompt_entries(echo.ids, item, logprobs_n)
            result.entries += _step_entries(item)
            parts[index].append(item.text)
            result.finish, result.completion = item.finish_reason or result.finish, item.completion_tokens
            result.stop_reason, result.logprob = item.stop_reason, item.cumulative_logprob
        for result, texts in zip(results, parts):
            result.text = "".join(texts)
        return results

    consumer, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(_disconnected(request))
    outcome = "client gone"
    try:
        await asyncio.wait({consumer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():
            return None
        try:
            result = consumer.result()
        except _Cut:
            outcome = "cut at the drain deadline"
            raise APIError(
                503, CUT_MESSAGE, "service_unavailable", code="draining", retry_after=DRAINING_RETRY_AFTER_S
            ) from None
        except APIError as e:
            outcome = f"failed: {e.message}"
            raise
        outcome = None
        return result
    finally:
        _drop(gone)
        _drop(consumer)
        choices.cancel()
        record.log(outcome)


def _best(results: list[_Result], n: int) -> list[int]:
    """Which n of best_of generations are answered: the most likely (the highest sum of their tokens'
    logprobs, vLLM's ranking), most likely first; all of them, in order, when there are only n."""
    order = range(len(results))
    return list(order) if len(results) == n else sorted(order, key=lambda i: results[i].logprob, reverse=True)[:n]


def _unknown_model(model: str, names: list[str]) -> APIError:
    served = ", ".join(repr(n) for n in names)
    return APIError(
        404, f"model {model!r} does not exist; this server serves {served}", param="model", code="model_not_found"
    )


def _check_prompt_bytes(engine: Engine, texts: list[str], param: str) -> None:
    """Refuse, without tokenizing it, a prompt longer in UTF-8 bytes than the longest prompt the
    model takes could be: no token stands for more than `max_token_bytes` bytes (a 10 MB prompt
    would otherwise hold a CPU core in the tokenizer for many seconds, only to be refused)."""
    per_token = getattr(engine.tokenizer, "max_token_bytes", None)
    if per_token is None:
        return
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    limit = engine.max_context
    if n_bytes > limit * per_token:
        raise APIError(
            400,
            f"the prompt is {n_bytes} bytes, more than the {limit} tokens this model "
            f"takes can hold (a token is at most {per_token} bytes)",
            param=param,
        )


def _check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    """Token ids a client sent (a prompt, /detokenize) must be the model's: below its vocabulary size."""
    bad = [i for i in ids if vocab_size is not None and i >= vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is not below the vocabulary size {vocab_size}", param=param)


def create_app(
    load: Callable[[], Engine],
    *,
    model_name: str | Sequence[str],
    api_key: str | None = None,
    max_running: int | None = None,
    max_queue: int = 32,
    max_body_bytes: int = MAX_BODY_BYTES,
    vocab_size: int | None = None,
    body_timeout: float = BODY_TIMEOUT_S,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """`load` builds the Engine; it runs in a thread at startup while the server already answers.
    `model_name`: the served name, or names (requests may give any; responses carry the first).
    `max_running`: requests generating at once (default: a batching engine's rows, else 1).
    `vocab_size`: the bound on token ids a client sends (None: not checked)."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    model_name = names[0]
    metrics = Metrics(model_name)
    scheduler = Scheduler(max_running, max_queue, metrics)

    def load_and_open() -> Engine:
        engine = load()
        scheduler.open(engine)
        return engine

    state = ServerState(load_and_open, on_load_error)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        state.loop = asyncio.get_running_loop()
        state.start_loading()
        yield
        scheduler.close()

    app = FastAPI(title="neuron-moe", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.server = state  # server.py marks it draining on SIGTERM; tests read it
    app.state.scheduler = scheduler
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout)
    if api_key:  # added last, so it runs first: no body is read for a client without the key
        app.add_middleware(BearerAuth, key=api_key)

    @app.get("/health")
    async def health():
        problem = state.unavailable()
        running = min(scheduler.admitted, scheduler.max_running or 0)
        body = {
            "status": "draining" if state.draining else state.phase,
            "model": model_name,
            "running": running,
            "waiting": scheduler.admitted - running,
        }
        return JSONResponse(body, problem.status if problem else 200, headers=problem.headers if problem else None)

    @app.get("/ping")
    async def ping():  # what AWS's containers health-check
        return await health()

    @app.get("/version")
    async def version():  # vLLM's
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():  # open, as /health: what a Prometheus scraper reads (metrics.py)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card(name: str) -> dict:
        context = state.engine.max_context if state.engine is not None else None  # known once loaded
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "neuron-moe",
            "root": names[0],
            "parent": None,
            "max_model_len": context,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in names]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):  # the `openai` client's models.retrieve; a served name may hold a '/'
        if model not in names:
            raise _unknown_model(model, names)
        return model_card(model)

    def ready_engine(model: str | None) -> Engine:
        problem = state.unavailable()
        if problem:
            raise problem
        if model is not None and model not in names:
            raise _unknown_model(model, names)
        return state.engine

    async def respond(
        engine: Engine,
        req,
        request: Request,
        prompt_ids: list[int],
        extra_stops: tuple,
        chat: bool,
        started: float,
        echo: _Echo | None = None,
    ):
        """Generate `req.candidates` completions of the prompt (each its own row or thread, choice i
        seeded with seed + i, as vLLM seeds them) and answer the `req.choices` most likely, `echo`
        before each one's text."""
        problem = state.unavailable()  # the server may have begun draining while the prompt was tokenized
        if problem:
            raise problem
        n, runs = req.choices, req.candidates
        if req.use_beam_search:
            return await beam_search(engine, req, request, prompt_ids, chat, started, extra_stops)
        try:
            max_tokens = engine.max_tokens_for(len(prompt_ids), req.requested_max_tokens)
            params = SamplingParams(
                max_tokens,
                **req.sampling,
                **req.stopping,
                stop=tuple(req.stop or ()) + extra_stops,
                processing=req.asked_processing,
                rank=runs > n,
                grammar=req.grammar,
                **req.vocabulary,
            )
            engine.check_sampling(params)
            if params.grammar is not None:  # compiled (or found in the cache) off the event loop
                await asyncio.to_thread(engine.compile_grammar, params)
        except RequestError as e:
            where = {
                "prompt": "messages" if chat else "prompt",
                "max_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
            }
            raise APIError(400, str(e), param=where.get(e.param, e.param)) from None
        _check_token_ids(list(params.stop_token_ids), vocab_size, "stop_token_ids")
        most = scheduler.max_running + scheduler.max_queue
        if runs > most:
            raise APIError(
                400,
                f"{'best_of' if runs > n else 'n'}={runs}: this server runs {scheduler.max_running} generation(s) "
                f"and queues {scheduler.max_queue}, so a request may ask for at most {most}",
                param="best_of" if runs > n else "n",
            )
        seeds = [None if params.seed is None else params.seed + i for i in range(runs)]
        choices = _Choices(scheduler.submit_all(engine, prompt_ids, [replace(params, seed=s) for s in seeds]))
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chat and req.stream else ""),
            "created": int(time.time()),
            "model": model_name,
        }
        record = _Record(head["id"], len(prompt_ids), started)
        asked = params.processing.logprobs is not None  # each choice its own: text_offset runs on per choice
        logprobs = [_Logprobs(engine.tokenizer, chat) for _ in range(runs)] if asked else None
        if req.stream:
            return StreamingResponse(
                _stream(choices, head, chat, req.include_usage, record, state.cut, echo, logprobs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        kept = None if chat else req.logprobs  # echo's prompt logprobs: as many most likely as logprobs asks
        results = await _collect(choices, request, state.cut, record, echo, kept)
        if results is None:
            return Response(status_code=499)  # nobody is listening; the status is for the access log
        before = echo.text if echo is not None else ""
        prompt_n = req.answered_prompt_logprobs
        answered = []
        for i, j in enumerate(_best(results, n)):
            choice = _choice(
                chat,
                False,
                before + results[j].text,
                results[j].finish,
                index=i,
                stop_reason=results[j].stop_reason,
                logprobs=logprobs[j](results[j].entries) if logprobs is not None else None,
            )
            if prompt_n is not None and not chat:  # vLLM's: a completion choice's
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(
                    engine.tokenizer, results[j].prompt_logprobs, prompt_n
                )
            answered.append(choice)
        extra = {}
        if prompt_n is not None and chat:  # vLLM's: the chat response's, once (the prompt is the choices' own)
            extra["prompt_logprobs"] = _vllm_prompt_logprobs(engine.tokenizer, results[0].prompt_logprobs, prompt_n)
        # usage as OpenAI counts it: the prompt once, every generated token (best_of's candidates too)
        usage = _usage(len(prompt_ids), sum(r.completion for r in results))
        return {**head, "choices": answered, "usage": usage, **extra}

    async def beam_search(
        engine: Engine, req, request: Request, prompt_ids: list[int], chat: bool, started: float, stops: tuple = ()
    ):
        """vLLM's beam search, as vLLM runs it above its engine: each step, every live beam is a one-token
        request whose prompt is the beam's whole sequence, asking the 2·n most likely tokens' logprobs
        (the model's own); each beam goes on with each of those (and the token drawn), an EOS (unless
        ignore_eos) completing it; the n best by cumulative logprob / length^length_penalty (the length
        counting the prompt, not a final EOS: vLLM's score) live on. After max_tokens, the n best of the
        completed and the live are the choices. Every step prefills every beam again (a request that asks for logprobs
        takes no prefix from the prefix cache).
        A chat template's own stop string (`stops`: the plain fallback's) cuts a choice's text, as it ends
        any other answer."""
        width = req.choices
        try:
            max_tokens = engine.max_tokens_for(len(prompt_ids), req.requested_max_tokens)
        except RequestError as e:
            field = {"prompt": "messages" if chat else "prompt"}.get(e.param, e.param)
            raise APIError(400, str(e), param=field) from None
        if width > scheduler.max_running + scheduler.max_queue:
            raise APIError(400, f"n={width}: more beams than this server runs and queues", param="n")
        temperature = 1.0 if req.temperature is None else req.temperature
        penalty = 1.0 if req.length_penalty is None else req.length_penalty
        step_params = SamplingParams(1, temperature=temperature, processing=Processing(logprobs=2 * width))
        try:
            engine.check_sampling(step_params)  # the logprobs it reads need the logits-processing graphs
        except RequestError as e:
            raise APIError(400, f"use_beam_search reads logprobs: {e}", param="use_beam_search") from None
        eos, keep_eos = engine.eos_ids, bool(req.include_stop_str_in_output)

        def score(tokens: list[int], cumulative: float) -> float:
            """cumulative / length^penalty (≤ 0), worked out in logs so that no power overflows."""
            length = max(1, len(tokens) - (1 if tokens[-1] in eos else 0))
            if cumulative >= 0:
                return 0.0
            return -math.exp(min(700.0, math.log(-cumulative) - penalty * math.log(length)))

        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        record = _Record(head["id"], len(prompt_ids), started)
        beams: list[tuple[list[int], float]] = [(list(prompt_ids), 0.0)]
        completed: list[tuple[list[int], float, str]] = []
        for _ in range(max_tokens):
            jobs = []
            try:
                for tokens, _ in beams:
                    jobs += scheduler.submit_all(engine, tokens, [step_params])
            except APIError:
                for job in jobs:
                    job.cancel()
                raise
            results = await _collect(_Choices(jobs), request, state.cut, _Quiet(head["id"], 0, started), None)
            if results is None:
                record.log("client gone")
                return Response(status_code=499)
            grown = []
            for (tokens, cumulative), result in zip(beams, results):
                entry = result.entries[-1][1]
                for token, logprob in dict([*entry.top, (entry.token, entry.logprob)]).items():
                    if token in eos and not req.ignore_eos:
                        ended = tokens + [token] if keep_eos else tokens
                        completed.append((ended, cumulative + logprob, "stop"))
                    else:
                        grown.append((tokens + [token], cumulative + logprob))
            beams = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
            if not beams:
                break
        completed += [(tokens, cumulative, "length") for tokens, cumulative in beams]
        best = sorted(completed, key=lambda b: score(b[0], b[1]), reverse=True)[:width]
        choices = []
        for i, (tokens, _, finish) in enumerate(best):
            generated = tokens[len(prompt_ids) :]
            text = await asyncio.to_thread(engine.tokenizer.decode, generated)
            cut = min((j for j in (text.find(stop) for stop in stops) if j >= 0), default=None)
            text, finish = (text, finish) if cut is None else (text[:cut], "stop")
            choices.append(_choice(chat, False, text, finish, index=i))
            record.tokens[i] = len(generated)
        record.finish = "beam search"
        record.log()
        return {**head, "choices": choices, "usage": _usage(len(prompt_ids), record.completion)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        started = time.perf_counter()
        engine = ready_engine(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        _check_prompt_bytes(engine, [m["content"] for m in messages], "messages")
        prompt_ids, extra_stops = await asyncio.to_thread(render_chat, engine.tokenizer, messages)
        # vLLM's chat echo: the conversation's last turn, when it is the assistant's, goes on in the answer
        last = messages[-1]
        echo = _Echo(last["content"], []) if req.echo and last["role"] == "assistant" else None
        return await respond(engine, req, request, prompt_ids, extra_stops, chat=True, started=started, echo=echo)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        started = time.perf_counter()
        engine = ready_engine(req.model)
        if isinstance(req.prompt, list):  # token ids, as they are
            _check_token_ids(req.prompt, vocab_size, "prompt")
            prompt_ids = req.prompt
        else:
            _check_prompt_bytes(engine, [req.prompt], "prompt")
            prompt_ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt)
        echo = None
        if req.echo:  # the prompt as sent, or its ids' text, and its ids (their logprobs, with logprobs)
            text = (
                req.prompt
                if isinstance(req.prompt, str)
                else await asyncio.to_thread(engine.tokenizer.decode, prompt_ids)
            )
            echo = _Echo(text, list(prompt_ids))
        return await respond(engine, req, request, prompt_ids, (), chat=False, started=started, echo=echo)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):  # vLLM's: the ids a completion of this prompt would start from
        engine = ready_engine(req.model)
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            _check_prompt_bytes(engine, [m["content"] for m in messages], "messages")
            ids, _ = await asyncio.to_thread(render_chat, engine.tokenizer, messages)
        else:
            _check_prompt_bytes(engine, [req.prompt], "prompt")
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        engine = ready_engine(req.model)
        _check_token_ids(req.tokens, vocab_size, "tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}

    # ---- SageMaker's contract (deploy/sagemaker.py starts the server for it; its GET /ping is above):
    # POST /invocations takes an OpenAI body and answers as the route its fields name (invocations.py)
    @app.post("/invocations")
    async def invocations(request: Request):
        req = invocation_request(await request.body(), model_name)
        if isinstance(req, ChatRequest):
            return await chat_completions(req, request)
        return await completions(req, request)

    return app
