"""vLLM's stop fields and OpenAI's choices: ignore_eos, stop_token_ids, min_tokens,
include_stop_str_in_output, echo, n and best_of — in `Output` on scripted logits, then over HTTP
against the engine over transformers' model (sampling on the host) and over the static graphs."""

import json
import math

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from neuron_moe.serve.app import create_app
from neuron_moe.serve.chat import render_chat
from neuron_moe.serve.backends import load_engine
from neuron_moe.port import load_port
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.decoding import RequestError, SamplingParams, bad_word_ids
from neuron_moe.serve.hf_runtime import HostRuntime
from neuron_moe.static.sampling import Processing
from neuron_moe.tokenizer import ByteTokenizer, load_tokenizer

from conftest import random_prompts
from serving import Scripted, serving, sse_events, wait_for

BYTES = ByteTokenizer()
EOS = BYTES.eos_token_id
MODEL = "tiny-gemma4-moe"
PROMPT = "The capital of France is"  # the trained tiny model's greedy answer ends with EOS after 23 tokens
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def byte(c: str) -> int:
    return ord(c) + BYTES.offset


class Ranked(HostRuntime):
    """Every step the same logits: the tokens of `order` most likely first (one logit apart), every
    other token far below. EOS first makes a model that wants to stop at once."""

    def __init__(self, order):
        super().__init__(1, BYTES.vocab_size, 511)
        self.ranked = torch.full((BYTES.vocab_size,), -30.0)
        for i, token in enumerate(order):
            self.ranked[token] = -float(i)

    def reset(self, row):
        pass

    def logits(self, row, ids, start, keep):
        return self.ranked.expand(keep or len(ids), -1).clone()


@pytest.fixture
def eos_first():
    """The engine over a model that wants to stop at once (EOS first): what it checks, the Outputs it makes."""
    with Engine(Ranked([EOS]), BYTES, {EOS}) as engine:
        yield engine


def scripted(text: str) -> Scripted:
    """The given text's byte tokens in order, whatever the prompt, then EOS."""
    return Scripted([byte(c) for c in text])


def run(runtime, max_tokens=64, **kw):
    with Engine(runtime, BYTES, {EOS}) as engine:
        params = SamplingParams(max_tokens, **{"temperature": 0.0, **kw})
        engine.check_sampling(params)
        return list(engine.generate([2, 50], params))


def text(steps) -> str:
    return "".join(s.text for s in steps)


# ---- Output on scripted logits ----------------------------------------------------------------------------


def test_ignore_eos_runs_to_max_tokens_feeding_eos_on():
    steps = run(scripted("hi"), max_tokens=6, ignore_eos=True)
    assert (text(steps), steps[-1].finish_reason, steps[-1].completion_tokens) == ("hi", "length", 6)
    assert run(scripted("hi"), max_tokens=6)[-1].completion_tokens == 3  # without it: "h", "i", EOS


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_until_then(temperature):
    """A model whose most likely token is always EOS: min_tokens of the next most likely, then EOS."""
    steps = run(Ranked([EOS, byte("x")]), min_tokens=5, temperature=temperature, seed=3)
    assert (text(steps), steps[-1].finish_reason, steps[-1].completion_tokens) == ("xxxxx", "stop", 6)
    assert run(Ranked([EOS, byte("x")]))[-1].completion_tokens == 1


def test_stop_token_ids_end_with_stop_and_the_token_as_stop_reason():
    steps = run(scripted("hello. more"), stop_token_ids=(byte("."),))
    assert (text(steps), steps[-1].finish_reason, steps[-1].stop_reason) == ("hello", "stop", byte("."))
    assert steps[-1].completion_tokens == len("hello.")
    kept = run(scripted("hello. more"), stop_token_ids=(byte("."),), include_stop_str_in_output=True)
    assert (text(kept), kept[-1].stop_reason) == ("hello.", byte("."))
    eos = run(scripted("hi"))
    assert (eos[-1].finish_reason, eos[-1].stop_reason) == ("stop", None)  # EOS: no stop_reason, as vLLM


