"""Structured output (serve/grammar.py): a request's grammar as a token bitmask over the tiny port's
tokenizer, applied on the host (`--backend hf`'s runtime, `hf_runtime.py`), and its request fields."""

import json
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from bench import structured_output
from neuron_moe.model import build_model
from neuron_moe.serve.app import create_app
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.decoding import RequestError, SamplingParams, eos_ids
from neuron_moe.serve.hf_runtime import HFRuntime, HostRuntime
from neuron_moe.serve.grammar import CACHE_SIZE, Grammars, GrammarSpec, Matcher, _key, unpack
from neuron_moe.serve.protocol import CompletionRequest
from neuron_moe.tokenizer import ByteTokenizer, load_tokenizer

from serving import serving, wait_for

MODEL = "tiny-gemma4-moe"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(tiny_port, tiny_eager):
    tokenizer = load_tokenizer(tiny_port)
    with Engine(HFRuntime(tiny_eager), tokenizer, eos_ids(tokenizer, tiny_eager.config)) as engine:
        yield engine


def generate(engine, spec: GrammarSpec, seed: int, max_tokens: int = 64, prompt: str = "Q: hello\nA:"):
    steps = list(engine.generate(engine.tokenizer.encode(prompt), SamplingParams(max_tokens, seed=seed, grammar=spec)))
    return "".join(s.text for s in steps), steps[-1]


@pytest.fixture(scope="module")
def static_engine(tiny_port):
    """The batching engine over the static graphs (8 rows), its cache wide enough for the bench's schema."""
    engine = structured_output.static_engine(tiny_port, build_model(tiny_port, tiny_port.static.decode_experts))
    yield engine
    engine.close()


def test_100_seeded_requests_at_temperature_one_parse_and_validate_against_a_bounded_schema(static_engine):
    """The acceptance case, in the static graphs (the bitmask an input of the logits-processing decode
    graph), 8 rows at a time: every output a JSON document that validates, ended by the grammar
    ("stop") within max_tokens, the schema compiled once for all of them."""
    record = structured_output.run(static_engine, requests=100, first_seed=1000)
    bad = [r for r in record["rows"] if not r["valid"] or r["finish_reason"] != "stop"]
    assert not bad, bad
    assert record["tokens_max"] < record["max_tokens"] and record["grammars_compiled"] == 1
    assert len({r["text"] for r in record["rows"]}) > 50  # sampled at temperature 1, not one text


def test_the_static_graphs_and_the_host_choose_the_same_tokens_under_a_grammar(engine, static_engine):
    """A seeded request with a grammar: the same text from the batching engine's graphs (beside other
    rows) as from the host path's own masking and sampling."""
    static = structured_output.run(static_engine, requests=8, first_seed=7)
    host = structured_output.run(engine, requests=3, first_seed=7)
    assert [r["text"] for r in host["rows"]] == [r["text"] for r in static["rows"][:3]]


