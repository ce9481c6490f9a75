"""Request bodies of the OpenAI dialect and errors in its shape.

Every field is checked against OpenAI's schema and ranges, strictly: a value of the wrong JSON
type is refused, never coerced ("0.5" is not a temperature, 1.0 is not a max_tokens, 1 is not a
`stream`), and `null`, where OpenAI allows it, means the field's default. Unknown fields are
ignored (clients send `extra_body` as-is); a field this server knows but does not honour (tools,
audio, `suffix`, …) is refused with 400 naming it when it asks for anything but its default
(`UNSUPPORTED`), and so is a field beam search does not take, sent with it: never accepted and
ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from ..static.sampling import Processing
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from .grammar import GrammarSpec

MAX_STOPS = 4
MAX_STOP_TOKEN_IDS = 32  # vLLM sets none; the logits-processing graphs take a fixed number of banned ids per row
MAX_BEST_OF = 20  # OpenAI's
# the fields that ask for structured output; at most one per request
GRAMMAR_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
MAX_BAD_WORDS = 64  # vLLM's limit is 128 token sequences; the graphs ban at most BIAS_WIDTH ids per row
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs, and the graphs' top-n width
MAX_LENGTH_PENALTY = 100.0  # vLLM takes any float; beyond this the length alone orders the beams
MAX_BEAMS = 10  # vLLM asks 2·n logprobs per beam and step; the graphs return at most MAX_TOP_LOGPROBS
# what vLLM's beam search takes (any other field set is refused with it, never ignored)
BEAM_FIELDS = frozenset(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "ignore_eos"}
    | {"include_stop_str_in_output", "use_beam_search", "length_penalty", "user"}
)
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries (the graphs take fewer: `engine.check_sampling`)
# vLLM takes any positive repetition_penalty; outside these a seen token's logit is scaled past any use
# (and near 0 to inf in fp32)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0

# What the server does not do, by field: the values that ask for nothing (their defaults). Any
# other value is a 400 naming the field. OpenAI's fields (each one's reason: docs/serving.md's
# field table); every sampling extra of vLLM's is honoured.
UNSUPPORTED: dict[str, tuple] = {
    # honoured by one route only (the request type that does lists it in its HONOURED): top_logprobs
    # in chat (completions' `logprobs` is a count)
    "top_logprobs": (),
    "tools": ([],),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "suffix": ("",),
    "modalities": (["text"],),
    "audio": (),
    "web_search_options": (),
}


class APIError(Exception):
    """Answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
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


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)  # JSON types as they are: nothing coerced


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class Message(_Strict):
    """A chat message; an assistant's `content` may be null (OpenAI's schema: a turn that only called
    tools), read as an empty turn. Tool calls themselves are refused by name."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None
    tool_calls: list | None = None
    function_call: dict | None = None

    @field_validator("content")
    @classmethod
    def _null_for_assistants(cls, v, info):
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"a {info.data['role']} message needs content; only an assistant's may be null")
        return v

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _no_tool_calls(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server (it runs no tools)")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool | None = None


def _schema(v):
    """A JSON schema: an object, or its text (vLLM's `guided_json` takes either)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError("nested too deep to read") from None
    if not isinstance(v, dict):
        raise ValueError(f"a JSON schema is a JSON object, got {type(v).__name__}")
    return v


Schema = Annotated[Text | dict, AfterValidator(_schema)]
Choices = Annotated[list[Text], Field(min_length=1)]
ANY_OBJECT = {"type": "object"}  # json_object: any JSON object


class JSONSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`; its schema is enforced whatever `strict` says."""

    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: Schema = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldError(
                "response_format.json_schema", "json_schema is given with type 'json_schema', and only then"
            )
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar or json_object, and options."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: Schema | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Choices | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | None = None
    disable_fallback: bool | None = None  # one grammar library here: nothing to fall back to, either way
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: Text | None = None

    @model_validator(mode="after")
    def _one(self):
        if self.structural_tag is not None:
            raise FieldError("structured_outputs.structural_tag", "structural_tag is not supported by this server")
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        is_json = self.json_ is not None or self.json_object
        for option, asks in (("whitespace_pattern", self.whitespace_pattern is not None),
                             ("disable_any_whitespace", self.disable_any_whitespace is False)):  # fmt: skip
            if asks and not is_json:
                raise FieldError(f"structured_outputs.{option}", f"{option} applies to json and json_object only")
        if len(given) != 1:
            raise FieldError(
                "structured_outputs",
                "give exactly one of json, regex, choice, grammar or json_object (true), got "
                + (", ".join(k.rstrip("_") for k in given) or "none"),
            )
        return self

    def spec(self) -> GrammarSpec:
        # strict JSON unless asked otherwise (grammar.py); false: JSON Schema's default, as vLLM's llguidance reads it
        options = {
            "whitespace_flexible": self.disable_any_whitespace is False,
            "strict": self.disable_additional_properties is not False,
        }
        if self.whitespace_pattern is not None:
            options.update(
                whitespace_pattern=self.whitespace_pattern, pattern_field="structured_outputs.whitespace_pattern"
            )
        if self.json_ is not None:
            return GrammarSpec.json_schema(self.json_, "structured_outputs.json", **options)
        if self.json_object:
            return GrammarSpec.json_schema(ANY_OBJECT, "structured_outputs.json_object", **options)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex, "structured_outputs.regex")
        if self.choice is not None:
            return GrammarSpec("choice", json.dumps(self.choice), "structured_outputs.choice")
        return GrammarSpec("grammar", self.grammar, "structured_outputs.grammar")


def _token_id(key: str) -> str:
    if not (key.isascii() and key.isdigit()) or len(key) > 12:  # str.isdigit alone takes "²", which int() refuses
        raise ValueError(f"logit_bias keys are token ids (decimal digits), got {key!r}")
    return key


class _Sampling(_Strict):
    HONOURED: ClassVar[frozenset[str]] = frozenset()  # the fields of UNSUPPORTED this route honours
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extra: -1 or 0 is off
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    n: int | None = Field(None, ge=1, le=128)
    best_of: int | None = Field(None, ge=1, le=MAX_BEST_OF)  # candidates, of which the n most likely are answered
    echo: bool | None = None  # completions: the prompt before the text; chat: vLLM's (the last assistant turn)
    ignore_eos: bool | None = None  # vLLM's extras, from here on
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[Annotated[str, AfterValidator(_token_id)], Annotated[float, Field(ge=-100, le=100)]] | None = (
        Field(None, max_length=MAX_LOGIT_BIAS)
    )
    # vLLM's extras: repetition_penalty 1 is off, min_p 0 is off
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # vLLM's: the only tokens that may be chosen; words not to generate; the prompt tokens' logprobs and
    # this many most likely per prompt token (vLLM's -1, the whole vocabulary, is past its default limit too)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    bad_words: list[Annotated[Text, Field(min_length=1)]] | None = Field(None, max_length=MAX_BAD_WORDS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's beam search: n beams, ranked by cumulative logprob / length^length_penalty
    use_beam_search: bool | None = None
    length_penalty: float | None = Field(None, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    user: str | None = None
    tools: list | None = None
    tool_choice: Literal["none", "auto"] | None = None  # a tool choice needs tools, which are refused
    functions: list | None = None
    function_call: Literal["none", "auto"] | dict | None = None
    # structured output (grammar.py): OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema | None = None
    guided_regex: Text | None = None
    guided_choice: Choices | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None  # vLLM's: the whitespace a JSON grammar allows, as a regex

    @model_validator(mode="before")
    @classmethod
    def _unsupported_extras(cls, data: Any):
        """An unsupported field this model does not declare (vLLM's extras): refused by name unless
        null or its default."""
        if isinstance(data, dict):
            for name in sorted(set(data) & set(UNSUPPORTED) - set(cls.model_fields)):
                _refuse_unless_default(name, data[name])
        return data

    @model_validator(mode="after")
    def _unsupported_fields(self):
        """An unsupported field this model declares: its type and range checked, then refused by
        name unless null or its default."""
        for name in sorted(self.model_fields_set & set(UNSUPPORTED) - self.HONOURED):
            _refuse_unless_default(name, getattr(self, name))
        return self

    @model_validator(mode="after")
    def _one_grammar(self):
        given = [k for k in GRAMMAR_FIELDS if getattr(self, k) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")  # asks for nothing
        if len(given) > 1:
            raise FieldError(given[1], f"one structured output per request: {given[0]} and {given[1]} are both given")
        json_given = self.guided_json is not None or (
            self.response_format is not None and self.response_format.type != "text"
        )
        if self.guided_whitespace_pattern is not None and not json_given:
            raise FieldError(
                "guided_whitespace_pattern",
                "guided_whitespace_pattern applies to JSON (guided_json or response_format) only",
            )
        return self

    @property
    def grammar(self) -> GrammarSpec | None:
        """What the output must match, from whichever field asked (None: free text)."""
        fmt = self.response_format
        pattern = self.guided_whitespace_pattern
        ws = {} if pattern is None else {"whitespace_pattern": pattern, "pattern_field": "guided_whitespace_pattern"}
        if fmt is not None and fmt.type == "json_schema":
            return GrammarSpec.json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema", **ws)
        if fmt is not None and fmt.type == "json_object":
            return GrammarSpec.json_schema(ANY_OBJECT, "response_format", **ws)
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        if self.guided_json is not None:
            return GrammarSpec.json_schema(self.guided_json, "guided_json", **ws)
        if self.guided_regex is not None:
            return GrammarSpec("regex", self.guided_regex, "guided_regex")
        if self.guided_choice is not None:
            return GrammarSpec("choice", json.dumps(self.guided_choice), "guided_choice")
        if self.guided_grammar is not None:
            return GrammarSpec("grammar", self.guided_grammar, "guided_grammar")
        return None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return stops

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        """vLLM's rule: prompt logprobs come with the whole answer only."""
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "prompt_logprobs are not available when stream=true")
        return self

    @model_validator(mode="after")
    def _beam_search(self):
        """vLLM's beam search takes n (the beams), max_tokens, temperature, ignore_eos, length_penalty and
        include_stop_str_in_output; any other field that asks for something is refused with it (vLLM
        ignores them), and length_penalty without it."""
        if not self.use_beam_search:
            if self.length_penalty is not None and self.length_penalty != 1:
                raise FieldError("length_penalty", "length_penalty applies to beam search only (use_beam_search: true)")
            return self
        if self.choices > MAX_BEAMS:
            raise FieldError("n", f"beam search takes at most {MAX_BEAMS} beams (n), got {self.choices}")
        for name in sorted(self.model_fields_set - BEAM_FIELDS):
            value = getattr(self, name)
            if isinstance(value, ResponseFormat) and value.type == "text":
                continue
            if value is not None and value is not False and value != []:
                raise FieldError(name, f"{name} is not taken with use_beam_search")
        return self

    @property
    def vocabulary(self) -> dict:
        """allowed_token_ids and bad_words with their defaults for null (SamplingParams' names)."""
        allowed = self.allowed_token_ids
        return {
            "allowed_token_ids": None if allowed is None else tuple(sorted(set(allowed))),
            "bad_words": tuple(self.bad_words or ()),
        }

    @model_validator(mode="after")
    def _best_of(self):
        """OpenAI's rules: best_of candidates hold the n answered; candidates beyond n cannot be streamed
        (the best are known at the end)."""
        if self.best_of is not None:
            if self.best_of < self.choices:
                raise FieldError("best_of", f"best_of ({self.best_of}) must be at least n ({self.choices})")
            if self.stream and self.best_of > self.choices:
                raise FieldError("best_of", "best_of above n cannot be streamed (the best are known only at the end)")
        return self

    @property
    def choices(self) -> int:
        """n: the choices answered."""
        return self.n or 1

    @property
    def candidates(self) -> int:
        """best_of: the generations run (each a row of the batch), of which the `choices` most likely are answered."""
        return self.best_of or self.choices

    @property
    def stopping(self) -> dict:
        """vLLM's stop fields, with their defaults for null (SamplingParams' names)."""
        return {
            "ignore_eos": bool(self.ignore_eos),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "min_tokens": self.min_tokens or 0,
            "include_stop_str_in_output": bool(self.include_stop_str_in_output),
        }

    def processing(self, logprobs: int | None, prompt_logprobs: int | None = None) -> Processing:
        """The request's logits processing (`static/sampling.py`), nulls as their defaults."""
        return Processing(
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items() if v != 0)),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    @property
    def sampling(self) -> dict:
        """temperature, top_p, top_k and seed with their defaults for null (top_k off: 0)."""
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": max(self.top_k or 0, 0),
            "seed": self.seed,
        }

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens; it wins when both are sent
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    HONOURED = frozenset({"top_logprobs"})
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    modalities: list[Literal["text"]] | None = None  # "audio" is refused as not one of these

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def asked_processing(self) -> Processing:
        """logprobs: the chosen token's and `top_logprobs` more per token; prompt_logprobs: the prompt's."""
        return self.processing((self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs)

    @property
    def answered_prompt_logprobs(self) -> int | None:
        """The most likely tokens per prompt token of the response's `prompt_logprobs` (None: none)."""
        return self.prompt_logprobs


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
    request: several are refused, naming how many); null, as in OpenAI's API, is the start of a new
    document (the empty prompt: the tokenizer's BOS)."""

    prompt: Text | list | None
    logprobs: int | None = Field(None, ge=0, le=5)  # the chosen token's logprob and this many more per token
    suffix: Text | None = None  # logprobs 0 asks for the chosen tokens' logprobs: not nothing

    @field_validator("prompt")
    @classmethod
    def _single(cls, v):
        if v is None:
            return ""
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

    @property
    def asked_processing(self) -> Processing:
        """logprobs n: the chosen token's and n more per token, the prompt's too with echo (and
        prompt_logprobs: the prompt's, the more of the two most likely kept)."""
        asked = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return self.processing(self.logprobs, max(asked) if asked else None)

    @property
    def answered_prompt_logprobs(self) -> int | None:
        """The most likely tokens per prompt token of the choice's `prompt_logprobs` (None: none), as
        vLLM's: prompt_logprobs, else with echo the logprobs count."""
        return self.prompt_logprobs if self.prompt_logprobs is not None else self.logprobs if self.echo else None


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


class FieldError(ValueError):
    """A check across fields that names the one at fault (`app._validation_error` reads `field`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _refuse_unless_default(name: str, value) -> None:
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_none=True)
    if value is not None and not any(value == d and type(value) is type(d) for d in UNSUPPORTED[name]):
        raise FieldError(name, f"{name}={_short(value)} is not supported by this server")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