def test_min_tokens_bans_stop_token_ids_too_and_ignore_eos_unbans_eos(eos_first):
    # "a" (a stop token) first, "b" next: b until min_tokens, then a ends it
    steps = run(Ranked([byte("a"), byte("b")]), min_tokens=3, stop_token_ids=(byte("a"),))
    assert (text(steps), steps[-1].stop_reason, steps[-1].completion_tokens) == ("bbb", byte("a"), 4)
    output = eos_first.output(SamplingParams(8, min_tokens=2, stop_token_ids=(9, 7)))
    assert output.banned() == (EOS, 7, 9)
    output.next(byte("b"))
    output.next(byte("b"))
    assert output.banned() == ()  # two generated: nothing banned any more
    ignoring = eos_first.output(SamplingParams(8, min_tokens=2, stop_token_ids=(9,), ignore_eos=True))
    assert ignoring.banned() == (9,)


def test_include_stop_str_in_output_keeps_the_stop_string_and_sends_nothing_past_it():
    steps = run(scripted("The answer is 42. Done"), stop=("42.",), include_stop_str_in_output=True)
    assert (text(steps), steps[-1].stop_reason) == ("The answer is 42.", "42.")
    cut = run(scripted("The answer is 42. Done"), stop=("42.",))
    assert (text(cut), cut[-1].stop_reason) == ("The answer is ", "42.")


def test_no_stop_string_ends_within_min_tokens():
    """vLLM's rule: text of the first min_tokens tokens is not searched for stop strings."""
    assert text(run(scripted("xaxxa yz"), stop=("a",))) == "x"
    steps = run(scripted("xaxxa yz"), stop=("a",), min_tokens=2)
    assert (text(steps), steps[-1].completion_tokens) == ("xaxx", 5)
    # a stop string that begins within min_tokens and ends after it counts
    assert text(run(scripted("xyzw"), stop=("yz",), min_tokens=2)) == "x"


