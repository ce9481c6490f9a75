"""vLLM's stop fields and OpenAI's choices: ignore_eos, stop_token_ids, min_tokens,
include_stop_str_in_output, echo, n and best_of — in `Output` on scripted logits, then over HTTP
against transformers' model (sampling on the host) and the static graphs (the batching engine)."""

import json
import math

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from neuron_moe.serve.app import create_app
from neuron_moe.serve.backends import load_engine
from neuron_moe.serve.engine import Engine, RequestError, SamplingParams
from neuron_moe.tokenizer import ByteTokenizer

from serving import serving, sse_events, wait_for

BYTES = ByteTokenizer()
EOS = BYTES.eos_token_id
MODEL = "tiny-gemma4-moe"
PROMPT = "The capital of France is"  # the trained tiny model's greedy answer ends with EOS after 23 tokens
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def byte(c: str) -> int:
    return ord(c) + BYTES.offset


class Ranked:
    """Every step the same logits: the tokens of `order` most likely first (one logit apart), every
    other token far below. EOS first makes a model that wants to stop at once."""

    def __init__(self, order):
        self.logits = torch.full((BYTES.vocab_size,), -30.0)
        for i, token in enumerate(order):
            self.logits[token] = -float(i)

    def prefill(self, ids):
        return self.logits.clone(), None

    def decode(self, token, state):
        return self.logits.clone()


class Scripted:
    """The given text's byte tokens in order, whatever the prompt, then EOS."""

    def __init__(self, text: str):
        self.tokens = [byte(c) for c in text]

    def prefill(self, ids):
        return self._logits(0), {"i": 0}

    def decode(self, token, state):
        state["i"] += 1
        return self._logits(state["i"])

    def _logits(self, i):
        logits = torch.full((BYTES.vocab_size,), -30.0)
        logits[self.tokens[i] if i < len(self.tokens) else EOS] = 0.0
        return logits


def run(runtime, max_tokens=64, **kw):
    engine = Engine(runtime, BYTES, 512, {EOS})
    params = SamplingParams(max_tokens, **{"temperature": 0.0, **kw})
    engine.check_sampling(params)
    return list(engine.generate([2, 50], params))


def text(steps) -> str:
    return "".join(s.text for s in steps)


# ---- Output on scripted logits ----------------------------------------------------------------------------


def test_ignore_eos_runs_to_max_tokens_feeding_eos_on():
    steps = run(Scripted("hi"), max_tokens=6, ignore_eos=True)
    assert (text(steps), steps[-1].finish_reason, steps[-1].completion_tokens) == ("hi", "length", 6)
    assert run(Scripted("hi"), max_tokens=6)[-1].completion_tokens == 3  # without it: "h", "i", EOS


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_until_then(temperature):
    """A model whose most likely token is always EOS: min_tokens of the next most likely, then EOS."""
    steps = run(Ranked([EOS, byte("x")]), min_tokens=5, temperature=temperature, seed=3)
    assert (text(steps), steps[-1].finish_reason, steps[-1].completion_tokens) == ("xxxxx", "stop", 6)
    assert run(Ranked([EOS, byte("x")]))[-1].completion_tokens == 1


def test_stop_token_ids_end_with_stop_and_the_token_as_stop_reason():
    steps = run(Scripted("hello. more"), stop_token_ids=(byte("."),))
    assert (text(steps), steps[-1].finish_reason, steps[-1].stop_reason) == ("hello", "stop", byte("."))
    assert steps[-1].completion_tokens == len("hello.")
    kept = run(Scripted("hello. more"), stop_token_ids=(byte("."),), include_stop_str_in_output=True)
    assert (text(kept), kept[-1].stop_reason) == ("hello.", byte("."))
    eos = run(Scripted("hi"))
    assert (eos[-1].finish_reason, eos[-1].stop_reason) == ("stop", None)  # EOS: no stop_reason, as vLLM


