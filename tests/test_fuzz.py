"""Fuzzing every surface the way a user reaches it (seeded, bounded, on loopback).

The server: request bodies drawn from the OpenAI schema (and beyond it: wrong types, edge numbers,
lone surrogates, arbitrary JSON) sent over HTTP to a live server of the tiny model. Each either
succeeds — its response or stream validating against OpenAI's types — or gets a 4xx in OpenAI's
error shape; a 5xx is a bug.

The files a user can pass: port files, a checkpoint's config.json and index, a reader sidecar's
metadata, an artifact's manifest, a publication's manifest, each mutated field by field. Each
either works or is one `UserError` (one `error:` line); any other exception is a bug.

`derandomize=True`: the same examples on every run, so a failure here is a regression, not luck.
"""

import argparse
import functools
import io
import json
import math
import posixpath
import re
import shutil
import tempfile
import typing
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat import completion_create_params as chat_params
from safetensors import safe_open
from safetensors.torch import save_file

from neuron_moe import cli
from neuron_moe.checkpoint import _weight_map
from neuron_moe.errors import UserError, error_exit
from neuron_moe.neuron import artifact as na
from neuron_moe.port import load_port, tomllib
from neuron_moe.tokenizer import load_tokenizer
from neuron_moe.publish import s3
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.prep import write_sidecar
from neuron_moe.reader.sidecar import Sidecar
from neuron_moe.serve.app import create_app
from neuron_moe.serve.backends import load_engine
from neuron_moe.serve.server import plan_load

from conftest import port_text_elsewhere
from test_grammar_bounds import chain, ref_chain
from serving import serving, sse_events, wait_for

MODEL = "tiny-gemma4-moe"
ERROR_KEYS = {"message", "type", "param", "code"}
FUZZ = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ---- values ----------------------------------------------------------------------------------------------

# Any code point, lone surrogates included: JSON can carry "\ud800", which no UTF-8 codec takes.
any_text = st.text(st.characters(exclude_categories=()), max_size=12)
edge_ints = st.sampled_from([0, -1, 1, 2, 3, 255, 256, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30])
edge_floats = st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-5, 0.5, 1.0, 2.0, 2.0000001, 1e308])
numbers = st.one_of(st.integers(-3, 600), edge_ints, st.floats(-3, 3), edge_floats)
scalars = st.one_of(st.none(), st.booleans(), numbers, any_text)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3), max_leaves=6
)


# ---- the server --------------------------------------------------------------------------------------------

