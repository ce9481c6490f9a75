"""xgrammar and llguidance side by side on this project's tokenizer: what structured output costs.

For each library and each tokenizer case — the embedded port's own tokenizer (byte-level BPE,
2,048 tokens) and a synthesized byte-level vocabulary of Gemma-4's size (262,144 tokens: the 26B
port's tokenizer is not on this machine, so its size is made up of the tiny vocabulary and the
most frequent pretokens of Python's own sources and docs) — this measures

- the tokenizer's set-up (once per server),
- a JSON schema's compile, cold and then repeated (the library's cache, or a copy of a compiled
  matcher),
- the per-token mask (the int32 [ceil(V/32)] bitmask the decode step takes) and the matcher's
  advance by the chosen token, over random walks: at each step a token drawn uniformly (seeded)
  from those the mask allows, until the grammar ends the walk (EOS) — the harshest sampler, since
  no model steers it,
- correctness: every walk's text parses as JSON and validates against the schema (`jsonschema`),
  and the regex and choice grammars' walks match their regex / are one of the choices.

    OMP_NUM_THREADS=1 python -m bench.grammar_libraries --walks 200 --json bench/results/grammar-libraries.json
"""

from __future__ import annotations

import argparse
from importlib import metadata
import json
import os
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch
from tokenizers import Tokenizer

TINY = Path(__file__).resolve().parent.parent / "ports" / "tiny-gemma4-moe" / "tokenizer.json"
EOS = 1
GEMMA4_VOCAB = 262144
MAX_TOKEN_CHARS = 16  # a pretoken longer than this is not a token (real vocabularies' longest are runs of spaces)

# A bounded schema: booleans, enums, short strings (maxLength), a small integer range, a short array.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "ok", "color", "count"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,8}-[0-9]{2,4}"
CHOICES = ["positive", "negative", "neutral"]


def synth_tokenizer(size: int) -> str:
    """A byte-level BPE tokenizer.json of `size` tokens: the tiny port's vocabulary (same ids, same
    specials), then the most frequent pretokens (GPT-2's split, at most MAX_TOKEN_CHARS long) of the
    Python sources and docs on this machine, in byte-level form; no merges (nothing here tokenizes
    text with it: the grammars only read each token's bytes)."""
    import regex

    tiny = json.loads(TINY.read_text())
    vocab = dict(tiny["model"]["vocab"])
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_map = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    assert set(byte_map.values()) == set(alphabet)
    split = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    counts: dict[str, int] = {}
    roots = sorted(
        {
            Path(p)
            for p in sys.path
            if p.endswith(("site-packages", f"python{sys.version_info[0]}.{sys.version_info[1]}"))
        }
    )
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix not in (".py", ".rst", ".md", ".txt") or not path.is_file():
                continue
            try:
                text = path.read_text("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for piece in split.findall(text):
                if 1 < len(piece) <= MAX_TOKEN_CHARS:
                    counts[piece] = counts.get(piece, 0) + 1
            if len(counts) > 2 * size:
                break
        if len(counts) > 2 * size:
            break
    for piece, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(vocab) >= size:
            break
        token = "".join(byte_map[b] for b in piece.encode("utf-8"))
        vocab.setdefault(token, len(vocab))
    n = 0
    while len(vocab) < size:  # not enough distinct pretokens: numbered filler words
        vocab.setdefault(f"Ġfiller{n}", len(vocab))
        n += 1
    tiny["model"]["vocab"] = vocab
    tiny["model"]["merges"] = []
    return json.dumps(tiny)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        tok = Tokenizer.from_str(tokenizer_json)
        encoded = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())]
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[EOS])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, kind: str, spec):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_regex("|".join(re.escape(c) for c in spec))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    @staticmethod
    def fill(matcher, mask):
        matcher.fill_next_token_bitmask(mask, 0)

    @staticmethod
    def accept(matcher, token) -> bool:
        return matcher.accept_token(token)

    @staticmethod
    def done(matcher) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int):
        import llguidance

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=EOS)

    def compile(self, kind: str, spec):
        ll = self.ll
        if kind == "json":
            grammar = ll.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = ll.LLMatcher.grammar_from_regex(spec)
        else:
            grammar = ll.grammar_from("choice", json.dumps(spec))
        matcher = ll.LLMatcher(self.tok, grammar, log_level=0)  # the grammar is built here
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    @staticmethod
    def matcher(compiled):
        return compiled.deep_copy()

    @staticmethod
    def fill(matcher, mask):
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)

    @staticmethod
    def accept(matcher, token) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()

    @staticmethod
    def done(matcher) -> bool:
        return matcher.is_stopped()


