"""Speculative decoding on CPU: output tokens/s of the static graphs with and without it, per method,
workload and batch size, greedy, each text checked against the one without speculation.

What runs is the engine step loop over the port's static graphs, `Rows.step`, driven as
`static.rows.generate` drives it (validate's greedy generation: each step prefills every prompt it
admits and decodes every generating row, a free row taking the next prompt; `--max-tokens` tokens per
prompt, EOS not stopping it), over `static_runtime(..., speculative=...)`: the graphs compiled by
torch.compile (inductor, serve's default; `--no-compile`: as modules). tok_s is the output tokens of a
workload's prompts over the wall time of that loop, prefill included; the served engine runs the same
step (`serve/engine.py`) with HTTP and streaming around it, which this leaves out.

Methods: `none` (a decode call per step), `ngram` (prompt lookup, `--ngram` config: a verify call over
each row's fed token and its drafts; a step in which no row has a draft is a plain decode step) and
`mtp` (Gemma-4's assistant, `--assistant`: its draft graph, then the verify call). A method's speed-up
is its tok_s over `none`'s at the same workload and batch, measured in the same repeat (the methods
take turns, their order rotating each repeat; the median of the repeats' ratios).

Workloads: `--prompts` prompts each, made from the tiny model's own corpus and task formats and its
tokenizer (`WORKLOADS`); what is measured is the model's greedy continuation of them, so a workload
helps lookup only where that continuation repeats text before it.

Besides the speed: tokens_per_step (output tokens per generating row per decode or verify step; the
first token of each prompt, from its prefill, not counted), the acceptance at each draft position
(vLLM's: accepted at position i over drafts), and where the time goes: the median decode, verify and
draft call, and the host's time per step (the loop's wall time less its graph calls: the proposer,
the rows' bookkeeping).

    OMP_NUM_THREADS=1 python -m bench.speculative --json bench/results/speculative-cpu.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.harness import command, cpu_host, machine, write_results
from neuron_moe import tasks
from neuron_moe.errors import UserError
from neuron_moe.model import build_model
from neuron_moe.port import load_port
from neuron_moe.report import table
from neuron_moe.spec import COMPILE_CACHE, compile_cache
from neuron_moe.hub import check_assistant, resolve_assistant
from neuron_moe.speculative import FLAG, SpeculativeConfig
from neuron_moe.static import inductor
from neuron_moe.static.draft import load_assistant as load_draft_assistant
from neuron_moe.static.rows import Rows
from neuron_moe.static.runtime import static_runtime
from neuron_moe.static.sampling import GREEDY
from neuron_moe.tokenizer import load_tokenizer
from neuron_moe.training.corpus import FORTUNES_DIR, read_fortunes, split_of

METHODS = ("none", "ngram", "mtp")
DEFAULT_NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
BUILTIN_ASSISTANT = "tiny-gemma4-moe-assistant"
CALLS = ("prefill", "decode", "verify", "draft")  # the runtime's graph calls, each timed
KEYS = ("method", "workload", "batch_size", "tokens_per_step", "tok_s", "speedup")  # every run's, first


# ---- workloads: prompts from the tiny model's corpus and task formats ----


def _question(rng: random.Random, words: int) -> tuple[str, str, int]:
    """A key-value question of the model's task format (`tasks.kv_item`): (its listing, key, answer)."""
    keys = rng.sample(tasks.WORDS, words)
    pairs = {key: rng.randint(10, 99) for key in keys}
    key = rng.choice(keys)
    return " ".join(f"{k}={v}" for k, v in pairs.items()), key, pairs[key]


def _code(rng: random.Random) -> str:
    """Python answering a key-value question asked in a comment, the question asked again."""
    listing, key, value = _question(rng, rng.randint(2, 3))
    return f"# Q: {listing}. What is {key}?\n{key} = {value}\n# Q: {listing}. What is {key}?\n{key} ="


def _json(rng: random.Random) -> str:
    """A key-value question over a JSON object, answered, then asked again."""
    key, value = rng.choice(tasks.WORDS), rng.randint(10, 99)
    question = f'Q: {{"{key}": {value}}}. What is {key}?\nA:'
    return f"{question} {value}\n{question}"


