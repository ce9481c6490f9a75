"""The server over HTTP on 127.0.0.1, driven by the official `openai` client (and raw httpx
where the wire format itself is the point): responses validate against OpenAI's types, and
every error case answers in OpenAI's shape with the right status."""

import asyncio
import contextlib
import copy
import gc
import json
import logging
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from openai.types import Completion, Model
from prometheus_client.parser import text_string_to_metric_families
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from neuron_moe.errors import UserError
from neuron_moe.serve import connection
from neuron_moe.serve.app import create_app
from neuron_moe.serve.chat import render_chat
from neuron_moe.serve.backends import load_engine
from neuron_moe.serve.decoding import SamplingParams
from neuron_moe.serve.server import DrainingServer

from serving import server_config, serving, sse_events, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MODEL = "tiny-gemma4-moe"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
ERROR_KEYS = {"message", "type", "param", "code"}
LONG, SLOW_S = 60, 0.05  # a long request (it fits the static graphs' cache after CHAT), slowed to 3 s


class Spy:
    """Wraps an engine: counts steps, records how each generation ended, can fail on cue, and can
    slow generation down (`step_delay_s`) or hold it until `gate` is set, so that a test holds the
    rows while it looks. It watches the sink the scheduler hands the engine's step loop (a failure
    there is one row's failure)."""

    def __init__(self, engine, fail_after=None, step_delay_s=0.0, gate: threading.Event | None = None):
        self.engine, self.fail_after, self.step_delay_s, self.gate = engine, fail_after, step_delay_s, gate
        self.steps, self.outcomes = 0, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, prompt_ids, params, sink):
        self.engine.submit(prompt_ids, params, _Watch(self, sink))


class _Watch:
    """One request's steps as the Spy sees them, passed on to the scheduler's sink."""

    def __init__(self, spy, sink):
        self.spy, self.sink, self.i, self.finish = spy, sink, 0, "cancelled"
        self.cancelled = sink.cancelled

    def put(self, step):
        if self.i == self.spy.fail_after:
            self._outcome("failed")  # recorded before the client can see the failure
            raise RuntimeError("injected backend fault")
        if self.spy.gate is not None:
            assert self.spy.gate.wait(60), "the test never opened the gate"
        self.i += 1
        self.spy.steps += 1
        self.finish = step.finish_reason or self.finish
        time.sleep(self.spy.step_delay_s)
        self.sink.put(step)

    def fail(self, error):
        self.sink.fail(error)

    def end(self):
        self._outcome(self.finish)
        self.sink.end()

    def _outcome(self, outcome):
        if self.finish is not None:
            self.spy.outcomes.append(outcome)
            self.finish = None


@pytest.fixture(scope="module", params=["eager", "static"])
def engine(request, tiny_port):
    """Each test against the engine over transformers' model and over the static graphs, 2 rows each
    (the port's batch)."""
    engine = load_engine(tiny_port, request.param, rows=2 if request.param == "eager" else None)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def endless_engine(engine):
    """The engine without EOS: the trained model may end an answer before a test has cancelled it.
    (A shallow copy: it feeds the same step loop.)"""
    endless = copy.copy(engine)
    endless.eos_ids = frozenset()
    return endless


def rows(engine) -> int:
    """Requests that generate at once: the engine's rows."""
    return engine.rows


def make_app(engine, **kw):
    """An app over `engine`."""
    return create_app(lambda: engine, model_name=MODEL, **kw)


def ready(url):
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, what="the model to be ready")
    return url


def client(url, key="unused", **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60, **kw)


def chat_body(**kw):
    return {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0, **kw}


def health(url):
    return httpx.get(f"{url}/health").json()


@pytest.fixture(scope="module")
def url(engine):
    with serving(make_app(engine, max_queue=8)) as base:
        yield ready(base)


def assert_openai_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    return error


# ---- what a client gets when all is well -----------------------------------------------------------


def test_chat_completion_validates_and_is_the_engines_output(url, engine):
    raw = client(url).chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0
    )
    completion = ChatCompletion.model_validate(raw.http_response.json())
    ids, stops = render_chat(engine.tokenizer, CHAT)
    steps = list(engine.generate(ids, SamplingParams(10, temperature=0.0, stop=stops)))
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == "".join(s.text for s in steps)
    assert choice.finish_reason == steps[-1].finish_reason
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        len(ids),
        steps[-1].completion_tokens,
    )
    assert completion.id.startswith("chatcmpl-") and completion.model == MODEL


