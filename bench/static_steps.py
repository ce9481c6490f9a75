"""What the static graphs cost per call on the host it runs on, the ceiling of the batching engine.

The batching engine (`serve/engine.py`) spends its time in two calls of the runtime: a prefill
of up to R prompts (the largest of `--prefill-rows`) and a decode step of every row. This times
both at each batch size on the port's static graphs as the server runs them (`serve --backend
static`: `static_runtime` on CPU, greedy rows: the sampler runs in every graph call), run a module
at a time (`--no-compile`) and compiled by torch.compile (inductor, serve's default) side by side,
the two taking turns call by call; the first call of each compiled graph compiles it, or loads it
from the compile cache when a run before compiled the same graph. From the step times, the
throughput ratio a perfect engine would reach for requests of `--max-tokens` tokens
against batch 1:

    ratio = B · (P_1 + (n−1)·D_1) / ((B/R)·P_R + (n−1)·D_B)

(every request: its share of a prefill call of R prompts, P_R, then n−1 decode steps; at batch B
the steps are shared by B rows; at batch 1, R = 1).
`bench/serve_load.py` measures what the server reaches through HTTP; this says what the graphs allow.

`--prefill-buckets`: instead, the prefill of R full chunks at each of those buckets with each of
`--prefill-experts`, and, at the batch size, the step graph (those R chunks and a decode of every row
in one call: `decoder.Step`) against the two calls it replaces (prefill, then decode).

    OMP_NUM_THREADS=1 python -m bench.static_steps --batch-sizes 1,8 --max-tokens 16 --prefill-rows 4
    OMP_NUM_THREADS=1 python -m bench.static_steps --batch-sizes 8 --prefill-buckets 8,24,56 \
        --prefill-experts dense_masked,selective --graphs modules

The decode step runs the decode graph of the smallest KV length above every row's position
(`--decode-lengths`, NxDI's token-generation buckets; `--kv-positions` in use); `--whole-cache`
times beside it the one decode graph of the whole cache (`--max-cache-len` positions), as a port
without decode lengths runs every step.

    OMP_NUM_THREADS=1 python -m bench.static_steps --batch-sizes 1,8 --max-tokens 16 --prefill-rows 4
    OMP_NUM_THREADS=1 python -m bench.static_steps --batch-sizes 8 --graphs compiled --max-cache-len 512 \
        --decode-lengths 64 --kv-positions 64 --whole-cache
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from dataclasses import replace

import torch

from neuron_moe.model import build_model
from neuron_moe.port import GRAPH_EXPERTS, load_port, with_shapes
from neuron_moe.report import table, write_json
from neuron_moe.run_config import Shapes
from neuron_moe.static.runtime import static_runtime
from neuron_moe.spec import COMPILE_CACHE, compile_cache
from neuron_moe.static import inductor
from neuron_moe.static.rows import Chunk
from neuron_moe.static.sampling import GREEDY

MODULE_GRAPHS, COMPILED_GRAPHS = "modules", "compiled"
GRAPHS = (MODULE_GRAPHS, COMPILED_GRAPHS)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def best_ms(calls: dict, repeats: int, clock=time.perf_counter) -> dict:
    """The fastest of `repeats` calls of each of `calls` (name -> call), in ms (the least disturbed by
    anything else on the machine); the calls take turns, so a burst of load falls on all of them alike.
    `clock`: wall time, or this thread's CPU time (`time.thread_time`: one-thread graphs on a machine
    shared with other work, whose turns on the cores it leaves out)."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = clock()
            call()
            times[name].append(clock() - start)
    return {name: 1e3 * min(t) for name, t in times.items()}