def _repeats(rng: random.Random) -> str:
    """A reverse or key-value question of the model's task formats, answered, then asked again."""
    if rng.random() < 0.5:
        words = rng.sample(tasks.WORDS, rng.randint(3, 6))
        question = f"Q: Reverse: {' '.join(words)}\nA:"
        return f"{question} {' '.join(reversed(words))}\n{question}"
    listing, key, value = _question(rng, rng.randint(3, 4))
    question = f"Q: {listing}. What is {key}?\nA:"
    return f"{question} {value}\n{question}"


def _prose(count: int) -> list[str]:
    """The first `count` held-out fortunes (the corpus's evaluation split, never trained on), in file order."""
    return [doc for doc in read_fortunes(FORTUNES_DIR) if split_of(doc) == "eval"][:count]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: object  # count -> prompt texts


def _drawn(make):
    return lambda count: [make(random.Random(f"{make.__name__}:{i}")) for i in range(count)]


WORKLOADS = {
    w.name: w
    for w in (
        Workload("code", _code.__doc__, _drawn(_code)),
        Workload("json", _json.__doc__, _drawn(_json)),
        Workload("repeats", _repeats.__doc__, _drawn(_repeats)),
        Workload("prose", "held-out fortunes (the corpus's evaluation split), cut to the prompt length", _prose),
    )
}


def workload_prompts(tokenizer, workload: Workload, count: int, most: int) -> list[list[int]]:
    """`count` prompts of `workload` as token ids (BOS first), each cut to at most `most` tokens."""
    return [tokenizer.encode(text)[:most] for text in workload.prompts(count)]


# ---- one measured run: a workload's prompts through the engine step loop ----


@dataclass
class Greedy:
    """A prompt generating `n` tokens greedily (as `static.rows.generate`'s work does), keeping them."""

    prompt: list[int]
    n: int
    tokens: list[int] = field(default_factory=list)

    def sampling(self) -> tuple[float, float, float, float]:
        return GREEDY

    def next(self, token: int, logits) -> int | None:
        self.tokens.append(token)
        return token if len(self.tokens) < self.n else None

    def end(self, error: Exception | None = None) -> None:
        """Nothing to release: a failed graph call raises out of the step."""


class Timed:
    """A runtime whose graph calls (`CALLS`) are timed, each call's seconds kept by graph, and whose
    speculation is `speculative` (None: none, a decode call per step); anything else is the runtime's."""

    def __init__(self, runtime, speculative):
        self._runtime, self.speculative = runtime, speculative
        self.seconds: dict[str, list[float]] = {name: [] for name in CALLS}

    def __getattr__(self, name: str):
        attr = getattr(self._runtime, name)
        if name not in CALLS:
            return attr

        def timed(*args):
            start = time.perf_counter()
            out = attr(*args)
            self.seconds[name].append(time.perf_counter() - start)
            return out

        return timed


def generate(runtime, speculative, prompts: list[list[int]], n: int) -> dict:
    """The prompts through `Rows.step` as `static.rows.generate` runs them (a step prefills every prompt
    it admits, a free row takes the next prompt), speculating by `speculative` (None: not at all), timed
    -> each prompt's tokens, the loop's seconds, the steps (decode or verify calls) and the rows they
    ran, each graph call's seconds, and per verified row with drafts (drafted, accepted)."""
    timed = Timed(runtime, speculative)
    rows = Rows(timed, prefill_all=True)
    verified: list[tuple[int, int]] = []
    rows.verified = lambda drafted, accepted: verified.extend(zip(drafted, accepted))
    works = [Greedy(p, n) for p in prompts]
    waiting, row_steps = deque(works), 0
    start = time.perf_counter()
    while waiting or rows.active():
        row_steps += len(rows.step(lambda: waiting.popleft() if waiting else None))
    seconds = time.perf_counter() - start
    return {
        "tokens": [w.tokens for w in works],
        "seconds": seconds,
        "steps": rows.steps,
        "row_steps": row_steps,
        "calls": timed.seconds,
        "verified": verified,
    }


# ---- the runs: every method, workload and batch size, the methods taking turns ----


