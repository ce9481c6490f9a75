"""Structured output on the embedded model: N seeded requests at temperature 1 with a bounded JSON
schema, each checked to parse and validate against it.

The tiny port is a small model trained on fortunes and code: it knows no JSON, so the grammar does
the work (serve/grammar.py). Each request runs as the server runs it over transformers' model on
CPU (`--backend hf`: `Engine.generate`, the grammar's bitmask applied to the logits before the
host samples), its own seed, `max_tokens` with room for the longest output the schema allows.
Recorded: per request the finish reason, the token count and whether the text validates; the
grammars compiled (one: the schema is compiled once, then copied per request); the time per token.

    OMP_NUM_THREADS=1 python -m bench.structured_output --requests 100 --json bench/results/structured-output.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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
PROMPT = "Q: Describe a fortune as JSON.\nA:"
# Room for the longest text the schema allows, a token per byte at worst: a string's character is
# at most 6 bytes written out (\uXXXX), the rest is keys, quotes and separators.
MAX_TOKENS = 6 * (12 + 2 * 6) + 120


def run(engine, requests: int, first_seed: int = 0) -> dict:
    """`requests` seeded requests through `engine` (an Engine of serve/engine.py) -> the record."""
    from neuron_moe.serve.engine import SamplingParams
    from neuron_moe.serve.grammar import GrammarSpec

    spec = GrammarSpec.json_schema(SCHEMA, "response_format.json_schema.schema")
    prompt = engine.tokenizer.encode(PROMPT)
    rows, tokens, started = [], 0, time.perf_counter()
    for seed in range(first_seed, first_seed + requests):
        params = SamplingParams(MAX_TOKENS, temperature=1.0, seed=seed, grammar=spec)
        steps = list(engine.generate(prompt, params))
        text = "".join(s.text for s in steps)
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            problem = None
        except (ValueError, jsonschema.ValidationError) as e:
            problem = str(e).splitlines()[0]
        tokens += steps[-1].completion_tokens
        rows.append(
            {
                "seed": seed,
                "finish_reason": steps[-1].finish_reason,
                "tokens": steps[-1].completion_tokens,
                "valid": problem is None,
                "problem": problem,
                "text": text,
            }
        )
    elapsed = time.perf_counter() - started
    return {
        "requests": requests,
        "valid": sum(r["valid"] for r in rows),
        "stopped": sum(r["finish_reason"] == "stop" for r in rows),
        "tokens_max": max(r["tokens"] for r in rows),
        "max_tokens": MAX_TOKENS,
        "grammars_compiled": engine.grammars.compiles,
        "ms_per_token": round(1e3 * elapsed / tokens, 2),
        "rows": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the record here")
    args = ap.parse_args(argv)
    from neuron_moe.port import load_port
    from neuron_moe.serve.backends import load_engine

    engine = load_engine(load_port("tiny-gemma4-moe"), "eager")
    load = os.getloadavg()
    record = run(engine, args.requests, args.first_seed)
    record.update(
        command="python -m bench.structured_output " + " ".join(argv if argv is not None else sys.argv[1:]),
        schema=SCHEMA,
        prompt=PROMPT,
        threads=torch.get_num_threads(),
        load_before=load,
        load_after=os.getloadavg(),
    )
    print({k: v for k, v in record.items() if k != "rows"})
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(args.json)
    return 0 if record["valid"] == record["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