def allowed_ids(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def walks(lib, compiled, decode, vocab: int, n: int, seed: int, cap: int = 400):
    """n random walks through the grammar; (texts, fill times s, accept times s, lengths)."""
    rng = random.Random(seed)
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    texts, fills, accepts, lengths = [], [], [], []
    for _ in range(n):
        matcher, tokens = lib.matcher(compiled), []
        while not lib.done(matcher) and len(tokens) < cap:
            t0 = time.perf_counter()
            lib.fill(matcher, mask)
            fills.append(time.perf_counter() - t0)
            token = rng.choice(allowed_ids(mask, vocab))
            t0 = time.perf_counter()
            ok = lib.accept(matcher, token)
            accepts.append(time.perf_counter() - t0)
            assert ok, f"{lib.name} refused a token its own mask allowed"
            tokens.append(token)
        texts.append(None if not lib.done(matcher) else decode([t for t in tokens if t != EOS]))
        lengths.append(len(tokens))
    return texts, fills, accepts, lengths


def check(kind: str, spec, text: str | None) -> bool:
    if text is None:
        return False
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), spec)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    return text in spec


def ms(xs) -> float:
    return round(1e3 * statistics.median(xs), 4) if xs else float("nan")


def p99(xs) -> float:
    return round(1e3 * sorted(xs)[int(0.99 * (len(xs) - 1))], 4) if xs else float("nan")


def run(libs, walks_n: int, seed: int) -> list[dict]:
    results = []
    cases = [("tiny-gemma4-moe (2,048)", TINY.read_text(), 2048)]
    t0 = time.perf_counter()
    big = synth_tokenizer(GEMMA4_VOCAB)
    print(f"synthesized a {GEMMA4_VOCAB}-token vocabulary in {time.perf_counter() - t0:.1f} s", flush=True)
    cases.append((f"synthetic byte-level ({GEMMA4_VOCAB:,})", big, GEMMA4_VOCAB))
    for case, tok_json, vocab in cases:
        decode = Tokenizer.from_str(tok_json).decode
        for cls in libs:
            t0 = time.perf_counter()
            lib = cls(tok_json, vocab)
            init_s = time.perf_counter() - t0
            for kind, spec in (("json", SCHEMA), ("regex", REGEX), ("choice", CHOICES)):
                t0 = time.perf_counter()
                compiled = lib.compile(kind, spec)
                cold = time.perf_counter() - t0
                t0 = time.perf_counter()
                again = lib.compile(kind, spec) if cls is XGrammar else lib.matcher(compiled)
                warm = time.perf_counter() - t0
                del again
                n = walks_n if kind == "json" else max(20, walks_n // 5)
                texts, fills, accepts, lengths = walks(lib, compiled, decode, vocab, n, seed)
                valid = sum(check(kind, spec, t) for t in texts)
                row = {
                    "tokenizer": case,
                    "library": lib.name,
                    "grammar": kind,
                    "tokenizer_init_s": round(init_s, 3),
                    "compile_ms": round(1e3 * cold, 2),
                    "repeat_ms": round(1e3 * warm, 3),
                    "mask_ms_mean": round(1e3 * statistics.fmean(fills), 4),
                    "mask_ms_p50": ms(fills),
                    "mask_ms_p99": p99(fills),
                    "advance_ms_p50": ms(accepts),
                    "tokens_p50": statistics.median(lengths),
                    "tokens_max": max(lengths),
                    "walks": n,
                    "valid": valid,
                    "example": texts[0],
                    "invalid_example": next((t for t in texts if not check(kind, spec, t)), None),
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--walks", type=int, default=200, help="random walks per JSON case (a fifth for regex/choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--libraries", default="xgrammar,llguidance")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    from bench.harness import command
    from neuron_moe.report import atomic_write

    libs = [{"xgrammar": XGrammar, "llguidance": LLGuidance}[name] for name in args.libraries.split(",")]
    results = run(libs, args.walks, args.seed)
    if args.json:
        report = {
            "command": command("bench.grammar_libraries", argv if argv is not None else sys.argv[1:]),
            "versions": {name: metadata.version(name) for name in ("xgrammar", "llguidance")},
            "host": {"machine": platform.machine(), "threads": torch.get_num_threads(), "load": os.getloadavg()},
            "schema": SCHEMA,
            "regex": REGEX,
            "choices": CHOICES,
            "results": results,
        }
        with atomic_write(args.json) as f:
            f.write(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
