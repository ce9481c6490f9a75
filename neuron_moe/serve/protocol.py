"""Request bodies of the OpenAI dialect and errors in its shape.

Unknown fields are ignored (clients send `extra_body` as-is); fields we cannot honour
(n > 1, logprobs, echo, best_of, tools) are refused with 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, field_validator, model_validator

MAX_STOPS = 4


class APIError(Exception):
    """Answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", *,
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _unicode(text: str) -> str:
    """JSON may carry a lone surrogate (\\ud800); no tokenizer can encode one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone surrogate (\\ud800-\\udfff): not valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    logprobs: bool | int | None = None
    tools: list | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return stops

    @field_validator("n", "best_of")
    @classmethod
    def _one(cls, v, info):
        if v is not None and v != 1:
            raise ValueError(f"only {info.field_name}=1 is supported")
        return v

    @field_validator("echo", "logprobs", "tools")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens; it wins when both are sent
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)


PROMPT_FORMS = "a string, a list of token ids, or a list of one of either"


def _token_ids(v: list) -> list[int]:
    if not v:
        raise ValueError("the prompt holds no token")
    bad = next((t for t in v if type(t) is not int or t < 0), None)
    if bad is not None:
        raise ValueError(f"token ids are integers from 0, got {bad!r}")
    return v


class CompletionRequest(_Sampling):
    """`prompt` as OpenAI allows it: a string, token ids, or a list of one of either (one prompt per
    request: several are refused, naming how many)."""

    prompt: Text | list

    @field_validator("prompt")
    @classmethod
    def _single(cls, v):
        if isinstance(v, str):
            return v
        if v and all(isinstance(p, (str, list)) for p in v):  # a batch of prompts
            if len(v) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(v)}: send each as its own request")
            v = v[0]
            if isinstance(v, str):
                return _unicode(v)
        if not isinstance(v, list) or any(isinstance(p, (str, list)) for p in v):
            raise ValueError(f"must be {PROMPT_FORMS}")
        return _token_ids(v)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` rendered as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' (text) or 'messages' (a chat), not both or neither")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: at least one message")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v):
        return _token_ids(v) if v else v
