"""What torch's intra-op thread count costs the CPU commands, side by side in one run.

Each workload runs at every thread count in turn, repeat after repeat (1, 2, 1, 2, ...), so that
every count meets the same load from whatever else the machine runs; the table gives each one's
median and fastest time. The workloads are what `--threads` (cli_parser.DEFAULT_THREADS) is for:

  validate   `validate --backend dense_masked` on the default prompts: the backend and the fp32
             reference each build their model and generate --max-new-tokens greedily
  serve      one request of --max-new-tokens tokens through `serve --backend eager`'s engine
             (the model built once), EOS ignored
  static     the same request through `serve --backend static`'s batching engine

    python -m bench.threads --threads 1,2 --repeats 5 --json bench/results/threads-cpu.json
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

import torch

from neuron_moe.eval.seq_match import DEFAULT_PROMPTS, run_validation
from neuron_moe.port import load_port
from neuron_moe.report import table, write_json
from neuron_moe.serve.backends import load_engine
from neuron_moe.serve.decoding import SamplingParams
from neuron_moe.tokenizer import load_tokenizer


def request(engine, prompt: str, n: int):
    """One greedy request of exactly n tokens (EOS ignored: a shallow copy of the engine without it)."""
    endless = copy.copy(engine)
    endless.eos_ids = frozenset()
    ids = engine.tokenizer.encode(prompt)
    return lambda: list(endless.generate(ids, SamplingParams(n, temperature=0.0)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-gemma4-moe")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--workloads", default="validate,serve,static")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    port = load_port(args.model)
    tokenizer = load_tokenizer(port)
    engines = {"serve": load_engine(port, "eager"), "static": load_engine(port, "static")}
    prompt = DEFAULT_PROMPTS[0]
    workloads = {
        "validate": lambda: run_validation(port, tokenizer, "dense_masked", args.max_new_tokens, list(DEFAULT_PROMPTS)),
        "serve": request(engines["serve"], prompt, args.max_new_tokens),
        "static": request(engines["static"], prompt, args.max_new_tokens),
    }
    chosen = args.workloads.split(",")
    times = {(w, n): [] for w in chosen for n in counts}
    load_before = os.getloadavg()
    for w in chosen:
        for n in counts:  # one untimed call per count: first-call costs (allocations, caches) out of the timing
            torch.set_num_threads(n)
            workloads[w]()
        for _ in range(args.repeats):
            for n in counts:
                torch.set_num_threads(n)
                start = time.perf_counter()
                workloads[w]()
                times[w, n].append(time.perf_counter() - start)
    engines["static"].close()
    load_after = os.getloadavg()
    rows = [
        {
            "workload": w,
            "threads": n,
            "median_s": statistics.median(t),
            "min_s": min(t),
            "vs_first": statistics.median(t) / statistics.median(times[w, counts[0]]),
        }
        for (w, n), t in times.items()
    ]
    host = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(
        f"{port.name}, {args.max_new_tokens} new tokens, {args.repeats} repeats per count, interleaved; "
        f"{host['cpus']} CPUs, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n"
    )
    print(
        table(
            rows,
            [
                ("workload", "workload"),
                ("threads", "threads"),
                ("median_s", "median s", "{:.3f}"),
                ("min_s", "fastest s", "{:.3f}"),
                ("vs_first", f"median / {counts[0]} thread(s)", "{:.2f}"),
            ],
        )
    )
    if args.json:
        write_json(
            {
                "host": host,
                "settings": vars(args),
                "rows": rows,
                "times": {f"{w}/{n}": t for (w, n), t in times.items()},
            },
            args.json,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
