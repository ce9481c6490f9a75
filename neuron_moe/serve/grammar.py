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

A compiled grammar is cached per (spec, tokenizer): one `Grammars` per engine (one tokenizer), its
cache holding the most recently used `CACHE_SIZE` grammars, so a repeated schema is not compiled
again; each request gets its own copy of the compiled matcher (microseconds). llguidance releases
the GIL while it compiles, so a compile on a request's thread does not stall the step loop.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

CACHE_SIZE = 64  # compiled grammars kept per engine
KINDS = ("json", "regex", "choice", "grammar")


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

    @classmethod
    def json_schema(cls, schema: dict, field: str, **options) -> GrammarSpec:
        return cls("json", json.dumps(schema, separators=(",", ":")), field, **options)


def _llguidance():
    import llguidance

    return llguidance


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
    the chosen one, `stopped` once the grammar takes nothing more (but an EOS)."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher, self.vocab_size = matcher, vocab_size
        self._mask: torch.Tensor | None = None

    def allowed(self) -> torch.Tensor:
        """int32 [ceil(V/32)]: bit t % 32 of word t // 32 set = token t may come next; filled once per
        token (a second call before `advance` returns the same tensor)."""
        if self._mask is None:
            mask = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
            self._matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            self._mask = mask
        return self._mask

    def advance(self, token: int) -> bool:
        """Take the chosen token; False if the grammar does not allow it."""
        self._mask = None
        return self._matcher.consume_token(token) and not self._matcher.is_error()

    @property
    def stopped(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


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
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._lock = threading.Lock()
        self._compiling: dict[GrammarSpec, threading.Lock] = {}  # a lock per grammar being compiled
        self.compiles = 0  # grammars compiled (cache misses)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of `spec`, from the cache or compiled now (once: requests that ask
        for it while it compiles wait for that compile); a GrammarError naming `spec.field` if it
        does not compile."""
        key = _key(spec)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
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
                    return self._compiled[key]
            try:
                compiled = self._compile(spec)
                with self._lock:
                    self.compiles += 1
                    self._compiled[key] = compiled
                    while len(self._compiled) > CACHE_SIZE:
                        self._compiled.popitem(last=False)
            finally:
                with self._lock:  # after the cache holds it: a later request finds it there
                    self._compiling.pop(key, None)
        return compiled

    def _compile(self, spec: GrammarSpec):
        ll = _llguidance()
        if spec.whitespace_pattern is not None:  # its own field's error, not the schema's
            field = spec.pattern_field or spec.field
            problem = ll.LLMatcher.validate_grammar(ll.LLMatcher.grammar_from_regex(spec.whitespace_pattern))
            if problem:
                raise GrammarError(field, f"{field}: {_first_line(problem)}")
        try:
            grammar = _grammar(ll, spec)
        except ValueError as e:
            raise GrammarError(spec.field, f"{spec.field}: {e}") from None
        try:
            compiled = ll.LLMatcher(self._tokenizer, grammar, log_level=0)  # compiles, the GIL released
        except BaseException as e:  # a Rust panic arrives as pyo3's PanicException, a BaseException
            if type(e).__name__ != "PanicException":
                raise
            raise GrammarError(spec.field, f"{spec.field}: the grammar library failed on it: {e}") from None
        if compiled.is_error():
            raise GrammarError(spec.field, f"{spec.field}: {_first_line(compiled.get_error())}")
        return compiled

    def matcher(self, spec: GrammarSpec) -> Matcher:
        return Matcher(self.compile(spec).deep_copy(), self.vocab_size)


def _key(spec: GrammarSpec) -> GrammarSpec:
    """The cache key: the spec without the fields it came from (the same schema from `guided_json` or
    `response_format` is one grammar)."""
    return GrammarSpec(spec.kind, spec.text, "", spec.whitespace_flexible, spec.whitespace_pattern, "")


def _grammar(ll, spec: GrammarSpec) -> str:
    if spec.kind == "json":
        options = {"whitespace_flexible": spec.whitespace_flexible}
        if spec.whitespace_pattern is not None:
            options["whitespace_pattern"] = spec.whitespace_pattern
        return ll.LLMatcher.grammar_from_json_schema(spec.text, overrides=options)
    if spec.kind == "regex":
        return ll.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return ll.grammar_from("choice", spec.text)
    if spec.kind == "grammar":
        return ll.grammar_from("grammar", spec.text)
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


def _first_line(error: str) -> str:
    """llguidance's error on one line, at most 300 characters."""
    line = " ".join(error.split()) or "the grammar does not compile"
    return line if len(line) <= 300 else line[:297] + "..."
