"""The batching engine's own cost per step, over a stand-in for the graphs.

The server's step loop (`serve/engine.py` `Engine`, one `static.rows.Rows.step` per turn)
drives a `GraphRuntime` whose two graph callables are stand-ins: they return their tokens at once
(`--step-ms 0`) or after a fixed sleep, which releases the GIL as a real graph call does (a CPU
graph's ops, a Neuron call). The runtime around them is the real one, so building each call's inputs
and taking its outputs is counted as the engine's. The requests are the server's own: each is
streamed through a `scheduler.Job` whose events an asyncio loop in another thread reads (as the
HTTP handlers do), with a `metrics.Metrics` observing every token, and the tiny port's tokenizer
(byte-level BPE) decodes the text, so detokenizing, stop strings and held-back text are the real
work. The stand-in's tokens spell a fixed text (accented letters and emoji among them, so characters
arrive in pieces), each row at its own place in it; the requests carry stop strings that never
occur, and half of them are sampled (a seeded draw per token, the graphs' sampling input).

Each graph call is timed on entry and exit (`time.perf_counter`). A decode step's wall time is the
time from one decode call's entry to the next's; the engine's cost per decode step is that time less
the time inside the call, over the steps with every row generating and no prefill between them; the
engine's cost per prefill is the same for a step with a prefill call, less the median decode-only
cost. At `--step-ms 0` the engine's cost is all of its host work per step; at `--step-ms 5` it is
what host work adds to a 5 ms graph call (work beside the call costs nothing). Medians and p90s.

`--graphs` runs the same load over the tiny port's own static graphs on CPU (`serve --backend static`'s
runtime at batch `--rows`, each request's max_tokens cut to a third so that it fits the 96-position
cache): the graph calls hold the GIL between their ops, so the text thread's work there competes
with them, and the decode step's wall time is the figure to read (against `bench/static_steps.py`'s
graph alone).

`--compare REF` runs the same load, alternately, on the engine of git revision REF (its `neuron_moe`
exported to a temporary folder) and on the working tree's, `--rounds` times each, all in one run so
the machine's load falls on both alike, and prints them side by side.

    python -m bench.engine_overhead --step-ms 0 5
    python -m bench.engine_overhead --step-ms 0 5 --compare main --json bench/results/engine-overhead.json
    python -m bench.engine_overhead --graphs --compare main
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = (
    "The expedition left the harbour before dawn, crossed the strait under a grey sky, and reached the "
    "northern islands three days later. Café owners in Zürich charged 4,50 € for a crème brûlée 🍮, "
    "and the crew wrote down every word the islanders taught them about the winds, the tides 🌊, the "
    "fish and the long winters of the far north — naïve questions, patient answers. "
) * 4
STOPS = ("\n\nUser:", "###")  # never in TEXT: looked for after every token
PROMPT_LENGTHS = [14, 33, 21, 60, 9, 47, 28, 17]  # 60: past the largest bucket, prefilled in two chunks
MAX_TOKENS = [96, 64, 112, 80, 72, 104, 88, 120]


def stand_in(rows: int, step_ms: float, text, calls: list, generating):
    """A `GraphRuntime` whose graph callables return their tokens at once, or after `step_ms` of sleep
    (which releases the GIL as a real graph call does): the fixed text's next token for each row, each
    row at its own place in it. Each call is recorded on `calls` as (graph, entry, exit, rows generating)."""
    import torch

    from neuron_moe.run_config import Shapes
    from neuron_moe.static.rows import GraphRuntime

    sleep = step_ms / 1000

    def prefill(ids, mask, positions, row_ids, sampling):
        start = time.perf_counter()
        out = text[(positions[:, -1] + 1 + 97 * row_ids) % len(text)][:, None]
        if sleep:
            time.sleep(sleep)
        calls.append(("prefill", start, time.perf_counter(), 0))
        return (out,)

    def decode(ids, positions, sampling):
        start = time.perf_counter()
        out = text[(positions[:, 0] + 1 + 97 * torch.arange(rows)) % len(text)][:, None]
        now = generating()
        if sleep:
            time.sleep(sleep)
        calls.append(("decode", start, time.perf_counter(), now))
        return (out,)

    return GraphRuntime(prefill, decode, Shapes(rows, 512, (8, 56), (1, 4), 56), candidates=256)


def tiny_graphs(rows: int, calls: list, generating):
    """The tiny port's own static graphs on CPU (`serve --backend static`'s runtime at batch `rows`), each
    call recorded on `calls` as the stand-in's are."""
    import torch

    from neuron_moe.model import build_model
    from neuron_moe.port import load_port
    from neuron_moe.static.runtime import static_runtime

    def timed(graph, call):
        def run(*inputs):
            start = time.perf_counter()
            now = generating() if graph == "decode" else 0
            out = call(*inputs)
            calls.append((graph, start, time.perf_counter(), now))
            return out

        return run

    port = load_port("tiny-gemma4-moe")
    runtime = static_runtime(build_model(port, port.static.decode_experts, torch.float32), port.static, rows)
    runtime._prefill = timed("prefill", runtime._prefill)
    runtime._decode.update({n: timed("decode", graph) for n, graph in runtime._decode.items()})  # each decode length
    return runtime