def test_streamed_chat_chunks_validate_and_add_up(url):
    body = chat_body(max_tokens=10, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [chunks[-2].choices[0].finish_reason]  # once, on the last choice chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == (
        chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    streamed = client(url).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    plain = client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert plain.choices[0].message.content == text
    assert plain.usage.completion_tokens == chunks[-1].usage.completion_tokens


def test_text_completions_plain_and_streamed(url):
    raw = client(url).completions.with_raw_response.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    plain = Completion.model_validate(raw.http_response.json())
    assert plain.object == "text_completion" and plain.id.startswith("cmpl-")
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    # OpenAI's Completion type has no null finish_reason, yet streamed text chunks carry one
    # (as OpenAI's and vLLM's do; the client builds them unvalidated): only the last validates.
    last = Completion.model_validate(events[-2])
    assert last.choices[0].finish_reason == plain.choices[0].finish_reason
    for event in events[:-2]:
        assert event.keys() == events[-2].keys() and event["choices"][0]["finish_reason"] is None
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == plain.choices[0].text


def test_stop_sequences_and_seeds_reach_the_engine(url):
    c = client(url)
    free = c.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0).choices[0].text
    stop = free[3:5]  # a stop string taken from the middle of the greedy output
    cut = c.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0, stop=[stop]).choices[0]
    assert cut.text == free[: free.index(stop)] and cut.finish_reason == "stop"
    sampled = [c.completions.create(model=MODEL, prompt="abc", max_tokens=8, seed=s).choices[0].text for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_models_health_and_ping(url):
    models = client(url).models.list()
    assert [Model.model_validate(m.model_dump()).id for m in models.data] == [MODEL]
    assert health(url) == {"status": "ready", "model": MODEL, "running": 0, "waiting": 0}
    assert httpx.get(f"{url}/ping").status_code == 200


# ---- invalid requests: 400 in OpenAI's shape, never 422 ------------------------------------------


@pytest.mark.parametrize(
    "edit,param",
    [
        (dict(temperature=3.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=100_000), "max_tokens"),  # past the context (512 tokens; 97 for the static graphs)
        (dict(max_completion_tokens=100_000), "max_completion_tokens"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(top_logprobs=2), "top_logprobs"),  # without logprobs: true
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
        (dict(messages=None), "messages"),
        (dict(seed="seven"), "seed"),
        (dict(messages=[{"role": "user", "content": "\ud800"}]), "messages.0.content"),  # a lone surrogate
        (dict(stop=["ok", "\udfff"]), "stop"),
    ],
)
def test_invalid_requests_are_400(url, edit, param):
    body = {k: v for k, v in chat_body(**edit).items() if v is not None}
    r = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    error = assert_openai_error(r, 400, param=param)
    assert error["type"] == "invalid_request_error"


# ---- sampling fields: OpenAI's schema and ranges, types refused, null the default, never ignored ---------

REFUSED = [
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"max_tokens": 8.0}, "max_tokens"),
    ({"stream": 1}, "stream"),
    ({"seed": 1.5}, "seed"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": "0"}, "presence_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias.a"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(65)}}, "logit_bias"),  # more than the graphs' 64 entries
    ({"logit_bias": {"5": 1.0, "99999": 2}}, "logit_bias"),  # past the vocabulary
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"min_p": 1.1}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"modalities": ["text", "audio"]}, "modalities.1"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": ["5"]}, "stop_token_ids.0"),
    ({"echo": 1}, "echo"),
]


@pytest.mark.parametrize("edit,param", REFUSED, ids=[param for _, param in REFUSED])
def test_a_sampling_field_is_checked_and_refused_by_name_never_ignored(url, edit, param):
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=json.dumps(chat_body(**edit)),
        headers={"content-type": "application/json"},
    )
    assert_openai_error(r, 400, param=param)


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "\uff11"])  # superscript two, Arabic-Indic three, fullwidth one
def test_a_logit_bias_key_of_non_ascii_digits_is_400_naming_it(url, key):
    """str.isdigit takes these, int() takes none of them (or reads another script's digit): refused by
    name, not a 500."""
    r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(logit_bias={key: 1}))
    assert repr(key) in assert_openai_error(r, 400, param="logit_bias")["message"]