def first_call_s(call) -> float:
    """Seconds of a graph's first call: compiling it (or loading it from the compile cache), or none."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


COLUMNS = [
    ("graphs", "graphs"),
    ("batch", "batch"),
    ("prefill_rows", "prompts per prefill"),
    ("decode_length", "decode KV length"),
    ("prefill_first_s", "prefill 1st call s", "{:.1f}"),
    ("decode_first_s", "decode 1st call s", "{:.1f}"),
    ("prefill_ms", "prefill ms", "{:.2f}"),
    ("prefill_ms_per_prompt", "prefill ms/prompt", "{:.2f}"),
    ("decode_ms", "decode step ms", "{:.2f}"),
    ("decode_ms_per_token", "decode ms/token", "{:.2f}"),
    ("speedup", "step speed-up vs modules", "{:.2f}"),
    ("decode_x_base", "step × base", "{:.2f}"),
    ("ceiling_x_base", "tok/s ceiling × base", "{:.2f}"),
]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-gemma4-moe", help="port with a [static] table (default tiny-gemma4-moe)")
    ap.add_argument("--batch-sizes", default="1,8", help="comma-separated; the first is the baseline (default 1,8)")
    ap.add_argument(
        "--prompt-tokens", type=int, default=25, help="prompt length (default 25: the chat prompts' middle)"
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per request for the ratio (default 16)")
    ap.add_argument("--prefill-rows", type=int, default=4, help="prompts a prefill call takes at batch > 1 (default 4)")
    ap.add_argument("--max-cache-len", type=int, help="the KV cache's positions (default: the port's)")
    ap.add_argument(
        "--decode-lengths",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        help="the decode graphs' KV lengths below --max-cache-len, comma-separated (default: the port's)",
    )
    ap.add_argument(
        "--kv-positions", type=int, help="positions in use at the timed decode step (default: --prompt-tokens + 1)"
    )
    ap.add_argument(
        "--whole-cache",
        action="store_true",
        help="also time the one decode graph of the whole cache (no decode lengths), in turns with the others",
    )
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument(
        "--graphs",
        choices=("both", *GRAPHS),
        default="both",
        help="modules (run a module at a time: serve --no-compile), compiled (torch.compile, inductor: "
        "serve's default) or both, timed in turns (default both)",
    )
    ap.add_argument(
        "--compile-cache",
        metavar="DIR",
        help=f"inductor's cache (default: $TORCHINDUCTOR_CACHE_DIR, else {COMPILE_CACHE}); a second run over "
        "the same cache times loading the compiled graphs instead of compiling them",
    )
    ap.add_argument(
        "--prefill-buckets", help="comma-separated: time the prefill and the step graph at these buckets instead"
    )
    ap.add_argument(
        "--prefill-experts",
        default="dense_masked",
        help=f"comma-separated, with --prefill-buckets: the prefill's experts, of {', '.join(GRAPH_EXPERTS)}",
    )
    ap.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="with --prefill-buckets: wall time, or the thread's CPU time (a shared machine; one thread)",
    )
    ap.add_argument("--json", metavar="FILE")
    return ap.parse_args()


PREFILL_COLUMNS = [
    ("graphs", "graphs"),
    ("experts", "prefill experts"),
    ("batch", "batch"),
    ("bucket", "bucket"),
    ("prefill_rows", "chunks per call"),
    ("prefill_ms", "prefill ms", "{:.2f}"),
    ("prefill_ms_per_chunk", "prefill ms/chunk", "{:.2f}"),
    ("decode_ms", "decode ms", "{:.2f}"),
    ("two_calls_ms", "prefill + decode ms", "{:.2f}"),
    ("step_ms", "step ms (one call)", "{:.2f}"),
]


def prefill_rows(model, spec, graphs, batch: int, bucket: int, experts: str, args) -> list[dict]:
    """At one batch size and bucket: R full chunks prefilled, a decode step, and the step graph doing
    both in one call, each kind of graphs timed in turns (the best of `repeats`)."""
    together = min(args.prefill_rows, batch)
    chunks = [Chunk(list(range(5, 5 + bucket)), 0, row, GREEDY) for row in range(together)]
    ids, positions = torch.full((batch, 1), 7), torch.full((batch, 1), bucket)
    sampling = torch.tensor([GREEDY] * batch)
    tables = {name: replace(spec, buckets=(bucket,), prefill_experts=experts) for name in graphs}  # that bucket only
    runtimes = {
        name: static_runtime(model, tables[name], batch, prefill_rows=(together,), compile=name == COMPILED_GRAPHS)
        for name in graphs
    }
    calls = {
        "prefill": lambda r: r.prefill(chunks),
        "decode": lambda r: r.decode(ids, positions, sampling),
        "step": lambda r: r.step(chunks, ids, positions, sampling),
    }
    for r in runtimes.values():  # the first calls: compiling, or loading from the compile cache
        for call in calls.values():
            call(r)
    best = {
        (name, what): ms
        for what, call in calls.items()
        for name, ms in best_ms(
            {n: (lambda r=r, call=call: call(r)) for n, r in runtimes.items()}, args.repeats, CLOCKS[args.clock]
        ).items()
    }
    return [
        {
            "graphs": name,
            "experts": experts,
            "batch": batch,
            "bucket": bucket,
            "prefill_rows": together,
            "prefill_ms": best[name, "prefill"],
            "prefill_ms_per_chunk": best[name, "prefill"] / together,
            "decode_ms": best[name, "decode"],
            "two_calls_ms": best[name, "prefill"] + best[name, "decode"],
            "step_ms": best[name, "step"],
        }
        for name in graphs
    ]


def positions_in_use(args) -> int:
    """The KV positions in use at the timed decode step: its rows sit at the position before."""
    return args.kv_positions or args.prompt_tokens + 1


def batch_rows(model, spec, graphs, batch: int, args) -> list[dict]:
    """At one batch size, each kind of graphs' first calls and best prefill and decode step, timed in turns."""
    together = min(args.prefill_rows, batch)
    chunks = [Chunk(list(range(5, 5 + args.prompt_tokens)), 0, row, GREEDY) for row in range(together)]
    ids = torch.full((batch, 1), 7)
    positions = torch.full((batch, 1), positions_in_use(args) - 1)
    sampling = torch.tensor([GREEDY] * batch)
    specs = [spec] + ([dataclasses.replace(spec, decode_lengths=())] if args.whole_cache else [])
    runtimes = {
        (name, i): static_runtime(model, s, batch, prefill_rows=(1, together), compile=name == COMPILED_GRAPHS)
        for name in graphs
        for i, s in enumerate(specs)
    }
    first = {
        name: (first_call_s(lambda: r.prefill(chunks)), first_call_s(lambda: r.decode(ids, positions, sampling)))
        for name, r in runtimes.items()
    }
    prefill = best_ms({name: (lambda r=r: r.prefill(chunks)) for name, r in runtimes.items()}, args.repeats)
    decode = best_ms(
        {name: (lambda r=r: r.decode(ids, positions, sampling)) for name, r in runtimes.items()}, args.repeats
    )
    return [
        {
            "graphs": key[0],
            "batch": batch,
            "prefill_rows": together,
            "decode_length": r.decode_length(positions),
            "prefill_first_s": first[key][0],
            "decode_first_s": first[key][1],
            "prefill_ms": prefill[key],
            "decode_ms": decode[key],
        }
        for key, r in runtimes.items()
    ]