def test_the_chosen_tokens_logprobs_are_summed_when_asked():
    steps = run(Ranked([byte("x"), EOS]), max_tokens=3, ignore_eos=True, rank=True)
    expected = 3 * float(torch.log_softmax(Ranked([byte("x"), EOS]).ranked, -1)[byte("x")])
    assert math.isclose(steps[-1].cumulative_logprob, expected, rel_tol=1e-6)
    assert run(scripted("ab"))[-1].cumulative_logprob is None
    # under a ban, still the model's own distribution: EOS, banned, keeps its share
    banned = run(Ranked([EOS, byte("x")]), max_tokens=2, min_tokens=2, rank=True)
    raw = float(torch.log_softmax(Ranked([EOS, byte("x")]).ranked, -1)[byte("x")])
    assert text(banned) == "xx" and math.isclose(banned[-1].cumulative_logprob, 2 * raw, rel_tol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_are_the_only_tokens_chosen(temperature):
    """The model wants EOS then "a"; only "x" and "y" allowed: every token one of them, to max_tokens."""
    allowed = (byte("x"), byte("y"))
    steps = run(
        Ranked([EOS, byte("a"), byte("y"), byte("x")]),
        max_tokens=12,
        temperature=temperature,
        seed=5,
        allowed_token_ids=allowed,
    )
    assert set(text(steps)) <= {"x", "y"} and steps[-1].completion_tokens == 12
    if temperature == 0:
        assert text(steps) == "y" * 12  # the more likely of the two


def test_allowed_token_ids_and_a_grammars_mask_allow_what_both_allow(eos_first):
    output = eos_first.output(SamplingParams(4, allowed_token_ids=(byte("a"), byte("b"))))
    grammar = torch.full_like(output.allowed(), -1)
    grammar[byte("a") // 32] &= ~(1 << (byte("a") % 32))  # a grammar that rules "a" out
    output.matcher = type("Grammar", (), {"allowed": lambda self: grammar})()
    mask = output.allowed()
    assert [t for t in range(BYTES.vocab_size) if mask[t // 32] >> (t % 32) & 1] == [byte("b")]


def test_bad_words_ban_each_words_last_token_after_the_rest(eos_first):
    """vLLM's bad_words: a one-token word is never chosen; a longer word's last token is banned right
    after its other tokens were generated, so the model takes its next choice there."""
    # "t" banned: the first of the tokens left at -30 instead (token 0: no text)
    assert text(run(scripted("a cat sat"), bad_words=("t",))) == "a ca sa"
    steps = run(Ranked([byte("a"), byte("b"), byte("c")]), max_tokens=6, bad_words=("ab", "aa"))
    assert text(steps) == "ac" * 3  # after "a": "a" and "b" banned; after "c": "a" again
    output = eos_first.output(SamplingParams(8, bad_words=("xyz", "q")))
    assert output.banned() == (byte("q"),)
    output.next(byte("x"))
    assert output.banned() == (byte("q"),)
    output.next(byte("y"))
    assert sorted(output.banned()) == [byte("q"), byte("z")]


def test_allowed_token_ids_and_bad_words_that_leave_nothing_are_the_requests_fault():
    with pytest.raises(RequestError) as e:  # "x" the only token allowed, and a bad word
        run(Ranked([byte("x")]), allowed_token_ids=(byte("x"),), bad_words=("x",))
    assert e.value.param == "allowed_token_ids" and "no token is left" in str(e.value)


def test_bad_words_tokenized_with_and_without_a_leading_space():
    """Each word as vLLM tokenizes it: plain and after a space (a word within the text), stripped of
    leading spaces; the spaced form kept when its first token differs — here also when it is shorter
    (" Paris" a token of its own, "Paris" two), which vLLM's equal-length rule would miss."""
    tokenizer = load_tokenizer(load_port(MODEL))
    ids = bad_word_ids(tokenizer, ("Paris", " Paris"))
    plain = tuple(tokenizer.encode("Paris", add_special_tokens=False))
    spaced = tuple(tokenizer.encode(" Paris", add_special_tokens=False))
    assert plain != spaced and ids == (plain, spaced, plain, spaced)
    assert bad_word_ids(BYTES, ("ab",)) == ((byte("a"), byte("b")),)  # " ab" only puts a space before it
    with pytest.raises(RequestError) as e:
        bad_word_ids(BYTES, ("",))
    assert e.value.param == "bad_words"


def test_what_a_backend_cannot_do_is_refused_by_name(eos_first):
    with pytest.raises(RequestError) as e:
        eos_first.check_sampling(SamplingParams(4, min_tokens=5))
    assert e.value.param == "min_tokens"
    with pytest.raises(RequestError) as e:  # EOS and 64 stop ids: past the graphs' 64 entries per row
        eos_first.check_sampling(SamplingParams(4, min_tokens=1, stop_token_ids=tuple(range(10, 74))))
    assert e.value.param == "stop_token_ids"
    eos_first.check_sampling(SamplingParams(4, min_tokens=1, stop_token_ids=tuple(range(10, 73))))
    with pytest.raises(RequestError) as e:  # 64 one-token words and a logit_bias entry: past the 64 entries
        words = tuple(chr(c) for c in range(ord("0"), ord("0") + 64))
        eos_first.check_sampling(SamplingParams(4, bad_words=words, processing=Processing(logit_bias=((3, 1.0),))))
    assert e.value.param == "bad_words"
    eos_first.check_sampling(SamplingParams(4, bad_words=words))
    with pytest.raises(RequestError) as e:
        eos_first.check_sampling(SamplingParams(4, allowed_token_ids=(5, BYTES.vocab_size)))
    assert e.value.param == "allowed_token_ids" and "vocabulary size" in str(e.value)
    eos_first.runtime.processing = False  # graphs without the logits-processing variants (an older artifact)
    for params, field in (
        (SamplingParams(4, min_tokens=2), "min_tokens"),
        (SamplingParams(4, rank=True), "best_of"),
        (SamplingParams(4, allowed_token_ids=(5,)), "allowed_token_ids"),
        (SamplingParams(4, bad_words=("x",)), "bad_words"),
    ):
        with pytest.raises(RequestError) as e:
            eos_first.check_sampling(params)
        assert e.value.param == field
    eos_first.check_sampling(SamplingParams(4, min_tokens=2, ignore_eos=True))  # nothing to ban: fine


# ---- over HTTP --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["eager", "static"])
def engine(request, tiny_port):
    engine = load_engine(tiny_port, request.param)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine, tiny_port):
    app = create_app(lambda: engine, model_name=MODEL, vocab_size=tiny_port.config.vocab_size)
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


def test_a_stop_string_in_the_token_that_completes_a_grammar_cuts_it_there(url):
    """The grammar's last token ends the output, yet a stop string in its text still cuts it (vLLM's):
    the text before the stop string, the stop string as stop_reason (kept with include_stop_str_in_output),
    streamed alike."""
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    schema = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    for fields, text, reason in (
        ({"guided_choice": ["yes"], "stop": ["es"]}, "y", "es"),
        ({"guided_choice": ["yes"], "stop": ["es"], "include_stop_str_in_output": True}, "yes", "es"),
        ({"guided_json": schema, "stop": ["}"]}, None, "}"),
        ({"guided_choice": ["yes"], "stop": ["x"]}, "yes", None),  # no stop string in it: the grammar's end
    ):
        choice = httpx.post(f"{url}/v1/completions", json={**base, **fields}, timeout=60).json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", reason), (fields, choice)
        if text is None:  # the JSON document without its closing brace
            assert json.loads(choice["text"] + "}")["a"] in (True, False), choice
        else:
            assert choice["text"] == text, (fields, choice)
        with httpx.stream("POST", f"{url}/v1/completions", json={**base, **fields, "stream": True}, timeout=60) as r:
            events = [e for e in sse_events(r.iter_lines()) if isinstance(e, dict)]
        assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
        assert (events[-1]["choices"][0]["finish_reason"], events[-1]["choices"][0]["stop_reason"]) == ("stop", reason)


def test_a_grammar_complete_before_min_tokens_ends_the_output_as_vllms(url):
    """vLLM's rule (vllm-project/vllm#54218): the grammar is authoritative. min_tokens bans EOS while the
    grammar could go on, but a grammar that takes nothing more ends the output ("stop") below min_tokens,
    neither a token outside it nor an error."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "guided_choice": ["yes", "no"]}
    free = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    held = httpx.post(f"{url}/v1/completions", json={**body, "min_tokens": 10}, timeout=60).json()
    assert held["choices"][0]["text"] in ("yes", "no") and held["choices"][0]["finish_reason"] == "stop", held
    assert held["usage"]["completion_tokens"] < 10
    regex = {**body, "guided_regex": "a+", "guided_choice": None, "max_tokens": 12}  # "a" could end it: banned EOS
    runs = httpx.post(f"{url}/v1/completions", json={**regex, "min_tokens": 8}, timeout=60).json()
    assert runs["usage"]["completion_tokens"] >= 8 and set(runs["choices"][0]["text"]) == {"a"}, runs
    assert free["choices"][0]["text"] in ("yes", "no")


# a text whose characters take 1 to 4 UTF-8 bytes: the byte-level tokenizer writes 🙂 and ö one byte a token
EMOJI = "Hello \U0001f642 w\u00f6rld"


def test_logprobs_bytes_are_each_tokens_own_bytes(url, engine):
    """chat's `bytes`: a token that holds part of a character (its `token` text U+FFFD) has its own
    bytes, not U+FFFD's [239, 191, 189]; a choice's tokens' bytes join into its text (OpenAI's meaning)."""
    asks = {"temperature": 0, "logprobs": True, "top_logprobs": 2, "guided_choice": [EMOJI]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say it."}], "max_tokens": 24, **asks}
    choice = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == EMOJI
    assert bytes(b for entry in content for b in entry["bytes"]) == EMOJI.encode()
    partial = [entry for entry in content if entry["token"] == "\ufffd"]
    assert len(partial) >= 2 and all(len(entry["bytes"]) == 1 and entry["bytes"][0] >= 0x80 for entry in partial)
    for entry in content:
        for top in entry["top_logprobs"]:  # every token's bytes its own, its text theirs where whole
            assert "\ufffd" in top["token"] or bytes(top["bytes"]) == top["token"].encode(), top


def test_text_offset_indexes_the_returned_text_after_a_multibyte_character(url):
    """completions' text_offset: each token's start in the returned text, in characters — past an emoji
    (4 byte tokens, one character) and a 2-byte ö; a token inside a character is at that character.
    Echo's prompt, then the generated tokens; streamed alike."""
    body = {"model": MODEL, "prompt": EMOJI, "max_tokens": 24, "temperature": 0, "echo": True, "logprobs": 1}
    generated = {**body, "guided_choice": [" " + EMOJI]}
    for request in (body, generated):
        choice = httpx.post(f"{url}/v1/completions", json=request, timeout=60).json()["choices"][0]
        text, lp = choice["text"], choice["logprobs"]
        assert text.startswith(EMOJI) and lp["text_offset"] == sorted(lp["text_offset"])
        for token, offset in zip(lp["tokens"], lp["text_offset"]):
            if "\ufffd" in token:  # part of a character: the emoji or ö, where it stands
                assert text[offset] in "\U0001f642\u00f6", (token, offset, text)
            else:
                assert text[offset : offset + len(token)] == token, (token, offset, text)
        assert text[lp["text_offset"][lp["tokens"].index(" w")] :].startswith(" w\u00f6rld")
        with httpx.stream("POST", f"{url}/v1/completions", json={**request, "stream": True}, timeout=60) as r:
            events = [e for e in sse_events(r.iter_lines()) if isinstance(e, dict)]
        offsets = [o for e in events if e["choices"][0]["logprobs"] for o in e["choices"][0]["logprobs"]["text_offset"]]
        assert offsets == lp["text_offset"]
    assert text.count(EMOJI) == 2  # the generated one too


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
    with serving(create_app(lambda: engine, model_name=MODEL, max_queue=1)) as base:
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, what="the model to be ready")
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": engine.rows + 2}
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


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_every_token_in_the_set(url, engine, temperature):
    """Every generated token one of allowed_token_ids (EOS not among them: to max_tokens), greedy and sampled."""
    allowed = engine.tokenizer.encode(" Paris London is", add_special_tokens=False)
    texts = {engine.tokenizer.decode([t]) for t in allowed}
    got = complete(
        url, max_tokens=12, temperature=temperature, seed=2, logprobs=0, extra_body={"allowed_token_ids": allowed}
    )
    choice = got.choices[0]
    assert got.usage.completion_tokens == 12 and set(choice.logprobs.tokens) <= texts, choice.logprobs.tokens
    assert "".join(choice.logprobs.tokens) == choice.text


def test_bad_words_never_generated(url, engine):
    """The greedy answer names Paris first; with "Paris" a bad word, neither of its tokenizations appears
    in the output ids, and the answer goes another way."""
    plain = complete(url, max_tokens=16, temperature=0).choices[0].text
    assert plain.startswith(" Paris")
    for temperature in (0.0, 1.0):
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 16,
            "temperature": temperature,
            "seed": 1,
            "bad_words": ["Paris"],
            "logprobs": 0,
        }
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        ids = engine.tokenizer.encode(choice["text"], add_special_tokens=False)
        for word in bad_word_ids(engine.tokenizer, ("Paris",)):
            assert not any(tuple(ids[i : i + len(word)]) == word for i in range(len(ids))), (choice["text"], word)
        assert "Paris" not in choice["text"]