def test_null_or_the_default_of_every_field_is_the_default(url):
    """What a client library sends when nothing is set: answered as if the fields were absent."""
    defaults = dict(
        temperature=None,
        top_p=None,
        top_k=None,
        n=None,
        stream=None,
        seed=None,
        stop=None,
        presence_penalty=0,
        frequency_penalty=None,
        logit_bias={},
        logprobs=False,
        top_logprobs=None,
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        functions=None,
        user="someone",
        modalities=["text"],
        stream_options=None,
        min_p=0,
        repetition_penalty=1.0,
        ignore_eos=False,
    )
    plain = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "seed": 3}
    with httpx.Client(base_url=url, timeout=60) as http:
        answers = [
            http.post("/v1/chat/completions", json={**plain, **extra}).json()
            for extra in ({}, {**defaults, "seed": 3}, {"temperature": 1.0, "top_p": 1.0})
        ]
    texts = [a["choices"][0]["message"]["content"] for a in answers]
    assert texts[0] == texts[1] == texts[2]  # null temperature and top_p: 1.0, sampled with the same seed


def test_top_k_is_honoured(url, engine):
    """top_k 1 is greedy whatever the temperature; past the static graphs' candidate width it is refused."""
    with httpx.Client(base_url=url, timeout=60) as http:
        greedy_text = http.post("/v1/chat/completions", json=chat_body()).json()["choices"][0]["message"]["content"]
        for seed in (1, 2):
            body = chat_body(temperature=2.0, top_k=1, seed=seed)
            answer = http.post("/v1/chat/completions", json=body).json()
            assert answer["choices"][0]["message"]["content"] == greedy_text
        wide = http.post("/v1/chat/completions", json=chat_body(temperature=1.0, top_k=300, seed=1))
    if engine.max_top_k is not None:
        assert "at most 256" in assert_openai_error(wide, 400, param="top_k")["message"]
    else:
        assert wide.status_code == 200  # on the host every token is a candidate


@pytest.mark.parametrize(
    "edit,param",
    [
        ({"logprobs": 6}, "logprobs"),  # OpenAI's most: 5
        ({"logprobs": True}, "logprobs"),  # a count, not a switch
        ({"suffix": "end"}, "suffix"),
        ({"echo": "true"}, "echo"),
        ({"top_logprobs": 2}, "top_logprobs"),  # chat's; completions' logprobs is the count
        ({"best_of": 21}, "best_of"),
    ],
)
def test_completions_fields_too(url, edit, param):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **edit}
    assert_openai_error(httpx.post(f"{url}/v1/completions", json=body), 400, param=param)
    fine = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 2,
        "suffix": "",
        "echo": False,
        "best_of": 1,
        "logprobs": None,
    }
    assert httpx.post(f"{url}/v1/completions", json=fine).status_code == 200


def test_malformed_json_and_a_too_long_prompt_are_400(url, engine):
    r = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_openai_error(r, 400)["message"]
    long = {"model": MODEL, "prompt": "x" * 600, "max_tokens": 1}
    n = len(engine.tokenizer.encode(long["prompt"]))
    # the limit is the context: 512 tokens, the static graphs' 97 (a prompt past a bucket is chunked)
    limit = f"context is {engine.max_context} tokens"
    message = assert_openai_error(httpx.post(f"{url}/v1/completions", json=long), 400, param="prompt")["message"]
    assert f"the prompt is {n} tokens" in message and limit in message
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model=MODEL, messages=CHAT, temperature=2.5)
    assert e.value.param == "temperature"


def test_unknown_model_is_404(url):
    with pytest.raises(openai.NotFoundError) as e:
        client(url).chat.completions.create(model="gpt-4o", messages=CHAT)
    assert (e.value.code, e.value.param) == ("model_not_found", "model")
    assert_openai_error(httpx.get(f"{url}/v1/nope"), 404)


def test_models_retrieve_answers_each_served_name(engine):
    """The `openai` client's `models.retrieve(id)` is GET /v1/models/{id}; a served name may hold '/'."""
    names = [MODEL, "google/gemma-4-26B-A4B-it"]
    app = create_app(lambda: engine, model_name=names)
    with serving(app) as url:
        ready(url)
        for name in names:
            model = client(url).models.retrieve(name)
            assert Model.model_validate(model.model_dump()).id == name and model.model_extra["root"] == MODEL
        with pytest.raises(openai.NotFoundError) as e:
            client(url).models.retrieve("gpt-4o")
        assert (e.value.code, e.value.param) == ("model_not_found", "model") and MODEL in e.value.message