def test_min_tokens_bans_stop_token_ids_too_and_ignore_eos_unbans_eos():
    # "a" (a stop token) first, "b" next: b until min_tokens, then a ends it
    steps = run(Ranked([byte("a"), byte("b")]), min_tokens=3, stop_token_ids=(byte("a"),))
    assert (text(steps), steps[-1].stop_reason, steps[-1].completion_tokens) == ("bbb", byte("a"), 4)
    engine = Engine(Ranked([EOS]), BYTES, 512, {EOS})
    output = engine.output(SamplingParams(8, min_tokens=2, stop_token_ids=(9, 7)))
    assert output.banned() == (EOS, 7, 9)
    output.next(None, byte("b"))
    output.next(None, byte("b"))
    assert output.banned() == ()  # two generated: nothing banned any more
    ignoring = engine.output(SamplingParams(8, min_tokens=2, stop_token_ids=(9,), ignore_eos=True))
    assert ignoring.banned() == (9,)


def test_include_stop_str_in_output_keeps_the_stop_string_and_sends_nothing_past_it():
    steps = run(Scripted("The answer is 42. Done"), stop=("42.",), include_stop_str_in_output=True)
    assert (text(steps), steps[-1].stop_reason) == ("The answer is 42.", "42.")
    cut = run(Scripted("The answer is 42. Done"), stop=("42.",))
    assert (text(cut), cut[-1].stop_reason) == ("The answer is ", "42.")


def test_no_stop_string_ends_within_min_tokens():
    """vLLM's rule: text of the first min_tokens tokens is not searched for stop strings."""
    assert text(run(Scripted("xaxxa yz"), stop=("a",))) == "x"
    steps = run(Scripted("xaxxa yz"), stop=("a",), min_tokens=2)
    assert (text(steps), steps[-1].completion_tokens) == ("xaxx", 5)
    # a stop string that begins within min_tokens and ends after it counts
    assert text(run(Scripted("xyzw"), stop=("yz",), min_tokens=2)) == "x"


def test_the_chosen_tokens_logprobs_are_summed_when_asked():
    steps = run(Ranked([byte("x"), EOS]), max_tokens=3, ignore_eos=True, rank=True)
    expected = 3 * float(torch.log_softmax(Ranked([byte("x"), EOS]).logits, -1)[byte("x")])
    assert math.isclose(steps[-1].cumulative_logprob, expected, rel_tol=1e-6)
    assert run(Scripted("ab"))[-1].cumulative_logprob is None
    # under a ban, still the model's own distribution: EOS, banned, keeps its share
    banned = run(Ranked([EOS, byte("x")]), max_tokens=2, min_tokens=2, rank=True)
    raw = float(torch.log_softmax(Ranked([EOS, byte("x")]).logits, -1)[byte("x")])
    assert text(banned) == "xx" and math.isclose(banned[-1].cumulative_logprob, 2 * raw, rel_tol=1e-6)


def test_what_a_backend_cannot_do_is_refused_by_name():
    engine = Engine(Ranked([EOS]), BYTES, 512, {EOS})
    with pytest.raises(RequestError) as e:
        engine.check_sampling(SamplingParams(4, min_tokens=5))
    assert e.value.param == "min_tokens"
    with pytest.raises(RequestError) as e:  # EOS and 64 stop ids: past the graphs' 64 entries per row
        engine.check_sampling(SamplingParams(4, min_tokens=1, stop_token_ids=tuple(range(10, 74))))
    assert e.value.param == "stop_token_ids"
    engine.check_sampling(SamplingParams(4, min_tokens=1, stop_token_ids=tuple(range(10, 73))))
    engine.runtime.processing = False  # graphs without the logits-processing variants (an older artifact)
    for params, field in ((SamplingParams(4, min_tokens=2), "min_tokens"), (SamplingParams(4, rank=True), "best_of")):
        with pytest.raises(RequestError) as e:
            engine.check_sampling(params)
        assert e.value.param == field
    engine.check_sampling(SamplingParams(4, min_tokens=2, ignore_eos=True))  # nothing to ban: fine


# ---- over HTTP --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["eager", "static"])
def engine(request, tiny_port):
    engine = load_engine(tiny_port, request.param)
    yield engine
    if engine.rows:
        engine.close()