def workload(engine, corpus: list[int], requests: int, graphs: bool) -> list[tuple]:
    """The requests, (prompt, SamplingParams) each: prompts cut from the text, half of them sampled, stop
    strings that never occur."""
    from neuron_moe.serve.decoding import SamplingParams

    work = []
    for i in range(requests):
        prompt = corpus[7 * i : 7 * i + PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]]
        budget = MAX_TOKENS[i % len(MAX_TOKENS)]
        if graphs:  # the tiny port's cache holds 96 positions
            budget = min(budget // 3, engine.max_tokens_for(len(prompt), None))
        sampled = i % 2 == 0
        params = SamplingParams(budget, temperature=0.8 if sampled else 0.0, top_p=0.95, seed=1000 + i, stop=STOPS)
        work.append((prompt, params))
    return work


def serve(engine, work: list[tuple]) -> tuple[list[int], float]:
    """Every request streamed through a `scheduler.Job` read by an asyncio loop in another thread, as
    the HTTP handlers do -> the events each request got, and the wall time of them all."""
    from neuron_moe.serve.scheduler import Job

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-event-loop", daemon=True)
    thread.start()

    async def stream(job) -> int:
        return sum([1 async for item in job.events() if item is not None])

    async def all_jobs() -> list[int]:
        jobs = []
        for prompt, params in work:
            job = Job(loop, engine.metrics, len(prompt))
            engine.submit(prompt, params, job)
            jobs.append(stream(job))
        return await asyncio.gather(*jobs)

    started = time.perf_counter()
    try:
        events = asyncio.run_coroutine_threadsafe(all_jobs(), loop).result(timeout=600)
    finally:
        wall = time.perf_counter() - started
        engine.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    return events, wall


def engine_costs(calls: list, rows: int) -> dict[str, list[float]]:
    """From the timed graph calls: the engine's cost per decode step (the time from one decode call's entry
    to the next's, less the time inside calls) over the steps with every row generating, that step's wall
    time, and the cost of a step with a prefill call less the median decode-only cost (ms)."""
    decode_ms, decode_wall_ms, prefill_ms = [], [], []
    decodes = [i for i, c in enumerate(calls) if c[0] == "decode"]
    for a, b in zip(decodes, decodes[1:]):
        if calls[a][3] != rows:
            continue
        period = calls[b][1] - calls[a][1]
        inside = sum(calls[i][2] - calls[i][1] for i in range(a, b))
        (decode_ms if b == a + 1 else prefill_ms).append(1e3 * (period - inside))
        if b == a + 1:
            decode_wall_ms.append(1e3 * period)
    base = median(decode_ms)
    return {"decode_ms": decode_ms, "decode_wall_ms": decode_wall_ms, "prefill_ms": [ms - base for ms in prefill_ms]}


def measure(rows: int, step_ms: float, requests: int, port_dir: Path, graphs: bool = False) -> dict:
    """One run of the load on the `neuron_moe` this process imports -> the samples (ms) and the
    run's totals. `graphs`: the tiny port's own static graphs on CPU instead of the stand-in."""
    import torch

    from neuron_moe.serve.engine import Engine
    from neuron_moe.serve.metrics import Metrics
    from neuron_moe.tokenizer import HFTokenizer

    torch.set_num_threads(1)
    tokenizer = HFTokenizer(port_dir)
    corpus = tokenizer.encode(TEXT, add_special_tokens=False)
    calls: list[tuple[str, float, float, int]] = []  # (graph, entry, exit, rows generating)
    engine = None

    def generating() -> int:
        return len(engine.batch.generating())

    if graphs:  # the real graphs, timed as the stand-in's calls are
        runtime = tiny_graphs(rows, calls, generating)
    else:
        runtime = stand_in(rows, step_ms, torch.tensor(corpus), calls, generating)
    engine = Engine(runtime, tokenizer, set() if graphs else {tokenizer.eos_token_id})  # every request runs out
    engine.metrics = Metrics("stand-in")
    work = workload(engine, corpus, requests, graphs)
    events, wall = serve(engine, work)
    assert sum(events) == sum(params.max_tokens for _, params in work), "a request fell short"
    tokens = sum(events)
    return {
        **engine_costs(calls, rows),
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "neuron_moe": str(Path(sys.modules["neuron_moe"].__file__).parent),
    }


def median(xs: list[float]) -> float:
    return quantile(xs, 0.5)


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def export(ref: str, dest: Path) -> str:
    """`neuron_moe` of git revision `ref` into `dest` -> its commit."""
    commit = subprocess.check_output(["git", "rev-parse", "--short", ref], cwd=ROOT, text=True).strip()
    archive = dest / "src.tar"
    subprocess.run(["git", "archive", "-o", str(archive), commit, "neuron_moe"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return commit


def child(source: Path, args, step_ms: float) -> dict:
    """`measure` in a fresh process that imports `neuron_moe` from `source`."""
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, __file__, "--child", "--rows", str(args.rows), "--requests", str(args.requests)]
    argv += ["--step-ms", str(step_ms), "--port-dir", str(args.port_dir)] + ["--graphs"] * args.graphs
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


FIGURES = [
    ("decode_ms", "engine cost per decode step"),
    ("decode_wall_ms", "decode step wall time"),
    ("prefill_ms", "engine cost per prefill step"),
]


def summary(runs: list[dict]) -> dict:
    """The runs' samples pooled -> median and p90 of each figure (ms), and tokens/s."""
    out = {}
    for key, _ in FIGURES:
        samples = [x for run in runs for x in run[key]]
        out[key] = {"median": median(samples), "p90": quantile(samples, 0.9), "n": len(samples)}
    out["tokens_per_s"] = median([run["tokens_per_s"] for run in runs])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8, help="the stand-in graphs' batch (default 8)")
    ap.add_argument("--requests", type=int, default=24, help="streamed requests per run (default 24)")
    ap.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 5.0], help="stand-in call time (default 0 5)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per engine and step time (default 3)")
    ap.add_argument("--compare", metavar="REF", help="also the engine of this git revision, side by side")
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="the tiny port's static graphs on CPU instead of the stand-in (--step-ms 0)",
    )
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--port-dir", type=Path, default=ROOT / "ports" / "tiny-gemma4-moe", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.rows, args.step_ms[0], args.requests, args.port_dir, args.graphs)))
        return

    from neuron_moe.report import table, write_json

    if args.graphs:
        args.step_ms = [0.0]

    def label(ms: float) -> str:
        return "the tiny port's graphs" if args.graphs else f"step {ms:g} ms"

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"now": ROOT}
        commits = {"now": subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()}
        if args.compare:
            commits["ref"] = export(args.compare, Path(tmp))
            sides = {"ref": Path(tmp), "now": ROOT}
        runs = {(side, ms): [] for side in sides for ms in args.step_ms}
        for _ in range(args.rounds):
            for ms in args.step_ms:
                for side, source in sides.items():
                    runs[side, ms].append(child(source, args, ms))
    load_after = os.getloadavg()
    results = {key: summary(value) for key, value in runs.items()}

    rows = []
    for ms in args.step_ms:
        for key, name in FIGURES:
            row = {"figure": f"{name} (ms), {label(ms)}"}
            for side in sides:
                row[f"{side} p50"] = results[side, ms][key]["median"]
                row[f"{side} p90"] = results[side, ms][key]["p90"]
                row[f"{side} n"] = results[side, ms][key]["n"]
            rows.append(row)
        row = {"figure": f"output tokens/s, {label(ms)}"}
        for side in sides:
            row[f"{side} p50"] = results[side, ms]["tokens_per_s"]
        rows.append(row)
    label = {"ref": f"{args.compare} ({commits.get('ref')})", "now": f"working tree ({commits['now']})"}
    columns = [("figure", "figure")]
    for side in sides:
        columns += [(f"{side} p50", f"{label[side]} p50"), (f"{side} p90", "p90"), (f"{side} n", "n")]
    print(table(rows, columns))
    print(
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; {platform.node()}, {os.cpu_count()} CPUs"
    )
    if args.json:
        write_json(
            {
                "settings": {k: v for k, v in vars(args).items() if k not in ("port_dir", "child", "json")},
                "commits": commits,
                "load_average": [load_before, load_after],
                "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
                "results": {f"{side} {ms:g}": value for (side, ms), value in results.items()},
            },
            args.json,
        )


if __name__ == "__main__":
    main()
