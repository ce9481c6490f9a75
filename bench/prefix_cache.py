"""Prefix caching, side by side: the same load against `neuron-moe serve --backend static` without
prefix caching and with it, one server after the other in one run, and a table of the two.

The server: the embedded model (`--model`, default the tiny port) with its [static] max_cache_len
raised to `--seq-len` (default 512; the port file is copied into a temporary folder with that one
field changed, its checkpoint path made absolute; `--buckets` changes the prefill buckets too) at
`--batch-size` rows. The load: `--clients`
clients at once, each sending `--requests` streamed /v1/completions one after another, greedy,
`--max-tokens` each; every prompt is token ids: one shared prefix of `--prefix-tokens` tokens
(BOS, then random ids) and a suffix of `--suffix-tokens` random ids of its own. Before the load,
one request of the prefix and a suffix of its own (not counted), in both runs: with caching, the
load then finds the prefix held. TTFT is request sent -> the first streamed chunk. Each client sends
its next request when its last ended; `--bursts`: in rounds, every client's next request at once
when all of the round's have ended (a burst of requests sharing a system prompt).

Reported per run: TTFT mean/p50/p90/p99, E2EL p50, and from /metrics the prefix-cache queries and
hits over the load (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`, tokens) beside the hits
the load makes (every request takes the prefix's whole blocks: floor(prefix / 16) * 16 tokens,
the suffixes differing from their first token); then whether both runs' outputs are identical, and
the TTFT p50 ratio. Timings are noisy on a shared machine: `uptime` is recorded with them.

    python -m bench.prefix_cache --json bench/results/prefix-cache-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.harness import machine
from bench.serve_load import stats, wait_ready
from neuron_moe.port import load_port
from neuron_moe.report import atomic_write
from neuron_moe.static.prefix import BLOCK

MODES = {"without prefix caching": "--no-enable-prefix-caching", "with prefix caching": "--enable-prefix-caching"}


def port_file(model: str, seq_len: int, buckets: list[int] | None, folder: Path) -> Path:
    """The port's file with [static] max_cache_len = seq_len (and buckets, if given), in `folder` (its
    checkpoint path absolute)."""
    port = load_port(model)
    text = port.path.read_text()
    if port.checkpoint is not None:
        rel = port.raw["weights"]["checkpoint"]
        text = text.replace(f'checkpoint = "{rel}"', f'checkpoint = "{port.checkpoint}"')
    changes = {"max_cache_len": str(seq_len)} | ({"buckets": str(sorted(buckets))} if buckets else {})
    for key, value in changes.items():
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        if n != 1:
            raise SystemExit(f"{port.path}: no single [static] {key} line to change")
    path = folder / f"{port.name}-{seq_len}.toml"
    path.write_text(text)
    return path


def start_server(port: Path, flag: str, batch_size: int, clients: int) -> tuple[subprocess.Popen, str]:
    """`neuron-moe serve` on 127.0.0.1, a free port; returns once /health answers 200."""
    cmd = [sys.executable, "-m", "neuron_moe", "serve", "--model", str(port), "--backend", "static"]
    cmd += ["--batch-size", str(batch_size), "--max-queue", str(clients), "--port", "0", flag]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = None
    for line in proc.stderr:
        if found := re.search(r"running on (http://127\.0\.0\.1:\d+)", line):
            url = found.group(1)
            break
    if url is None:
        raise SystemExit(f"the server exited ({proc.wait()}) before it was listening")
    proc.log = collections.deque(maxlen=40)  # its last lines, shown if the run fails
    threading.Thread(target=lambda: [proc.log.append(line) for line in proc.stderr], daemon=True).start()
    wait_ready(proc, url, time.monotonic() + 300)
    return proc, url


async def one_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": client.headers["x-model"],
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    start, first, text = time.perf_counter(), None, []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise SystemExit(f"error event: {event['error']}")
            if event.get("choices"):
                first = first or time.perf_counter()
                text.append(event["choices"][0].get("text", ""))
    end = time.perf_counter()
    return {"ttft": first - start, "e2el": end - start, "text": "".join(text)}


def prefix_counters(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
                found[sample.name.split("_")[-2]] = sample.value
    return found


def run(url: str, model: str, prompts: list[list[list[int]]], warm: list[int], args) -> dict:
    max_tokens = args.max_tokens

    async def client_loop(http, mine):
        return [await one_request(http, prompt, max_tokens) for prompt in mine]

    async def bursts(http):  # round r: every client's r-th request at once, the next round when all ended
        rounds = [
            await asyncio.gather(*(one_request(http, mine[r], max_tokens) for mine in prompts))
            for r in range(len(prompts[0]))
        ]
        return [list(mine) for mine in zip(*rounds)]

    async def load():
        async with httpx.AsyncClient(base_url=url, timeout=600, headers={"x-model": model}) as http:
            await one_request(http, warm, max_tokens)
            before = prefix_counters(url)
            start = time.perf_counter()
            if args.bursts:
                results = await bursts(http)
            else:
                results = await asyncio.gather(*(client_loop(http, mine) for mine in prompts))
            return results, time.perf_counter() - start, before

    results, duration, before = asyncio.run(load())
    after = prefix_counters(url)
    flat = [r for mine in results for r in mine]
    return {
        "duration_s": duration,
        "ttft_ms": stats([r["ttft"] for r in flat]),
        "e2el_ms": stats([r["e2el"] for r in flat]),
        "queries": after["queries"] - before["queries"],
        "hits": after["hits"] - before["hits"],
        "texts": [[r["text"] for r in mine] for mine in results],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-gemma4-moe")
    p.add_argument("--seq-len", type=int, default=512, help="the served cache's positions (default 512)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--buckets",
        type=lambda v: [int(b) for b in v.split(",")],
        help="the prefill buckets, comma-separated (default the port's; a bucket near the remainder a "
        "cached prompt prefills makes its one call shorter)",
    )
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="per client, one after another (default 4)")
    p.add_argument("--prefix-tokens", type=int, default=200)
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--bursts",
        action="store_true",
        help="the clients send in rounds: every client's next request at once once all have ended "
        "(default: each client on its own, the next request when its last ended)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the report here")
    return p.parse_args(argv)


def load_prompts(args) -> tuple[list[int], list[list[list[int]]]]:
    """The warm-up prompt and each client's prompts: the shared prefix (BOS, then random ids) and a
    suffix of random ids of its own, whose first never extends the prefix's held run."""
    vocab = load_port(args.model).config.vocab_size
    rng = random.Random(args.seed)
    prefix = [2] + [rng.randrange(3, vocab) for _ in range(args.prefix_tokens - 1)]

    def suffix():
        first = rng.randrange(3, vocab)
        while first == prefix[-1]:  # never extend the prefix's held run by chance
            first = rng.randrange(3, vocab)
        return [first] + [rng.randrange(3, vocab) for _ in range(args.suffix_tokens - 1)]

    warm = prefix + suffix()
    return warm, [[prefix + suffix() for _ in range(args.requests)] for _ in range(args.clients)]


