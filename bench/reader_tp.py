"""The reader inside the TP decode graph on gloo ranks (CPU), the tiny port, per TP degree.

For each degree (default 2, 4, 8) one set of t forked gloo processes runs, over validate's four
default prompts and N new tokens, three generators whose graphs are exported once as rank 0
(`parallel/tp_generator.py`): the channel layout without the reader, the reader at 100 %, and the
reader at --budget (--recovery-rank). Step 0's logits come from the prefill graph, which runs the
full experts in all three; the reader runs in the decode graph, steps 1…N−1. Reported: SEQ_MATCH
against HF eager fp32 (`validate`'s reference); the reader at 100 % against the channel layout
without it (the same graphs but the decode experts) and against HF eager, max |Δlogit| over the
decode steps; the reader at the budget against the per-rank reader emulated in one process
(`attach_reader(..., tp=t)`, what eval-reader measures): the same tokens, max |Δlogit|.

    python -m bench.reader_tp [--tp 2,4,8] [--budget 60] [--recovery-rank 0] [--new-tokens 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from neuron_moe.eval.seq_match import DEFAULT_PROMPTS
from neuron_moe.experts.channel_reader import attach_reader
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model, prep_port
from neuron_moe.parallel.tp_generator import TPGenerator, generate_replicated
from neuron_moe.port import load_port
from neuron_moe.reader import shard
from neuron_moe.reader.sidecar import Sidecar
from neuron_moe.report import table, write_json
from neuron_moe.spec import Reader, tp_backend
from neuron_moe.tokenizer import load_tokenizer


def step0(got, want) -> list[float]:
    """Per prompt, max |Δlogit| at step 0: the prefill graph's logits (the reader is not in it)."""
    return [float(d) for d in (got.logits[:, 0] - want.logits[:, 0]).abs().amax(-1)]


def decode_steps(got, want) -> list[float]:
    """Per prompt, max |Δlogit| over steps 1…N−1: the decode graph's, where the reader runs."""
    return [float(d) for d in (got.logits[:, 1:] - want.logits[:, 1:]).abs().amax((-2, -1))]


def columns(budget: float) -> list[tuple]:
    """The table's columns, the reader's at `budget` named by it."""
    return [
        ("tp", "TP"),
        ("prompt", "prompt", "{!r}"),
        ("channel_seq_match", "channel SEQ_MATCH"),
        ("r100_seq_match", "reader 100 % SEQ_MATCH"),
        ("r100_vs_channel_decode", "100 % vs channel, decode steps", "{:.1e}"),
        ("r100_vs_eager_decode", "100 % vs eager, decode", "{:.1e}"),
        ("channel_vs_eager_decode", "channel vs eager, decode", "{:.1e}"),
        ("max_logit", "max logit", "{:.1f}"),
        ("k_per_rank", f"k/rank @ {budget:g} %"),
        ("reader_vs_eager_seq_match", f"{budget:g} %: SEQ_MATCH"),
        ("reader_eq_emulation", "= emulation (tokens)"),
        ("reader_vs_emulation", "|Δlogit| vs emulation", "{:.1e}"),
    ]


def degree_rows(port, whole: Sidecar, tmp: str, tp: int, args, ids, mask, eager) -> list[dict]:
    """One TP degree: the three generators on t gloo ranks and the one-process emulation, a row per prompt."""
    shard.write_shards(whole, tmp, tp, progress=False)
    backend = tp_backend(tp)
    gens = {
        "channel": TPGenerator(port, backend),
        "reader 100": TPGenerator(port, replace(backend, reader=Reader(sidecar=tmp, budget=100))),
        "reader": TPGenerator(
            port, replace(backend, reader=Reader(sidecar=tmp, budget=args.budget, recovery_rank=args.recovery_rank))
        ),
    }
    out = generate_replicated(gens, ids, mask, args.new_tokens)
    emulated = build_model(port, "eager", torch.float32)
    attach_reader(emulated, whole.path, args.budget, rank=args.recovery_rank, tp=tp)
    emulation = greedy(emulated, ids, mask, args.new_tokens)
    reader, r100, channel = out["reader"], out["reader 100"], out["channel"]
    return [
        {
            "tp": tp,
            "prompt": prompt,
            "channel_seq_match": bool(torch.equal(channel.tokens[i], eager.tokens[i])),
            "r100_seq_match": bool(torch.equal(r100.tokens[i], eager.tokens[i])),
            "r100_vs_eager": step0(r100, eager)[i],
            "r100_vs_channel_decode": decode_steps(r100, channel)[i],
            "r100_vs_eager_decode": decode_steps(r100, eager)[i],
            "channel_vs_eager_decode": decode_steps(channel, eager)[i],
            "max_logit": float(eager.logits[i].abs().max()),
            "k_per_rank": gens["reader"].reader_k,
            "reader_vs_eager_seq_match": bool(torch.equal(reader.tokens[i], eager.tokens[i])),
            "reader_eq_emulation": bool(torch.equal(reader.tokens[i], emulation.tokens[i])),
            "reader_vs_emulation": float((reader.logits[i] - emulation.logits[i]).abs().max()),
        }
        for i, prompt in enumerate(DEFAULT_PROMPTS)
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="2,4,8", help="TP degrees (default 2,4,8)")
    ap.add_argument("--budget", type=float, default=60.0, help="the reader's budget besides 100 (default 60)")
    ap.add_argument("--recovery-rank", type=int, default=0, help="recovery rank at --budget (default 0)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    port = load_port("tiny-gemma4-moe")
    tok = load_tokenizer(port)
    ids, mask = left_pad([tok.encode(p) for p in DEFAULT_PROMPTS], tok.pad_token_id)
    eager = greedy(build_model(port, "eager", torch.float32), ids, mask, args.new_tokens)
    rows, started = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        whole = Sidecar(prep_port(port, Path(tmp) / shard.WHOLE))
        for tp in [int(t) for t in args.tp.split(",")]:
            t0 = time.time()
            rows += degree_rows(port, whole, tmp, tp, args, ids, mask, eager)
            print(f"TP {tp}: {time.time() - t0:.0f} s", file=sys.stderr)
    print(table(rows, columns(args.budget)))
    report = {
        "budget": args.budget,
        "rank": args.recovery_rank,
        "new_tokens": args.new_tokens,
        "rows": rows,
        "seconds": time.time() - started,
        "machine": "CPU (gloo ranks as forked processes)",
    }
    if args.json:
        write_json(report, args.json)
    ok = all(
        r["r100_seq_match"] and r["reader_eq_emulation"] and r["r100_vs_channel_decode"] <= 2e-6 * r["max_logit"]
        for r in rows
    )
    print(
        f"\n{'PASS' if ok else 'FAIL'}: reader at 100 % = HF eager (SEQ_MATCH) and = the channel layout without it "
        f"on every decode step (fp32 bound, 2e-6 of the largest logit); reader at {args.budget:g} % = the one-process "
        f"emulation, at every TP degree"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