def median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def summary(method: str, workload: str, batch: int, measured: list[dict], base: list[dict], k: int) -> dict:
    """One method × workload × batch size from its repeats (`measured`) and `none`'s in the same repeats
    (`base`): the median tok_s and speed-up, tokens per step, the acceptance at each draft position, the
    median call times, and whether every repeat's tokens are `none`'s."""
    first = measured[0]
    outputs = sum(len(t) for t in first["tokens"])
    tok_s = [outputs / m["seconds"] for m in measured]
    speedups = [t / (outputs / b["seconds"]) for t, b in zip(tok_s, base)]
    calls = {name: [s for m in measured for s in m["calls"][name]] for name in CALLS}
    graph_s = [sum(sum(s) for s in m["calls"].values()) for m in measured]
    verified = first["verified"]
    return {
        "method": method,
        "workload": workload,
        "batch_size": batch,
        "tokens_per_step": (outputs - len(first["tokens"])) / first["row_steps"],
        "tok_s": statistics.median(tok_s),
        "speedup": statistics.median(speedups),
        "identical": all(m["tokens"] == b["tokens"] for m, b in zip(measured, base)),
        "tok_s_repeats": tok_s,
        "speedup_repeats": speedups,
        "output_tokens": outputs,
        "steps": first["steps"],
        "decode_calls": len(first["calls"]["decode"]),
        "verify_calls": len(first["calls"]["verify"]),
        "drafted_row_steps": len(verified) / first["row_steps"],
        "mean_drafted": statistics.mean(d for d, _ in verified) if verified else None,
        "mean_accepted": statistics.mean(a for _, a in verified) if verified else None,
        "acceptance_per_position": [sum(a > i for _, a in verified) / len(verified) for i in range(k)]
        if verified
        else None,
        **{f"{name}_call_ms": median_ms(calls[name]) for name in CALLS},
        "host_ms_per_step": statistics.median(1e3 * (m["seconds"] - g) / m["steps"] for m, g in zip(measured, graph_s)),
    }


def measure(model, spec, configs: dict, assistant, prompts: dict, batch: int, args) -> list[dict]:
    """Every method (`configs`: name -> SpeculativeConfig or None) on every workload (`prompts`: name ->
    token ids) at `batch` rows: a first run of each (compiling its graphs' shapes), then `--repeats`
    repeats in which the methods take turns on each workload, their order rotated each repeat.

    The methods share one runtime, built for the most any of them needs (the verify graph, and the
    draft graph with an assistant, over the cache with their slack): the same prefill and decode graphs
    for all, `none` running that decode graph a step at a time, and one compile of each graph."""
    progress = (lambda line: print(f"  {line}", flush=True)) if args.compile else None
    widest = configs.get("mtp") or configs.get("ngram")
    runtime = static_runtime(
        model, spec, batch, compile=args.compile, progress=progress, speculative=widest, assistant=assistant
    )
    methods = list(configs)
    for name, ids in prompts.items():
        for method in methods:
            generate(runtime, configs[method], ids, args.max_tokens)
    results = {(method, name): [] for method in methods for name in prompts}
    for repeat in range(args.repeats):
        turn = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]
        for name, ids in prompts.items():
            for method in turn:
                results[method, name].append(generate(runtime, configs[method], ids, args.max_tokens))
    k = widest.num_speculative_tokens if widest else 0
    return [
        summary(method, name, batch, results[method, name], results["none", name], k)
        for name in prompts
        for method in methods
    ]


def load_assistant(args, target, k: int) -> tuple[SpeculativeConfig | None, object, str | None]:
    """The mtp method's (config of `k` drafts, assistant model for the target model `target`, None), or
    (None, None, why it is skipped) when the built-in assistant is not there; an `--assistant` given that
    is not a fitting assistant is an error. The assistant is resolved and loaded as validate and serve
    load it (`hub.check_assistant`: `hub.resolve_assistant`; `static.draft.load_assistant`)."""
    model = args.assistant or BUILTIN_ASSISTANT
    config = SpeculativeConfig("mtp", k, model=model)
    try:
        directory = check_assistant(config, target.config)
    except UserError as e:
        if args.assistant:
            raise UserError(f"--assistant: {str(e).removeprefix(FLAG + ': ')}") from None
        return None, None, f"no built-in assistant {BUILTIN_ASSISTANT!r} on this branch ({e}); --assistant DIR runs it"
    return config, load_draft_assistant(directory, target), None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-gemma4-moe", help="port with a [static] table (default tiny-gemma4-moe)")
    ap.add_argument("--batch-sizes", default="1,8", help="comma-separated (default 1,8)")
    ap.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated of {', '.join(METHODS)} (default all)"
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated of {', '.join(WORKLOADS)}")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (default 8)")
    ap.add_argument("--max-tokens", type=int, default=40, help="tokens generated per prompt (default 40)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats after a first run (default 3)")
    ap.add_argument(
        "--ngram", default=DEFAULT_NGRAM, metavar="JSON", help=f"prompt lookup's config (default {DEFAULT_NGRAM})"
    )
    ap.add_argument(
        "--assistant",
        metavar="DIR",
        help=f"Gemma-4 assistant for mtp, drafting --ngram's num_speculative_tokens (one verify graph serves "
        f"both; default: the built-in {BUILTIN_ASSISTANT}, mtp skipped if it is not there)",
    )
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="run the graphs as modules")
    ap.add_argument(
        "--compile-cache",
        metavar="DIR",
        help=f"inductor's cache (default $TORCHINDUCTOR_CACHE_DIR, else {COMPILE_CACHE})",
    )
    ap.add_argument("--json", metavar="FILE", help="write the report as JSON, its page (.md) and plot (.png) beside it")
    return ap.parse_args(argv)