# Schema-valid requests (what the server must answer 200), then each with one field made anything
# (what it must refuse with a 4xx), then arbitrary JSON.
valid_text = st.text(max_size=16)  # any code point but lone surrogates
parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": valid_text}), max_size=2)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": valid_text | parts}
)
# a number of the wrong JSON type: refused, never coerced
wrong_types = st.sampled_from(["0.5", "1", True, False, [], {}, [1]])
# JSON schemas (objects, and their text as vLLM's guided_json takes it), some of them invalid, and not schemas
schemas = st.sampled_from(
    [
        {},
        {"type": "object"},
        {"type": "boolean"},
        {"enum": ["a", "b"]},
        {"type": "string", "maxLength": 3},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "nope"},
        {"type": "string", "pattern": "["},
        # the grammars a matcher cannot follow (no output, or past a bound): a 400, never a 500 or a crash
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        ref_chain(1500),
        {"type": "string", "pattern": "((a{100}){100}){100}"},
        '{"items":' * 100 + "{}" + "}" * 100,
        "[" * 100000 + "]" * 100000,
        '{"type": "integer"}',
        "{not json",
        [],
        3,
        None,
    ]
)
regexes = st.sampled_from(
    [None, "[a-z]+", "yes|no", "[0-9]{2}", "", "[a-", "(", "a{1000000}", "((a{100}){100}){100}", r"[^\s\S]", "(" * 100]
)
grammar_texts = st.sampled_from(
    [None, 'start: "yes" | "no"', "root ::= [0-9]+", "start: nowhere", "", "start: start", 'start: "a"{100000}']
    + [chain(3000), chain(3000, " | "), chain(3000, head="::="), "start: " + " | ".join(f'"w{i}"' for i in range(2000))]
)
choices = (
    st.none() | st.lists(valid_text, max_size=3) | st.sampled_from([[f"c{i}" for i in range(1100)], ["x" * 2**19]])
)
TOKENIZER = load_tokenizer(load_port(MODEL))
# one-token texts of one character each: allowed_token_ids drawn from these, a text of theirs told by its characters
LETTERS = {TOKENIZER.encode(c, add_special_tokens=False)[0]: c for c in "abx .e"}
assert all(len(TOKENIZER.encode(c, add_special_tokens=False)) == 1 for c in LETTERS.values())
BAD_WORDS = ["the", " is", "a", "Paris", "xyz", "", "\ud800"]
OPTIONAL = {
    "max_completion_tokens": st.integers(1, 3) | st.none(),  # small: a request that succeeds is a few decode steps
    "temperature": st.floats(0, 2) | st.sampled_from([0.0, 1e-300, 5e-324, 2.0, None]),
    "top_p": st.floats(0, 1) | st.sampled_from([5e-324, 1.0, 0, None]),
    "top_k": st.none() | st.integers(-1, 300) | st.sampled_from([1, 256, 257, 2048, 10**6]),
    "stream": st.booleans() | st.none(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans() | st.none()}),
    "stop": st.none() | st.text(min_size=1, max_size=6) | st.lists(st.text(min_size=1, max_size=6), max_size=4),
    "seed": st.none() | st.integers(-(2**63), 2**64 - 1),
    "n": st.sampled_from([1, None, 2, 3]),
    "best_of": st.sampled_from([None, 1, 2, 3]),
    "echo": st.sampled_from([None, False, True]),
    "logprobs": st.sampled_from([None, False, True, 0, 3]),
    "top_logprobs": st.sampled_from([None, 0, 5, 20]),
    "presence_penalty": st.sampled_from([None, 0, 0.0, -2.0, 0.5, 2.0]) | st.floats(-2, 2),
    "frequency_penalty": st.sampled_from([None, 0, 0.0, 1.0, -0.1]) | st.floats(-2, 2),
    "logit_bias": st.none()
    | st.dictionaries(st.integers(0, 3000).map(str), st.integers(-100, 100) | st.floats(-100, 100), max_size=3),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}])
    | st.sampled_from([{"type": "xml"}, {"type": "text", "json_schema": {"name": "s", "schema": {}}}])
    | st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {"name": st.sampled_from(["s", "bad name", ""]), "schema": schemas},
                optional={"strict": st.none() | st.booleans(), "description": st.none() | valid_text},
            ),
        }
    ),
    "suffix": st.sampled_from([None, "", "tail"]),
    "tools": st.none() | st.just([]) | st.just([{"type": "function", "function": {"name": "f"}}]),
    "tool_choice": st.sampled_from([None, "none", "auto", "required"]),
    "functions": st.sampled_from([None, [], [{"name": "f"}]]),
    "function_call": st.sampled_from([None, "none", "auto", {"name": "f"}]),
    "modalities": st.sampled_from([None, ["text"], ["text", "audio"]]),
    "min_p": st.sampled_from([None, 0, 0.0, 0.05, 1.0]) | st.floats(0, 1),  # vLLM's extras, sent through extra_body
    "repetition_penalty": st.sampled_from([None, 1, 1.0, 1.3, 0.5, 5e-324]) | st.floats(0.01, 3),
    "ignore_eos": st.booleans() | st.none(),
    "min_tokens": st.sampled_from([None, 0, 1, 2, 5]),
    "stop_token_ids": st.none() | st.lists(st.integers(0, 300), max_size=3),
    "include_stop_str_in_output": st.booleans() | st.none(),
    "user": valid_text,  # not ours: ignored
    # structured output: OpenAI's response_format (above) and vLLM's fields
    "structured_outputs": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "json": schemas,
            "regex": regexes,
            "choice": choices,
            "grammar": grammar_texts,
            "json_object": st.none() | st.booleans(),
            "disable_any_whitespace": st.none() | st.booleans(),
            "whitespace_pattern": st.sampled_from([None, " ?", "[", "\\s*"]),
            "disable_fallback": st.none() | st.booleans(),
            "disable_additional_properties": st.sampled_from([None, False, True]),
            "structural_tag": st.sampled_from([None, "{}"]),
        },
    ),
    "guided_json": st.none() | schemas,
    "guided_regex": regexes,
    "guided_choice": choices,
    "guided_grammar": grammar_texts,
    "guided_whitespace_pattern": st.sampled_from([None, " ?", "[", ""]),
    # vLLM's vocabulary fields: a few one-character tokens (LETTERS), and ids at and past the vocabulary
    "allowed_token_ids": st.none()
    | st.lists(st.sampled_from(sorted(LETTERS)), min_size=1, max_size=3)
    | st.sampled_from([[], [2048], [10**6], [-1], ["5"]]),
    "bad_words": st.none() | st.lists(st.sampled_from(BAD_WORDS), max_size=3),
    "prompt_logprobs": st.sampled_from([None, 0, 2, 20, 21, -1, 1.0]),
    # vLLM's beam search (with most other fields: a 400 naming the other)
    "use_beam_search": st.sampled_from([None, False, True]),
    "length_penalty": st.sampled_from([None, 1, 1.0, 0.5, -1.0]),
    # what the server refuses (IGNORABLE), each with its reason in docs/serving.md
    "web_search_options": st.sampled_from([None, {}, {"search_context_size": "low"}]),
    "audio": st.sampled_from([None, {}, {"voice": "alloy", "format": "wav"}]),
}

# What a request may set only to null or these (the server does not do anything else with them).
# Written here from OpenAI's and vLLM's documentation, not from the server's own table: a 200 for
# any other value is an accepted-and-ignored field.
IGNORABLE = {
    "suffix": [""],
    "tools": [[]],
    "tool_choice": ["none", "auto"],
    "functions": [[]],
    "function_call": ["none", "auto"],
    "modalities": [["text"]],
    "web_search_options": [],
    "audio": [],
}
# ... and on one route only: top_logprobs is chat's (completions' logprobs is the count)
IGNORABLE_ON = {True: {}, False: {"top_logprobs": []}}


