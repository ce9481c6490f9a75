"""The HTTP surface: OpenAI-compatible routes over an Engine.

POST /v1/chat/completions and /v1/completions (SSE when `stream`), GET /v1/models — behind
the bearer key when one is set — and GET /health, /ping, open for load balancers and
Docker's HEALTHCHECK. The model loads in a thread once the socket is bound; until it is
ready, /health, /ping and the completion routes answer 503 + Retry-After. Every error is
OpenAI's `{"error": {...}}` with 400 for an invalid request (never FastAPI's 422).
"""

from __future__ import annotations

import asyncio
import hmac
import json
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

from .chat import render_chat
from .engine import Engine, RequestError, SamplingParams
from .protocol import APIError, ChatRequest, CompletionRequest, error_body
from .scheduler import Scheduler

log = logging.getLogger("neuron_moe.serve")
LOADING_RETRY_AFTER_S = 5
DRAINING_RETRY_AFTER_S = 5
KEEPALIVE_S = 15.0  # an SSE comment while a streamed request waits in the queue


class ServerState:
    """Loading -> ready (or failed); draining once the server was told to stop."""

    def __init__(self, load: Callable[[], Engine], on_load_error: Callable[[BaseException], None] | None):
        self.load, self.on_load_error = load, on_load_error
        self.phase = "loading"
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.draining = False

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


async def _api_error(_request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), e.status, headers=e.headers)


async def _validation_error(_request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return JSONResponse(error_body(f"the request body is not valid JSON: {err.get('msg')}",
                                       "invalid_request_error"), 400)
    param = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return JSONResponse(error_body(f"{param}: {msg}" if param else msg, "invalid_request_error", param), 400)


async def _http_error(_request, exc: HTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)


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
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(job, head: dict, chat: bool, include_usage: bool, n_prompt: int):
    """SSE events: (chat: a role delta), text deltas, a finish chunk, (usage), [DONE]. A
    failure mid-stream is an `{"error": ...}` event, then [DONE]. Leaving this generator
    early — the client disconnected — cancels the job, which frees its slot."""
    usage = {"usage": None} if include_usage else {}
    completion, finished = 0, False
    try:
        if chat:
            yield _sse({**head, "choices": [_choice(True, True, "", None, role=True)], **usage})
        async for item in job.events(KEEPALIVE_S):
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
    finally:
        job.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(job, request: Request):
    """(text, finish_reason, completion tokens), or None when the client left first."""
    async def consume():
        parts, finish, completion = [], None, 0
        async for item in job.events():
            if isinstance(item, Exception):
                raise APIError(500, f"generation failed: {type(item).__name__}: {item}", "server_error")
            parts.append(item.text)
            finish, completion = item.finish_reason or finish, item.completion_tokens
        return "".join(parts), finish, completion

    consumer, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({consumer, gone}, return_when=asyncio.FIRST_COMPLETED)
        return consumer.result() if consumer.done() else None
    finally:
        gone.cancel()
        consumer.cancel()
        job.cancel()


def create_app(load: Callable[[], Engine], *, model_name: str, api_key: str | None = None,
               max_running: int | None = None, max_queue: int = 32,
               on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """`load` builds the Engine; it runs in a thread at startup while the server already answers.
    `max_running`: requests generating at once (default: a batching engine's rows, else 1)."""
    scheduler = Scheduler(max_running, max_queue)

    def load_and_open() -> Engine:
        engine = load()
        scheduler.open(engine)
        return engine

    state = ServerState(load_and_open, on_load_error)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
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
    if api_key:
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
        try:
            max_tokens = engine.max_tokens_for(len(prompt_ids), req.requested_max_tokens)
            engine.check_sampling(req.temperature)
        except RequestError as e:
            where = {"prompt": "messages" if chat else "prompt",
                     "max_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens"}
            raise APIError(400, str(e), param=where.get(e.param, e.param)) from None
        params = SamplingParams(max_tokens, req.temperature, req.top_p, req.seed, tuple(req.stop or ()) + extra_stops)
        job = scheduler.submit(engine, prompt_ids, params)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chat and req.stream else ""),
                "created": int(time.time()), "model": model_name}
        if req.stream:
            return StreamingResponse(_stream(job, head, chat, req.include_usage, len(prompt_ids)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        result = await _collect(job, request)
        if result is None:
            return Response(status_code=499)  # nobody is listening; the status is for the access log
        text, finish, completion = result
        return {**head, "choices": [_choice(chat, False, text, finish)], "usage": _usage(len(prompt_ids), completion)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        engine = ready_engine(req.model)
        prompt_ids, extra_stops = render_chat(engine.tokenizer, [{"role": m.role, "content": m.text()}
                                                                 for m in req.messages])
        return await respond(engine, req, request, prompt_ids, extra_stops, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        engine = ready_engine(req.model)
        return await respond(engine, req, request, engine.tokenizer.encode(req.prompt), (), chat=False)

    return app
