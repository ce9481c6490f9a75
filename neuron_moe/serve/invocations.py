"""SageMaker's POST /invocations (its hosting contract; `deploy/sagemaker.py` starts the server for it):
an OpenAI request body, read as the route its fields name — `messages` makes it a chat completion,
anything else a completion — so that it is answered exactly as /v1/chat/completions or
/v1/completions answers that body, errors included (the same validation, the same 400s). An endpoint
serves one model: a body without `model` asks for it. As there, the body must be sent as JSON: another
Content-Type (or none) is a 415, no body a 400."""

from __future__ import annotations

import email.message
import json

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from .protocol import ChatRequest, CompletionRequest


def sent_as_json(content_type: str | None) -> bool:
    """Whether a Content-Type is JSON as FastAPI reads it for a route's body (application/json or
    application/*+json, any parameters; none is not, FastAPI's strict content type)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def invocation_request(body: bytes, content_type: str | None, model: str) -> ChatRequest | CompletionRequest:
    """The request `body` (sent as `content_type`) asks for (`model`: the served model, where the body
    names none); the RequestValidationError FastAPI raises for that route's body where it is not valid
    (none, not sent as JSON, not JSON, or not that route's request)."""
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    if not sent_as_json(content_type):  # FastAPI leaves such a body bytes: the app's 415
        raise RequestValidationError(
            [{"type": "model_attributes_type", "loc": ("body",), "msg": "not sent as JSON", "input": body}]
        )
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