@pytest.mark.parametrize("route", ["/v1/completions", "/invocations"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_json_body_sent_as_another_content_type_is_told_so(url, content_type, route):
    """curl -d sends form-urlencoded; the answer names the Content-Type, not a missing field. SageMaker's
    /invocations answers as the /v1 route its body names."""
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{url}{route}", content=json.dumps({"model": MODEL, "prompt": "hi"}), headers=headers)
    message = assert_openai_error(r, 415, code="unsupported_media_type")["message"]
    assert (
        "'Content-Type: application/json'" in message and (repr(content_type) if content_type else "missing") in message
    )
    json_too = {"content-type": "application/vnd.api+json; charset=utf-8"}  # JSON, as FastAPI reads it
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(f"{url}{route}", json=body, headers=json_too, timeout=60).status_code == 200


@pytest.mark.parametrize("route", ["/v1/completions", "/invocations"])
def test_a_request_without_a_body_is_told_so(url, route):
    r = httpx.post(f"{url}{route}", headers={"content-type": "application/json"})
    assert "the request has no body" in assert_openai_error(r, 400)["message"]


def test_the_open_routes_are_the_ones_the_docs_name():
    """docs/serving.md says which routes need no key; the server's OPEN_PATHS are those."""
    from pathlib import Path

    from neuron_moe.serve.app import OPEN_PATHS

    docs = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    sentence = re.search(r"every route needs it but ([^)]*)\)", docs)
    assert sentence and set(re.findall(r"`(/[a-z]+)`", sentence.group(1))) == set(OPEN_PATHS), sentence


def test_api_key(engine):
    with serving(make_app(engine, api_key="secret")) as url:
        ready(url)  # /health stays open for load balancers
        assert httpx.get(f"{url}/ping").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200  # open, as vLLM's: for a Prometheus scraper
        assert_openai_error(httpx.get(f"{url}/v1/models/{MODEL}"), 401, code="invalid_api_key")
        with pytest.raises(openai.AuthenticationError):
            client(url, key="wrong").models.list()
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
        assert_openai_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        assert client(url, key="secret").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices


# ---- /metrics --------------------------------------------------------------------------------------------


def scrape(url) -> dict:
    """/metrics parsed by prometheus_client's own parser: {(sample name, labels): value}."""
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.labels.get("model_name") == MODEL
    }


def test_metrics_count_the_requests_and_tokens_sent(engine):
    """A load of 9 requests (streamed and not, chat and completions, greedy and sampled, one cut short
    by max_tokens): every counter is what the responses' usage says; the batching engine's calls add
    up (each request's first token from a prefill call, every other token from a decode step)."""
    with serving(make_app(engine, max_queue=16)) as base:
        url = ready(base)
        before = scrape(url)
        assert before[("vllm:num_requests_running", ())] == before[("vllm:num_requests_waiting", ())] == 0
        usages = []

        async def one(i):
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                body = chat_body(max_tokens=3 + i % 4, temperature=0.7 * (i % 2), seed=i)
                if i % 3 == 0:
                    r = await http.post("/v1/completions", json={**body, "prompt": f"Hi {i}", "messages": None})
                    usages.append(r.json()["usage"])
                elif i % 3 == 1:
                    async with http.stream(
                        "POST",
                        "/v1/chat/completions",
                        json={**body, "stream": True, "stream_options": {"include_usage": True}},
                    ) as r:
                        usages.append(sse_events([line async for line in r.aiter_lines()])[-2]["usage"])
                else:
                    usages.append((await http.post("/v1/chat/completions", json=body)).json()["usage"])

        async def load():
            await asyncio.gather(*(one(i) for i in range(9)))

        asyncio.run(load())
        after = scrape(url)
    got = {k: v - before.get(k, 0) for k, v in after.items()}
    finished = sum(got[("vllm:request_success_total", (("finished_reason", r),))] for r in ("stop", "length"))
    assert finished == 9 and got[("vllm:request_success_total", (("finished_reason", "abort"),))] == 0
    assert got[("vllm:prompt_tokens_total", ())] == sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert got[("vllm:generation_tokens_total", ())] == generated
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert got[(f"{name}_count", ())] == 9 and got[(f"{name}_sum", ())] > 0
    assert got[("vllm:time_per_output_token_seconds_count", ())] == generated - 9  # every token but the first
    assert after[("vllm:num_requests_running", ())] == after[("vllm:num_requests_waiting", ())] == 0
    chunks = sum(-(-u["prompt_tokens"] // engine.runtime.chunk) for u in usages)  # every chunk once, several a call
    assert got[("neuron_moe:prefill_rows_total", ())] == chunks
    assert chunks / engine.runtime.prefill_rows[-1] <= got[("neuron_moe:prefill_calls_total", ())] <= chunks
    assert got[("neuron_moe:decode_rows_total", ())] == generated - 9
    assert got[("neuron_moe:decode_calls_total", ())] >= (generated - 9) / engine.rows
    assert after[("neuron_moe:batch_rows", ())] == engine.rows and after[("neuron_moe:batch_rows_in_use", ())] == 0


# ---- load, overload, disconnects, failures ------------------------------------------------------------


def test_503_with_retry_after_while_loading(engine):
    gate = threading.Event()

    def load():
        assert gate.wait(60)
        return engine

    with serving(create_app(load, model_name=MODEL)) as url:
        try:
            for path in ("/health", "/ping"):
                r = httpx.get(url + path)
                assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
            assert health(url)["status"] == "loading"
            r = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
            assert_openai_error(r, 503, code="model_loading")
            assert int(r.headers["retry-after"]) > 0
            with pytest.raises(openai.InternalServerError):
                client(url).chat.completions.create(model=MODEL, messages=CHAT)
        finally:
            gate.set()
        ready(url)
        assert client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices


def test_a_failed_load_is_reported_and_stops_the_server(engine):
    failures = []

    def load():
        raise UserError("/ckpt: no config.json")

    with serving(create_app(load, model_name=MODEL, on_load_error=failures.append)) as url:
        wait_for(lambda: failures, what="the load failure callback")
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
        assert "no config.json" in assert_openai_error(r, 503, code="model_load_failed")["message"]


def hold_streams(url, stack, n):
    """Open n long streamed requests (the Spy slows them down) and keep them open in `stack`."""
    body = chat_body(max_tokens=LONG, stream=True)
    return [stack.enter_context(httpx.stream("POST", f"{url}/v1/chat/completions", json=body)) for _ in range(n)]


def test_past_the_bounded_queue_429_with_retry_after(endless_engine):
    spy, n = Spy(endless_engine, step_delay_s=SLOW_S), rows(endless_engine)
    with serving(make_app(spy, max_queue=1)) as url, contextlib.ExitStack() as stack:
        ready(url)
        first = hold_streams(url, stack, n)[0]
        wait_for(lambda: spy.steps >= n, what="the first requests to generate")
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body(max_tokens=3, stream=True)) as queued:
            assert queued.status_code == 200
            wait_for(lambda: health(url) == dict(health(url), running=n, waiting=1), what="one request to queue")
            r = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
            assert_openai_error(r, 429, code="queue_full")
            assert r.headers["retry-after"] == "1"
            with pytest.raises(openai.RateLimitError):
                client(url).chat.completions.create(model=MODEL, messages=CHAT)
            first.close()  # the first client leaves; the queued request gets its slot (its row)
            events = sse_events(queued.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert spy.outcomes == ["cancelled", "length"]


def test_a_client_that_disconnects_mid_stream_frees_its_slot(endless_engine):
    spy, n = Spy(endless_engine, step_delay_s=SLOW_S), rows(endless_engine)
    with serving(make_app(spy, max_queue=0)) as url, contextlib.ExitStack() as stack:
        ready(url)
        first = hold_streams(url, stack, n)[0]
        lines = first.iter_lines()  # held: a dropped iterator closes the connection
        next(lines)
        wait_for(lambda: spy.steps >= 2 * n, what="generation to start")
        assert httpx.post(f"{url}/v1/chat/completions", json=chat_body()).status_code == 429  # all slots taken
        first.close()  # the connection closed mid-stream
        wait_for(lambda: spy.outcomes, what="the generation to stop")
        assert spy.outcomes == ["cancelled"] and spy.steps < n * LONG
        wait_for(lambda: health(url)["running"] == n - 1, what="the slot to be free")
        assert client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices


def test_a_client_that_gives_up_on_a_plain_request_frees_its_slot(endless_engine):
    spy = Spy(endless_engine, step_delay_s=SLOW_S)
    with serving(make_app(spy, max_queue=0)) as url:
        ready(url)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=LONG), timeout=httpx.Timeout(30, read=1))
        wait_for(lambda: spy.outcomes, what="the generation to stop")
        assert spy.outcomes == ["cancelled"] and spy.steps < LONG
        wait_for(lambda: health(url)["running"] == 0, what="the slot to be free")


def test_a_storm_of_clients_that_leave_logs_no_unretrieved_task(endless_engine, caplog):
    """Clients that leave mid-stream or mid-request: each one's waiting task is cancelled and read,
    not left for asyncio to log 'Task exception was never retrieved', once per client."""
    spy = Spy(endless_engine, step_delay_s=0.01)

    async def storm(url):
        async def leave_a_stream(c):
            async with c.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=LONG, stream=True)) as r:
                async for _ in r.aiter_lines():
                    break

        async def leave_a_request(c):
            with contextlib.suppress(httpx.ReadTimeout):
                await c.post(
                    "/v1/chat/completions", json=chat_body(max_tokens=LONG), timeout=httpx.Timeout(30, read=0.05)
                )

        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            for _ in range(3):
                await asyncio.gather(*[leave_a_stream(c) for _ in range(6)], *[leave_a_request(c) for _ in range(4)])

    with caplog.at_level(logging.ERROR, logger="asyncio"), serving(make_app(spy, max_queue=32)) as url:
        ready(url)
        asyncio.run(storm(url))
        wait_for(lambda: health(url)["running"] == 0 and health(url)["waiting"] == 0, what="the slots to be free")
        gc.collect()  # a task nobody holds any more is logged when it is collected
        time.sleep(0.2)
    assert spy.outcomes and set(spy.outcomes) == {"cancelled"}
    assert not [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


def test_the_queue_bound_holds_under_50_concurrent_clients(endless_engine):
    """50 clients at once, while the admitted requests are held: exactly rows + max_queue are
    admitted, every other one gets 429 + Retry-After at once, and the admitted ones all finish."""
    gate, max_queue = threading.Event(), 3
    admitted = rows(endless_engine) + max_queue
    spy = Spy(endless_engine, gate=gate)

    async def storm(url):
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=50)) as c:
            tasks = [
                asyncio.create_task(c.post("/v1/chat/completions", json=chat_body(max_tokens=4))) for _ in range(50)
            ]
            deadline = time.monotonic() + 60
            while sum(t.done() for t in tasks) < 50 - admitted:
                assert time.monotonic() < deadline, "the refused requests were not answered at once"
                await asyncio.sleep(0.05)
            refused = [t.result() for t in tasks if t.done()]
            gate.set()
            return refused, await asyncio.wait_for(asyncio.gather(*tasks), 60)

    with serving(make_app(spy, max_queue=max_queue)) as url:
        ready(url)
        try:
            refused, responses = asyncio.run(storm(url))
        finally:
            gate.set()
        assert health(url)["running"] == 0
    assert len(refused) == 50 - admitted and all(r.status_code == 429 for r in refused)
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in refused)
    done = [r.json() for r in responses if r.status_code == 200]
    assert len(done) == admitted and all(r["usage"]["completion_tokens"] == 4 for r in done)
    assert spy.outcomes == ["length"] * admitted