def same_json(a, b) -> bool:
    """Equal as JSON values: 1 and 1.0 alike, but never a boolean and a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def ignored_fields(body, chat: bool) -> list[str]:
    """The fields of a body that ask for something this server does not do (on the chat route or
    the completions one)."""
    if not isinstance(body, dict):
        return []
    return [
        k
        for k, allowed in {**IGNORABLE, **IGNORABLE_ON[chat]}.items()
        if body.get(k) is not None and not any(same_json(body[k], v) for v in allowed)
    ]


def grammar_prefix(body):
    """For a body asking for one structured output whose text this test can judge by eye, whether a
    text is a beginning of what it allows (a fuzzed request stops after a few tokens); else None."""
    if not isinstance(body, dict) or body.get("echo"):
        return None
    fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    asked = [k for k in fields if body.get(k) is not None and body.get(k) != {"type": "text"}]
    if len(asked) != 1 or not isinstance(body[asked[0]], (dict, list)):
        return None
    value = body[asked[0]]
    choices = value if asked[0] == "guided_choice" else value.get("choice") if isinstance(value, dict) else None
    if isinstance(choices, list):
        return lambda text: any(c.startswith(text) for c in choices)
    if value.get("type") == "json_object" or (asked[0] == "structured_outputs" and value.get("json_object")):
        return lambda text: not text.strip() or text.lstrip().startswith("{")
    return None


def answer_text(r: httpx.Response, chat: bool) -> str:
    if r.headers["content-type"].startswith("text/event-stream"):
        firsts = [c for e in sse_events(r.text.splitlines())[:-1] for c in e["choices"] if c["index"] == 0]
        if chat:
            return "".join(c["delta"].get("content") or "" for c in firsts)
        return "".join(c["text"] for c in firsts)
    choice = r.json()["choices"][0]
    return (choice["message"]["content"] or "") if chat else choice["text"]


def requests(required: dict):
    valid = st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_tokens": st.integers(1, 3), **required}, optional=OPTIONAL
    )
    fields = sorted({"model", "max_tokens", *required, *OPTIONAL})
    broken = st.tuples(
        valid,
        st.sampled_from(fields),
        json_values | wrong_types | st.sampled_from([0, -1, 600, 2**63, 10**30, 1e308, "\ud800", "", [], {}]),
    ).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(valid, valid, broken, json_values)


chat_requests = requests({"messages": st.lists(message, min_size=1, max_size=3)})
completion_requests = requests({"prompt": valid_text | st.lists(valid_text, min_size=1, max_size=1)})


@pytest.fixture(scope="module", params=["eager", "static"])
def url(request, tiny_port):
    """A server over transformers' model (sampling on the host) and over the static graphs (sampling
    in the graphs)."""
    engine = load_engine(tiny_port, request.param)
    try:
        with serving(create_app(lambda: engine, model_name=MODEL, max_queue=4)) as base:
            wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, what="the model to be ready")
            yield base
    finally:
        engine.close()


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, body) -> httpx.Response:
    """`body` as JSON, lone surrogates escaped (httpx's own json= cannot encode them)."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def check_honoured(body: dict, answer: dict, chat: bool) -> None:
    """What the server does with the fields it honours, seen in a 200's body: n choices, each ended as
    ignore_eos, stop_token_ids, min_tokens and include_stop_str_in_output say, echo before the text."""
    n = body.get("n") or 1
    assert [c["index"] for c in answer["choices"]] == list(range(n)), (body, answer)
    requested = body.get("max_completion_tokens") or body.get("max_tokens")
    for choice in answer["choices"]:
        text = choice["message"]["content"] if chat else choice["text"]
        reason = choice["stop_reason"]
        if choice["finish_reason"] == "stop":
            # EOS alone has no stop_reason: never the end with ignore_eos
            assert reason is not None or not body.get("ignore_eos"), (body, answer)
            assert reason is None or reason in (body.get("stop_token_ids") or []) or isinstance(reason, str), answer
            if isinstance(reason, str) and body.get("include_stop_str_in_output"):
                assert text.endswith(reason), (body, answer)
        if n == 1 and not body.get("best_of"):
            tokens = answer["usage"]["completion_tokens"]
            assert choice["finish_reason"] == "length" or tokens > (body.get("min_tokens") or 0), (body, answer)
            assert choice["finish_reason"] != "length" or requested is None or tokens == requested, (body, answer)
        if body.get("echo") and not chat and isinstance(body["prompt"], str):
            assert text.startswith(body["prompt"]), (body, answer)
        if body.get("allowed_token_ids") and not body.get("echo"):  # only those tokens: only their characters
            allowed = "".join(TOKENIZER.decode([t]) for t in body["allowed_token_ids"])  # EOS's: none
            assert set(text) <= set(allowed), (body, answer)
        if body.get("bad_words") and not body.get("echo"):  # no bad word's own token among the generated
            generated = logprob_tokens(choice, chat)
            for word in body["bad_words"]:
                for form in (word.lstrip(), " " + word.lstrip()):
                    ids = TOKENIZER.encode(form, add_special_tokens=False) if word else []
                    if len(ids) == 1:
                        assert TOKENIZER.decode(ids) not in generated, (word, body, answer)
    n_prompt = answer["usage"]["prompt_tokens"]
    asked = body.get("prompt_logprobs")
    if asked is None and not chat and body.get("echo"):
        asked = body.get("logprobs")  # vLLM's: echo's logprobs count
    scores = [answer.get("prompt_logprobs")] if chat else [c.get("prompt_logprobs") for c in answer["choices"]]
    for got in scores:
        assert (got is None) == (asked is None), (body, answer)
        if got is not None:
            assert len(got) == n_prompt and got[0] is None, (body, answer)
            assert all(0 < len(p) <= asked + 1 for p in got[1:]), (body, answer)


def logprob_tokens(choice: dict, chat: bool) -> list[str]:
    """The generated tokens' texts of a choice that asked for logprobs ([] when it did not)."""
    if not choice.get("logprobs"):
        return []
    return [e["token"] for e in choice["logprobs"]["content"]] if chat else choice["logprobs"]["tokens"]


def check_answer(r: httpx.Response, body, chat: bool) -> None:
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"], r.text
        assert "Traceback" not in error["message"], r.text
        return
    assert not ignored_fields(body, chat), f"accepted and ignored: {ignored_fields(body, chat)} in {body}"
    if isinstance(body, dict) and not r.headers["content-type"].startswith("text/event-stream"):
        check_honoured(body, r.json(), chat)
    allows = None if body.get("echo") else grammar_prefix(body)  # echo: the prompt comes first
    assert allows is None or allows(answer_text(r, chat)), f"the grammar not followed: {answer_text(r, chat)!r}, {body}"
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r.text.splitlines())
        assert events[-1] == "[DONE]", (body, events)
        errors = [e["error"] for e in events[:-1] if "error" in e]
        # the one error a stream may end with: allowed_token_ids and bad_words (and a grammar) left no token
        assert all(e["param"] in ("allowed_token_ids", "bad_words") for e in errors), (body, events)
        events = [e for e in events if "error" not in e]
        for event in events[:-1]:
            if chat:
                ChatCompletionChunk.model_validate(event)
            elif event["choices"]:  # OpenAI's Completion type has no null finish_reason: checked by hand
                assert isinstance(event["choices"][0]["text"], str) and event["object"] == "text_completion"
            else:
                assert event["usage"]["total_tokens"] >= 1
        return
    answer = r.json()
    if not chat:  # an echoed prompt's first token has no logprob: null, as OpenAI's API and vLLM send it, which
        for choice in answer["choices"]:  # the `openai` package's Completion type does not allow
            lp = choice["logprobs"]
            if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
                lp["token_logprobs"][0], lp["top_logprobs"][0] = 0.0, {}
    (ChatCompletion if chat else Completion).model_validate(answer)


