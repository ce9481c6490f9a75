"""Structured output: a request's grammar, compiled for the served tokenizer, as a token bitmask.

A request may constrain its output to a JSON schema, any JSON object, a regular expression, one of
a list of strings, or a Lark / GBNF grammar (`protocol.py` reads OpenAI's `response_format` and
vLLM's `structured_outputs` and `guided_*` fields into one `GrammarSpec`). llguidance compiles it
against the tokenizer's own tokens (bench/results/grammar-libraries.md says why llguidance and
what it costs) and, at each step, fills the next token's bitmask: int32 [ceil(V/32)], bit t % 32
of word t // 32 set = token t allowed (V the model's vocabulary, the logits' width). The bitmask is
applied to the logits before sampling, by the logits-processing graphs (an input of their decode
graph) or on the host (`static.sampling.process_host`). The chosen token advances the matcher;
once the grammar can take nothing more but an EOS, the request ends ("stop"). EOS is allowed
exactly where the grammar is complete.

JSON is written compactly unless asked otherwise (no whitespace between its tokens: a bounded
schema bounds the output's length), as vLLM's `disable_any_whitespace` writes it.

An object schema that lists its properties admits no others unless it says so
(`additionalProperties`), as vLLM's default backend (xgrammar's strict mode) and OpenAI's structured
outputs read a schema; vLLM's `disable_additional_properties: false` asks for JSON Schema's own
default instead (any other property allowed), as vLLM's llguidance backend reads it.

A grammar comes from an untrusted client: before it compiles, its text is held to the bounds of
grammar_bounds.py (size, rules, alternatives, nesting, repetition), below the points where
llguidance's compile overflows a stack; it compiles on one thread of its own (a 256 MiB stack, one
compile at a time: a flood of new schemas takes one core, not the step loop's), under llguidance's
own limits (`LLParserLimits`); then its first bitmask is computed, so a grammar that admits no output
(`{"$ref": "#"}`, `[^\\s\\S]`, `start: start`) is refused before the request runs. A limit met
later, at a step (an Earley row past its size, a lexer out of fuel), is found by `Matcher.advance`.
Each is the client's error: a GrammarError naming the request field, a 400.

The rows of a batch that follow grammars have their bitmasks filled together at each step
(`Matcher.fill`: llguidance's batched fill, one call for every row, the GIL released and the rows
spread over its own threads) into one tensor, instead of one call per row.

A compiled grammar is cached per (spec, tokenizer): one `Grammars` per engine (one tokenizer), its
cache holding the most recently used grammars, at most CACHE_SIZE of them and CACHE_BYTES of their
estimated memory, so a repeated schema is not compiled again; each request gets its own copy of the
compiled matcher (microseconds).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import grammar_bounds

CACHE_SIZE = 64  # compiled grammars kept per engine
# the compiled grammars' estimated memory kept per engine: each is taken as COST_BASE plus COST_PER_BYTE
# per byte of its llguidance grammar (measured on the tiny port's tokenizer: a 25,000-option enum's
# 264 KB grammar held ~9 MB, a 1,000-property object's 28 KB ~4 MB)
CACHE_BYTES = 256 * 2**20
COST_BASE, COST_PER_BYTE = 64 * 2**10, 160
COMPILE_STACK = 256 * 2**20  # the compile thread's stack (llguidance recurses over a grammar's rules)
KINDS = ("json", "regex", "choice", "grammar")

log = logging.getLogger("neuron_moe.serve")


class GrammarError(ValueError):
    """A grammar that does not compile; `field` names the request field it came from."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: `kind` one of KINDS; `text` the JSON schema (as compact
    JSON, its keys in the request's order: an object's properties are written in that order), the
    regex, the choices (a JSON list) or the grammar (Lark or GBNF); `field` the request field it
    came from (errors name it)."""

    kind: str
    text: str
    field: str
    whitespace_flexible: bool = False  # JSON: any whitespace between tokens (vLLM's disable_any_whitespace=false)
    whitespace_pattern: str | None = None  # JSON: the whitespace allowed between tokens, as a regex
    pattern_field: str = ""  # the request field whitespace_pattern came from (errors name it)
    strict: bool = True  # JSON: an object schema listing properties admits no others unless it says so

    @classmethod
    def json_schema(cls, schema: dict, field: str, **options) -> GrammarSpec:
        return cls("json", json.dumps(schema, separators=(",", ":")), field, **options)


def _llguidance():
    import llguidance
    import llguidance.torch  # noqa: F401  (its batched fill)

    return llguidance


_fills = None  # llguidance's thread pool of the batched fill (`Matcher.fill`), made at its first use
_fills_lock = threading.Lock()


def _executor():
    """The process's one `LLExecutor`, a thread per core up to 32 (llguidance's default, 80 % of the
    cores, is one thread on two: the rows handed to it and filled one after another)."""
    global _fills
    with _fills_lock:
        if _fills is None:
            _fills = _llguidance().LLExecutor(num_threads=min(32, os.cpu_count() or 1))
        return _fills


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """llguidance's view of the served tokenizer: an HF fast tokenizer's JSON, or the bytes of each
    token of the built-in byte tokenizer."""
    ll = _llguidance()
    eos = sorted(eos_ids) or [tokenizer.eos_token_id]
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        return ll.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    offset = getattr(tokenizer, "offset", None)
    if offset is not None:  # tokenizer.ByteTokenizer: the specials below `offset`, then one token per byte

        class _Bytes:
            eos_token_id, bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
            tokens = [b"<special%d>" % i for i in range(offset)] + [bytes([b]) for b in range(256)]
            special_token_ids = list(range(offset))

            def __call__(self, text: bytes) -> list[int]:
                return [b + offset for b in text]

        return ll.LLTokenizer(ll.TokenizerWrapper(_Bytes()), n_vocab=vocab_size, eos_token=eos)
    raise GrammarError("tokenizer", "this server's tokenizer has no token table a grammar can be compiled against")


def _vocab_size(tokenizer) -> int:
    backend = getattr(tokenizer, "backend", None)
    size = backend.get_vocab_size() if backend is not None else getattr(tokenizer, "vocab_size", None)
    if size is None:
        raise GrammarError("tokenizer", "this server's tokenizer has no token table a grammar can be compiled against")
    return size


class Matcher:
    """One request's place in its grammar: `allowed()` the next token's bitmask, `advance(token)`
    the chosen one, `stopped` once the grammar takes nothing more (but an EOS); `field` the request
    field the grammar came from."""

    def __init__(self, matcher, vocab_size: int, field: str = ""):
        self._matcher, self.vocab_size, self.field = matcher, vocab_size, field
        self._mask: torch.Tensor | None = None

    def allowed(self) -> torch.Tensor:
        """int32 [ceil(V/32)]: bit t % 32 of word t // 32 set = token t may come next; filled once per
        token (a second call before `advance` returns the same tensor). A matcher that fails on the
        grammar here allows EOS alone, and `advance` says why."""
        if self._mask is None:
            mask = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
            self._matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            self._mask = mask
        return self._mask

    def advance(self, token: int) -> bool:
        """Take the chosen token; False if the grammar does not allow it. A GrammarError naming the
        field when the matcher failed on the grammar rather than on the token: at the last bitmask,
        or on a token that bitmask allowed (a limit of llguidance's met at this step)."""
        mask, self._mask = self._mask, None
        if self._matcher.is_error():
            raise GrammarError(self.field, f"{self.field}: {_failure(self._matcher)}")
        if self._matcher.consume_token(token) and not self._matcher.is_error():
            return True
        if mask is not None and int(mask[token // 32]) >> (token % 32) & 1:
            raise GrammarError(self.field, f"{self.field}: {_failure(self._matcher)}")
        return False

    @classmethod
    def fill(cls, matchers: list[Matcher]) -> None:
        """The next bitmask of each of `matchers` not yet filled, in one call of llguidance's batched fill
        (`LLExecutor`: the GIL released, the matchers spread over its threads) into one tensor [n,
        ceil(V/32)], each matcher's `allowed()` then a row of it: the very bits of `allowed()`'s own fill
        (a matcher failed on its grammar allows EOS alone there too). Should the batched call fail, each
        matcher's `allowed()` fills its own, and fails or not on its own."""
        pending = [m for m in matchers if m._mask is None]
        for size in {m.vocab_size for m in pending}:
            group = [m for m in pending if m.vocab_size == size]
            masks = torch.zeros(len(group), (size + 31) // 32, dtype=torch.int32)
            try:
                _llguidance().torch.fill_next_token_bitmask_par(
                    _executor(), [(m._matcher, i) for i, m in enumerate(group)], masks
                )
            except Exception:
                log.warning("the batched bitmask fill failed; each row fills its own", exc_info=True)
                continue
            for m, mask in zip(group, masks):
                m._mask = mask

    @property
    def stopped(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


def _failure(matcher) -> str:
    """Why llguidance's matcher failed on a grammar, for the client: it admits no output here, or it
    passed one of llguidance's limits."""
    if matcher.get_error().split()[:1] in (["NoExtension"], ["NoExtensionBias"]):  # nothing may come first
        return "the grammar admits no output (no text matches it)"
    return f"the grammar passes a limit of the grammar library: {_first_line(matcher.get_error())}"


def unpack(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bitmask int32 [..., ceil(V/32)] as bool [..., V]."""
    bits = (mask[..., None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


class Grammars:
    """The grammars compiled for one tokenizer and vocabulary (the logits' width; None: the
    tokenizer's own), most recently used kept."""

    def __init__(self, tokenizer, vocab_size: int | None, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, frozenset(eos_ids)
        self._tokenizer = None  # llguidance's, made at the first grammar
        self._compiled: OrderedDict[GrammarSpec, tuple[object, int]] = OrderedDict()  # (grammar, its cost)
        self.cached_bytes = 0  # the cached grammars' estimated memory
        self._lock = threading.Lock()
        self._compiling: dict[GrammarSpec, threading.Lock] = {}  # a lock per grammar being compiled
        self.compiles = 0  # grammars compiled (cache misses)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of `spec`, from the cache or compiled now (once: requests that ask
        for it while it compiles wait for that compile); a GrammarError naming `spec.field` if it
        passes a bound, does not compile or admits no output."""
        key = _key(spec)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key][0]
            if self._tokenizer is None:
                try:
                    if self.vocab_size is None:
                        self.vocab_size = _vocab_size(self.tokenizer)
                    self._tokenizer = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
                except GrammarError as e:
                    raise GrammarError(spec.field, f"{spec.field}: {e}") from None
            compiling = self._compiling.setdefault(key, threading.Lock())
        with compiling:  # one compile per grammar at a time; the others find it in the cache after
            with self._lock:
                if key in self._compiled:
                    return self._compiled[key][0]
            try:
                _check_bounds(spec)
                compiled, cost = _on_compile_thread(self._compile, spec)
                with self._lock:
                    self.compiles += 1
                    self._keep(key, compiled, cost)
            finally:
                with self._lock:  # after the cache holds it: a later request finds it there
                    self._compiling.pop(key, None)
        return compiled

    def _keep(self, key: GrammarSpec, compiled, cost: int) -> None:
        """Cache a compiled grammar; the least recently used go past CACHE_SIZE or CACHE_BYTES (the
        newest stays, whatever its cost)."""
        self._compiled[key] = (compiled, cost)
        self.cached_bytes += cost
        while len(self._compiled) > 1 and (len(self._compiled) > CACHE_SIZE or self.cached_bytes > CACHE_BYTES):
            self.cached_bytes -= self._compiled.popitem(last=False)[1][1]

    def _compile(self, spec: GrammarSpec) -> tuple[object, int]:
        """On the compile thread: the compiled grammar and its estimated memory."""
        ll = _llguidance()
        limits = ll.LLParserLimits(verbose_errors=False)
        if spec.whitespace_pattern is not None:  # its own field's error, not the schema's
            field = spec.pattern_field or spec.field
            problem = ll.LLMatcher.validate_grammar(
                ll.LLMatcher.grammar_from_regex(spec.whitespace_pattern), limits=limits
            )
            if problem:
                raise GrammarError(field, f"{field}: {_first_line(problem)}")
        try:
            grammar = _grammar(ll, spec)
        except ValueError as e:
            raise GrammarError(spec.field, f"{spec.field}: {e}") from None
        try:
            compiled = ll.LLMatcher(self._tokenizer, grammar, log_level=0, limits=limits)  # the GIL released
        except BaseException as e:  # a Rust panic arrives as pyo3's PanicException, a BaseException
            if type(e).__name__ != "PanicException":
                raise
            raise GrammarError(spec.field, f"{spec.field}: the grammar library failed on it: {e}") from None
        if compiled.is_error():
            raise GrammarError(spec.field, f"{spec.field}: {_first_line(compiled.get_error())}")
        first = compiled.deep_copy()
        first.compute_bitmask()  # the first token's: a grammar that admits no output fails here
        if first.is_error():
            raise GrammarError(spec.field, f"{spec.field}: {_failure(first)}")
        return compiled, COST_BASE + COST_PER_BYTE * len(grammar)

    def matcher(self, spec: GrammarSpec) -> Matcher:
        return Matcher(self.compile(spec).deep_copy(), self.vocab_size, spec.field)


def _check_bounds(spec: GrammarSpec) -> None:
    """A GrammarError naming the field when the grammar, or its whitespace pattern, passes a bound of
    grammar_bounds.py."""
    for field, problem in (
        (spec.field, grammar_bounds.problem(spec.kind, spec.text)),
        (
            spec.pattern_field or spec.field,
            spec.whitespace_pattern and grammar_bounds.regex_problem(spec.whitespace_pattern),
        ),
    ):
        if problem:
            raise GrammarError(field, f"{field}: {problem}")


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _on_compile_thread(fn, *args):
    """fn(*args) on the compile thread (one for the process, its stack COMPILE_STACK), the caller
    waiting for it."""
    global _pool
    with _pool_lock:
        if _pool is None:
            before = threading.stack_size(COMPILE_STACK)
            try:
                _pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
                _pool.submit(int).result()  # its one thread starts now, with that stack
            finally:
                threading.stack_size(before)
    return _pool.submit(fn, *args).result()


def _key(spec: GrammarSpec) -> GrammarSpec:
    """The cache key: the spec without the fields it came from (the same schema from `guided_json` or
    `response_format` is one grammar)."""
    return GrammarSpec(spec.kind, spec.text, "", spec.whitespace_flexible, spec.whitespace_pattern, "", spec.strict)


def _grammar(ll, spec: GrammarSpec) -> str:
    if spec.kind == "json":
        options = {"whitespace_flexible": spec.whitespace_flexible}
        if spec.whitespace_pattern is not None:
            options["whitespace_pattern"] = spec.whitespace_pattern
        schema = json.loads(spec.text)
        return ll.LLMatcher.grammar_from_json_schema(_strict(schema) if spec.strict else schema, overrides=options)
    if spec.kind == "regex":
        return ll.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return ll.grammar_from("choice", spec.text)
    if spec.kind == "grammar":
        return ll.grammar_from("grammar", spec.text)
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


def _strict(schema):
    """The schema (parsed, changed in place) with `additionalProperties: false` in each object schema
    that lists `properties` or `patternProperties` and says nothing of others: vLLM's walk for its
    `disable_additional_properties`, the reading of xgrammar's strict mode. Its nesting is bounded
    (grammar_bounds.MAX_DEPTH)."""
    if isinstance(schema, dict):
        for value in schema.values():
            _strict(value)
        if "additionalProperties" not in schema and ("properties" in schema or "patternProperties" in schema):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


def _first_line(error: str) -> str:
    """llguidance's error on one line (its `<non-verbose/>` marker dropped), at most 300 characters."""
    line = " ".join(error.replace("<non-verbose/>", "").split()) or "the grammar does not compile"
    return line if len(line) <= 300 else line[:297] + "..."
