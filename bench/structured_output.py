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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("static", "hf"), default="static")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the record here")
    ap.add_argument("--stall", action="store_true", help="also: the step loop's gaps while another thread compiles")
    args = ap.parse_args(argv)
    from bench.harness import command
    from neuron_moe.model import build_model
    from neuron_moe.port import load_port
    from neuron_moe.report import atomic_write
    from neuron_moe.serve.backends import load_engine

    port = load_port("tiny-gemma4-moe")
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