def test_an_error_mid_stream_is_an_error_event_then_done(endless_engine):
    """Every request is greedy and cannot end before its third token (no EOS): each one reaches the
    injected fault, whatever the model would have said."""
    spy = Spy(endless_engine, fail_after=3)
    with serving(make_app(spy)) as url:
        ready(url)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body(max_tokens=20, stream=True)) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and set(events[-2]) == {"error"}
        assert set(events[-2]["error"]) == ERROR_KEYS and events[-2]["error"]["type"] == "server_error"
        assert "injected backend fault" in events[-2]["error"]["message"]
        for event in events[:-2]:
            ChatCompletionChunk.model_validate(event)
        with pytest.raises(openai.APIError, match="injected backend fault"):
            for _ in client(url).chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=20, stream=True, temperature=0
            ):
                pass
        with pytest.raises(openai.InternalServerError, match="injected backend fault"):
            client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
        assert spy.outcomes == ["failed"] * 3
        spy.fail_after = None  # the server itself is unharmed
        assert client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices


def test_a_draining_server_refuses_new_requests_and_finishes_the_running_ones(endless_engine):
    """What SIGTERM does to the app (uvicorn's side: test_serve_process.py): no new request, and
    the running ones — every row of a batching engine — go on to their own end."""
    spy, n = Spy(endless_engine, step_delay_s=0.01), rows(endless_engine)
    app = make_app(spy)
    with serving(app) as url, contextlib.ExitStack() as stack:
        ready(url)
        running = hold_streams(url, stack, n)
        wait_for(lambda: spy.steps >= n, what="the rows to generate")
        app.state.server.draining = True
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
        assert_openai_error(r, 503, code="draining")
        assert int(r.headers["retry-after"]) > 0
        assert health(url)["status"] == "draining"
        for stream in running:
            events = sse_events(stream.iter_lines())
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert spy.outcomes == ["length"] * n