def add_ratios(rows: list[dict], n: int) -> None:
    """Each row's per-prompt and per-token figures, and its ratios to the first batch size's row of the same
    graphs (the ceiling for `n`-token requests) and to the modules' at its batch."""
    for r in rows:
        same = [b for b in rows if b["decode_length"] == r["decode_length"]]
        base = next(b for b in same if b["graphs"] == r["graphs"])  # the first batch size, the same graphs
        modules = next((m for m in same if m["graphs"] == MODULE_GRAPHS and m["batch"] == r["batch"]), None)
        r["prefill_ms_per_prompt"] = r["prefill_ms"] / r["prefill_rows"]
        r["decode_ms_per_token"] = r["decode_ms"] / r["batch"]
        r["decode_x_base"] = r["decode_ms"] / base["decode_ms"]
        r["speedup"] = modules["decode_ms"] / r["decode_ms"] if modules else None
        alone = base["prefill_ms"] / base["prefill_rows"] + (n - 1) * base["decode_ms"] / base["batch"]
        r["ceiling_x_base"] = r["batch"] * alone / (r["batch"] * r["prefill_ms_per_prompt"] + (n - 1) * r["decode_ms"])


def machine_line(graphs) -> str:
    return (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, threads {torch.get_num_threads()}"
        + (f", compile cache {os.environ[inductor.CACHE_ENV]}" if COMPILED_GRAPHS in graphs else "")
    )


def main() -> int:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    graphs = GRAPHS if args.graphs == "both" else (args.graphs,)
    if COMPILED_GRAPHS in graphs:
        inductor.require_compiler("--graphs modules")
        inductor.use_cache_dir(compile_cache(args.compile_cache))
    shapes = Shapes(max_cache_len=args.max_cache_len, decode_lengths=args.decode_lengths)
    port = with_shapes(load_port(args.model), shapes)
    spec = port.static_spec("bench/static_steps.py")
    model = build_model(port, spec.decode_experts)
    if args.prefill_buckets:
        rows = [
            row
            for batch in args.batch_sizes.split(",")
            for bucket in args.prefill_buckets.split(",")
            for experts in args.prefill_experts.split(",")
            for row in prefill_rows(model, spec, graphs, int(batch), int(bucket), experts, args)
        ]
        columns = PREFILL_COLUMNS
        title = f"prefill and step at buckets {args.prefill_buckets}; best of {args.repeats}, {args.clock} time"
    else:
        rows = [
            row for batch in args.batch_sizes.split(",") for row in batch_rows(model, spec, graphs, int(batch), args)
        ]
        add_ratios(rows, args.max_tokens)
        columns = COLUMNS
        title = (
            f"(prefill: {spec.prefill_experts}, decode: {spec.decode_experts}), prompt {args.prompt_tokens} tokens, "
            f"{args.max_tokens}-token requests, decode at {positions_in_use(args)} positions in use of "
            f"{spec.max_cache_len}; best of {args.repeats}, the graphs timed in turns"
        )
    print(f"static graphs of {port.name} {title}")
    print(machine_line(graphs) + "\n")
    print(table(rows, columns))
    if args.json:
        write_json({"model": port.name, "settings": vars(args), "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
