"""Structured output on the embedded model: N seeded requests at temperature 1 with a bounded JSON
schema, each checked to parse and validate against it.

The tiny port is a small model trained on fortunes and code: it knows no JSON, so the grammar does
the work (serve/grammar.py). Each request runs as the server runs it, its own seed, `max_tokens`
with room for the longest text the schema allows (MAX_TOKENS), on one of

- `static`: the static graphs on CPU, 8 rows, their cache widened to hold the prompt and
  MAX_TOKENS (the port's own holds 96 positions), the requests submitted together (the batching
  engine: the grammar's bitmask an input of the logits-processing decode graph),
- `hf`: transformers' model on CPU, one request at a time (`Engine.generate`: the bitmask applied
  to the logits before the host samples).

Recorded: per request the finish reason, the token count and whether the text validates; the
grammars compiled (one: the schema is compiled once, then copied per request); the time per token.

    OMP_NUM_THREADS=1 python -m bench.structured_output --backend static --requests 100 \
        --json bench/results/structured-output-static.json

`--steps` measures one step's grammar work instead, in one table: the bitmask fill of 8 rows at
Gemma-4's vocabulary (262,144 tokens: bench/grammar_libraries.py's synthesized tokenizer), one row at
a time (each matcher's own fill, what a step did before) against llguidance's batched fill
(`Matcher.fill`, one call for the 8 rows), on the same states of 8 seeded random walks through SCHEMA
(each step's two fills checked bit for bit); and the tiny port's logits-processing decode step at batch
8 run a module at a time and compiled by torch.compile, taking turns call by call (the plain decode
beside them for reference):

    OMP_NUM_THREADS=1 python -m bench.structured_output --steps 300 \
        --json bench/results/structured-output-steps-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import torch

# Booleans, enums, short strings (maxLength), a small integer range and a short list of short strings.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "ok", "color", "count"],
    "additionalProperties": False,
}
PROMPT = "JSON:"
# Room for the longest text the schema allows, a token per byte at worst: 64 characters of keys,
# punctuation and the longest values ('{"name":"","ok":false,"color":"green","count":99,"tags":["",""]}')
# and 12 + 2 x 6 string characters of at most 12 bytes each (a surrogate pair written \uXXXX\uXXXX).
MAX_TOKENS = 64 + 12 * (12 + 2 * 6)
STATIC_ROWS = 8


def run(engine, requests: int, first_seed: int = 0) -> dict:
    """`requests` seeded requests through `engine` (serve/engine.py's Engine: it takes as many at once
    as it has rows) -> the record."""
    from neuron_moe.serve.decoding import SamplingParams
    from neuron_moe.serve.grammar import GrammarSpec

    spec = GrammarSpec.json_schema(SCHEMA, "response_format.json_schema.schema")
    prompt = engine.tokenizer.encode(PROMPT)

    def one(seed: int) -> dict:
        steps = list(engine.generate(prompt, SamplingParams(MAX_TOKENS, temperature=1.0, seed=seed, grammar=spec)))
        text = "".join(s.text for s in steps)
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            problem = None
        except (ValueError, jsonschema.ValidationError) as e:
            problem = str(e).splitlines()[0]
        last = steps[-1]
        return {"seed": seed, "finish_reason": last.finish_reason, "tokens": last.completion_tokens,
                "valid": problem is None, "problem": problem, "text": text}  # fmt: skip

    started = time.perf_counter()
    with ThreadPoolExecutor(engine.rows or 1) as pool:
        rows = list(pool.map(one, range(first_seed, first_seed + requests)))
    elapsed = time.perf_counter() - started
    return {
        "requests": requests,
        "valid": sum(r["valid"] for r in rows),
        "stopped": sum(r["finish_reason"] == "stop" for r in rows),
        "tokens_max": max(r["tokens"] for r in rows),
        "max_tokens": MAX_TOKENS,
        "grammars_compiled": engine.grammars.compiles,
        "ms_per_token": round(1e3 * elapsed / sum(r["tokens"] for r in rows), 2),
        "rows": rows,
    }


def static_engine(port, model, rows: int = STATIC_ROWS):
    """The batching engine over the port's static graphs, their cache widened for PROMPT + MAX_TOKENS."""
    import dataclasses

    from neuron_moe.serve.engine import Engine
    from neuron_moe.serve.decoding import eos_ids
    from neuron_moe.static.runtime import static_runtime
    from neuron_moe.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(port)
    length = len(tokenizer.encode(PROMPT)) + MAX_TOKENS
    spec = dataclasses.replace(port.static, max_cache_len=max(port.static.max_cache_len, length))
    return Engine(static_runtime(model, spec, rows), tokenizer, eos_ids(tokenizer, model.config))