@settings(max_examples=60, **FUZZ)
@given(body=chat_requests)
def test_fuzz_chat_requests(http, body):
    check_answer(post(http, "/v1/chat/completions", body), body, chat=True)


# bodies nested past what a JSON parser recurses through: a 400
DEEP = [
    b'{"model": "%s", "prompt": %s}' % (MODEL.encode(), b"[" * 100000 + b"]" * 100000),
    b'{"model": "%s", "prompt": "Q:", "guided_json": %s}' % (MODEL.encode(), b'{"a":' * 100000 + b"{}" + b"}" * 100000),
]


@settings(max_examples=40, **FUZZ)
@given(body=completion_requests, raw=st.none() | st.binary(max_size=40) | st.sampled_from(DEEP))
def test_fuzz_completion_requests(http, body, raw):
    check_answer(post(http, "/v1/completions", body), body, chat=False)
    if raw is not None:  # not JSON at all, or not UTF-8
        check_answer(
            http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), raw, chat=False
        )


VOCABULARY = ("allowed_token_ids", "bad_words", "prompt_logprobs")


@settings(max_examples=30, **FUZZ)
@given(chat=st.booleans(), data=st.data())
def test_fuzz_beam_search(http, chat, data):
    """vLLM's beam search with what it takes (n, temperature, ignore_eos, length_penalty,
    include_stop_str_in_output) and now and then one field it does not: served, or a 400 naming it."""
    takes = ("n", "temperature", "ignore_eos", "length_penalty", "include_stop_str_in_output", "stop", "logprobs")
    fields = data.draw(st.fixed_dictionaries({}, optional={k: OPTIONAL[k] for k in takes}))
    route = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "The capital of France is"}
    body = {"model": MODEL, "max_tokens": 2, **route, **fields, "use_beam_search": True}
    r = post(http, "/v1/chat/completions" if chat else "/v1/completions", body)
    check_answer(r, body, chat)
    if r.status_code == 200:
        assert len(r.json()["choices"]) == (body.get("n") or 1)


@settings(max_examples=40, **FUZZ)
@given(chat=st.booleans(), data=st.data())
def test_fuzz_allowed_token_ids_bad_words_and_prompt_logprobs(http, chat, data):
    """vLLM's vocabulary fields drawn among a few others a request often sends with them (most of these
    requests are valid, unlike the broad fuzzers', so the checks of a 200's body run on them)."""
    others = (
        "temperature",
        "seed",
        "echo",
        "stream",
        "n",
        "stop",
        "guided_choice",
        "use_beam_search",
        "length_penalty",
    )
    # guided_choice of ASCII texts: a text cut by max_tokens within a character is not a prefix of its choice
    ascii_choices = st.none() | st.lists(st.sampled_from(["Paris", "a b", "xx", ".", "e.a"]), min_size=1, max_size=3)
    optional = {**{k: OPTIONAL[k] for k in VOCABULARY + others}, "guided_choice": ascii_choices}
    fields = data.draw(st.fixed_dictionaries({}, optional=optional))
    fields["logprobs"] = data.draw(st.sampled_from([None, True]) if chat else st.sampled_from([None, 0, 2]))
    route = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "The capital of France is"}
    body = {"model": MODEL, "max_tokens": 3, **route, **fields}
    check_answer(post(http, "/v1/chat/completions" if chat else "/v1/completions", body), body, chat)


def nullable_fields(params) -> list[str]:
    """The fields of one of the `openai` package's request types that may be null: OpenAI's schema,
    as its own client spells it."""
    return sorted(k for k, kind in typing.get_type_hints(params).items() if type(None) in typing.get_args(kind))


CHAT_NULLABLE = nullable_fields(chat_params.CompletionCreateParamsBase)
COMPLETION_NULLABLE = nullable_fields(completion_params.CompletionCreateParamsBase)


