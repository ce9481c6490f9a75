"""Untrusted grammars (serve/grammar_bounds.py, serve/grammar.py): refused by a bound before they
compile, compiled where a deep one cannot crash the server, a grammar the matcher cannot follow a
400 naming its field on both backends, strict JSON by default, and the cache bounded by bytes."""

import json
import logging
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from bench import structured_output
from neuron_moe.model import build_model
from neuron_moe.serve import grammar, grammar_bounds
from neuron_moe.serve.app import create_app
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.decoding import RequestError, SamplingParams, eos_ids
from neuron_moe.serve.hf_runtime import HFRuntime
from neuron_moe.serve.grammar import Grammars, GrammarSpec
from neuron_moe.serve.protocol import CompletionRequest
from neuron_moe.tokenizer import load_tokenizer

from serving import serving, wait_for

MODEL = "tiny-gemma4-moe"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def chain(n: int, sep: str = " ", head: str = ":") -> str:
    """A Lark (or, with head '::=', GBNF) grammar of n rules each naming the next: r0: "a" r1 ..."""
    start = "start" if head == ":" else "root"
    return f"{start}{head} r0\n" + "".join(f'r{i}{head} "a"{sep}r{i + 1}\n' for i in range(n)) + f'r{n}{head} "z"\n'


def ref_chain(n: int) -> dict:
    """A JSON schema of n definitions each an object holding the next by $ref."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def nested(depth: int, leaf, wrap) -> object:
    value = leaf
    for _ in range(depth):
        value = wrap(value)
    return value


# ---- the bounds, on the text ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, text, bound",
    [
        ("grammar", chain(3000), f"at most {grammar_bounds.MAX_RULES}"),
        ("grammar", chain(3000, " | "), f"at most {grammar_bounds.MAX_RULES}"),
        ("grammar", chain(3000, head="::="), f"at most {grammar_bounds.MAX_RULES}"),
        ("grammar", "start: " + " | ".join(f'"w{i}"' for i in range(20000)), "alternatives in a rule; at most 1000"),
        ("grammar", "start: " + "(" * 100 + '"a"' + ")" * 100, "nested 65 deep; at most 64"),
        ("grammar", 'start: "a"{100000}', "count of 100000; at most 10000"),
        ("grammar", 'start: "a" ~ 2..20000', "count of 20000; at most 10000"),
        ("grammar", "start: /a{100000}/", "count of 100000"),
        ("regex", "a{1000000}", "count of 1000000"),
        ("regex", "((a{100}){100}){100}", "count of 1000000 (times the counts of the groups around it)"),
        ("regex", "(" * 65 + "a" + ")" * 65, "nested 65 deep"),
        ("choice", json.dumps([f"o{i}" for i in range(10000)]), "10000 choices; at most 1000"),
        ("choice", json.dumps(["x" * 2**20]), f"bytes; at most {grammar_bounds.MAX_BYTES}"),
        ("json", json.dumps(ref_chain(1500)), "1501 $refs; at most 1000"),
        ("json", json.dumps(nested(100, {}, lambda s: {"items": s})), "nested 65 deep"),
        ("json", json.dumps({"type": "string", "pattern": "^((a{100}){100}){100}$"}), "count of 1000000"),
        ("json", json.dumps({"patternProperties": {"a{99999}": {}}}), "count of 99999"),
    ],
)
def test_a_grammar_past_a_bound_is_named_with_the_bound(kind, text, bound):
    assert bound in (grammar_bounds.problem(kind, text) or ""), grammar_bounds.problem(kind, text)


@pytest.mark.parametrize(
    "kind, text",
    [
        ("grammar", chain(998)),
        ("grammar", 'start: "a" ("b" | "c"){2,5} /[0-9]{1,3}/ // a comment with | | ( ( {99999}\n'),
        ("grammar", 'root ::= [|({]{3} "|" # |||| (((\n'),
        ("grammar", 'start: "x" | "y"\n    | "z"'),
        ("regex", r"[a-c]{1,3}x?\p{L}{3}[{(]{5}(a{100}){100}"),
        ("regex", r"[^\s\S]"),  # within the bounds: the compile finds it admits nothing
        ("choice", json.dumps([f"o{i}" for i in range(1000)])),
        ("json", json.dumps(structured_output.SCHEMA)),
    ],
)
def test_a_grammar_within_the_bounds_passes_them(kind, text):
    assert grammar_bounds.problem(kind, text) is None


CRASH = """
import sys
from neuron_moe.port import load_port
from neuron_moe.tokenizer import load_tokenizer
from neuron_moe.serve.grammar import Grammars, GrammarError, GrammarSpec
sys.path.insert(0, "tests")
from test_grammar_bounds import chain, ref_chain
tok = load_tokenizer(load_port("tiny-gemma4-moe"))
grammars = Grammars(tok, None, {tok.eos_token_id})
for spec in (
    GrammarSpec("grammar", chain(3000), "guided_grammar"),
    GrammarSpec("grammar", chain(3000, " | "), "guided_grammar"),
    GrammarSpec("grammar", chain(998), "guided_grammar"),
    GrammarSpec.json_schema(ref_chain(999), "guided_json"),
):
    try:
        grammars.matcher(spec).allowed()
        print("compiled")
    except GrammarError as e:
        print("refused", e)