def wide_schema(tag: int, properties: int = 60) -> dict:
    """A schema of `properties` required properties (enums and bounded strings), its keys tagged: a
    larger compile, and a different one per tag (never from the cache)."""
    props = {
        f"k{tag}_{j}": {"enum": [f"v{j}", f"w{j}"]} if j % 2 else {"type": "string", "maxLength": 8}
        for j in range(properties)
    }
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def stall(engine, repeats: int = 2) -> dict:
    """Whether compiles on another thread stall the step loop: the gaps between decode steps of 8
    rows generating under a regex, alone, while a thread compiles new schemas back to back (far
    more often than a server does: it compiles a schema once, on the request's thread), and while a
    thread as busy runs matrix products with the GIL released (what a busy core alone costs)."""
    import statistics
    import threading

    from neuron_moe.serve.decoding import SamplingParams
    from neuron_moe.serve.grammar import GrammarSpec

    started = time.perf_counter()
    engine.grammars.compile(GrammarSpec.json_schema(wide_schema(-1), "guided_json"))
    one_ms = 1e3 * (time.perf_counter() - started)
    prompt, rows = engine.tokenizer.encode("Once"), []

    def gaps(beside: str) -> dict:
        stamps, compiled, stop = [], [0], threading.Event()

        def compiler():
            while not stop.is_set():
                engine.grammars.compile(GrammarSpec.json_schema(wide_schema(compiled[0]), "guided_json"))
                compiled[0] += 1

        def matmuls():  # the reference: a thread as busy, in C with the GIL released
            a = torch.randn(512, 512)
            while not stop.is_set():
                a @ a

        def request(seed: int):
            spec = GrammarSpec("regex", "[a-z ]{60}", "guided_regex")
            for _ in engine.generate(prompt, SamplingParams(60, temperature=1.0, seed=seed, grammar=spec)):
                if seed == 0:
                    stamps.append(time.perf_counter())

        threads = [threading.Thread(target=request, args=(seed,)) for seed in range(STATIC_ROWS)]
        threads += [threading.Thread(target={"compiling": compiler, "matmuls": matmuls}[beside])] if beside else []
        for t in threads:
            t.start()
        for t in threads[:STATIC_ROWS]:
            t.join()
        stop.set()
        threads[-1].join()
        ms = [1e3 * (b - a) for a, b in zip(stamps[5:], stamps[6:])]
        return {"beside": beside or "nothing", "gap_ms_p50": round(statistics.median(ms), 2),
                "gap_ms_max": round(max(ms), 1), "schemas_compiled_meanwhile": compiled[0]}  # fmt: skip

    for _ in range(repeats):
        rows += [gaps(""), gaps("compiling"), gaps("matmuls")]
    return {"wide_schema_compile_ms": round(one_ms, 1), "runs": rows}


STEP_COLUMNS = [
    ("work", "per step"),
    ("how", "run"),
    ("rows", "rows"),
    ("ms_p50", "ms p50", "{:.3f}"),
    ("ms_mean", "ms mean", "{:.3f}"),
    ("ms_p90", "ms p90", "{:.3f}"),
    ("ms_best", "ms best", "{:.3f}"),
]


def _times(name: str, how: str, rows: int, seconds: list[float]) -> dict:
    import statistics

    ms = sorted(1e3 * s for s in seconds)
    return {"work": name, "how": how, "rows": rows, "ms_p50": statistics.median(ms),
            "ms_mean": statistics.fmean(ms), "ms_p90": ms[int(0.9 * (len(ms) - 1))], "ms_best": ms[0]}  # fmt: skip


def fill_steps(steps: int, rows: int = STATIC_ROWS, seed: int = 0) -> list[dict]:
    """The bitmask fill of `rows` rows per step at Gemma-4's vocabulary, one row at a time and batched,
    over `steps` steps of seeded random walks through SCHEMA (a walk the grammar ends starts again): two
    sets of matchers fed the same tokens, one filled a row at a time, the other by `Matcher.fill`, the
    two taking turns first; every step's masks equal bit for bit (an AssertionError otherwise)."""
    import random
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    from bench.grammar_libraries import EOS, GEMMA4_VOCAB, synth_tokenizer
    from neuron_moe.serve.grammar import Grammars, GrammarSpec, Matcher, unpack

    tokenizer = SimpleNamespace(backend=Tokenizer.from_str(synth_tokenizer(GEMMA4_VOCAB)), eos_token_id=EOS)
    grammars = Grammars(tokenizer, GEMMA4_VOCAB, {EOS})
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    rng = random.Random(seed)
    one, batched = ([grammars.matcher(spec) for _ in range(rows)] for _ in range(2))
    times = {"one": [], "batched": []}
    for step in range(steps):
        fills = {"one": lambda: [m.allowed() for m in one], "batched": lambda: Matcher.fill(batched)}
        for how in sorted(fills, reverse=step % 2 == 1):  # the two take turns first
            started = time.perf_counter()
            fills[how]()
            times[how].append(time.perf_counter() - started)
        for i in range(rows):
            mask = one[i].allowed()
            assert torch.equal(mask, batched[i].allowed()), f"step {step}, row {i}: the fills differ"
            token = rng.choice(unpack(mask, GEMMA4_VOCAB).nonzero().flatten().tolist())
            if token == EOS:  # the walk is complete: a new one
                one[i], batched[i] = grammars.matcher(spec), grammars.matcher(spec)
            else:
                assert one[i].advance(token) and batched[i].advance(token)
    name = f"grammar bitmask fill ({GEMMA4_VOCAB:,} tokens, JSON schema)"
    return [_times(name, "one row at a time", rows, times["one"]),
            _times(name, "batched (one llguidance call)", rows, times["batched"])]  # fmt: skip


