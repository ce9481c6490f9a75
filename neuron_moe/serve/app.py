"""The HTTP surface: OpenAI-compatible routes over an Engine, in vLLM's dialect.

POST /v1/chat/completions and /v1/completions (SSE when `stream`), GET /v1/models and
/v1/models/{id}, and vLLM's POST /tokenize and /detokenize — behind the bearer key when one is
set — and GET /health, /ping, /version and /metrics, open for load balancers, Docker's
HEALTHCHECK and a Prometheus scraper (as vLLM's are: /metrics holds counts and latencies, no
request's content). A body that is not sent as JSON gets 415. The model loads in a
thread once the socket is bound; until it is ready, /health, /ping and the model's routes
answer 503 + Retry-After. Every error is OpenAI's `{"error": {...}}` with 400 for an invalid
request (never FastAPI's 422). Each request that generates logs one line when it ends: its
prompt and completion tokens, time to first token and duration. What a request's fields ask of the
engine, and the choices its Steps make, is `decoding.py`'s: this module admits, streams and frames.

Nothing slow runs on the event loop, so /health answers under any request mix: a body over
`max_body_bytes` is refused (413) before it is read, a body that has not all come within
`body_timeout` seconds gets 408 (a request's headers have their own deadline: `connection.py`),
tokenizing runs in a thread, and a prompt longer in bytes than the longest prompt the model takes
could be in tokens is refused untokenized. No schema or docs pages are served (`/openapi.json`,
`/docs`): the API is OpenAI's, documented by OpenAI, and a server behind a key shows nothing without it.
Draining (SIGTERM) refuses new requests; past the drain timeout the requests still in flight are
ended properly: a stream with an error event and [DONE], a plain request (or one whose body is still
arriving) with a 503 JSON body.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .. import __version__
from ..report import dumps
from . import decoding
from .chat import render_chat
from .decoding import Echo, Logprobs, RequestError, Result
from .engine import Engine
from .invocations import invocation_request
from .metrics import CONTENT_TYPE, Metrics
from .ready import Stopped
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
            if isinstance(e, Stopped):  # the server is exiting: not a failure of the model
                log.info("%s", e)
            else:
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
    one that has not all come `timeout_s` after the app began to read it gets 408, and one still
    arriving at the drain deadline (`cut`, which may come first: SageMaker's drain is shorter than
    the default body timeout) a 503 as any request in flight then (it would be refused once read)."""

    def __init__(self, app, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S, cut: asyncio.Event | None = None):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self.cut = cut or asyncio.Event()

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
                message = await asyncio.wait_for(_or_cut(receive(), self.cut), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not all arrive within {self.timeout_s:g} s",
                    headers={"Connection": "close"},
                ) from None
            except _Cut:  # an HTTPException, as the others: one passes FastAPI's body parsing as it is
                headers = {"Retry-After": str(DRAINING_RETRY_AFTER_S), "Connection": "close"}
                raise HTTPException(503, CUT_MESSAGE, headers=headers) from None
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
    kind, code = {
        408: (kind, "request_timeout"),
        413: (kind, "request_too_large"),
        503: ("service_unavailable", "draining"),  # BodyLimit's at the drain deadline
    }.get(exc.status_code, (kind, None))
    return JSONResponse(error_body(str(exc.detail), kind, code=code), exc.status_code, headers=exc.headers)


async def _server_error(_request, exc: Exception) -> JSONResponse:
    # Starlette re-raises it after this answer, so the server logs the traceback
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), 500)


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


async def _first(task: asyncio.Future, other: asyncio.Future) -> bool:
    """Wait until `task` or `other` is done; whether `task` is."""
    await asyncio.wait({task, other}, return_when=asyncio.FIRST_COMPLETED)
    return task.done()


async def _or_cut(awaitable, cut: asyncio.Event):
    """What `awaitable` returns, or _Cut once `cut` is set first. Cancelled or cut, it leaves no task
    behind."""
    task, stop = asyncio.ensure_future(awaitable), asyncio.ensure_future(cut.wait())
    try:
        if not await _first(task, stop):
            raise _Cut
        return task.result()
    finally:
        _drop(stop)
        _drop(task)


async def _until_cut(events, cut: asyncio.Event):
    """`events` as they come, until `cut` is set: then _Cut. Closed early (the client left), it
    leaves no task behind."""
    it = events.__aiter__()
    while True:
        try:
            item = await _or_cut(it.__anext__(), cut)
        except StopAsyncIteration:
            return
        yield item


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
    echo: Echo | None = None,
    logprobs: list[Logprobs] | None = None,
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
            yield _sse({**head, "choices": [decoding.choice(True, True, "", None, role=True, index=index)], **usage})
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
            first = index not in started
            started.add(index)
            if item.finish_reason:
                finished.add(index)
            for chunk in decoding.stream_choices(chat, index, item, first, echo, scores):
                yield _sse({**head, "choices": [chunk], **usage})
        done = len(finished) == n
        if done and include_usage:
            yield _sse({**head, "choices": [], "usage": decoding.usage(record.n_prompt, record.completion)})
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