def test_bitmask_layout_is_bit_t_mod_32_of_word_t_div_32(engine):
    """allowed(): int32 [ceil(V/32)] with token t's bit at word t // 32, bit t % 32 — set exactly for
    the tokens the matcher takes; a vocabulary wider than the tokenizer's leaves the extra ids out."""
    vocab = engine.grammars.vocab_size or 2048
    grammars = Grammars(engine.tokenizer, vocab + 40, engine.eos_ids)
    spec = GrammarSpec("regex", "[a-c]{1,3}x?", "guided_regex")
    matcher = grammars.matcher(spec)
    mask = matcher.allowed()
    assert mask.dtype == torch.int32 and mask.shape == ((vocab + 40 + 31) // 32,)
    compiled = grammars.compile(spec)
    takes = [t for t in range(vocab) if compiled.deep_copy().consume_token(t)]
    bits = [t for t in range(vocab + 40) if (int(mask[t // 32]) >> (t % 32)) & 1]
    assert bits == takes and takes  # the extra 40 ids never
    assert unpack(mask, vocab + 40).nonzero().flatten().tolist() == takes
    assert not set(engine.eos_ids) & set(bits)  # the regex needs a character first: no EOS yet


def test_the_batched_fill_is_each_rows_own_fill_bit_for_bit(engine):
    """`Matcher.fill`, llguidance's batched fill of many rows at once, against each matcher's own fill
    (`allowed()`), on a JSON schema, a regex and a choice, two walks each, a matcher failed on its
    grammar and one whose grammar is complete, over a vocabulary wider than the tokenizer's, at every
    state of 14 steps of seeded random walks: the same bits, every row a row of one tensor."""
    vocab = engine.grammars.vocab_size or 2048
    grammars = Grammars(engine.tokenizer, vocab + 40, engine.eos_ids)
    specs = [
        GrammarSpec.json_schema(structured_output.SCHEMA, "response_format"),
        GrammarSpec("regex", r"[A-Z][a-z]{1,8}-[0-9]{2,4}", "guided_regex"),
        GrammarSpec("choice", json.dumps(["positive", "negative", "neutral"]), "guided_choice"),
    ]
    matchers = [grammars.matcher(spec) for spec in specs * 2]
    failed, complete = grammars.matcher(specs[1]), grammars.matcher(specs[2])
    assert not failed.advance(engine.tokenizer.encode("a", False)[0]) and failed.error  # a lower-case first letter
    for token in engine.tokenizer.encode("neutral", False):
        assert complete.advance(token)
    assert complete.stopped
    matchers += [failed, complete]
    rng = random.Random(0)
    for step in range(14):
        own = [Matcher(m._matcher.deep_copy(), m.vocab_size) for m in matchers]  # each fills its own
        pending = [m for m in matchers if m._mask is None]  # those that took a token since their last fill
        Matcher.fill(matchers)
        masks = [m.allowed() for m in matchers]
        assert len({m.allowed().untyped_storage().data_ptr() for m in pending}) == 1  # one tensor, one call
        for m, twin in zip(matchers, own):
            assert torch.equal(m.allowed(), twin.allowed()), (step, m.field)
        Matcher.fill(matchers)  # filled already: left as they are
        assert all(m.allowed() is mask for m, mask in zip(matchers, masks))
        for m, mask in zip(matchers[:6], masks):
            allowed = unpack(mask, m.vocab_size).nonzero().flatten().tolist()
            if not m.stopped:
                assert m.advance(rng.choice(allowed))
    assert all(m.stopped for m in matchers[2:6:3]) and not all(m.stopped for m in matchers[:6])


def test_the_step_fills_every_grammar_rows_bitmask_in_one_call(static_engine, monkeypatch):
    """8 requests with a grammar in the batching engine's 8 rows: each step fills the bitmasks of all its
    grammar rows in one batched call, and no row fills its own."""
    sizes, own = [], []
    fill, allowed = Matcher.fill, Matcher.allowed
    monkeypatch.setattr(Matcher, "fill", classmethod(lambda cls, ms: sizes.append(len(ms)) or fill(ms)))
    monkeypatch.setattr(Matcher, "allowed", lambda self: own.append(self._mask is None) or allowed(self))
    record = structured_output.run(static_engine, requests=8, first_seed=50)
    assert record["valid"] == 8 and max(sizes) == 8 and not any(own), (sizes, sum(own))


def test_choice_and_regex_end_the_request_when_the_grammar_is_complete(engine):
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        text, last = generate(engine, GrammarSpec("choice", json.dumps(choices), "guided_choice"), seed)
        assert text in choices and last.finish_reason == "stop", (text, last)
        text, last = generate(engine, GrammarSpec("regex", r"[A-Z][a-z]{1,5}-[0-9]{2}", "guided_regex"), seed)
        assert re.fullmatch(r"[A-Z][a-z]{1,5}-[0-9]{2}", text) and last.finish_reason == "stop", (text, last)


def test_a_grammar_cut_by_max_tokens_ends_with_length(engine):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 8}}, "required": ["answer"]}
    text, last = generate(engine, GrammarSpec.json_schema(schema, "response_format"), 0, max_tokens=3)
    assert last.finish_reason == "length" and last.completion_tokens == 3 and text.startswith("{")


def test_requests_asking_for_one_grammar_at_once_compile_it_once(engine):
    """Eight requests with a schema not yet compiled, at the same moment (a batch's worth of clients):
    one compile, the others wait for it; then an LRU cache of CACHE_SIZE."""
    grammars = Grammars(engine.tokenizer, None, engine.eos_ids)
    spec = GrammarSpec.json_schema(structured_output.wide_schema(0), "guided_json")
    start = threading.Barrier(8)

    def ask():
        start.wait()
        return grammars.matcher(spec)

    with ThreadPoolExecutor(8) as pool:
        matchers = list(pool.map(lambda _: ask(), range(8)))
    assert grammars.compiles == 1 and len({id(m._matcher) for m in matchers}) == 8  # each its own copy
    for tag in range(1, CACHE_SIZE + 1):
        grammars.compile(GrammarSpec.json_schema(structured_output.wide_schema(tag, 2), "guided_json"))
    grammars.compile(spec)  # the least recently used: evicted, compiled again
    assert grammars.compiles == CACHE_SIZE + 2


def test_the_builtin_byte_tokenizer_compiles_grammars():
    """The seeded random ports' tokenizer: one token per byte after the specials."""
    tok = ByteTokenizer()
    matcher = Grammars(tok, tok.vocab_size, {tok.eos_token_id}).matcher(GrammarSpec("choice", '["yes","no"]', "c"))
    assert unpack(matcher.allowed(), tok.vocab_size).nonzero().flatten().tolist() == [tok.encode("ny", False)[0], 124]


def test_a_grammar_that_does_not_compile_is_a_request_error_naming_its_field(engine):
    for spec in (
        GrammarSpec("regex", "[a-", "guided_regex"),
        GrammarSpec.json_schema({"type": "nope"}, "response_format.json_schema.schema"),
        GrammarSpec("grammar", "start: undefined_rule", "structured_outputs.grammar"),
    ):
        with pytest.raises(RequestError) as caught:
            engine.output(SamplingParams(4, grammar=spec))
        assert caught.value.param == spec.field and str(caught.value).startswith(spec.field)


def test_graphs_without_the_logits_processing_variant_refuse_a_grammar_by_its_field(engine):
    """An artifact built before the variant graphs (its runtime's `processing` False): a 400 naming the
    field that asked, never a grammar accepted and ignored."""

    class Runtime(HostRuntime):
        processing = False

    with Engine(Runtime(1, engine.vocab, 63), engine.tokenizer, engine.eos_ids) as old:
        with pytest.raises(RequestError) as caught:
            old.check_sampling(SamplingParams(4, grammar=GrammarSpec("regex", "a", "guided_regex")))
    assert caught.value.param == "guided_regex"


def test_each_field_reads_into_one_grammar_spec():
    """The request's fields as the grammar they ask for: the same schema from each field is one
    grammar (one cache entry); the whitespace options go with it."""
    base = {"model": MODEL, "prompt": "Q:"}
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "boolean"}}}
    specs = [
        CompletionRequest.model_validate({**base, **fields}).grammar
        for fields in (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
            {"guided_json": schema},
            {"guided_json": json.dumps(schema)},
            {"structured_outputs": {"json": schema}},
        )
    ]
    assert len({_key(spec) for spec in specs}) == 1 and specs[0].kind == "json"
    assert specs[0].text.index('"b"') < specs[0].text.index('"a"')  # the properties in the request's order
    assert not specs[0].whitespace_flexible  # compact JSON unless asked
    loose = CompletionRequest.model_validate(
        {**base, "structured_outputs": {"json": schema, "disable_any_whitespace": False}}
    )
    assert loose.grammar.whitespace_flexible
    spaced = CompletionRequest.model_validate({**base, "guided_json": schema, "guided_whitespace_pattern": " ?"})
    assert spaced.grammar.whitespace_pattern == " ?" and spaced.grammar.pattern_field == "guided_whitespace_pattern"
    assert CompletionRequest.model_validate({**base, "response_format": {"type": "text"}}).grammar is None
    choice = CompletionRequest.model_validate({**base, "guided_choice": ["x", "y"]}).grammar
    assert (choice.kind, json.loads(choice.text), choice.field) == ("choice", ["x", "y"], "guided_choice")