@settings(max_examples=40, **FUZZ)
@given(chat=st.booleans(), data=st.data())
def test_fuzz_null_wherever_openai_allows_it_is_the_default(http, chat, data):
    """Any set of the fields OpenAI's schema lets be null, each null (an assistant turn's content too,
    and a completion's prompt: the start of a document): a 200, as a request without them."""
    nullable = CHAT_NULLABLE if chat else COMPLETION_NULLABLE
    nulls = data.draw(st.sets(st.sampled_from(nullable), min_size=1), label="null")
    # A length stays set (a completion's max_tokens, or one of chat's two): a request that runs to the
    # end of the context takes seconds, and the fuzzer sends many.
    length = ({"max_tokens", "max_completion_tokens"} - nulls) if chat else {"max_tokens"}
    body = {"model": MODEL, **{k: None for k in nulls}, **({next(iter(sorted(length))): 2} if length else {})}
    if not length:  # both lengths drawn null: one of them set after all
        body["max_completion_tokens"] = 2
    if chat:
        turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
        body["messages"] = turns + [{"role": "user", "content": "again"}] if data.draw(st.booleans()) else turns[:1]
    elif "prompt" not in nulls:
        body["prompt"] = "Hi"
    r = post(http, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert r.status_code == 200, (body, r.text)
    check_answer(r, body, chat)


def test_the_nullable_fields_are_openais():
    """The schema the null fuzzer reads: the fields a user meets most are in it."""
    assert {"temperature", "top_p", "seed", "stop", "max_tokens", "n", "logprobs"} <= set(CHAT_NULLABLE)
    assert {"prompt", "suffix", "echo", "best_of", "max_tokens"} <= set(COMPLETION_NULLABLE)


@settings(max_examples=60, **FUZZ)
@given(field=st.sampled_from(sorted({*IGNORABLE, "top_logprobs"})), data=st.data(), chat=st.booleans())
def test_fuzz_one_unsupported_field_is_refused_by_name_or_is_its_default(http, field, data, chat):
    """A plain request with one field this server does not implement, set to anything its strategy
    draws (defaults, nulls, real values, wrong types): a 200 only for null or the default, else a
    400 that names the field."""
    value = data.draw(OPTIONAL[field] | wrong_types, label=field)
    body = {
        "model": MODEL,
        "max_tokens": 1,
        field: value,
        **({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}),
    }
    r = post(http, "/v1/chat/completions" if chat else "/v1/completions", body)
    check_answer(r, body, chat)
    if ignored_fields(body, chat):
        assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == field, (body, r.text)


# ---- the files a user can pass ----------------------------------------------------------------------------

# what a careless edit puts in a field: a size of zero, a negative or absurd one, the wrong type
CONFUSIONS = [0, -1, 10**9, 10**30, 1e308, 1.5, "", "x", "8", True, [], [1], {}, {"a": 1}]


def mutations(fields: dict, values=json_values):
    """(key, value) edits of a dict: mostly an existing field set to a confusing value, to any
    value, or deleted (DELETE); sometimes an unknown field added."""
    keys = st.one_of(*[st.sampled_from(sorted(fields))] * 3, any_text)
    edits = st.one_of(st.sampled_from(CONFUSIONS), st.sampled_from(CONFUSIONS), values, st.just(DELETE))
    return st.lists(st.tuples(keys, edits), min_size=1, max_size=3)


DELETE = object()


def mutated(fields: dict, edits) -> dict:
    out = dict(fields)
    for key, value in edits:
        if value is DELETE:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def expect_user_error_or_nothing(call):
    """The call works, or raises a UserError (the CLI's one line); anything else fails the test."""
    try:
        return call()
    except UserError:
        return None


def one_line_or_success(argv, capsys) -> None:
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status in (0, 2), (status, err)
    if status == 2:
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # control characters as \u00XX: TOML reads them too
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_text(doc: dict) -> str:
    lines = [f"{json.dumps(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for name, table in doc.items():
        if isinstance(table, dict):
            lines += [f"[{json.dumps(name)}]"] + [f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# TOML cannot hold a lone surrogate (a file is UTF-8) or None: the values a port file can carry
toml_scalars = st.one_of(st.booleans(), numbers, st.floats(), st.text(max_size=12))
toml_values = st.recursive(
    toml_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def tiny_doc(tiny_port):
    return tomllib.loads(port_text_elsewhere(tiny_port))


@settings(max_examples=70, **FUZZ)
@given(data=st.data())
def test_fuzz_port_files(tiny_doc, tmp_path, capsys, data):
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in tiny_doc.items()}
    doc["reader"] = {"sidecar": "s.safetensors", "budget": 17.8, "rank": 8}
    section = data.draw(st.sampled_from(["", "weights", "tokenizer", "config", "static", "reader"]))
    if section:
        doc[section] = mutated(doc[section], data.draw(mutations(doc[section], toml_values)))
    else:
        doc = mutated(doc, data.draw(mutations(doc, toml_values)))
    path = tmp_path / "port.toml"
    path.write_text(toml_text(doc))
    one_line_or_success(["info", "--model", str(path)], capsys)
    one_line_or_success(["reads", "--model", str(path), "--budget", "50"], capsys)


@pytest.fixture(scope="module")
def checkpoint_files(tiny_port):
    config = json.loads((tiny_port.checkpoint / "config.json").read_text())
    return tiny_port.checkpoint, config


@settings(max_examples=50, **FUZZ)
@given(
    edits=st.one_of(
        mutations(
            {
                "hidden_size": 0,
                "num_experts": 0,
                "layer_types": 0,
                "vocab_size": 0,
                "num_hidden_layers": 0,
                "rope_parameters": 0,
                "per_layer_config": 0,
                "enable_moe_block": 0,
                "model_type": 0,
                "top_k_experts": 0,
            }
        ),
        mutations({"x": 0}),
    ),
    index=st.one_of(st.none(), json_values, st.fixed_dictionaries({"weight_map": json_values})),
)
def test_fuzz_checkpoint_config_and_index(checkpoint_files, tmp_path, edits, index):
    """What `serve --checkpoint DIR` reads before it binds: config.json (and the tokenizer beside it)."""
    source, config = checkpoint_files
    ckpt = tmp_path / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).symlink_to(source / name)
    (ckpt / "config.json").write_text(json.dumps(mutated(config, edits)))
    if index is not None:
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    config = cli.serve_config(["serve", "--checkpoint", str(ckpt)])
    expect_user_error_or_nothing(lambda: plan_load(config))
    if index is not None:
        expect_user_error_or_nothing(lambda: _weight_map(ckpt))


@pytest.fixture(scope="module")
def small_sidecar(tmp_path_factory):
    import torch

    gen = torch.Generator().manual_seed(0)
    layers = [(torch.randn(4, 32, 128, generator=gen), torch.randn(4, 128, 16, generator=gen)) for _ in range(2)]
    path = tmp_path_factory.mktemp("sidecar") / "s.safetensors"
    write_sidecar(path, layers, Geometry(hidden=128, experts=4, intermediate=16), layers=2, rank=4, progress=False)
    with safe_open(path, framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


@settings(max_examples=30, **FUZZ)
@given(
    edits=mutations(
        {
            k: 0
            for k in (
                "format",
                "format_version",
                "block",
                "scan",
                "rank",
                "seed",
                "hidden",
                "experts",
                "intermediate",
                "layers",
                "codes_per_byte",
            )
        },
        st.one_of(st.text(max_size=8), edge_ints.map(str), st.integers(-3, 300).map(str)),
    )
)
def test_fuzz_sidecar_metadata(small_sidecar, tmp_path, edits):
    meta, tensors = small_sidecar
    path = tmp_path / "s.safetensors"
    metadata = {str(k): str(v) for k, v in mutated(meta, edits).items()}  # safetensors takes strings only
    save_file(tensors, path, metadata=metadata)
    expect_user_error_or_nothing(lambda: Sidecar(path))


ARTIFACT = {
    "format": na.FORMAT,
    "port": MODEL,
    "dtype": "bfloat16",
    "quantization": "none",
    "quantized_layers": ["experts"],
    "tp": 1,
    "expert_layout": "channel",
    "buckets": [64],
    "max_cache_len": 128,
    "batch_size": 1,
    "prefill_rows": [1],
    "prefill_chunk": 64,
    "decode_lengths": [32, 128],
    "candidates": 256,
    "dry_run": False,
    "logits": False,
    "weights": True,
    "target": na.TARGET,
    "tokenizer": {"kind": "checkpoint", "files": ["tokenizer/tokenizer.json"]},
    "keys": {k: {"inputs": {}, "outputs": {}} for k in na.key_names([64], [1], spans=[32])},
    "state": {"cache.k0": {"shape": [1, 1, 128, 4], "dtype": "bfloat16"}},
    "files": {
        name: {"size": 3, "sha256": "0" * 64}
        for name in ("tokenizer/tokenizer.json", na.MODEL, na.SHARD_PLAN, na.RANK_WEIGHTS.format(rank=0))
    },
}
PUBLICATION = {
    "format": s3.FORMAT,
    "run": "r1",
    "files": [{"path": "model.pt", "key": "runs/r1/model.pt", "size": 3, "sha256": "0" * 64}],
}


@settings(max_examples=40, **FUZZ)
@given(artifact=mutations(ARTIFACT), publication=mutations(PUBLICATION), entry=mutations(PUBLICATION["files"][0]))
def test_fuzz_manifests(tmp_path, artifact, publication, entry):
    (tmp_path / na.MANIFEST).write_text(json.dumps(mutated(ARTIFACT, artifact)))
    expect_user_error_or_nothing(lambda: na.read_manifest(tmp_path))
    expect_user_error_or_nothing(lambda: na.check_tokenizer(tmp_path, na.read_manifest(tmp_path), load_port(MODEL)))
    for doc in (mutated(PUBLICATION, publication), dict(PUBLICATION, files=[mutated(PUBLICATION["files"][0], entry)])):
        expect_user_error_or_nothing(lambda: s3._check_manifest(doc, "s3://b/p/manifest"))


# Each contract field of a manifest past its bounds (or of the wrong kind): refused, always, by one error line.
not_strictly_increasing = st.lists(st.integers(-2, 200), min_size=2, max_size=4).filter(lambda b: b != sorted(set(b)))
PAST_BOUNDS = {
    "tp": st.sampled_from([0, -1, 3, 16, 2**31, 2**70, True, False, 1.0, "1"]),
    "batch_size": st.integers(1025, 2**70) | st.sampled_from([0, -1, True, 1.0]),
    "max_cache_len": st.integers(2**24 + 1, 2**70) | st.sampled_from([0, -1, True]),
    "candidates": st.integers(257, 2**70) | st.sampled_from([0, -1, True]),
    "quantization": st.text(max_size=6).filter(lambda q: q not in ("none", "int8", "int4")),
    "dtype": st.text(max_size=9).filter(lambda d: d not in ("bfloat16", "float32")),
    "port": st.sampled_from(["", "../../etc/passwd", "/etc/passwd", "a/b", "p.toml", ".p", "a b", "\ud800", "a" * 101]),
    "buckets": not_strictly_increasing | st.sampled_from([[], [0], [-8], [129], [True], list(range(1, 66))]),
    "prefill_rows": not_strictly_increasing | st.sampled_from([[], [0], [2], [True]]),
    # the last must be max_cache_len (128), each a positive int, at most 64 of them
    "decode_lengths": not_strictly_increasing
    | st.sampled_from([[], [32], [0, 128], [-8, 128], [True, 128], [32, 129], [32, 256], [*range(1, 65), 128]]),
    "keys": st.sampled_from([{}, {"token_generation": {}}, {"x": {"inputs": {}, "outputs": {}}}]),
    "state": st.sampled_from([{}, {"cache.k0": {"shape": [0], "dtype": "bf16"}}, {"cache.k0": []}]),
    "weights": st.sampled_from([False, 0, None]),
    "dry_run": st.sampled_from([None, 0, "false"]),
}


@settings(max_examples=60, **FUZZ)
@given(field=st.sampled_from(sorted(PAST_BOUNDS)), data=st.data())
def test_fuzz_manifest_fields_past_their_bounds(tmp_path, field, data):
    """What the contract allows is fixed here, apart from the code: every value outside it is refused."""
    value = data.draw(PAST_BOUNDS[field])
    (tmp_path / na.MANIFEST).write_text(json.dumps(dict(ARTIFACT, **{field: value})))
    with pytest.raises(UserError):
        na.read_manifest(tmp_path)


@pytest.mark.parametrize(
    "fields",
    [{}, {"batch_size": 1024}, {"max_cache_len": 2**24, "decode_lengths": [32, 2**24]}, {"candidates": 256}],
    ids=["as built", "batch_size", "max_cache_len", "candidates"],
)
def test_a_manifest_at_its_bounds_is_taken(tmp_path, fields):
    (tmp_path / na.MANIFEST).write_text(json.dumps(dict(ARTIFACT, **fields)))
    assert na.read_manifest(tmp_path)["batch_size"] == fields.get("batch_size", 1)


class _OneObject:
    """An S3 client holding one object, whatever its key: a publication's manifest."""

    def __init__(self, body: bytes):
        self.body = body

    def get_object(self, **_):
        return {"Body": io.BytesIO(self.body), "ETag": '"e"'}


@settings(max_examples=40, **FUZZ)
@given(
    opens=st.lists(st.sampled_from(["[", '{"a": ']), min_size=60, max_size=70),
    inner=st.sampled_from(["1", "[]", "{}", '"x"', "NaN"]),
)
def test_fuzz_deep_json_manifests(tmp_path, opens, inner):
    """Nested arrays and objects about the bound deep (and the 200,000-deep case in tests/test_verify.py):
    an artifact's manifest and a publication's are one UserError, never a RecursionError."""
    text = "".join(opens) + inner + "".join("]" if o == "[" else "}" for o in reversed(opens))
    (tmp_path / na.MANIFEST).write_text(text)
    with pytest.raises(UserError) as caught:
        na.read_manifest(tmp_path)
    depth = len(opens) + (inner in ("[]", "{}"))
    if inner == "NaN":
        assert "NaN is not a JSON number" in str(caught.value)
    else:  # within the bound: read, then refused for what it holds (not an object, or a field)
        assert ("nested deeper than 64 levels" in str(caught.value)) == (depth > 64), caught.value
    with pytest.raises(UserError):
        s3.read_manifest("s3://b/p", client=_OneObject(text.encode()))


# ---- deploy k8s's objects ------------------------------------------------------------------------------------

KUBERNETES_SCHEMAS = "kubernetes-json-schema/v1.37.0-local-strict"
# the integer formats of Kubernetes' OpenAPI schema, which jsonschema leaves unchecked by default
INTEGER_FORMATS = {"int32": 2**31, "int64": 2**63}


@functools.cache
def kubernetes_validator(kind: str, api_version: str):
    """Kubernetes' schema of `kind` (kubernetes-validate's, offline) with its integer formats enforced."""
    from jsonschema import Draft202012Validator, FormatChecker
    from kubernetes_validate.utils import schema_contents
    from referencing import Registry, Resource

    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = schema_contents(f"{KUBERNETES_SCHEMAS}/{kind.lower()}-{group}.json", "1.37")
    definitions = schema_contents(f"{KUBERNETES_SCHEMAS}/_definitions.json", "1.37")
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    checker = FormatChecker()
    for name, bound in INTEGER_FORMATS.items():
        checker.checks(name)(lambda v, bound=bound: not isinstance(v, int) or -bound <= v < bound)
    return Draft202012Validator(schema, registry=registry, format_checker=checker)


buckets = st.sampled_from(["models", "..", ".", "a..b", "My_Bucket", "b" * 64, "a b", ""])
segments = st.lists(st.sampled_from(["x", "..", ".", "", "gemma4", "..x", "a b", "é"]), min_size=0, max_size=3)
replicas = st.integers(1, 2**31 - 1) | st.sampled_from([2**31 - 1, 2**29, 2**31, 2**63, 0, -1])


@settings(max_examples=40, **FUZZ)
@given(
    bucket=buckets,
    prefix=segments,
    replicas=replicas,
    max_replicas=st.none() | replicas,
    drain=st.floats(0, 1e308) | st.sampled_from([0.0, 86400.0, 86400.5, 1e308, math.inf, math.nan, -1.0]),
)
def test_fuzz_deploy_k8s_objects(tmp_path, bucket, prefix, replicas, max_replicas, drain):
    """Whatever the settings, deploy k8s writes objects valid against Kubernetes' schema, integers
    within their int32 / int64 formats, and every path inside its folder (the node's cache, its
    mount in the pod), or refuses them with one UserError and writes nothing."""
    from neuron_moe.deploy import k8s

    settings_ = k8s.Settings(
        model=MODEL,
        instance="inf2.xlarge",
        artifacts=f"s3://{bucket}/" + "/".join(prefix),
        tp=1,
        replicas=replicas,
        max_replicas=max_replicas,
        drain_timeout=drain,
    )
    out = Path(tempfile.mkdtemp(dir=tmp_path)) / "out"
    try:
        k8s.write(settings_, load_port(MODEL), out)
    except UserError:
        assert not out.exists()
        return
    objects = {rel: yaml.safe_load((out / rel).read_text()) for rel in k8s.OBJECTS}
    for obj in objects.values():
        errors = [e.message for e in kubernetes_validator(obj["kind"], obj["apiVersion"]).iter_errors(obj)]
        assert not errors, errors
    pod = objects["deployment.yaml"]["spec"]["template"]["spec"]
    assert [v["hostPath"]["path"] for v in pod["volumes"]] == [k8s.CACHE_HOST_PATH]
    pull = next(c for c in pod["initContainers"] if c["name"] == "pull")
    server = pod["containers"][0]
    local = server["args"][server["args"].index("--artifacts") + 1]
    assert pull["command"][-1] == local
    assert posixpath.normpath(local) == local and local.startswith(k8s.CACHE_MOUNT + "/")
    for container in (*pod["initContainers"], server):
        assert {m["mountPath"] for m in container["volumeMounts"]} == {k8s.CACHE_MOUNT}


# ---- the command line's numbers ---------------------------------------------------------------------------

# what a user may type for a number: edges, non-finite, absurd sizes, not a number at all
edge_texts = st.sampled_from(
    [
        "nan",
        "inf",
        "-inf",
        "-0",
        "0",
        "-1",
        "1",
        "2",
        "0.5",
        "1e308",
        "-1e-300",
        str(2**63),
        str(2**64 - 1),
        str(2**64),
        "99999999999999999999",
        "100000",
        str(10**30),
        "1e3",
        "",
        "x",
        " 7 ",
        "1_0",
    ]
)
plausible_texts = st.sampled_from(["0", "1", "4", "8", "32", "80", "127", "128", "129", "4096", "17.8", "60"])
number_texts = st.one_of(
    edge_texts,
    edge_texts,
    plausible_texts,
    plausible_texts,
    st.integers(-3, 300).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    return next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def least_argv(sub: argparse.ArgumentParser) -> list[str]:
    """What a command needs to parse at all: its required options and positionals, and a nested
    command's (its first) with that command's own."""
    argv = []
    for a in sub._actions:
        if isinstance(a, argparse._SubParsersAction):
            name, nested = next(iter(a.choices.items()))
            argv += [name, *least_argv(nested)]
        elif a.required or (not a.option_strings and a.nargs != 0):
            argv += [*a.option_strings[:1], str(a.choices[0]) if a.choices else "x"]
    return argv


def numeric_options(sub: argparse.ArgumentParser) -> list[str]:
    """Every option of a command that takes a number (cli_parser.number's types), --threads included."""
    return sorted(a.option_strings[0] for a in sub._actions if hasattr(a.type, "bounds"))


def integer_option(sub: argparse.ArgumentParser, flag: str) -> bool:
    (action,) = [a for a in sub._actions if flag in a.option_strings]
    return getattr(action.type, "kind", None) is int


# every numeric option of the commands the fuzzer runs, read from the parser: a new one is fuzzed too
NUMERIC = {command: numeric_options(subcommands()[command]) for command in ("plan", "reads", "serve", "prep-reader")}
BASE = {
    # the reader on (--budget given here, a drawn one after it wins): its numbers are fuzzed too
    "plan": ["--model", "gemma4-26b-a4b", "--instance", "inf2.48xlarge", "--tp", "8", "--reader", "--budget", "17.8"],
    "reads": [],
    "serve": ["--backend", "static", "--no-compile"],
    "prep-reader": [],
}


def numeric_argv(data, command: str, geometry: bool = False) -> list[str]:
    flags = data.draw(st.lists(st.sampled_from(NUMERIC[command]), min_size=1, max_size=2, unique=True))
    values = {flag: data.draw(number_texts) for flag in flags}
    if geometry:  # reads with an explicit geometry: all four given, mostly plausible sizes
        for flag in ("--hidden", "--experts", "--top-k", "--intermediate"):
            values[flag] = data.draw(st.sampled_from(["1", "4", "16", "128", "2816", str(2**40)]) | number_texts)
    return [command, *BASE[command], *(a for flag, value in values.items() for a in (flag, value))]


def refused_or_ran(run, capsys):
    """`run()` returns an exit status (0 or 1: a plan that does not fit) with a report free of NaN and inf,
    or 2 with one `error:` line, or argparse refuses an argument by name (exit 2); any other exception
    fails the test. torch's thread count (--threads) is put back after."""
    threads = torch.get_num_threads()
    try:
        status = run()
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2 and err.splitlines()[-1].split(": error: argument --")[1], err
        return None
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert status in (0, 1, 2), (status, err)
    if status == 2:
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not re.search(r"\b(nan|inf)\b", out, re.IGNORECASE), out  # a NaN taken for a number ("FITS: nan")
    return status


@settings(max_examples=80, **FUZZ)
@given(data=st.data(), command=st.sampled_from(["plan", "reads", "reads"]))
def test_fuzz_numeric_options_of_plan_and_reads(capsys, data, command):
    argv = numeric_argv(data, command, geometry=command == "reads" and data.draw(st.booleans()))
    refused_or_ran(lambda: cli.main(argv), capsys)


@settings(max_examples=40, **FUZZ)
@given(data=st.data())
def test_fuzz_numeric_options_of_serve_before_binding(capsys, data):
    """What `serve` checks before it binds; no model is loaded (the sizes are checked up front)."""
    argv = numeric_argv(data, "serve")

    def check():
        config = cli.serve_config(argv)
        try:
            plan_load(config)
        except UserError as e:
            return error_exit(str(e))
        taken = {k: v for k, v in vars(config.serving).items() if isinstance(v, float)}
        assert all(math.isfinite(v) for v in taken.values()), taken  # a NaN timeout taken for a number
        return 0

    refused_or_ran(check, capsys)


@settings(max_examples=150, **FUZZ)
@given(data=st.data())
def test_fuzz_every_integer_option_of_every_command_up_to_2_to_the_64(capsys, data):
    """Every command's every integer option (--threads included), parsed alone with what a user may type,
    up to 2^64 and past it: refused by name, or a value within the option's own bounds, never anything
    the parser let through unbounded."""
    commands = subcommands()
    command = data.draw(st.sampled_from(sorted(commands)), label="command")
    sub = commands[command]
    flags = [f for f in numeric_options(sub) if integer_option(sub, f)]
    assert "--threads" in flags
    flag = data.draw(st.sampled_from(flags), label="flag")
    value = data.draw(number_texts | st.integers(-(2**65), 2**65).map(str), label="value")
    try:  # the flag before a nested command (`deploy k8s`), whose own arguments its parser takes
        args = cli.parser().parse_args([command, flag, value, *least_argv(sub)])
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2 and f": error: argument {flag}" in err, err
        return
    (action,) = [a for a in sub._actions if flag in a.option_strings]
    low, high = action.type.bounds
    got = getattr(args, action.dest)
    for v in got if isinstance(got, list) else [got]:
        assert type(v) is int and low <= v <= high < 2**64, (flag, value, v)  # a seed takes all of uint64


@settings(max_examples=30, **FUZZ)
@given(data=st.data())
def test_fuzz_numeric_options_of_prep_reader(capsys, tmp_path_factory, data):
    out = tmp_path_factory.mktemp("prep") / "s.safetensors"
    refused_or_ran(lambda: cli.main(numeric_argv(data, "prep-reader") + ["--out", str(out)]), capsys)
