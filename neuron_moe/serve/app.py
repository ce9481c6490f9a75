"""The HTTP surface: OpenAI-compatible routes over an Engine.

POST /v1/chat/completions and /v1/completions (SSE when `stream`), GET /v1/models — behind
the bearer key when one is set — and GET /health, /ping, open for load balancers and
Docker's HEALTHCHECK. The model loads in a thread once the socket is bound; until it is
ready, /health, /ping and the completion routes answer 503 + Retry-After. Every error is
OpenAI's `{"error": {...}}` with 400 for an invalid request (never FastAPI's 422).

Nothing slow runs on the event loop, so /health answers under any request mix: a body over
`max_body_bytes` is refused (413) before it is read, tokenizing runs in a thread, and a prompt
longer in bytes than the longest prompt the model takes could be in tokens is refused untokenized.
Draining (SIGTERM) refuses new requests; past the drain timeout the requests still in flight are
ended properly: a stream with an error event and [DONE], a plain request with a 503 JSON body.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..report import dumps
from .chat import render_chat
from .engine import Engine, RequestError, SamplingParams
from .metrics import CONTENT_TYPE, Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, FieldError, error_body
from .scheduler import Scheduler

log = logging.getLogger("neuron_moe.serve")
LOADING_RETRY_AFTER_S = 5
DRAINING_RETRY_AFTER_S = 5
KEEPALIVE_S = 15.0  # an SSE comment while a streamed request waits in the queue
MAX_BODY_BYTES = 4 * 2**20  # a full 262144-token context is about 1 MiB of text; 4 leaves room for JSON escapes


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

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="load-model", daemon=True).start()

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
            return APIError(503, "the server is shutting down", "service_unavailable", code="draining",
                            retry_after=DRAINING_RETRY_AFTER_S)
        if self.phase == "loading":
            return APIError(503, "the model is loading", "service_unavailable", code="model_loading",
                            retry_after=LOADING_RETRY_AFTER_S)
        if self.phase == "failed":
            return APIError(503, f"the model failed to load: {self.error}", "service_unavailable",
                            code="model_load_failed")
        return None


class BearerAuth:
    """Pure ASGI (a BaseHTTPMiddleware would break disconnect detection of streams): every
    /v1 route needs `Authorization: Bearer <key>`; /health and /ping stay open."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                body = error_body("missing or invalid API key (send 'Authorization: Bearer <key>')",
                                  "invalid_request_error", code="invalid_api_key")
                await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Pure ASGI: a request body over `max_bytes` gets 413 in OpenAI's shape — at once when its
    Content-Length says so, else as soon as the chunks received pass it — and is never read whole."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _message(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            body = error_body(self._message(), "invalid_request_error", code="request_too_large")
            return await JSONResponse(body, 413, headers={"Connection": "close"})(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
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


async def _validation_error(_request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return JSONResponse(error_body(f"the request body is not valid JSON: {err.get('msg')}",
                                       "invalid_request_error"), 400)
    cause = (err.get("ctx") or {}).get("error")
    param = cause.field if isinstance(cause, FieldError) else _param(err.get("loc", ()))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return JSONResponse(error_body(f"{param}: {msg}" if param else msg, "invalid_request_error", param), 400)


async def _http_error(_request, exc: HTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = "request_too_large" if exc.status_code == 413 else None
    return JSONResponse(error_body(str(exc.detail), kind, code=code), exc.status_code, headers=exc.headers)


async def _server_error(_request, exc: Exception) -> JSONResponse:
    # Starlette re-raises it after this answer, so the server logs the traceback
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), 500)


def _choice(chat: bool, stream: bool, text: str | None, finish: str | None, role: bool = False) -> dict:
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if not stream:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}
    delta = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj) -> str:
    return f"data: {dumps(obj)}\n\n"


class _Cut(Exception):
    """The drain deadline passed while a request was still in flight."""


CUT_MESSAGE = "the server shut down before this request finished (drain timeout); retry it"


async def _until_cut(events, cut: asyncio.Event):
    """`events` as they come, until `cut` is set: then _Cut."""
    stop = asyncio.ensure_future(cut.wait())
    it = events.__aiter__()
    try:
        while True:
            step = asyncio.ensure_future(it.__anext__())
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                raise _Cut
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stop.cancel()