def print_report(args, report: dict) -> None:
    """The two runs side by side, in a markdown table, and the verdicts."""
    expected = report["expected_with_caching"]
    on = report["runs"]["with prefix caching"]
    print(
        f"{args.clients} clients x {args.requests} streamed completions"
        f"{' in rounds (--bursts)' if args.bursts else ''}, "
        f"greedy, {args.max_tokens} tokens each; "
        f"prompts: a shared {args.prefix_tokens}-token prefix + {args.suffix_tokens} tokens of their own; "
        f"serve --backend static --batch-size {args.batch_size}, max_cache_len {args.seq_len}, "
        f"buckets {args.buckets or load_port(args.model).static.buckets}"
    )
    print("| run | TTFT mean | TTFT p50 | TTFT p90 | TTFT p99 | E2EL p50 | prefix queries | prefix hits | hits made |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in report["runs"].items():
        t, made = r["ttft_ms"], expected["hits"] if r is on else 0
        print(
            f"| {name} (`{r['flag']}`) | {t['mean']:.1f} ms | {t['p50']:.1f} ms | {t['p90']:.1f} ms | "
            f"{t['p99']:.1f} ms | {r['e2el_ms']['p50']:.1f} ms | {r['queries']:.0f} | {r['hits']:.0f} | {made} |"
        )
    print(
        f"TTFT p50 without / with: {report['ttft_p50_ratio']:.2f}x; outputs identical: {report['identical_outputs']}; "
        f"counters as expected: {report['counters_match']}"
    )
    print(f"load: before {report['machine_before']['uptime']}; after {report['machine_after']['uptime']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    warm, prompts = load_prompts(args)
    n = args.clients * args.requests
    expected = {
        "queries": n * (args.prefix_tokens + args.suffix_tokens),
        "hits": n * (args.prefix_tokens // BLOCK * BLOCK),
    }

    report = {"machine_before": machine(), "args": vars(args) | {"json": str(args.json)}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        port = port_file(args.model, args.seq_len, args.buckets, Path(tmp))
        for name, flag in MODES.items():
            proc, url = start_server(port, flag, args.batch_size, args.clients)
            try:
                report["runs"][name] = run(url, load_port(str(port)).name, prompts, warm, args) | {"flag": flag}
            except BaseException:
                sys.stderr.write(f"{name}: the run failed; the server's last lines:\n{''.join(proc.log)}")
                raise
            finally:
                proc.terminate()
                proc.wait(60)
    report["machine_after"] = machine()
    off, on = report["runs"].values()
    report["identical_outputs"] = off["texts"] == on["texts"]
    report["ttft_p50_ratio"] = off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"]
    report["expected_with_caching"] = expected
    report["counters_match"] = {"queries": on["queries"] == expected["queries"], "hits": on["hits"] == expected["hits"]}
    print_report(args, report)
    if args.json:
        with atomic_write(args.json) as f:
            f.write(json.dumps(report, indent=1) + "\n")
    return 0 if report["identical_outputs"] and all(report["counters_match"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