def _listed(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError(f"--{what}: {unknown[0] if unknown else text!r} is not one of {', '.join(known)}")
    return names


def check(args) -> tuple[list[int], list[str], list[str]]:
    """The batch sizes, methods and workloads asked for, or a UserError naming the bad flag."""
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise UserError(f"--batch-sizes: {args.batch_sizes!r} is not a comma-separated list of integers") from None
    if any(b < 1 for b in batches):
        raise UserError(f"--batch-sizes: each must be at least 1, got {args.batch_sizes}")
    for flag, value in (("--prompts", args.prompts), ("--max-tokens", args.max_tokens), ("--repeats", args.repeats)):
        if value < 1:
            raise UserError(f"{flag}: must be at least 1, got {value}")
    methods = _listed(args.methods, METHODS, "methods")
    if "none" not in methods:
        raise UserError("--methods: the speed-ups are against 'none', which must be among them")
    return batches, methods, _listed(args.workloads, WORKLOADS, "workloads")


def run(args, argv: list[str]) -> dict:
    """The report: every method × workload × batch size (`runs`), what each workload is, the methods'
    configs, what was skipped and why, and the machine before and after."""
    batches, methods, names = check(args)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.compile:
        inductor.require_compiler("--no-compile")
        inductor.use_cache_dir(compile_cache(args.compile_cache))
    port = load_port(args.model)
    spec = port.static_spec("bench/speculative.py")
    host = machine()
    try:
        lookup = SpeculativeConfig.from_json(args.ngram)
    except UserError as e:
        raise UserError(f"--ngram: {str(e).removeprefix(FLAG + ': ')}") from None
    if lookup.method != "ngram":
        raise UserError(f"--ngram: {args.ngram!r} is not a prompt-lookup config (method 'ngram')")
    configs: dict = {"none": None, **({"ngram": lookup} if "ngram" in methods else {})}
    model = build_model(port, spec.decode_experts)
    skipped, assistant = {}, None
    if "mtp" in methods:
        config, assistant, skipped_why = load_assistant(args, model, lookup.num_speculative_tokens)
        if config is None:
            skipped["mtp"] = skipped_why
        else:
            configs["mtp"] = config
    tokenizer = load_tokenizer(port)
    most = spec.max_cache_len - args.max_tokens  # a prompt and its tokens fit the cache
    if most < 2:
        raise UserError(
            f"--max-tokens: {args.max_tokens} leaves no room for a prompt in {spec.max_cache_len} positions"
        )
    prompts = {name: workload_prompts(tokenizer, WORKLOADS[name], args.prompts, most) for name in names}
    runs = []
    for batch in batches:
        print(f"batch {batch}: {', '.join(configs)} on {', '.join(names)}", flush=True)
        runs += measure(model, spec, configs, assistant, prompts, batch, args)
    return {
        "benchmark": "speculative",
        "command": command("bench.speculative", argv),
        "model": port.name,
        "graphs": "compiled (torch.compile, inductor)" if args.compile else "modules",
        "loop": "Rows.step as static.rows.generate drives it (prefill_all; each prompt its --max-tokens tokens)",
        "settings": vars(args),
        "configs": {
            m: None if c is None else {k: v for k, v in vars(c).items() if v is not None} for m, c in configs.items()
        },
        "assistant": None if assistant is None else assistant_source(args),
        "skipped": skipped,
        "workloads": {
            name: {"description": WORKLOADS[name].description, "prompts": [tokenizer.decode(p) for p in prompts[name]]}
            for name in names
        },
        "runs": runs,
        "machine": {**host, **cpu_host()},
    }


def assistant_source(args) -> dict:
    """Where the assistant came from: its directory and its weights' sha256 (it may be retrained)."""
    import hashlib

    directory = resolve_assistant(args.assistant or BUILTIN_ASSISTANT)
    weights = directory / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists() else None
    return {"directory": str(directory), "model.safetensors sha256": digest}


# ---- the printed table and the page ----

COLUMNS = [
    ("method", "method"),
    ("workload", "workload"),
    ("batch_size", "batch"),
    ("tokens_per_step", "tokens/step", "{:.2f}"),
    ("tok_s", "tok/s", "{:.1f}"),
    ("speedup", "speed-up", "{:.2f}"),
    ("identical", "identical"),
    ("acceptance", "accepted at 1..k"),
    ("decode_call_ms", "decode ms", "{:.2f}"),
    ("verify_call_ms", "verify ms", "{:.2f}"),
    ("draft_call_ms", "draft ms", "{:.2f}"),
    ("host_ms_per_step", "host ms/step", "{:.2f}"),
]


def table_rows(runs: list[dict]) -> list[dict]:
    return [{**r, "acceptance": " ".join(f"{a:.2f}" for a in r["acceptance_per_position"] or []) or None} for r in runs]


def header(report: dict) -> str:
    m = report["machine"]
    load = ", ".join(f"{x:.1f}" for x in m["load_average"])
    end = ", ".join(f"{x:.1f}" for x in m["load_average_at_end"])
    return (
        f"{report['model']}, graphs {report['graphs']}; {report['loop']}; "
        f"{report['settings']['prompts']} prompts per workload, {report['settings']['max_tokens']} tokens each; "
        f"median of {report['settings']['repeats']} repeats, the methods in turns\n"
        f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} at {m['torch_threads']} thread(s); "
        f"load average (1, 5, 15 min) {load} at the start, {end} at the end; code {m['code'] or '-'}"
    )