"""


def test_the_shapes_that_overflowed_llguidances_stack_are_refused_or_compile_in_a_subprocess():
    """3,000 chained Lark rules (a segfault at ~2,800 on an 8 MiB stack), an alternation chain, and
    just inside the bounds: 998 chained rules and 999 chained $refs (a segfault from ~1,000 on an
    8 MiB stack), compiled on the compile thread's stack. In a child: a crash is its exit code."""
    done = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    assert all(line.startswith("refused guided_grammar: more than 1000 rules") for line in lines[:2]), lines
    assert lines[2:] == ["compiled", "compiled"], lines


# ---- the engine: refused before the request runs, or at the step the matcher fails ---------------------


@pytest.fixture(scope="module")
def engine(tiny_port, tiny_eager):
    tokenizer = load_tokenizer(tiny_port)
    with Engine(HFRuntime(tiny_eager, 2), tokenizer, eos_ids(tokenizer, tiny_eager.config)) as engine:
        yield engine


@pytest.fixture(scope="module")
def static_engine(tiny_port):
    engine = structured_output.static_engine(tiny_port, build_model(tiny_port, tiny_port.static.decode_experts))
    yield engine
    engine.close()


UNHONOURED = [  # the grammars the matcher could not follow: a 500 at step 0 before
    ("guided_json", {"$ref": "#"}, "admits no output"),
    (
        "guided_json",
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "admits no output",
    ),
    ("guided_regex", r"[^\s\S]", "admits no output"),
    ("guided_regex", "a{1000000}", "at most 10000"),
    ("guided_regex", "((a{100}){100}){100}", "at most 10000"),
    ("guided_grammar", "start: start", "admits no output"),
    ("guided_grammar", "start: " + " | ".join(f'"w{i}"' for i in range(20000)), "at most 1000"),
    ("guided_choice", [f"opt{i}" for i in range(10000)], "at most 1000"),
    ("guided_choice", ["x" * 2**20], f"at most {grammar_bounds.MAX_BYTES}"),
    # within the bounds, past llguidance's own: 3,000 optional properties make an Earley row of ~12,000
    # items at the first token (its limit 2,000), found by the matcher at that step
    (
        "guided_json",
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}},
        "max is 2000",
    ),
]


@pytest.fixture(scope="module")
def urls(engine, static_engine):
    """Both runtimes over HTTP: transformers' model (hf) and the static graphs."""
    with (
        serving(create_app(lambda: engine, model_name=MODEL, max_running=2, max_queue=8)) as hf,
        serving(create_app(lambda: static_engine, model_name=MODEL, max_running=8, max_queue=8)) as static,
    ):
        for base in (hf, static):
            wait_for(lambda base=base: httpx.get(f"{base}/health").status_code == 200, what="the model to be ready")
        yield {"hf": hf, "static": static}