# ---- hostile clients: huge bodies, slow tokenizing -------------------------------------------------------


def test_a_body_over_the_limit_is_413_in_openai_shape(engine):
    big = chat_body(messages=[{"role": "user", "content": "x" * 10_000}])
    data = json.dumps(big).encode()
    with serving(make_app(engine, max_body_bytes=4096)) as url:
        ready(url)
        r = httpx.post(f"{url}/v1/chat/completions", json=big)  # Content-Length says it: refused unread
        assert (
            "larger than this server's limit of 4096 bytes"
            in assert_openai_error(r, 413, code="request_too_large")["message"]
        )
        chunked = (data[i : i + 1000] for i in range(0, len(data), 1000))  # no Content-Length: refused as it grows
        r = httpx.post(f"{url}/v1/chat/completions", content=chunked, headers={"content-type": "application/json"})
        assert_openai_error(r, 413, code="request_too_large")
        assert client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices


def test_no_schema_or_docs_pages_are_served(engine):
    """FastAPI's /openapi.json (and the /docs that reads it) answered without the API key."""
    with serving(make_app(engine, api_key="secret")) as url:
        ready(url)
        for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
            assert httpx.get(f"{url}{path}").status_code == 401, path  # behind the key, as every route
            assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer secret"}).status_code == 404, path