@pytest.fixture(scope="module")
def url(engine, tiny_port):
    rows = {} if engine.rows else {"max_running": 1}
    app = create_app(lambda: engine, model_name=MODEL, vocab_size=tiny_port.config.vocab_size, **rows)
    with serving(app) as base:
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, what="the model to be ready")
        yield base


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def complete(url, **kw):
    return client(url).completions.create(model=MODEL, prompt=PROMPT, **kw)


def test_n_choices_each_seeded_from_the_request_seed(url):
    """n=3: three choices, indexed; choice i is what n=1 answers with seed + i (vLLM's seeding);
    usage: the prompt once, the choices' tokens summed."""
    three = complete(url, n=3, max_tokens=8, seed=11, temperature=1.0)
    assert [c.index for c in three.choices] == [0, 1, 2]
    alone = [complete(url, max_tokens=8, seed=11 + i, temperature=1.0) for i in range(3)]
    assert [c.text for c in three.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in three.choices}) > 1
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert three.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    chat = client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=4, seed=5
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]


def test_n_choices_streamed_each_chunk_naming_its_choice(url):
    body = {"model": MODEL, "prompt": PROMPT, "n": 2, "max_tokens": 6, "seed": 4, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    texts, finishes = ["", ""], [None, None]
    for event in events[:-2]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
    plain = complete(url, n=2, max_tokens=6, seed=4)
    assert texts == [c.text for c in plain.choices] and finishes == [c.finish_reason for c in plain.choices]
    assert events[-2]["usage"]["completion_tokens"] == plain.usage.completion_tokens
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat, timeout=60) as r:
        events = sse_events(r.iter_lines())
    roles = [e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["delta"].get("role")]
    ends = [e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(roles) == [0, 1] and sorted(ends) == [0, 1]


def test_ignore_eos_returns_exactly_max_tokens(url):
    ends = complete(url, max_tokens=40, temperature=0)
    assert ends.choices[0].finish_reason == "stop" and ends.usage.completion_tokens < 40  # the model's EOS
    got = complete(url, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert (got.choices[0].finish_reason, got.usage.completion_tokens) == ("length", 40)
    assert got.choices[0].text.startswith(ends.choices[0].text)


def test_min_tokens_keeps_eos_away(url):
    free = complete(url, max_tokens=60, temperature=0)
    n = free.usage.completion_tokens  # EOS is its last token
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "min_tokens": n + 5}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text  # the static graphs: EOS banned in their logits-processing variant
    answer = r.json()
    assert answer["usage"]["completion_tokens"] > n + 5 or answer["choices"][0]["finish_reason"] == "length"
    assert answer["choices"][0]["text"].startswith(free.choices[0].text)
    too_many = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 4, "min_tokens": 5}, timeout=60)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "min_tokens"
    nothing_to_ban = {**body, "min_tokens": 3, "max_tokens": 5, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=nothing_to_ban, timeout=60).status_code == 200