def test_prompt_logprobs_as_vllm_shapes_them_are_hf_eagers(url, engine, tiny_eager):
    """vLLM's prompt_logprobs (no echo): per prompt token None (the first), else {id: {logprob, rank,
    decoded_token}}, the prompt's token first then the n most likely; HF eager's log_softmax within 1e-4;
    completions in the choice, chat once in the response."""
    ids = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logp = tiny_eager(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    choice = got["choices"][0]
    assert not choice["text"].startswith(PROMPT) and choice["logprobs"] is None  # no echo
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for i, position in enumerate(scores[1:]):
        row, token = logp[i], ids[i + 1]
        top, top_ids = row.topk(3)
        assert list(position)[0] == str(token)  # the prompt's token first
        assert set(position) == {str(token), *map(str, top_ids.tolist())}
        assert abs(position[str(token)]["logprob"] - float(row[token])) < 1e-4
        assert position[str(token)]["rank"] == int((row >= row[token]).sum())
        for rank, (t, value) in enumerate(zip(top_ids.tolist(), top.tolist()), 1):
            entry = position[str(t)]
            assert abs(entry["logprob"] - value) < 1e-4 and entry["rank"] == rank
            assert entry["decoded_token"] == engine.tokenizer.decode([t])
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0},
    ).json()
    rendered = render_chat(engine.tokenizer, messages)[0]
    with torch.no_grad():
        chat_logp = tiny_eager(input_ids=torch.tensor([rendered])).logits[0].float().log_softmax(-1)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(rendered)
    for i, position in enumerate(chat["prompt_logprobs"][1:]):
        assert list(position) == [str(rendered[i + 1])]  # 0 most likely: the prompt's token alone
        assert abs(position[str(rendered[i + 1])]["logprob"] - float(chat_logp[i, rendered[i + 1]])) < 1e-4
    streamed = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_a_prompt_tokens_rank_is_exact_beyond_the_top_20(url, engine, tiny_eager):
    """Random prompt tokens, most far down the distribution: each one's rank is its place among HF
    eager's logprobs (those at least as likely), up to the 1e-4 by which the two fp32 logprobs may
    differ."""
    (ids,) = random_prompts(2048, [16], seed=3)
    with torch.no_grad():
        logp = tiny_eager(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
    scores = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
    ranks = []
    for i, position in enumerate(scores[1:]):
        row, entry = logp[i], position[str(ids[i + 1])]
        ranks.append(entry["rank"])
        above, near = int((row >= entry["logprob"] + 1e-4).sum()), int((row >= entry["logprob"] - 1e-4).sum())
        assert above <= entry["rank"] <= near, (i, entry, above, near)
    assert sum(rank > 20 for rank in ranks) >= 10, ranks


def test_constraints_that_leave_no_token_are_a_400_naming_the_field(url, engine, caplog):
    """The client's error: a 400 (an error event when streamed), and one line in the server's log, no
    traceback."""
    only = engine.tokenizer.encode(" Paris", add_special_tokens=False)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "allowed_token_ids": only, "bad_words": ["Paris"]}
    with caplog.at_level("WARNING", logger="neuron_moe.serve"):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
        events = sse_events(
            httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60).text.splitlines()
        )
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "invalid_request_error", events
    logged = [record for record in caplog.records if "no token is left" in record.getMessage()]
    assert len(logged) == 2 and all(record.exc_info is None for record in logged), caplog.text