async def _collect(
    choices: _Choices,
    request: Request,
    cut: asyncio.Event,
    record: _Record,
    echo: Echo | None,
    logprobs_n: int | None = None,
):
    """Each generation's Result, in order, or None when the client left first; a 503 APIError at
    the drain deadline. `logprobs_n`: the most likely tokens kept per echoed prompt token."""

    async def consume():
        results = [Result() for _ in choices.jobs]
        async for index, item in _until_cut(choices.events(), cut):
            if isinstance(item, RequestError):  # what the request asked admits no token: the client's
                raise APIError(400, str(item), param=item.param)
            if isinstance(item, Exception):
                raise APIError(500, f"generation failed: {type(item).__name__}: {item}", "server_error")
            record.step(index, item)
            results[index].add(item, echo, logprobs_n)
        return results

    consumer, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(_disconnected(request))
    outcome = "client gone"
    try:
        if not await _first(consumer, gone):
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


def _head(chat: bool, chunk: bool, model_name: str) -> dict:
    """A response's (or each chunk's) id, object, created and model."""
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chunk else ""),
        "created": int(time.time()),
        "model": model_name,
    }


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


class _Routes:
    """The routes' handlers over one server: its state, its admission, its metrics and the names it
    serves (requests may give any; responses carry the first)."""

    def __init__(self, state: ServerState, scheduler: Scheduler, metrics: Metrics, names: list[str], vocab_size):
        self.state, self.scheduler, self.metrics = state, scheduler, metrics
        self.names, self.model_name, self.vocab_size = names, names[0], vocab_size
        self.created = int(time.time())

    def add_to(self, app: FastAPI) -> None:
        """Each route on `app`, as `app.get`/`app.post` would add it."""
        for method, path, handler in (
            ("GET", "/health", self.health),
            ("GET", "/ping", self.ping),
            ("GET", "/version", self.version),
            ("GET", "/metrics", self.prometheus_metrics),
            ("GET", "/v1/models", self.models),
            ("GET", "/v1/models/{model:path}", self.model),
            ("POST", "/v1/chat/completions", self.chat_completions),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/tokenize", self.tokenize),
            ("POST", "/detokenize", self.detokenize),
            ("POST", "/invocations", self.invocations),
        ):
            app.add_api_route(path, handler, methods=[method])

    async def health(self):
        state, scheduler = self.state, self.scheduler
        problem = state.unavailable()
        running = min(scheduler.admitted, scheduler.max_running or 0)
        body = {
            "status": "draining" if state.draining else state.phase,
            "model": self.model_name,
            "running": running,
            "waiting": scheduler.admitted - running,
        }
        return JSONResponse(body, problem.status if problem else 200, headers=problem.headers if problem else None)

    async def ping(self):  # what AWS's containers health-check
        return await self.health()

    async def version(self):  # vLLM's
        return {"version": __version__}

    async def prometheus_metrics(self):  # open, as /health: what a Prometheus scraper reads (metrics.py)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def model_card(self, name: str) -> dict:
        context = self.state.engine.max_context if self.state.engine is not None else None  # known once loaded
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "neuron-moe",
            "root": self.names[0],
            "parent": None,
            "max_model_len": context,
        }

    async def models(self):
        return {"object": "list", "data": [self.model_card(name) for name in self.names]}

    async def model(self, model: str):  # the `openai` client's models.retrieve; a served name may hold a '/'
        if model not in self.names:
            raise _unknown_model(model, self.names)
        return self.model_card(model)

    def ready_engine(self, model: str | None) -> Engine:
        problem = self.state.unavailable()
        if problem:
            raise problem
        if model is not None and model not in self.names:
            raise _unknown_model(model, self.names)
        return self.state.engine

    async def respond(
        self,
        engine: Engine,
        req,
        request: Request,
        prompt_ids: list[int],
        extra_stops: tuple,
        chat: bool,
        started: float,
        echo: Echo | None = None,
    ):
        """Generate `req.candidates` completions of the prompt (each its own row or thread) and answer
        the `req.choices` most likely (decoding.py), streamed or whole, `echo` before each one's text."""
        problem = self.state.unavailable()  # the server may have begun draining while the prompt was tokenized
        if problem:
            raise problem
        if req.use_beam_search:
            return await self.beam_search(engine, req, request, prompt_ids, chat, started, extra_stops)
        scheduler = self.scheduler
        params = await decoding.sampling_params(engine, req, len(prompt_ids), extra_stops, chat)
        _check_token_ids(list(params.stop_token_ids), self.vocab_size, "stop_token_ids")
        decoding.check_runs(req, scheduler.max_running, scheduler.max_queue)
        choices = _Choices(scheduler.submit_all(engine, prompt_ids, decoding.seeded(params, req.candidates)))
        head = _head(chat, chat and req.stream, self.model_name)
        record = _Record(head["id"], len(prompt_ids), started)
        logprobs = decoding.logprobs_for(engine.tokenizer, params, chat, req.candidates)
        if req.stream:
            return StreamingResponse(
                _stream(choices, head, chat, req.include_usage, record, self.state.cut, echo, logprobs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        kept = None if chat else req.logprobs  # echo's prompt logprobs: as many most likely as logprobs asks
        results = await _collect(choices, request, self.state.cut, record, echo, kept)
        if results is None:
            return Response(status_code=499)  # nobody is listening; the status is for the access log
        return {**head, **decoding.answer(engine.tokenizer, req, results, chat, echo, logprobs, len(prompt_ids))}

    async def beam_search(
        self, engine: Engine, req, request: Request, prompt_ids: list[int], chat: bool, started: float, stops: tuple
    ):
        """vLLM's beam search (decoding.BeamSearch), each step's beams admitted as requests of their own
        (that log nothing: the request logs once)."""
        scheduler = self.scheduler
        search = decoding.BeamSearch(engine, req, len(prompt_ids), chat, scheduler.max_running, scheduler.max_queue)
        head = _head(chat, False, self.model_name)
        record = _Record(head["id"], len(prompt_ids), started)

        async def step(sequences: list[list[int]]) -> list[Result] | None:
            jobs = []
            try:
                for tokens in sequences:
                    jobs += scheduler.submit_all(engine, tokens, [search.params])
            except APIError:
                for job in jobs:
                    job.cancel()
                raise
            return await _collect(_Choices(jobs), request, self.state.cut, _Quiet(head["id"], 0, started), None)

        beams = await search.run(prompt_ids, step)
        if beams is None:
            record.log("client gone")
            return Response(status_code=499)
        choices, counts = await search.choices(engine.tokenizer, beams, len(prompt_ids), stops, chat)
        record.tokens = dict(enumerate(counts))
        record.finish = "beam search"
        record.log()
        return {**head, "choices": choices, "usage": decoding.usage(len(prompt_ids), record.completion)}

    async def chat_completions(self, req: ChatRequest, request: Request):
        started = time.perf_counter()
        engine = self.ready_engine(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        _check_prompt_bytes(engine, [m["content"] for m in messages], "messages")
        prompt_ids, extra_stops = await asyncio.to_thread(render_chat, engine.tokenizer, messages)
        # vLLM's chat echo: the conversation's last turn, when it is the assistant's, goes on in the answer
        last = messages[-1]
        echo = Echo(last["content"], []) if req.echo and last["role"] == "assistant" else None
        return await self.respond(engine, req, request, prompt_ids, extra_stops, chat=True, started=started, echo=echo)

    async def completions(self, req: CompletionRequest, request: Request):
        started = time.perf_counter()
        engine = self.ready_engine(req.model)
        if isinstance(req.prompt, list):  # token ids, as they are
            _check_token_ids(req.prompt, self.vocab_size, "prompt")
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
            echo = Echo(text, list(prompt_ids))
        return await self.respond(engine, req, request, prompt_ids, (), chat=False, started=started, echo=echo)

    async def tokenize(self, req: TokenizeRequest):  # vLLM's: the ids a completion of this prompt would start from
        engine = self.ready_engine(req.model)
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            _check_prompt_bytes(engine, [m["content"] for m in messages], "messages")
            ids, _ = await asyncio.to_thread(render_chat, engine.tokenizer, messages)
        else:
            _check_prompt_bytes(engine, [req.prompt], "prompt")
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": None}

    async def detokenize(self, req: DetokenizeRequest):
        engine = self.ready_engine(req.model)
        _check_token_ids(req.tokens, self.vocab_size, "tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}

    # SageMaker's contract (deploy/sagemaker.py starts the server for it; its GET /ping is above):
    # POST /invocations takes an OpenAI body and answers as the route its fields name (invocations.py)
    async def invocations(self, request: Request):
        req = invocation_request(await request.body(), request.headers.get("content-type"), self.model_name)
        if isinstance(req, ChatRequest):
            return await self.chat_completions(req, request)
        return await self.completions(req, request)


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
    metrics = Metrics(names[0])
    scheduler = Scheduler(max_running, max_queue, metrics)

    def load_and_open() -> Engine:
        engine = load()
        scheduler.open(engine)
        return engine

    state = ServerState(load_and_open, on_load_error)

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
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout, cut=state.cut)
    if api_key:  # added last, so it runs first: no body is read for a client without the key
        app.add_middleware(BearerAuth, key=api_key)
    _Routes(state, scheduler, metrics, names, vocab_size).add_to(app)
    return app