async def _stream(job, head: dict, chat: bool, include_usage: bool, n_prompt: int, cut: asyncio.Event):
    """SSE events: (chat: a role delta), text deltas, a finish chunk, (usage), [DONE]. A
    failure mid-stream, or the drain deadline, is an `{"error": ...}` event, then [DONE]. Leaving
    this generator early — the client disconnected — cancels the job, which frees its slot."""
    usage = {"usage": None} if include_usage else {}
    completion, finished = 0, False
    try:
        if chat:
            yield _sse({**head, "choices": [_choice(True, True, "", None, role=True)], **usage})
        async for item in _until_cut(job.events(KEEPALIVE_S), cut):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            if isinstance(item, Exception):
                yield _sse(error_body(f"generation failed: {type(item).__name__}: {item}", "server_error"))
                break
            completion = item.completion_tokens
            if item.text:
                yield _sse({**head, "choices": [_choice(chat, True, item.text, None)], **usage})
            if item.finish_reason:
                finished = True
                yield _sse({**head, "choices": [_choice(chat, True, None if chat else "", item.finish_reason)],
                            **usage})
        if finished and include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(n_prompt, completion)})
        yield "data: [DONE]\n\n"
    except _Cut:
        yield _sse(error_body(CUT_MESSAGE, "service_unavailable", code="draining"))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(job, request: Request, cut: asyncio.Event):
    """(text, finish_reason, completion tokens), or None when the client left first; a 503
    APIError at the drain deadline."""
    async def consume():
        parts, finish, completion = [], None, 0
        async for item in _until_cut(job.events(), cut):
            if isinstance(item, Exception):
                raise APIError(500, f"generation failed: {type(item).__name__}: {item}", "server_error")
            parts.append(item.text)
            finish, completion = item.finish_reason or finish, item.completion_tokens
        return "".join(parts), finish, completion

    consumer, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({consumer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():
            return None
        try:
            return consumer.result()
        except _Cut:
            raise APIError(503, CUT_MESSAGE, "service_unavailable", code="draining",
                           retry_after=DRAINING_RETRY_AFTER_S) from None
    finally:
        gone.cancel()
        consumer.cancel()
        job.cancel()


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
        raise APIError(400, f"the prompt is {n_bytes} bytes, more than the {limit} tokens this model "
                            f"takes can hold (a token is at most {per_token} bytes)", param=param)


def create_app(load: Callable[[], Engine], *, model_name: str, api_key: str | None = None,
               max_running: int | None = None, max_queue: int = 32, max_body_bytes: int = MAX_BODY_BYTES,
               on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """`load` builds the Engine; it runs in a thread at startup while the server already answers.
    `max_running`: requests generating at once (default: a batching engine's rows, else 1)."""
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

    app = FastAPI(title="neuron-moe", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state  # server.py marks it draining on SIGTERM; tests read it
    app.state.scheduler = scheduler
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:  # added last, so it runs first: no body is read for a client without the key
        app.add_middleware(BearerAuth, key=api_key)

    @app.get("/health")
    async def health():
        problem = state.unavailable()
        running = min(scheduler.admitted, scheduler.max_running or 0)
        body = {"status": "draining" if state.draining else state.phase, "model": model_name,
                "running": running, "waiting": scheduler.admitted - running}
        return JSONResponse(body, problem.status if problem else 200, headers=problem.headers if problem else None)

    @app.get("/ping")
    async def ping():  # what AWS's containers health-check
        return await health()

    @app.get("/metrics")
    async def prometheus_metrics():  # open, as /health: what a Prometheus scraper reads (metrics.py)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "neuron-moe"}]}

    def ready_engine(model: str) -> Engine:
        problem = state.unavailable()
        if problem:
            raise problem
        if model != model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return state.engine

    async def respond(engine: Engine, req, request: Request, prompt_ids: list[int], extra_stops: tuple,
                      chat: bool):
        problem = state.unavailable()  # the server may have begun draining while the prompt was tokenized
        if problem:
            raise problem
        try:
            max_tokens = engine.max_tokens_for(len(prompt_ids), req.requested_max_tokens)
            params = SamplingParams(max_tokens, **req.sampling, stop=tuple(req.stop or ()) + extra_stops)
            engine.check_sampling(params)
        except RequestError as e:
            where = {"prompt": "messages" if chat else "prompt",
                     "max_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens"}
            raise APIError(400, str(e), param=where.get(e.param, e.param)) from None
        job = scheduler.submit(engine, prompt_ids, params)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chat and req.stream else ""),
                "created": int(time.time()), "model": model_name}
        if req.stream:
            return StreamingResponse(_stream(job, head, chat, req.include_usage, len(prompt_ids), state.cut),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        result = await _collect(job, request, state.cut)
        if result is None:
            return Response(status_code=499)  # nobody is listening; the status is for the access log
        text, finish, completion = result
        return {**head, "choices": [_choice(chat, False, text, finish)], "usage": _usage(len(prompt_ids), completion)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        engine = ready_engine(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        _check_prompt_bytes(engine, [m["content"] for m in messages], "messages")
        prompt_ids, extra_stops = await asyncio.to_thread(render_chat, engine.tokenizer, messages)
        return await respond(engine, req, request, prompt_ids, extra_stops, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        engine = ready_engine(req.model)
        _check_prompt_bytes(engine, [req.prompt], "prompt")
        prompt_ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt)
        return await respond(engine, req, request, prompt_ids, (), chat=False)

    return app