@pytest.mark.parametrize("backend", ["hf", "static"])
@pytest.mark.parametrize("field, value, why", UNHONOURED, ids=range(len(UNHONOURED)))
def test_a_grammar_the_engine_cannot_honour_is_a_400_naming_the_field(urls, backend, field, value, why, caplog):
    body = {"model": MODEL, "prompt": "Q:", "max_tokens": 4, field: value}
    with caplog.at_level(logging.WARNING):
        r = httpx.post(f"{urls[backend]}/v1/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field) and why in error["message"], error
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback in the log"


def test_a_limit_met_at_a_step_is_the_clients_error_naming_the_field(engine):
    """The matcher's state is checked at each token: llguidance failing on the grammar at a step is a
    RequestError naming the field (a 400), never a GenerationError (a 500)."""
    schema = UNHONOURED[-1][1]
    spec = GrammarSpec.json_schema(schema, "response_format.json_schema.schema")
    with pytest.raises(RequestError) as caught:
        list(engine.generate(engine.tokenizer.encode("Q:"), SamplingParams(4, seed=0, grammar=spec)))
    assert caught.value.param == spec.field and "(at token 1)" in str(caught.value)


# ---- strict JSON ------------------------------------------------------------------------------------------

BOOL = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_an_object_schema_without_additional_properties_admits_no_others(urls, backend):
    """The issue's case: greedy, 30 tokens, once `{"a":true,"I'm not a mental…` (length); now the
    object ends after its one property, as vLLM's default backend writes it."""
    fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOOL}}
    body = {"model": MODEL, "prompt": "Q: hello\nA:", "max_tokens": 30, "temperature": 0, "response_format": fmt}
    r = httpx.post(f"{urls[backend]}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert json.loads(choice["text"]) in ({"a": True}, {"a": False}) and choice["finish_reason"] == "stop", choice


def first_after(grammars: Grammars, spec: GrammarSpec, text: str) -> set[str]:
    """The text of each token the grammar allows after `text` (fed token by token)."""
    matcher = grammars.matcher(spec)
    for token in grammars.tokenizer.encode(text, False):
        assert matcher.advance(token), text
    mask = matcher.allowed()
    allowed = [t for t in range(grammars.vocab_size) if int(mask[t // 32]) >> (t % 32) & 1]
    return {grammars.tokenizer.decode([t]) for t in allowed}


def test_extras_are_allowed_where_the_schema_or_disable_additional_properties_false_says_so(engine):
    """After `{"a":true` a strict object can only close; `additionalProperties: true` in the schema,
    or vLLM's `disable_additional_properties: false`, lets another property follow."""
    grammars = Grammars(engine.tokenizer, None, engine.eos_ids)
    after = '{"a":true'
    assert first_after(grammars, GrammarSpec.json_schema(BOOL, "guided_json"), after) == {"}"}
    loose = GrammarSpec.json_schema({**BOOL, "additionalProperties": True}, "guided_json")
    assert "," in first_after(grammars, loose, after)
    assert "," in first_after(grammars, GrammarSpec.json_schema(BOOL, "guided_json", strict=False), after)
    nested_schema = {"type": "object", "properties": {"o": BOOL}, "required": ["o"]}
    assert first_after(grammars, GrammarSpec.json_schema(nested_schema, "guided_json"), '{"o":{"a":true') == {"}"}
    # json_object: any object, whatever its properties
    assert "," in first_after(grammars, GrammarSpec.json_schema({"type": "object"}, "response_format"), after)


def test_vllms_disable_additional_properties_is_read_either_way(urls):
    for value, strict in ((True, True), (False, False), (None, True)):
        fields = {"json": BOOL, **({} if value is None else {"disable_additional_properties": value})}
        req = CompletionRequest.model_validate({"model": MODEL, "prompt": "Q:", "structured_outputs": fields})
        assert req.grammar.strict is strict
    body = {"model": MODEL, "prompt": "Q:", "max_tokens": 30, "temperature": 0}
    body["structured_outputs"] = {"json": BOOL, "disable_additional_properties": True}
    r = httpx.post(f"{urls['hf']}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and json.loads(r.json()["choices"][0]["text"]).keys() == {"a"}, r.text


OBJECT = {  # no additionalProperties anywhere: strict by default
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "ok": {"type": "boolean"},
        "tag": {"type": "object", "properties": {"x": {"enum": ["x", "y"]}}},
    },
    "required": ["name", "ok"],
}


def test_seeded_requests_at_temperature_one_parse_and_validate_against_an_object_schema(static_engine):
    """response_format json_schema, an object schema with no additionalProperties, temperature 1,
    max_tokens 40, seeded: each output parses, validates against the schema made strict (no property
    it does not list), and ends with "stop". (The acceptance run is 100 requests; 24 here.)"""
    spec = GrammarSpec.json_schema(OBJECT, "response_format.json_schema.schema")
    strict = grammar._strict(json.loads(json.dumps(OBJECT)))
    prompt = static_engine.tokenizer.encode("Q: hello\nA:")

    def one(seed):
        steps = list(static_engine.generate(prompt, SamplingParams(40, temperature=1.0, seed=seed, grammar=spec)))
        return "".join(s.text for s in steps), steps[-1].finish_reason

    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(one, range(24)))
    for text, finish in outputs:
        jsonschema.validate(json.loads(text), strict)
        assert finish == "stop", text
    assert len({text for text, _ in outputs}) > 1


# ---- the cache ------------------------------------------------------------------------------------------


def test_the_cache_is_bounded_by_the_grammars_estimated_bytes(engine, monkeypatch):
    """Grammars whose estimated memory passes CACHE_BYTES push out the least recently used, though
    fewer than CACHE_SIZE are cached; the newest stays whatever its size."""
    grammars = Grammars(engine.tokenizer, None, engine.eos_ids)
    specs = [GrammarSpec("regex", f"x{i}[0-9]{{1,3}}", "guided_regex") for i in range(6)]
    grammars.compile(specs[0])
    one = grammars.cached_bytes
    monkeypatch.setattr(grammar, "CACHE_BYTES", 3 * one)
    for spec in specs[1:]:
        grammars.compile(spec)
    assert grammars.cached_bytes == 3 * one and grammars.compiles == 6
    grammars.compile(specs[-1])
    grammars.compile(specs[0])  # evicted: compiled again
    assert grammars.compiles == 7
    monkeypatch.setattr(grammar, "CACHE_BYTES", one // 2)
    grammars.compile(specs[1])
    assert grammars.cached_bytes == one and grammars.compiles == 8  # only the newest


def test_compiles_run_one_at_a_time_on_their_own_thread(engine):
    """Many new grammars at once compile on the one compile thread (a flood takes one core, not the
    step loop's), whichever thread asks."""
    grammars = Grammars(engine.tokenizer, None, engine.eos_ids)
    seen = []
    real = grammars._compile

    def compile_(spec):
        seen.append(threading.current_thread().name)
        return real(spec)

    grammars._compile = compile_
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: grammars.compile(GrammarSpec("regex", f"q{i}", "guided_regex")), range(6)))
    assert len(seen) == 6 and len(set(seen)) == 1 and seen[0].startswith("grammar-compile")


# ---- the family, against a live server ----------------------------------------------------------------


def family() -> list[tuple[str, dict, re.Pattern | None]]:
    """(name, request fields, the text a 200 must match in full or as a prefix; None: a 400 expected)."""
    alternatives = "start: " + " | ".join(f'"w{i}"' for i in range(20000))
    return [
        ("chain 3,000", {"guided_grammar": chain(3000)}, None),
        ("chain 50,000", {"guided_grammar": chain(50000)}, None),
        ("alternation chain 3,000", {"guided_grammar": chain(3000, " | ")}, None),
        ("gbnf chain 20,000", {"structured_outputs": {"grammar": chain(20000, head="::=")}}, None),
        ("chain 998", {"guided_grammar": chain(998)}, re.compile("a*z?")),
        ("20,000 alternatives", {"guided_grammar": alternatives}, None),
        ("parentheses 50,000 deep", {"guided_grammar": "start: " + "(" * 50000 + '"a"' + ")" * 50000}, None),
        ("repetition 100,000", {"guided_grammar": 'start: "a"{100000}'}, None),
        ("regex terminal 100,000", {"guided_grammar": "start: /a{100000}/"}, None),
        ("start: start", {"guided_grammar": "start: start"}, None),
        ("regex a{1000000}", {"guided_regex": "a{1000000}"}, None),
        ("regex nested repetition", {"guided_regex": "((a{100}){100}){100}"}, None),
        ("regex nothing", {"guided_regex": r"[^\s\S]"}, None),
        ("regex 50,000 groups deep", {"guided_regex": "(" * 50000 + "a" + ")" * 50000}, None),
        ("regex inside the bounds", {"guided_regex": "(ab{1,50}){1,100}"}, re.compile("(ab{1,50})*a?b*")),
        ("$ref #", {"guided_json": {"$ref": "#"}}, None),
        ("$ref chain 3,000", {"guided_json": ref_chain(3000)}, None),
        ("schema 50,000 deep", {"guided_json": '{"items":' * 50000 + "{}" + "}" * 50000}, None),
        ("10,000 choices", {"guided_choice": [f"c{i}" for i in range(10000)]}, None),
        ("a 1 MB choice", {"guided_choice": ["x" * 2**20]}, None),
        ("1,000 choices", {"guided_choice": [f"c{i}" for i in range(1000)]}, re.compile(r"c\d{0,3}")),
        ("body 100,000 deep", {"guided_json": Raw('{"a":' * 100000 + "{}" + "}" * 100000)}, None),
        ("prompt 100,000 deep", {"prompt": Raw("[" * 100000 + "1" + "]" * 100000)}, None),
        ("messages 100,000 deep", {"messages": Raw("[" * 100000 + "]" * 100000)}, None),
    ]


class Raw(str):
    """A field's JSON text as sent (nested past what a JSON encoder writes)."""


def body_text(fields: dict) -> str:
    parts = [f"{json.dumps(k)}:{v if isinstance(v, Raw) else json.dumps(v)}" for k, v in fields.items()]
    return "{" + ",".join(parts) + "}"


def test_the_grammar_family_is_a_400_or_a_conforming_200_the_server_alive_throughout(engine, caplog):
    """Each shape a 400 naming a field or a 200 whose text matches (as a prefix where cut by
    max_tokens); /health answers within 1 s all along (polled beside the requests); nothing in the
    log with a traceback."""
    stop, slow = threading.Event(), []

    with serving(create_app(lambda: engine, model_name=MODEL, max_running=2, max_queue=8)) as base:
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, what="the model to be ready")

        def poll():
            while not stop.is_set():
                try:
                    if httpx.get(f"{base}/health", timeout=1.0).status_code != 200:
                        slow.append("not 200")
                except httpx.HTTPError as e:
                    slow.append(repr(e))
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        with caplog.at_level(logging.WARNING):
            poller.start()
            try:
                for name, fields, conforming in family():
                    body = body_text({"model": MODEL, "prompt": "Q:", "max_tokens": 6, "temperature": 0, **fields})
                    headers = {"content-type": "application/json"}
                    r = httpx.post(f"{base}/v1/completions", content=body, headers=headers, timeout=120)
                    if conforming is None:
                        assert r.status_code == 400 and r.json()["error"]["message"], (name, r.text[:300])
                        field, value = next(iter(fields.items()))
                        field += ".grammar" if field == "structured_outputs" else ""
                        assert isinstance(value, Raw) or r.json()["error"]["param"] == field, (name, r.text[:300])
                    else:
                        assert r.status_code == 200, (name, r.text[:300])
                        text = r.json()["choices"][0]["text"]
                        assert conforming.fullmatch(text), (name, text)
            finally:
                stop.set()
                poller.join()
    assert not slow, slow
    assert not [rec for rec in caplog.records if rec.exc_info or "Traceback" in rec.getMessage()]