def decode_steps(port, model, steps: int, rows: int = STATIC_ROWS) -> list[dict]:
    """The tiny port's logits-processing decode step (and the plain one) at batch `rows`, run a module
    at a time and compiled (serve's default), the four calls taking turns; the rows ask for penalties,
    a bias and a bitmask (the graphs' cost does not depend on the values)."""
    from neuron_moe.spec import compile_cache
    from neuron_moe.static import inductor
    from neuron_moe.static.runtime import static_runtime
    from neuron_moe.static.sampling import GREEDY, neutral_inputs

    inductor.use_cache_dir(compile_cache(None))
    runtimes = {
        how: static_runtime(model, port.static, rows, compile=how == "compiled") for how in ("modules", "compiled")
    }
    ids, positions = torch.full((rows, 1), 7), torch.full((rows, 1), 20)
    sampling = torch.tensor([GREEDY] * rows)
    process, bias_ids, bias, mask = neutral_inputs(rows, model.config.vocab_size)
    process[:, :4] = torch.tensor([0.5, 0.3, 1.2, 0.05])
    bias_ids[:, :2], bias[:, :2] = torch.tensor([7, 100]), torch.tensor([3.0, -1.0])
    mask[:, ::2] = 0x55555555
    calls = {}
    for how, runtime in runtimes.items():
        calls[("logits-processing decode (tiny port)", how)] = lambda r=runtime: r.decode_processing(
            ids, positions, sampling, process, bias_ids, bias, mask
        )
        calls[("decode, for reference (tiny port)", how)] = lambda r=runtime: r.decode(ids, positions, sampling)
    for call in calls.values():  # the first call compiles (or loads from the compile cache)
        call()
    times = {key: [] for key in calls}
    for _ in range(steps):
        for key, call in calls.items():
            started = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - started)
    return [_times(name, how, rows, times[(name, how)]) for name, how in sorted(calls, reverse=True)]


def steps_table(port, model, steps: int) -> dict:
    """`fill_steps` and `decode_steps` in one run -> the record (its table printed)."""
    import platform

    from neuron_moe.report import table

    rows = fill_steps(steps) + decode_steps(port, model, steps)
    by = {(r["work"].split(" (")[0], r["how"]): r for r in rows}
    fill = (
        by[("grammar bitmask fill", "one row at a time")]["ms_mean"]
        / by[("grammar bitmask fill", "batched (one llguidance call)")]["ms_mean"]
    )
    compiled = (
        by[("logits-processing decode", "modules")]["ms_p50"] / by[("logits-processing decode", "compiled")]["ms_p50"]
    )
    print(table(rows, STEP_COLUMNS))
    print(
        f"batched fill: {fill:.2f}x the rows one at a time (means); compiled processing decode: {compiled:.2f}x (p50)"
    )
    return {
        "steps": steps,
        "table": rows,
        "fill_speedup_mean": round(fill, 3),
        "processing_decode_speedup_p50": round(compiled, 3),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "table_md": table(rows, STEP_COLUMNS, markdown=True),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("static", "hf"), default="static")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the record here")
    ap.add_argument("--stall", action="store_true", help="also: the step loop's gaps while another thread compiles")
    ap.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="instead of the requests: N steps of the batch-8 bitmask fill (one row at a time vs batched) and "
        "of the logits-processing decode (modules vs compiled), one table",
    )
    args = ap.parse_args(argv)
    from bench.harness import command
    from neuron_moe.model import build_model
    from neuron_moe.port import load_port
    from neuron_moe.report import atomic_write
    from neuron_moe.serve.backends import load_engine

    port = load_port("tiny-gemma4-moe")
    if args.steps:
        load = os.getloadavg()
        record = steps_table(port, build_model(port, port.static.decode_experts, torch.float32), args.steps)
        record.update(command=command("bench.structured_output", argv if argv is not None else sys.argv[1:]),
                      threads=torch.get_num_threads(), load_before=load, load_after=os.getloadavg())  # fmt: skip
        if args.json:
            with atomic_write(args.json) as f:
                f.write(json.dumps(record, indent=1) + "\n")
        return 0
    if args.backend == "static":
        engine = static_engine(port, build_model(port, port.static.decode_experts, torch.float32))
    else:
        engine = load_engine(port, "eager")
    load = os.getloadavg()
    record = run(engine, args.requests, args.first_seed)
    if args.stall and args.backend == "static":
        record["stall"] = stall(engine)
    record.update(
        backend=args.backend,
        command=command("bench.structured_output", argv if argv is not None else sys.argv[1:]),
        schema=SCHEMA,
        prompt=PROMPT,
        threads=torch.get_num_threads(),
        load_before=load,
        load_after=os.getloadavg(),
    )
    print({k: v for k, v in record.items() if k != "rows"})
    engine.close()
    if args.json:
        with atomic_write(args.json) as f:
            f.write(json.dumps(record, indent=1) + "\n")
    return 0 if record["valid"] == record["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
