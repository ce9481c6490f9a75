"""Serving load on loopback: N concurrent clients, each sending M streamed chat requests one
after another, against `neuron-moe serve` (started here on 127.0.0.1, or --url).

Metrics as vLLM's serving benchmark defines them: TTFT (request sent -> first content
chunk), ITL (gaps between content chunks), TPOT ((E2EL - TTFT) / (output tokens - 1)),
E2EL (request sent -> [DONE]) as mean/p50/p90/p99, plus request and output-token
throughput over the whole run, and errors (any non-200, error event, or missing [DONE]). Each
client sends one warm-up request first, which is not counted. GET /health is polled throughout
(every 0.1 s, in a thread of its own): its latency too.

The engine under test is `--backend`; with `--batch-size B [B ...]` (`--backend static`, the
batching engine) the same load runs against a server at each batch size in turn, and a table
puts the runs side by side, with each run's output tokens/s as a multiple of the last run's.

--hostile-bytes N runs the load twice on the same server, side by side: without, then with one
more client that sends an N-byte prompt again and again (a server that tokenizes on its event loop
freezes under it: a 10 MB prompt can hold the loop for seconds). It reports what that client got and
how /health and the normal clients' TTFT fared in each run.

The load: short chat prompts, greedy; `--sampled` samples them (temperature 0.7, top-p 0.9, each
request its own seed); `--long-every N` makes one request in N of each client a long prompt, its
chat prompt `--long-tokens` long (default: the longest the cache takes with max_tokens, past the
largest prefill bucket, so it is prefilled in chunks), and reports the short requests apart.
`--prefill-rows` and `--prefill-chunk` set the batching engine's prefill graphs (serve's flags).
Each run ends with a scrape of the server's /metrics (prefill and decode calls, and the rows in
them), and records `uptime` and the commit.

`--acceptance` runs the batching engine's acceptance comparison, the same 8-client load against each (`--backend
static`): the batched engine (batch 8, prefill graphs of 1 and 4 prompts, the port's prefill chunk
or `--prefill-chunk`) greedy, the same with one-prompt prefill only, batch 1 (each prompt in one
call: its fastest), the batched engine sampled, and the batched engine under the mixed load (one
long prompt in 8); then the table of its goals: tokens/s against batch 1, TTFT p99, and
the short requests' TPOT p99 under the mixed load against the batched run without it.

    python -m bench.serve_load --clients 8 --requests 64 --max-tokens 16 --json out.json
    python -m bench.serve_load --backend static --batch-size 8 1
    python -m bench.serve_load --clients 8 --requests 16 --hostile-bytes 10000000
    OMP_NUM_THREADS=1 python -m bench.serve_load --acceptance --requests 64 --json bench/results/serve-load-32.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

from bench.harness import command, machine, uptime
from neuron_moe.port import load_port
from neuron_moe.report import check_output, table, write_json
from neuron_moe.serve.chat import render_chat
from neuron_moe.tokenizer import load_tokenizer

# The long prompt: this text, cut to the number of tokens asked (with the chat template's own)
LONG_TEXT = (
    "Summarise the following passage in one sentence. The expedition left the harbour before dawn, "
    "crossed the strait under a grey sky, and reached the northern islands three days later, where the "
    "crew mapped the coast, counted the birds on the cliffs and wrote down every word the islanders "
    "taught them about the winds, the tides, the fish and the long winters of the far north. "
) * 8

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Mixture-of-Experts models route each token to",
    "Explain what a KV cache is in one sentence.",
    "Once upon a time, in a land far away,",
    "List three prime numbers.",
    "Translate 'good morning' into French.",
]


async def one_request(
    client: httpx.AsyncClient, body: dict, path: str = "/v1/chat/completions", require_done: bool = True
) -> dict:
    """One streamed request to `path` (chat or text completions: a chunk's content is `delta.content` or
    `text`): its timings and the text it streamed. A stream that ends without `[DONE]` is an error unless
    not `require_done` (a server that never sends it); one without usage always is."""
    start = time.perf_counter()
    chunk_times, usage, error, done, parts = [], None, None, False, []
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    error = f"error event: {event['error'].get('message')}"
                    break
                usage = event.get("usage") or usage
                content = "".join(c.get("delta", {}).get("content") or c.get("text") or "" for c in event["choices"])
                if content:
                    chunk_times.append(time.perf_counter())
                    parts.append(content)
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error or (require_done and not done) or usage is None:
        return {"error": error or "stream ended without [DONE] and usage"}
    n = usage["completion_tokens"]
    ttft = (chunk_times[0] if chunk_times else end) - start
    return {
        "ttft": ttft,
        "e2el": end - start,
        "output_tokens": n,
        "tpot": (end - start - ttft) / (n - 1) if n > 1 else None,
        "itl": list(np.diff(chunk_times)) if len(chunk_times) > 1 else [],
        "text": "".join(parts),
    }


def chat_body(args, content: str) -> tuple[str, dict]:
    """A streamed chat request of `content` as the load sends it: (path, body)."""
    return "/v1/chat/completions", {
        "model": args.served,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def long_prompt(model: str, tokens: int) -> str:
    """A user message whose chat prompt is `tokens` tokens long (the port's tokenizer and template)."""
    tokenizer = load_tokenizer(load_port(model), None)
    words = LONG_TEXT.split()
    for n in range(len(words), 0, -1):
        text = " ".join(words[:n])
        if len(render_chat(tokenizer, [{"role": "user", "content": text}])[0]) <= tokens:
            return text
    raise SystemExit(f"error: no prompt fits in {tokens} tokens")


def is_long(args, c: int, r: int) -> bool:
    """One request in `long_every` of each client, staggered across the clients."""
    return bool(args.long_every) and (c + r) % args.long_every == args.long_every - 1


async def run_load(url: str, args, request=chat_body, require_done: bool = True, prompts=PROMPTS, warmup=None):
    """`args.clients` clients, each sending `args.requests` requests one after another (after one warm-up
    request each, not counted); `request(args, prompt)` makes each one's (path, body). Client c's r-th
    request sends `prompts[(c * requests + r) % len(prompts)]`, its warm-up `warmup[c]` (default: the
    prompt of its first request). Each result names its prompt."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:

        async def client_loop(c: int, n: int, warm: bool = False) -> list[dict]:
            results = []
            for r in range(n):
                long = not warm and is_long(args, c, r)
                if long:
                    content = args.long_text
                else:
                    content = warmup[c] if warm and warmup else prompts[(c * args.requests + r) % len(prompts)]
                path, body = request(args, content)
                if args.sampled:
                    body.update(temperature=0.7, top_p=0.9, seed=1000 * c + r)
                results.append({**await one_request(client, body, path, require_done), "long": long, "prompt": content})
            return results

        # one request per client first, not counted: the server's first calls (allocations, lazy imports)
        await asyncio.gather(*(client_loop(c, 1, warm=True) for c in range(args.clients)))
        start = time.perf_counter()
        per_client = await asyncio.gather(*(client_loop(c, args.requests) for c in range(args.clients)))
        return [r for rs in per_client for r in rs], time.perf_counter() - start


def health_loop(url: str, stop: threading.Event, latencies: list, interval_s: float = 0.1) -> None:
    """GET /health every interval_s until stop; each latency, or None for a failure."""
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                ok = client.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - start if ok else None)
            stop.wait(interval_s)


def hostile_loop(url: str, model: str, n_bytes: int, interval_s: float, api_key: str | None, stop, answers) -> None:
    """One client sending an n_bytes prompt again and again until stop, each at least interval_s after
    the one before: (status or error, seconds) each, put on `answers`. Run in a process of its own
    (its sending is not this process's GIL), the body encoded once (its JSON work is not measured)."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "x" * n_bytes}], "max_tokens": 1}
    ).encode()
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                outcome = client.post("/v1/chat/completions", content=body).status_code
            except httpx.HTTPError as e:  # a server that refuses a body unread may close before it is all sent
                outcome = type(e).__name__
            answers.put((outcome, time.perf_counter() - start))
            stop.wait(max(0.0, interval_s - (time.perf_counter() - start)))


def run_phase(url: str, args, hostile_bytes: int) -> dict:
    """The load, /health polled beside it, and (hostile_bytes > 0) the hostile client."""
    spawn = multiprocessing.get_context("spawn")
    stop, hostile_stop, answers, latencies = threading.Event(), spawn.Event(), spawn.Queue(), []
    health = threading.Thread(target=health_loop, args=(url, stop, latencies), daemon=True)
    hostile = spawn.Process(
        target=hostile_loop,
        daemon=True,
        args=(url, args.served, hostile_bytes, args.hostile_interval, args.api_key, hostile_stop, answers),
    )
    if hostile_bytes:
        hostile.start()
        time.sleep(2.0)  # its interpreter started and its first request sent
    health.start()
    try:
        results, duration = asyncio.run(run_load(url, args))
    finally:
        stop.set()
        hostile_stop.set()
        health.join(600)
        answers_list = []
        if hostile_bytes:
            while hostile.is_alive() or not answers.empty():
                try:
                    answers_list.append(answers.get(timeout=1))
                except queue.Empty:
                    pass
            hostile.join(600)
    answers = answers_list
    summary = summarize(results, duration)
    if args.long_every:  # the short requests apart, and the long ones
        summary["short"] = summarize([r for r in results if not r.get("long")], duration)
        summary["long"] = summarize([r for r in results if r.get("long")], duration)
    ok = [x for x in latencies if x is not None]
    summary["health_ms"] = {**stats(ok), "max": 1000 * max(ok) if ok else None, "failed": len(latencies) - len(ok)}
    if hostile_bytes:
        outcomes: dict[str, int] = {}
        for outcome, _ in answers:
            outcomes[str(outcome)] = outcomes.get(str(outcome), 0) + 1
        summary["hostile"] = {
            "bytes": hostile_bytes,
            "interval_s": args.hostile_interval,
            "requests": len(answers),
            "rate_per_s": len(answers) / duration,
            "outcomes": outcomes,
            "seconds": stats([sec for _, sec in answers]),
        }
    return summary


def stats(values) -> dict:
    """mean/p50/p90/p99 in ms of seconds."""
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0}
    ms = np.array(values) * 1000
    return {
        "mean": float(ms.mean()),
        "p50": float(np.percentile(ms, 50)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
        "n": len(values),
    }


def summarize(results: list[dict], duration: float) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["output_tokens"] for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:10],
        "duration_s": duration,
        "request_throughput_per_s": len(ok) / duration,
        "output_tokens": tokens,
        "output_token_throughput_per_s": tokens / duration,
        "ttft_ms": stats([r["ttft"] for r in ok]),
        "tpot_ms": stats([r["tpot"] for r in ok]),
        "itl_ms": stats([x for r in ok for x in r["itl"]]),
        "e2el_ms": stats([r["e2el"] for r in ok]),
    }