def _raw_request(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_body_that_does_not_all_come_gets_408(engine):
    """A client that sends its headers and then trickles (or stops sending) its body is answered 408
    once the body deadline passes, and the connection closed; the server goes on serving."""
    with serving(make_app(engine, body_timeout=0.5)) as url:
        ready(url)
        with _raw_request(url) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 200\r\n\r\n{"model":'
            )
            start = time.monotonic()
            answer = _read_until_closed(sock)
            waited = time.monotonic() - start
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and 0.4 < waited < 5, (answer, waited)
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "did not all arrive within 0.5 s" in error["message"]
        assert client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices


def test_a_request_whose_headers_do_not_come_is_cut_and_others_are_not(engine):
    """uvicorn alone never times out a connection that sends nothing or trickles its headers
    (slowloris); with `connection.protocol`, the headers are due within the deadline, counted from
    the connection (or the next request's first byte): a slow response is not cut."""
    app = make_app(Spy(engine, step_delay_s=0.1))
    config = server_config(app)
    config.http = connection.protocol(0.5)
    with serving(app, server=uvicorn.Server(config)) as url:
        ready(url)
        with _raw_request(url) as silent, _raw_request(url) as trickle:
            start = time.monotonic()
            try:
                for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":  # a byte every 0.05 s: 1.6 s of headers
                    trickle.sendall(bytes([byte]))
                    time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):  # the server closed it meanwhile
                pass
            assert _read_until_closed(silent) == b"" and _read_until_closed(trickle) == b""
            assert time.monotonic() - start < 5
        # a keep-alive connection with a response slower than the deadline (10 steps of 0.1 s): not cut
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(2):
                r = http.post("/v1/chat/completions", json=chat_body(max_tokens=10))
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
                time.sleep(0.3)


class SlowTokenizer:
    """The engine's tokenizer, taking `seconds` to encode (time.sleep holds no GIL: only the event loop
    being blocked can delay /health) and counting its calls."""

    def __init__(self, inner, seconds):
        self.inner, self.seconds = inner, seconds
        self.calls, self.busy = 0, threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text):
        self.calls += 1
        self.busy.set()
        time.sleep(self.seconds)
        return self.inner.encode(text)