def limits(runs: list[dict]) -> list[dict]:
    """Per speculative run, what bounds its speed-up: a step's cost against a plain decode step's (its
    verify call and host time against `none`'s decode call and host time at the same workload and
    batch), and the speed-up that cost allows at its tokens per step (`bound`: every step a verify step)."""
    out = []
    for r in runs:
        base = next(
            b
            for b in runs
            if b["method"] == "none" and (b["workload"], b["batch_size"]) == (r["workload"], r["batch_size"])
        )
        if r["method"] == "none" or not r["verify_call_ms"]:
            continue
        plain = base["decode_call_ms"] + base["host_ms_per_step"]
        step = r["verify_call_ms"] + (r["draft_call_ms"] or 0.0) + r["host_ms_per_step"]
        out.append(
            {
                "method": r["method"],
                "workload": r["workload"],
                "batch_size": r["batch_size"],
                "verify_x_decode": r["verify_call_ms"] / base["decode_call_ms"],
                "draft_x_decode": (r["draft_call_ms"] or 0.0) / base["decode_call_ms"],
                "host_ms_none": base["host_ms_per_step"],
                "host_ms": r["host_ms_per_step"],
                "step_x_plain": step / plain,
                "bound": r["tokens_per_step"] / (step / plain),
                "speedup": r["speedup"],
            }
        )
    return out


LIMIT_COLUMNS = [
    ("method", "method"),
    ("workload", "workload"),
    ("batch_size", "batch"),
    ("verify_x_decode", "verify call ÷ decode call", "{:.2f}"),
    ("host_ms_none", "host ms/step, none", "{:.2f}"),
    ("host_ms", "host ms/step", "{:.2f}"),
    ("step_x_plain", "step ÷ plain step", "{:.2f}"),
    ("bound", "tokens/step ÷ that", "{:.2f}"),
    ("speedup", "measured speed-up", "{:.2f}"),
]


def _limit(run: dict, bounds: list[dict]) -> dict:
    """`run`'s entry of `limits`."""
    return next(b for b in bounds if all(b[key] == run[key] for key in ("method", "workload", "batch_size")))


def _bounded(run: dict, bounds: list[dict]) -> str:
    """What bounds `run`'s speed-up, in a sentence: its step's cost against a plain step's, part by part
    (the calls' medians; a lookup step in which no row has a draft is a plain step, which the estimate
    does not count)."""
    b = _limit(run, bounds)
    draft = f", the draft call {b['draft_x_decode']:.2f}×" if b["draft_x_decode"] else ""
    return (
        f"{run['method']} on {run['workload']}: a step costs {b['step_x_plain']:.2f}× a plain step (the verify "
        f"call {b['verify_x_decode']:.2f}× the decode call{draft}; host {b['host_ms']:.2f} ms a step against "
        f"{b['host_ms_none']:.2f}): about {run['tokens_per_step']:.2f} / {b['step_x_plain']:.2f} = {b['bound']:.2f}× "
        f"if every step were a verify step."
    )


