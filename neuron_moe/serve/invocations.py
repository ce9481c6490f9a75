"""SageMaker's POST /invocations (its hosting contract; `deploy/sagemaker.py` starts the server for it):
an OpenAI request body, read as the route its fields name — `messages` makes it a chat completion,
anything else a completion — so that it is answered exactly as /v1/chat/completions or
/v1/completions answers that body, errors included (the same validation, the same 400s). An endpoint
serves one model: a body without `model` asks for it."""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from .protocol import ChatRequest, CompletionRequest


def invocation_request(body: bytes, model: str) -> ChatRequest | CompletionRequest:
    """The request `body` asks for (`model`: the served model, where the body names none); the
    RequestValidationError FastAPI raises for that route's body where it is not valid (not JSON, or
    not that route's request)."""
    try:
        doc = json.loads(body)
    except ValueError as e:  # FastAPI's own error for a body that is not JSON (a JSONDecodeError or a UnicodeError)
        where, why = getattr(e, "pos", 0), getattr(e, "msg", str(e))
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", where), "msg": "JSON decode error", "ctx": {"error": why}}]
        ) from None
    kind = ChatRequest if isinstance(doc, dict) and "messages" in doc else CompletionRequest
    if isinstance(doc, dict):
        doc.setdefault("model", model)
    try:
        return kind.model_validate(doc, from_attributes=True)  # as FastAPI validates a body
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