def test_health_answers_while_a_prompt_is_tokenized(engine):
    """Tokenizing runs off the event loop: while a prompt is in the tokenizer (3 s here; a 10 MB prompt
    takes ~15 s), /health answers at once, well before the tokenizer is done."""
    slow = copy.copy(engine)
    slow.tokenizer = SlowTokenizer(engine.tokenizer, 3.0)
    with serving(make_app(slow)) as url:
        ready(url)
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1}
        answers = []
        sender = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))
        )
        sender.start()
        assert slow.tokenizer.busy.wait(30)
        start = time.perf_counter()
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert time.perf_counter() - start < 2.0  # not the tokenizer's 3 s, with room for a loaded machine
        sender.join(60)
    assert answers[0].status_code == 200


def test_a_prompt_longer_than_the_context_could_hold_is_refused_untokenized(engine):
    counting = copy.copy(engine)
    counting.tokenizer = SlowTokenizer(engine.tokenizer, 0.0)
    longest = engine.max_context
    n_bytes = longest * engine.tokenizer.max_token_bytes + 1  # more than any prompt it takes can be
    with serving(make_app(counting)) as url:
        ready(url)
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x" * n_bytes, "max_tokens": 1})
        assert f"the prompt is {n_bytes} bytes" in assert_openai_error(r, 400, param="prompt")["message"]
        wide = chat_body(messages=[{"role": "user", "content": "é" * n_bytes}])  # 2 bytes a character
        r = httpx.post(f"{url}/v1/chat/completions", json=wide)
        assert_openai_error(r, 400, param="messages")
    assert counting.tokenizer.calls == 0


# ---- the drain deadline (item 7) ------------------------------------------------------------------------


def test_past_the_drain_timeout_requests_in_flight_end_properly(endless_engine):
    """Not cut off (a chunked stream without its end, or a plain-text 500): a stream ends with an error
    event and [DONE], a plain request with a 503 JSON body."""
    spy = Spy(endless_engine, step_delay_s=SLOW_S)  # LONG tokens take 3 s: running at the 1 s deadline
    app = create_app(lambda: spy, model_name=MODEL)
    server = DrainingServer(server_config(app), drain_timeout=1.0)
    plain = []
    with serving(app, server=server) as url:
        ready(url)
        sender = threading.Thread(
            target=lambda: plain.append(
                httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=LONG), timeout=60)
            )
        )
        sender.start()
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=chat_body(max_tokens=LONG, stream=True), timeout=60
        ) as r:
            lines = r.iter_lines()
            next(lines)
            wait_for(lambda: spy.steps >= 4 and health(url)["running"] == 2, what="both requests to generate")
            start = time.perf_counter()
            server.handle_exit(signal.SIGTERM, None)
            events = sse_events(lines)
        assert 0.9 < time.perf_counter() - start < 4.5  # at the deadline, not at uvicorn's own later one
        sender.join(30)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "draining"
    assert set(events[-2]["error"]) == ERROR_KEYS and "drain timeout" in events[-2]["error"]["message"]
    assert_openai_error(plain[0], 503, code="draining")
    wait_for(lambda: spy.outcomes == ["cancelled", "cancelled"], what="both generations to stop")


def test_a_body_still_arriving_at_the_drain_deadline_is_a_503_in_openai_shape(engine, caplog):
    """--drain-timeout below --body-timeout (SageMaker's 20 s drain, the 30 s default): a client mid-body at
    the drain deadline gets the drain's 503 JSON, as every request in flight then — not a plain-text 500
    when uvicorn cancels the request DRAIN_GRACE_S later, with a CancelledError traceback in the log."""
    app = make_app(engine, body_timeout=60)
    server = DrainingServer(server_config(app), drain_timeout=0.5)
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate to the root's
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO), serving(app, server=server) as url:
            ready(url)
            with _raw_request(url) as sock:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 200\r\n\r\n{"model":'
                )
                server.handle_exit(signal.SIGTERM, None)
                answer = _read_until_closed(sock)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"\r\nretry-after: 5\r\n" in head.lower(), answer
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "draining") and "drain timeout" in error["message"]
    assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()], caplog.text