def page(report: dict) -> str:
    """The report as markdown, from its JSON alone: the table, the goal, what limits it, the workloads."""
    runs = report["runs"]
    lines = ["# Speculative decoding on CPU: speed-up per method, workload and batch size", ""]
    lines += ["```", report["command"], "```", "", header(report).replace("\n", "\n\n"), ""]
    lines += [table(table_rows(runs), COLUMNS, markdown=True), ""]
    if Path(report.get("plot") or "").suffix == ".png":
        lines += [f"![speed-up per workload]({Path(report['plot']).name})", ""]
    for method, why in report["skipped"].items():
        lines += [f"`{method}` skipped: {why}.", ""]
    single = [r for r in runs if r["batch_size"] == 1 and r["method"] != "none"]
    if single:
        best = max(single, key=lambda r: r["speedup"])
        prose = [r for r in single if r["workload"] == "prose"]
        lines += [
            f"Batch 1, best: {best['speedup']:.2f}× ({best['method']}, {best['workload']}, "
            f"{best['tokens_per_step']:.2f} tokens per step): the goal of 1.8× "
            + ("met." if best["speedup"] >= 1.8 else "not met.")
            + "".join(
                f" Prose, {r['method']}: {r['speedup']:.2f}× at {r['tokens_per_step']:.2f} tokens per step."
                for r in prose
            ),
            "",
            " ".join(_bounded(r, limits(runs)) for r in [best] + [r for r in prose if r is not best])
            + f" At its step's cost, 1.8× would take {1.8 * _limit(best, limits(runs))['step_x_plain']:.2f} "
            "tokens per step.",
            "",
            f"Greedy texts with speculation identical to those without: "
            f"{sum(r['identical'] for r in runs)} of {len(runs)} runs.",
            "",
        ]
    lines += [
        "## What bounds the speed-up",
        "",
        "A speculative step costs a verify call over k + 1 positions per row (and the assistant's draft call) "
        "and the host's work (the proposer, each row's tokens one at a time); a plain step a decode call and "
        "its host work. The speed-up is at most tokens/step over that ratio (less where some steps are plain "
        "decode steps: a lookup that finds no draft for any row).",
        "",
        table(limits(runs), LIMIT_COLUMNS, markdown=True),
        "",
        "## Workloads",
        "",
    ]
    for name, w in report["workloads"].items():
        lines += [
            f"- **{name}**: {w['description'].rstrip('.')}; the first of {len(w['prompts'])}: `{w['prompts'][0]!r}`"
        ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    """Speed-up per workload, a bar per method, a panel per batch size, as PNG at `path` (written
    atomically); False where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from neuron_moe.report import atomic_write

    runs = [r for r in report["runs"] if r["method"] != "none"]
    batches = sorted({r["batch_size"] for r in runs})
    methods = list(dict.fromkeys(r["method"] for r in runs))
    workloads = list(report["workloads"])
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.5), sharey=True, squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for i, method in enumerate(methods):
            got = {r["workload"]: r["speedup"] for r in runs if r["batch_size"] == batch and r["method"] == method}
            xs = [j + i / (len(methods) + 1) for j in range(len(workloads))]
            ax.bar(xs, [got.get(w, 0.0) for w in workloads], width=1 / (len(methods) + 1), label=method)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.axhline(1.8, color="red", linewidth=0.8, linestyle="--")
        ax.set_xticks([j + (len(methods) - 1) / (2 * (len(methods) + 1)) for j in range(len(workloads))], workloads)
        ax.set_title(f"batch {batch}")
    axes[0][0].set_ylabel("tok/s ÷ no speculation")
    axes[0][-1].legend()
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        report = run(args, argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(header(report) + "\n")
    print(table(table_rows(report["runs"]), COLUMNS))
    for method, why in report["skipped"].items():
        print(f"{method} skipped: {why}")
    if args.json:
        if args.json != "-":
            png = Path(args.json).with_suffix(".png")
            report["plot"] = str(png) if plot(report, png) else None
        write_results(report, args.json, page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