# ---- over HTTP ---------------------------------------------------------------------------------------------

SCHEMA = {**structured_output.SCHEMA, "title": "fortune"}  # this module's own: compiled here first


@pytest.fixture(scope="module")
def url(engine):
    with serving(create_app(lambda: engine, model_name=MODEL, max_running=1, max_queue=8)) as base:
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, what="the model to be ready")
        yield base


def test_openai_clients_response_format_and_vllms_fields_are_honoured(url, engine):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    before = engine.grammars.compiles
    fmt = {"type": "json_schema", "json_schema": {"name": "fortune", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format=fmt, seed=3, max_tokens=200
    )
    assert set(json.loads(chat.choices[0].message.content)) <= set(SCHEMA["properties"])
    assert chat.choices[0].finish_reason == "stop"
    # the same schema through vLLM's fields: the compiled grammar is reused
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": json.dumps(SCHEMA)}}):
        done = client.completions.create(model=MODEL, prompt="Q:", max_tokens=200, seed=4, extra_body=extra)
        assert set(json.loads(done.choices[0].text)) >= set(SCHEMA["required"])
    assert engine.grammars.compiles - before == 1
    obj = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"}, max_tokens=2
    )
    assert obj.choices[0].message.content.startswith("{")
    for extra, check in (
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
        ({"guided_grammar": 'start: "a" "b"+'}, lambda t: re.fullmatch("ab+", t)),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9]'}}, lambda t: re.fullmatch("x[0-9]", t)),
    ):
        done = client.completions.create(model=MODEL, prompt="Q:", max_tokens=12, seed=5, extra_body=extra)
        assert check(done.choices[0].text), (extra, done.choices[0].text)


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs.backend"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        (
            {"structured_outputs": {"choice": ["a"], "disable_any_whitespace": False}},
            "structured_outputs.disable_any_whitespace",
        ),
        (
            {"structured_outputs": {"json_object": True, "whitespace_pattern": "["}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "["}, "guided_whitespace_pattern"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
    ],
)
def test_a_bad_structured_output_is_a_400_naming_the_field(url, fields, param):
    body = {"model": MODEL, "prompt": "Q:", "max_tokens": 4, **fields}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert param.split(".")[-1] in r.json()["error"]["message"], r.text