def engine_counters(url: str) -> dict:
    """The batching engine's calls and rows, from the server's /metrics (empty for another engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = (
        "neuron_moe:prefill_calls_total",
        "neuron_moe:prefill_rows_total",
        "neuron_moe:decode_calls_total",
        "neuron_moe:decode_rows_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    )
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    found = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in wanted}
    if found.get("neuron_moe:prefill_calls_total"):
        found["prefill_rows_per_call"] = (
            found["neuron_moe:prefill_rows_total"] / found["neuron_moe:prefill_calls_total"]
        )
    if found.get("neuron_moe:decode_calls_total"):
        found["decode_rows_per_call"] = found["neuron_moe:decode_rows_total"] / found["neuron_moe:decode_calls_total"]
    return found


def start_server(args, batch_size: int | None, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`neuron-moe serve` on 127.0.0.1 with a free port, `extra` arguments last (a later option overrides
    an earlier one); returns once /health answers 200."""
    cmd = [
        sys.executable,
        "-m",
        "neuron_moe",
        "serve",
        "--model",
        args.model,
        "--backend",
        args.backend,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--max-queue",
        str(args.clients + bool(args.hostile_bytes)),
        *(["--batch-size", str(batch_size)] if batch_size else []),
        *(["--prefill-rows", *map(str, args.prefill_rows)] if args.prefill_rows else []),
        *(["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # stdout: access log
    deadline = time.monotonic() + 300
    for line in proc.stderr:  # uvicorn names the port it bound
        found = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
        if found:
            url = found.group(1)
            break
        if time.monotonic() > deadline:
            break
    else:
        raise SystemExit(f"the server exited ({proc.wait()}) before it was listening")
    # keep reading its log, so that a full pipe never stalls it; pass on all but the INFO lines
    threading.Thread(
        target=lambda: [sys.stderr.write(line) for line in proc.stderr if not line.startswith("INFO")], daemon=True
    ).start()
    wait_ready(proc, url, deadline)
    return proc, url


def wait_ready(proc: subprocess.Popen, url: str, deadline: float) -> None:
    """Until the server's /health answers 200; past `deadline` (time.monotonic) or once it exited, it
    is killed and the bench stops."""
    while httpx.get(f"{url}/health").status_code != 200:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit("the server did not become ready within 300 s")
        time.sleep(0.5)


def run_once(args, batch_size: int | None) -> dict:
    """The load against one server (started here, or --url), and again beside the hostile client
    with --hostile-bytes; the report of that run."""
    proc, url = (None, args.url) if args.url else start_server(args, batch_size)
    try:
        host = machine()
        summary = run_phase(url, args, 0)
        hostile = run_phase(url, args, args.hostile_bytes) if args.hostile_bytes else None
        host["load_average_after"], host["uptime_after"] = os.getloadavg(), uptime()
        counters = engine_counters(url)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    report = {
        "benchmark": "serve_load",
        "model": args.model,
        "backend": args.backend,
        "batch_size": batch_size,
        "prefill_rows": args.prefill_rows,
        "prefill_chunk": args.prefill_chunk,
        "sampled": args.sampled,
        "long_every": args.long_every,
        "long_prompt_tokens": args.long_tokens if args.long_every else None,
        "clients": args.clients,
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "machine": host,
        "engine": counters,
        **summary,
    }
    if hostile:
        report["with_hostile_client"] = hostile
    return report


def print_run(summary: dict) -> None:
    rows = [
        {"metric": name, **summary[key]}
        for name, key in (
            ("TTFT", "ttft_ms"),
            ("TPOT", "tpot_ms"),
            ("ITL", "itl_ms"),
            ("E2EL", "e2el_ms"),
            ("/health", "health_ms"),
        )
    ]
    print(
        table(
            rows,
            [
                ("metric", "ms"),
                ("mean", "mean", "{:.1f}"),
                ("p50", "p50", "{:.1f}"),
                ("p90", "p90", "{:.1f}"),
                ("p99", "p99", "{:.1f}"),
                ("n", "samples"),
            ],
        )
    )
    print(
        f"\nrequests: {summary['completed']}/{summary['requests']} completed, {summary['failed']} failed "
        f"in {summary['duration_s']:.1f} s; {summary['request_throughput_per_s']:.2f} req/s, "
        f"{summary['output_tokens']} output tokens, {summary['output_token_throughput_per_s']:.1f} tok/s; "
        f"/health max {summary['health_ms']['max']:.1f} ms, {summary['health_ms']['failed']} failed"
    )
    for error in summary["errors"]:
        print(f"  error: {error}")


def print_hostile_comparison(without: dict, hostile: dict) -> None:
    h = hostile["hostile"]
    pace = f"at most one per {h['interval_s']:g} s" if h["interval_s"] else "back to back"
    print(
        f"\nside by side: the same load without, then with one client sending a {h['bytes']:,}-byte prompt "
        f"again and again, {pace} ({h['requests']} times, {h['rate_per_s']:.1f}/s: {h['outcomes']}, "
        f"{h['seconds']['mean']:.0f} ms each on average)\n"
    )
    rows = [
        {
            "run": name,
            "ttft50": r["ttft_ms"]["p50"],
            "ttft99": r["ttft_ms"]["p99"],
            "ttft": r["ttft_ms"]["mean"],
            "h50": r["health_ms"]["p50"],
            "h99": r["health_ms"]["p99"],
            "hmax": r["health_ms"]["max"],
            "failed": r["failed"],
        }
        for name, r in (("without", without), ("with", hostile))
    ]
    rows.append(
        {
            "run": "with / without",
            "ttft50": hostile["ttft_ms"]["p50"] / without["ttft_ms"]["p50"],
            "ttft99": hostile["ttft_ms"]["p99"] / without["ttft_ms"]["p99"],
            "ttft": hostile["ttft_ms"]["mean"] / without["ttft_ms"]["mean"],
        }
    )
    print(
        table(
            rows,
            [
                ("run", "run"),
                ("ttft", "TTFT mean", "{:.2f}"),
                ("ttft50", "TTFT p50", "{:.2f}"),
                ("ttft99", "TTFT p99", "{:.2f}"),
                ("h50", "/health p50 ms", "{:.1f}"),
                ("h99", "/health p99 ms", "{:.1f}"),
                ("hmax", "/health max ms", "{:.1f}"),
                ("failed", "failed requests"),
            ],
        )
    )


def run_name(r: dict) -> str:
    name = f"batch {r['batch_size']}"
    if r.get("prefill_rows"):
        name += f", prefill {'/'.join(map(str, r['prefill_rows']))}"
    if r.get("sampled"):
        name += ", sampled"
    if r.get("prefill_chunk"):
        name += f", chunk {r['prefill_chunk']}"
    if r.get("long_every"):
        name += f", mixed (1 in {r['long_every']} long)"
    return name


def print_batch_comparison(reports: list[dict]) -> None:
    """The runs side by side; tokens/s also as a multiple of the batch-1 run's (else the last run's)."""
    base_run = next((r for r in reports if r["batch_size"] == 1), reports[-1])
    base = base_run["output_token_throughput_per_s"]
    runs = [run_name(r) for r in reports]

    def row(metric, value):
        return {"metric": metric, **{run: value(r) for run, r in zip(runs, reports)}}

    rows = [
        row("output tok/s", lambda r: f"{r['output_token_throughput_per_s']:.1f}"),
        row(f"  x {run_name(base_run)}", lambda r: f"{r['output_token_throughput_per_s'] / base:.2f}"),
        row("requests/s", lambda r: f"{r['request_throughput_per_s']:.2f}"),
    ]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("/health", "health_ms")):
        for stat in ("mean", "p50", "p99"):
            rows.append(
                row(f"{name} {stat} (ms)", lambda r: f"{r[key][stat]:.1f}" if r[key][stat] is not None else "-")
            )
    rows += [
        row("short TPOT p99 (ms)", lambda r: f"{r['short']['tpot_ms']['p99']:.1f}" if "short" in r else "-"),
        row("prefill rows / call", lambda r: f"{r['engine'].get('prefill_rows_per_call', 0):.2f}"),
        row("decode rows / call", lambda r: f"{r['engine'].get('decode_rows_per_call', 0):.2f}"),
        row("completed", lambda r: f"{r['completed']}/{r['requests']}"),
        row("failed", lambda r: str(r["failed"])),
        row("duration (s)", lambda r: f"{r['duration_s']:.1f}"),
        row(
            "load avg before/after",
            lambda r: f"{r['machine']['load_average'][0]:.1f} / {r['machine']['load_average_after'][0]:.1f}",
        ),
    ]
    print(table(rows, [("metric", "metric"), *[(run, run) for run in runs]]))


# the acceptance comparison: (name, overrides of the command line's settings), all --backend static;
# "largest": prefill chunks of the largest bucket (one call per prompt here: batch 1's fastest)
ACCEPTANCE = [
    ("batched", {"batch_size": 8, "prefill_rows": [1, 4]}),
    ("one-prompt prefill", {"batch_size": 8, "prefill_rows": [1]}),
    ("batch 1", {"batch_size": 1, "prefill_rows": [1], "prefill_chunk": "largest"}),
    ("batched, sampled", {"batch_size": 8, "prefill_rows": [1, 4], "sampled": True}),
    ("batched, mixed", {"batch_size": 8, "prefill_rows": [1, 4], "long_every": 8}),
]
TODAYS_TTFT_P99_MS = 340.5  # bench/results/serve-batching.md: batch 8, one-prompt prefill, idle machine


def acceptance(args) -> tuple[list[dict], dict]:
    spec = load_port(args.model).static
    reports = {}
    for name, overrides in ACCEPTANCE:
        run = argparse.Namespace(**{**vars(args), "long_every": 0, **overrides})
        run.prefill_chunk = spec.buckets[-1] if run.prefill_chunk == "largest" else (run.prefill_chunk or spec.chunk)
        print(f"== {name}: {', '.join(f'{k} {v}' for k, v in overrides.items())}", flush=True)
        reports[name] = run_once(run, run.batch_size)
    tps = {name: r["output_token_throughput_per_s"] for name, r in reports.items()}
    mixed, without = reports["batched, mixed"]["short"]["tpot_ms"]["p99"], reports["batched"]["tpot_ms"]["p99"]
    summary = {
        "greedy_tokens_per_s_x_batch_1": tps["batched"] / tps["batch 1"],
        "sampled_tokens_per_s_x_batch_1": tps["batched, sampled"] / tps["batch 1"],
        "one_prompt_prefill_tokens_per_s_x_batch_1": tps["one-prompt prefill"] / tps["batch 1"],
        "ttft_p99_ms": reports["batched"]["ttft_ms"]["p99"],
        "ttft_p99_ms_one_prompt_prefill": reports["one-prompt prefill"]["ttft_ms"]["p99"],
        "ttft_p99_ms_recorded_before": TODAYS_TTFT_P99_MS,
        "long_prompt_tokens": args.long_tokens,
        "mixed_short_tpot_p99_ms": mixed,
        "tpot_p99_ms_without_long": without,
        "mixed_short_tpot_p99_x_without": mixed / without,
    }
    return list(reports.values()), summary


def print_acceptance(summary: dict) -> None:
    rows = [
        {
            "what": "greedy output tok/s, batched / batch 1",
            "got": summary["greedy_tokens_per_s_x_batch_1"],
            "goal": ">= 4",
        },
        {
            "what": "  the same with one-prompt prefill",
            "got": summary["one_prompt_prefill_tokens_per_s_x_batch_1"],
            "goal": "",
        },
        {
            "what": "sampled output tok/s, batched / batch 1",
            "got": summary["sampled_tokens_per_s_x_batch_1"],
            "goal": "reported",
        },
        {
            "what": "TTFT p99 (ms), batched",
            "got": summary["ttft_p99_ms"],
            "goal": f"< {summary['ttft_p99_ms_recorded_before']:g} (recorded before)",
        },
        {
            "what": "TTFT p99 (ms), one-prompt prefill, this run",
            "got": summary["ttft_p99_ms_one_prompt_prefill"],
            "goal": "the same machine's",
        },
        {
            "what": "short requests' TPOT p99, mixed / without",
            "got": summary["mixed_short_tpot_p99_x_without"],
            "goal": "<= 1.5",
        },
    ]
    print(table(rows, [("what", "acceptance"), ("got", "this run", "{:.2f}"), ("goal", "goal")]))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked; the served name and the long prompt resolved from the port."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running server (default: start one on 127.0.0.1)")
    p.add_argument("--model", default="tiny-gemma4-moe", help="port to serve / model name to request")
    p.add_argument(
        "--backend",
        default="eager",
        help="engine under test: the backend of the server started here (static: the batching engine "
        "on CPU; an experts implementation: one request per thread) (default: eager)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        metavar="B",
        help="--backend static: run the load against a server at each batch size, one after another, "
        "and compare them (e.g. 8 1)",
    )
    p.add_argument("--api-key", default=os.environ.get("NEURON_MOE_API_KEY"))
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--requests", type=int, default=64, help="requests per client, one after another (default 64)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request (default 16)")
    p.add_argument(
        "--hostile-bytes",
        type=int,
        default=0,
        metavar="N",
        help="also run the load beside a client sending an N-byte prompt again and again (default: no)",
    )
    p.add_argument(
        "--hostile-interval",
        type=float,
        default=0.0,
        metavar="S",
        help="at least S seconds from one of its requests to the next (default 0: back to back)",
    )
    p.add_argument("--sampled", action="store_true", help="sample: temperature 0.7, top-p 0.9, a seed per request")
    p.add_argument(
        "--long-every",
        type=int,
        default=0,
        metavar="N",
        help="one request in N of each client is a long prompt (default 0: none)",
    )
    p.add_argument(
        "--long-tokens",
        type=int,
        metavar="T",
        help="the long prompt's length in tokens (default: the longest the port's cache takes with --max-tokens)",
    )
    p.add_argument(
        "--prefill-rows", type=int, nargs="+", metavar="P", help="serve --prefill-rows (default: the port's)"
    )
    p.add_argument("--prefill-chunk", type=int, metavar="N", help="serve --prefill-chunk (default: the port's)")
    p.add_argument(
        "--acceptance",
        action="store_true",
        help="the acceptance runs side by side (see the module docstring); --backend static",
    )
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON ('-' for stdout)")
    args = p.parse_args(argv)
    args.served = load_port(args.model).name  # --model may be a port file: the server serves its name
    if args.acceptance:
        if args.url or args.batch_size:
            p.error("--acceptance starts the servers it compares: no --url or --batch-size")
        args.backend = "static"
    if args.long_every or args.acceptance:
        spec = load_port(args.model).static_spec("--long-every / --acceptance (the long prompt is sized to its cache)")
        # a prompt of n tokens and max_tokens new ones take positions 0..n + max_tokens - 2
        args.long_tokens = args.long_tokens or spec.max_cache_len + 1 - args.max_tokens
        args.long_text = long_prompt(args.model, args.long_tokens)
    if args.batch_size and args.url:
        p.error("--batch-size starts the servers it compares: it cannot be used with --url")
    if args.batch_size and args.backend != "static":
        p.error("--batch-size is the batching engine's (--backend static)")
    return args


def print_report(args, report: dict) -> None:
    """One run's settings, machine and figures (and the short requests' apart, and the run beside the
    hostile client's)."""
    host = report["machine"]
    engine = args.backend + (f", batch {report['batch_size']}" if report["batch_size"] else "")
    print(
        f"serve_load  {args.model} ({engine}), {args.clients} clients x {args.requests} requests, "
        f"max_tokens {args.max_tokens}, streamed, {'sampled' if report['sampled'] else 'temperature 0'}, "
        f"loopback{'; mixed' if report['long_every'] else ''}"
    )
    print(
        f"machine: {host['cpu']}, {host['cores']} cores, load average {host['load_average'][0]:.1f} before / "
        f"{host['load_average_after'][0]:.1f} after, OMP_NUM_THREADS={host['OMP_NUM_THREADS']}\n"
    )
    print_run(report)
    if "short" in report:
        print("\nthe short requests alone:\n")
        print_run({**report["short"], "health_ms": report["health_ms"]})
    hostile = report.get("with_hostile_client")
    if hostile:
        print(f"\nwith the {args.hostile_bytes:,}-byte client:\n")
        print_run(hostile)
        print_hostile_comparison(report, hostile)
    print()


def main(argv=None) -> int:
    args = parse_args(argv)
    check_output(args.json or "-")

    summary = None
    if args.acceptance:
        reports, summary = acceptance(args)
    else:
        reports = [run_once(args, batch_size) for batch_size in (args.batch_size or [None])]
    failed = sum(r["failed"] + r.get("with_hostile_client", {}).get("failed", 0) for r in reports)
    if args.json:
        doc = reports[0] if len(reports) == 1 else {"benchmark": "serve_load", "runs": reports}
        if summary is not None:
            doc = {**doc, "command": command("bench.serve_load", sys.argv[1:]), "acceptance": summary}
        write_json(doc, args.json)
    if args.json == "-":
        return 0 if failed == 0 else 1
    for report in reports:
        print_report(args, report)
    if len(reports) > 1:
        print_batch_comparison(reports)
    if summary is not None:
        print()
        print_acceptance(summary)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