def test_allowed_token_ids_and_a_grammar_together(url, engine):
    """guided_choice's two answers, allowed_token_ids only the second's tokens: the second, where the
    grammar alone answers the first."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "guided_choice": ["Paris", "Rome"]}
    alone = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert alone == "Paris"
    rome = engine.tokenizer.encode("Rome", add_special_tokens=False)
    both = httpx.post(f"{url}/v1/completions", json={**body, "allowed_token_ids": rome}, timeout=60).json()
    assert both["choices"][0]["text"] == "Rome", both


def test_beam_search_as_vllm_runs_it(url, engine, tiny_eager):
    """use_beam_search with n beams: each step every beam goes on with its 2·n most likely tokens, the n
    best cumulative logprobs live on (vLLM's rule; one length for all: length_penalty does not reorder
    them); the n best are the choices. Held to the same search over HF eager's logprobs, ignore_eos so
    that nothing completes early; n=1 is greedy."""
    ids = engine.tokenizer.encode(PROMPT)

    def logp(tokens):
        with torch.no_grad():
            return tiny_eager(input_ids=torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)

    beams = [(ids, 0.0)]
    for _ in range(3):
        grown = []
        for tokens, total in beams:
            top, top_ids = logp(tokens).topk(4)
            grown += [(tokens + [t], total + v) for t, v in zip(top_ids.tolist(), top.tolist())]
        beams = sorted(grown, key=lambda b: b[1], reverse=True)[:2]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    got = httpx.post(f"{url}/v1/completions", json={**body, "use_beam_search": True, "n": 2}, timeout=60).json()
    assert [c["text"] for c in got["choices"]] == [engine.tokenizer.decode(t[len(ids) :]) for t, _ in beams], got
    assert [c["finish_reason"] for c in got["choices"]] == ["length", "length"]
    assert got["usage"]["completion_tokens"] == 6
    one = httpx.post(f"{url}/v1/completions", json={**body, "use_beam_search": True}, timeout=60).json()
    assert one["choices"][0]["text"] == complete(url, max_tokens=3, temperature=0).choices[0].text
    for edit, param in (({"stop": "x"}, "stop"), ({"n": 11}, "n"), ({"logprobs": 1}, "logprobs")):
        r = httpx.post(f"{url}/v1/completions", json={**body, "use_beam_search": True, **edit}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{url}/v1/completions", json={**body, "length_penalty": 0.5}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty", r.text