def test_stop_token_ids_and_include_stop_str_in_output(url, engine):
    free = complete(url, max_tokens=16, temperature=0).choices[0].text
    tokens = engine.tokenizer.encode(free, False)
    stop_id = tokens[4]
    cut = complete(url, max_tokens=16, temperature=0, extra_body={"stop_token_ids": [stop_id]})
    choice = cut.choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop_id)
    assert choice.text == engine.tokenizer.decode(tokens[: tokens.index(stop_id)])
    kept = complete(
        url, max_tokens=16, temperature=0, extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == engine.tokenizer.decode(tokens[: tokens.index(stop_id) + 1])
    stop = free[3:6]
    with_stop = complete(
        url, max_tokens=16, temperature=0, stop=[stop], extra_body={"include_stop_str_in_output": True}
    )
    assert with_stop.choices[0].text == free[: free.index(stop) + len(stop)]
    assert with_stop.choices[0].model_extra["stop_reason"] == stop
    bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "stop_token_ids": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"


def test_echo_prepends_the_prompt(url):
    plain = complete(url, max_tokens=6, temperature=0).choices[0].text
    assert complete(url, max_tokens=6, temperature=0, echo=True).choices[0].text == PROMPT + plain
    ids = client(url).completions.create(model=MODEL, prompt=[[2, 87, 108]], max_tokens=3, temperature=0, echo=True)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[0]["choices"][0]["text"] == PROMPT
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == PROMPT + plain
    assert ids.choices[0].text.startswith(
        httpx.post(f"{url}/detokenize", json={"tokens": [2, 87, 108]}).json()["prompt"]
    )
    turns = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Sure,"}]
    chat = client(url).chat.completions.create(
        model=MODEL, messages=turns, max_tokens=4, temperature=0, extra_body={"echo": True}
    )
    quiet = client(url).chat.completions.create(model=MODEL, messages=turns, max_tokens=4, temperature=0)
    assert chat.choices[0].message.content == "Sure," + quiet.choices[0].message.content


def test_best_of_answers_the_most_likely_candidates(url, engine):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "seed": 7, "best_of": 3, "n": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text  # the static graphs: the logprobs from their logits-processing variant
    ids = engine.tokenizer.encode(PROMPT)
    ranked = []
    for seed in (7, 8, 9):  # the candidates, as best_of seeds them, each with its tokens' summed logprob
        steps = list(engine.generate(ids, SamplingParams(6, temperature=1.0, seed=seed, rank=True)))
        ranked.append((steps[-1].cumulative_logprob, text(steps)))
    assert len({t for _, t in ranked}) == 3
    assert r.json()["choices"][0]["text"] == max(ranked)[1]
    assert r.json()["usage"]["completion_tokens"] == 18  # every candidate's tokens, as OpenAI counts them
    two = httpx.post(f"{url}/v1/completions", json={**body, "n": 2}, timeout=60).json()
    assert [c["text"] for c in two["choices"]] == [t for _, t in sorted(ranked, reverse=True)[:2]]


@pytest.mark.parametrize(
    "edit,param",
    [
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"stop_token_ids": "5"}, "stop_token_ids"),
        ({"stop_token_ids": list(range(33))}, "stop_token_ids"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"echo": 1}, "echo"),
    ],
)
def test_fields_checked_by_name(url, edit, param):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **edit}
    r = httpx.post(f"{url}/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_more_generations_than_the_server_admits_is_400_naming_n(tiny_port, engine):
    rows = {} if engine.rows else {"max_running": 1}
    with serving(create_app(lambda: engine, model_name=MODEL, max_queue=1, **rows)) as base:
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, what="the model to be ready")
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": (engine.rows or 1) + 2}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert httpx.post(f"{base}/v1/completions", json={**body, "n": 2}, timeout=60).status_code == 200


def aborted(url) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    success = next(f for f in families if f.name == "vllm:request_success")
    return sum(s.value for s in success.samples if s.labels.get("finished_reason") == "abort")


def test_a_client_that_leaves_ends_every_choice(url):
    """A stream of n=2 left after its first chunk: both generations are cancelled (counted as aborted,
    not run to their length), and their slots are free."""
    before = aborted(url)
    body = {"model": MODEL, "prompt": PROMPT, "n": 2, "max_tokens": 85, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())
    wait_for(lambda: aborted(url) == before + 2, 30, "both generations to be cancelled")
    assert httpx.get(f"{url}/health").json() | {"status": "ready"} == {
        "status": "ready",
        "model": MODEL,
        "running": 0,
        "waiting": 0,
    }


def test_each_choice_has_its_own_logprobs_and_echo(url):
    """n=2 with logprobs and echo: each choice its own prompt then tokens, text_offset from 0 per choice."""
    got = complete(url, n=2, max_tokens=4, seed=3, temperature=1.0, logprobs=1, echo=True)
    for choice in got.choices:
        lp = choice.logprobs
        assert "".join(lp.tokens) == choice.text and choice.text.startswith(PROMPT)
        assert lp.text_offset[0] == 0 and lp.token_logprobs[0] is None  # the prompt's first token has none
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    alone = complete(url, max_tokens=4, seed=4, temperature=1.0, logprobs=1, echo=True).choices[0]
    assert got.choices[1].text == alone.text  # choice 1 is seeded seed + 1; its logprobs within fp32 rounding of
    # the same rows' prefill batched otherwise (1e-4: the fp32 port's tolerance against HF eager)
    assert got.choices[1].logprobs.token_logprobs[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-4)
