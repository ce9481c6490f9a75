"""The reader's batch rule against independent per-token top-k on decode batches of B tokens.

On the committed tiny model (`tiny-gemma4-moe`, fp32): the evaluation split's sequences decoded
B rows at a time, teacher-forced, each step's tokens from different sequences
(`eval/reader_batch.py`), every MoE layer's routed experts through the reader on decode steps
(prompts prefilled with the full experts). Per B and rule, against the full model teacher-forced
on the same positions: KL(full ‖ sparse) mean and p99, top-1 agreement; the union reads per step
(each row once: `reader/batch.py`, charged by `accounting.step_reads`) as a multiple of one
token's reads and as a share of the full batch's (the union's experts whole); with --accuracy B,..,
task accuracy (all four tasks) with the same rule in batched greedy generation at those B.

Teacher-forced data: the fact, kv and reverse items of the evaluation split and --text-docs
held-out texts of --corpus (the series task's 4,558 answer positions are copied digits: KL ≈ 5e-6
at every setting tried, a dilution that costs most of the time; it is in the accuracy runs).

Rules per B (k: today's channels per token at --budget; one: one token's reads at k):
  token         independent per-token top-k at k (today's reader); the step reads the union
  batch=token   the batch rule within what `token` reads on the same step (equal union reads)
  batch-raw=token  the same, summing raw scores instead of each token's shares (at --raw B,..)
  batch-xM      the batch rule within M x one (--step-budgets)
  batch-xM-scanS   the same scanning S coordinates per block instead of the sidecar's 80, trading
                the union's sketch for exact channels (--scans, at the --raw B, M < 4)
At B = 1 the batch rule is `token` (tests/test_reader_batch.py), so B = 1 runs `token` alone.

The accounting part: the same three reads at each B on the Gemma-4 26B-A4B and Qwen3-30B-A3B
geometries, under uniform routing (`accounting.batch_breakdown`).

    python -m bench.reader_batch --corpus build/tiny/corpus [--per-task 20] [--text-docs 30]
        [--batches 1,4,8,16] [--budget 17.8] [--recovery-rank 0] [--step-budgets 2,3,4,16:6] [--raw 8]
        [--scans 40] [--accuracy 1,8]
        [--work build/reader-batch] [--out bench/results/reader-batch]

Cells are JSON files under --work (a rerun skips what is done); --out gets report.json,
report.md and union_reads.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.harness import write_results
from neuron_moe.eval import reader_batch as RB
from neuron_moe.eval import reader_eval as R
from neuron_moe.eval.reader_report import _pyplot
from neuron_moe.experts.selector_experts import moe_layers
from neuron_moe.model import build_model, prep_port
from neuron_moe.port import load_port
from neuron_moe.reader import accounting as A
from neuron_moe.reader import selectors as S
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.sidecar import Sidecar
from neuron_moe import spec
from neuron_moe.report import table, write_json
from neuron_moe.tokenizer import answer_text, load_tokenizer

GEOMETRIES = {
    "gemma4-26b-a4b": Geometry(hidden=2816, experts=128, top_k=8, intermediate=704),
    "qwen3-30b-a3b": Geometry(hidden=2048, experts=128, top_k=8, intermediate=768),
}


def parse_step_budgets(text: str) -> list[tuple[int | None, float]]:
    """ "2,3,4,16:6" -> [(None, 2), (None, 3), (None, 4), (16, 6)]: M at every B, or B:M at that B only."""
    out = []
    for item in text.split(","):
        at, _, m = item.rpartition(":")
        out.append((int(at) if at else None, float(m)))
    return out


def rules(batch: int, k: int, one: int, step_budgets: list, raw_at: list[int], scans: list[int]) -> dict[str, S.Step]:
    if batch == 1:
        return {"token": S.Step("token", k=k)}
    mine = [m for at, m in step_budgets if at in (None, batch)]
    raw = {"batch-raw=token": S.Step("batch", k=k, weigh="raw")} if batch in raw_at else {}
    narrow = (
        {f"batch-x{m:g}-scan{s}": S.Step("batch", limit=m * one, scan=s) for s in scans for m in mine if m < 4}
        if batch in raw_at
        else {}
    )
    return {
        "token": S.Step("token", k=k),
        "batch=token": S.Step("batch", k=k),
        **raw,
        **{f"batch-x{m:g}": S.Step("batch", limit=m * one) for m in mine},
        **narrow,
    }


def generation_sequences(tokenizer, items) -> tuple[list[R.Sequence], list[int]]:
    """Each item's prompt, its last token the first decoded; tokens to generate as eval-tasks does."""
    seqs = [R.Sequence(tokenizer.encode(i.prompt), i.task, len(tokenizer.encode(i.prompt)) - 1) for i in items]
    return seqs, [len(tokenizer.encode(i.answer)) + 1 for i in items]


def accuracy(tokenizer, items, decoded: RB.Decoded) -> dict:
    rows = [
        {"task": i.task, "correct": answer_text(tokenizer, picks) == i.answer, "answer_tokens": 0}
        for i, picks in zip(items, decoded.picks)
    ]
    return R.accuracy(rows)


def cell(run: dict, batch: int, name: str, rule: S.Step, progress) -> dict:
    model, layers, seqs = run["model"], run["layers"], run["seqs"]
    started = time.perf_counter()
    decoded = RB.run_rule(model, seqs, batch, "reader", layers, [rule] * len(layers), progress=progress)
    # each scored position's reads: its step's, the mean over layers (cell_stats reports them as % of one token's full)
    step_of = []
    for s in decoded.steps:
        step_of += [sum(layer["bytes"] for layer in s["layers"]) / len(s["layers"])] * s["tokens"]
    reads = [torch.zeros(1, len(lp)) for lp in decoded.logprobs]  # positions are consumed row by row, not in order
    stats = R.cell_stats(run["reference"], [(lp, r) for lp, r in zip(decoded.logprobs, reads)], seqs, run["full"])
    full_steps = [s for s in decoded.steps if s["tokens"] == batch] or decoded.steps
    per_layer = [layer for s in full_steps for layer in s["layers"]]
    mean = lambda key: sum(layer[key] for layer in per_layer) / len(per_layer)  # noqa: E731
    geo, settings = layers[0].geo, layers[0].settings
    share = [100 * layer["bytes"] / A.full_reads(geo, settings, layer["experts"]) for layer in per_layer]
    row = {
        "batch": batch,
        "rule": name,
        "steps": len(decoded.steps),
        "full_steps": len(full_steps),
        "positions": stats["positions"],
        "kl_mean": stats["kl_mean"],
        "kl_p99": stats["kl_p99"],
        "top1": stats["top1"],
        "by_source": stats["by_source"],
        "step_bytes": mean("bytes"),
        "x_one_token": mean("bytes") / run["one"],
        "percent_of_full_batch": sum(share) / len(share),
        "union_experts": mean("experts"),
        "exact_channels": mean("exact"),
        "over_limit_steps": None,
    }
    if rule.rule == "batch" and rule.limit is not None:
        row["over_limit_steps"] = sum(layer["bytes"] > rule.limit for layer in per_layer) / len(per_layer)
    if batch in run["accuracy"]:
        gen_seqs, new_tokens = run["generation"]
        decoded = RB.run_rule(
            model,
            gen_seqs,
            batch,
            "reader",
            layers,
            [rule] * len(layers),
            new_tokens=new_tokens,
            eos=run["tokenizer"].eos_token_id,
            progress=progress,
        )
        row["accuracy"] = accuracy(run["tokenizer"], run["items"], decoded)
    return row | {"seconds": time.perf_counter() - started}


def accounting_rows(budget: float, rank: int, batches: list[int], step_budgets: list[float]) -> list[dict]:
    rows = []
    for name, geo in GEOMETRIES.items():
        settings = A.Reader(recovery_rank=rank).resolved()
        for batch in batches:
            for m in step_budgets:
                b = A.batch_breakdown(geo, settings, budget, batch, m)
                token, rule = b["rules"]["token"], b["rules"]["batch"]
                rows.append(
                    {
                        "geometry": name,
                        "batch": batch,
                        "step_budget": m,
                        "union_experts": b["union_experts"],
                        "expected_union": b["expected_union"],
                        "full_x": b["full_bytes"] / b["one_token_bytes"],
                        "token_x": token["x_one_token"],
                        "token_percent": token["percent_of_full_batch"],
                        "batch_x": rule["x_one_token"],
                        "batch_percent": rule["percent_of_full_batch"],
                        "batch_k": rule["k"],
                        "token_k": min(batch * b["k_per_token"], rule["rows"]["experts"] * geo.intermediate),
                        "sketch_x": rule["reads"]["sketch"] / b["one_token_bytes"],
                    }
                )
    return rows


MEASURED = [
    ("batch", "B"),
    ("rule", "rule"),
    ("x_one_token", "step reads x one token", "{:.2f}"),
    ("percent_of_full_batch", "% of full batch", "{:.1f}"),
    ("union_experts", "union experts", "{:.1f}"),
    ("exact_channels", "exact channels", "{:.0f}"),
    ("kl_mean", "KL mean", "{:.4f}"),
    ("kl_p99", "KL p99", "{:.3f}"),
    ("top1", "top-1", "{:.3f}"),
    ("acc", "accuracy % of full"),
    ("full_steps", "full steps"),
]
GEOMETRY = [
    ("geometry", "geometry"),
    ("batch", "B"),
    ("union_experts", "union experts"),
    ("full_x", "full batch x one token", "{:.2f}"),
    ("token_x", "token: x one token (at most)", "{:.2f}"),
    ("token_percent", "token: % of full batch", "{:.1f}"),
    ("batch_x", "batch rule: x one token", "{:.2f}"),
    ("batch_percent", "batch rule: % of full batch", "{:.2f}"),
    ("batch_k", "batch rule: channels"),
    ("sketch_x", "of which sketch x one token", "{:.2f}"),
]


def page(report: dict) -> str:
    """report.md: the measured cells and the accounting, as tables."""
    full_correct = report["full_model"]["accuracy"]["correct"] if report["full_model"] else None
    cells = []
    for c in report["cells"]:
        acc = c.get("accuracy")
        cells.append(c | {"acc": f"{100 * acc['correct'] / full_correct:.1f}" if acc and full_correct else ""})
    settings = report["settings"]
    lines = [
        f"# reader-batch: {settings['model']}, budget {settings['budget']}% per token "
        f"(k = {settings['k']}), recovery rank {settings['rank']}",
        "",
        "Measured (CPU, fp32, teacher-forced decode batches):",
        "",
        table(cells, MEASURED, markdown=True),
        "",
        f"Accounting, uniform routing, batch rule within {report['geometries'][0]['step_budget']:g}x one token:",
        "",
        table(report["geometries"], GEOMETRY, markdown=True),
        "",
    ]
    return "\n".join(lines)


def holding(cells: list[dict], batch: int, limit: float) -> dict | None:
    """The batch rule's cell with the least reads whose KL stays within `limit`, at that B."""
    return min(
        (c for c in batch_rule_curve(cells, batch) if c["kl_mean"] <= limit),
        key=lambda c: c["x_one_token"],
        default=None,
    )


def batch_rule_curve(cells: list[dict], batch: int) -> list[dict]:
    """The batch rule's cells at B (not the raw-score or scan variants), by their reads."""
    return sorted(
        (
            c
            for c in cells
            if c["batch"] == batch
            and c["rule"].startswith("batch")
            and "raw" not in c["rule"]
            and "scan" not in c["rule"]
        ),
        key=lambda c: c["x_one_token"],
    )


def plot_quality(ax, report: dict, batches: list[int]) -> None:
    """KL against union reads per step, a curve per B (the batch rule; x: independent top-k)."""
    cells = report["cells"]
    one = next(c for c in cells if c["batch"] == 1)
    for i, b in enumerate(batches):
        curve = batch_rule_curve(cells, b)
        ax.plot(
            [c["x_one_token"] for c in curve],
            [c["kl_mean"] for c in curve],
            marker="o",
            color=f"C{i}",
            label=f"B = {b}: batch rule",
        )
        token = next(c for c in cells if c["batch"] == b and c["rule"] == "token")
        ax.scatter(
            [token["x_one_token"]],
            [token["kl_mean"]],
            marker="x",
            s=80,
            color=f"C{i}",
            label=f"B = {b}: independent top-k",
        )
    ax.axhline(one["kl_mean"], color="gray", linestyle="--", label="B = 1")
    ax.axhline(1.5 * one["kl_mean"], color="gray", linestyle=":", label="1.5x B = 1")
    ax.set(
        xlabel="union reads per step, x one token's",
        ylabel="KL(full || reader), mean",
        yscale="log",
        title=f"{report['settings']['model']}: quality against step reads (CPU)",
    )
    ax.legend(fontsize=7)


def plot_held(ax, report: dict, batches: list[int]) -> None:
    """Union reads per step against B: independent top-k, and the batch rule's least measured reads that
    hold KL within 1.5x of B = 1."""
    cells = report["cells"]
    limit = 1.5 * next(c for c in cells if c["batch"] == 1)["kl_mean"]
    xs = [1] + batches
    token_x = [1.0] + [
        next(c for c in cells if c["batch"] == b and c["rule"] == "token")["x_one_token"] for b in batches
    ]
    held = [1.0] + [(holding(cells, b, limit) or {}).get("x_one_token", float("nan")) for b in batches]
    ax.plot(xs, token_x, marker="x", label="independent top-k (its union)")
    ax.plot(xs, held, marker="o", label="batch rule, least measured reads with KL <= 1.5x B = 1")
    full = report["full_batch_x"]
    ax.plot([int(b) for b in full], list(full.values()), color="gray", linestyle=":", label="full batch")
    ax.set(
        xlabel="tokens per step B",
        ylabel="union reads per step, x one token's",
        yscale="log",
        title="reads that hold batch-1 quality (measured)",
    )
    ax.legend(fontsize=7)


def plot_accounting(ax, report: dict) -> None:
    """The accounting on the full-size geometries, uniform routing."""
    for i, name in enumerate(GEOMETRIES):
        rows = [r for r in report["geometries"] if r["geometry"] == name]
        b = [r["batch"] for r in rows]
        ax.plot(
            b, [r["token_x"] for r in rows], marker="x", color=f"C{i}", label=f"{name}: independent top-k (at most)"
        )
        ax.plot(
            b,
            [r["batch_x"] for r in rows],
            marker="o",
            color=f"C{i}",
            linestyle="--",
            label=f"{name}: batch rule at 2x (its floor where above)",
        )
        ax.plot(b, [r["sketch_x"] for r in rows], color=f"C{i}", linestyle="-.", label=f"{name}: the union's sketch")
        ax.plot(b, [r["full_x"] for r in rows], color=f"C{i}", linestyle=":", label=f"{name}: full batch")
    ax.set(
        xlabel="tokens per step B",
        ylabel="union reads per step, x one token's",
        yscale="log",
        title="accounting, uniform routing",
    )
    ax.legend(fontsize=6)


def plot(report: dict, out: Path) -> Path:
    """union_reads.png: the quality against step reads (`plot_quality`), the reads that hold batch-1
    quality (`plot_held`) and the accounting (`plot_accounting`), side by side."""
    plt = _pyplot()
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(17, 4.8))
    batches = sorted({c["batch"] for c in report["cells"] if c["batch"] > 1})
    plot_quality(left, report, batches)
    plot_held(mid, report, batches)
    plot_accounting(right, report)
    fig.tight_layout()
    path = out / "union_reads.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", help="build-corpus's directory: held-out text (eval_text.jsonl)")
    ap.add_argument("--per-task", type=int, default=20)
    ap.add_argument("--tasks", default="fact,kv,reverse", help="teacher-forced tasks (default: all but series)")
    ap.add_argument("--text-docs", type=int, default=30)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--budget", type=float, default=17.8)
    ap.add_argument(
        "--recovery-rank",
        type=int,
        default=0,
        help="recovery rank (default 0: rank 32 reads 18.5%% on the tiny geometry)",
    )
    ap.add_argument(
        "--step-budgets",
        default="2,3,4",
        metavar="M,B:M,..",
        help="the batch rule's step reads, x one token's: at every B, or B:M at B only",
    )
    ap.add_argument(
        "--raw",
        default="8",
        metavar="B,..",
        help="the raw-score ablation and the --scans variants at these B (default 8)",
    )
    ap.add_argument("--scans", default="", metavar="S,..", help="batch-rule scan widths to try (default none)")
    ap.add_argument(
        "--accuracy",
        default="",
        metavar="B,..",
        help="task accuracy in batched greedy generation (all four tasks) at these B",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="build/reader-batch")
    ap.add_argument("--out", default="bench/results/reader-batch")
    return ap.parse_args()


def setup(args, work: Path) -> tuple[dict, dict]:
    """The tiny model with the reader on its MoE layers (its sidecar prepped into `work` once) and the
    sequences: (what the cells run on, the key of this run's cells; `work` holding another run's is an error)."""
    port = load_port("tiny-gemma4-moe")
    tokenizer = load_tokenizer(port, None)
    model = build_model(port, "eager", torch.float32)
    sidecar_path = work / "sidecar.safetensors"
    if not sidecar_path.exists():
        prep_port(port, sidecar_path)
    sidecar = Sidecar(sidecar_path)
    settings = R.Settings(
        per_task=args.per_task, tasks=tuple(args.tasks.split(",")), text_docs=args.text_docs, corpus=args.corpus
    )
    seqs = R.sequences(tokenizer, settings, model.config.max_position_embeddings, "evaluation")
    layers = moe_layers(model, sidecar, args.recovery_rank)
    geo, settings = layers[0].geo, layers[0].settings
    k = A.solve_k(geo, settings, args.budget)
    one = sum(A.reads(geo, settings, k).values())
    key = {
        "model": port.name,
        "weights_sha256": R.weights_digest(model),
        "per_task": args.per_task,
        "tasks": args.tasks,
        "text_docs": args.text_docs if args.corpus else 0,
        "budget": args.budget,
        "rank": args.recovery_rank,
        "k": k,
    }
    run_file = work / "run.json"
    if run_file.exists() and json.loads(run_file.read_text()) != key:
        sys.exit(f"{work} holds cells of another run; pass another --work or remove it")
    write_json(key, str(run_file))
    spec.set_experts(model, spec.EAGER)
    run = {
        "model": model,
        "layers": layers,
        "seqs": seqs,
        "one": one,
        "full": A.full_bytes(geo),
        "tokenizer": tokenizer,
        "accuracy": [int(b) for b in args.accuracy.split(",") if b],
        "reference": None,
    }
    return run, key


def full_model_accuracy(run: dict, per_task: int, work: Path) -> dict | None:
    """With --accuracy: the generation items (into `run`) and the full model's accuracy on them, batch 16
    (cells/full.json, made once)."""
    if not run["accuracy"]:
        return None
    tokenizer = run["tokenizer"]
    run["items"] = R.evaluation_items(R.Settings(per_task=per_task))
    run["generation"] = generation_sequences(tokenizer, run["items"])
    full_file = work / "cells" / "full.json"
    if not full_file.exists():
        gen_seqs, new_tokens = run["generation"]
        decoded = RB.decode(run["model"], gen_seqs, 16, new_tokens=new_tokens, eos=tokenizer.eos_token_id)
        write_json({"accuracy": accuracy(tokenizer, run["items"], decoded)}, str(full_file))
    return json.loads(full_file.read_text())


def measure_cells(run: dict, wanted: list[tuple], work: Path) -> list[dict]:
    """Each wanted (B, name, rule) cell, measured into cells/ under `work` unless there already."""
    positions = sum(len(s.ids) - 1 - s.start for s in run["seqs"])
    results = []
    with tqdm(total=len(wanted), desc="reader-batch", unit="cell") as bar:
        for b, name, rule in wanted:
            path = work / "cells" / f"B{b}-{name}.json"
            if not path.exists():
                if run["reference"] is None:
                    run["reference"] = R.teacher_forced(run["model"], run["seqs"])
                bar.set_postfix_str(f"B={b} {name}")
                answers = sum(run["generation"][1]) if b in run["accuracy"] else 0
                with tqdm(total=positions + answers, desc=f"B={b} {name}", unit="tok", leave=False) as inner:
                    write_json(cell(run, b, name, rule, inner), str(path))
            results.append(json.loads(path.read_text()))
            bar.update(1)
    return results


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    step_budgets = parse_step_budgets(args.step_budgets)
    work, out = Path(args.work), Path(args.out)
    (work / "cells").mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    run, key = setup(args, work)
    full_model = full_model_accuracy(run, args.per_task, work)
    raw_at = [int(b) for b in args.raw.split(",") if b]
    scans = [int(s) for s in args.scans.split(",") if s]
    k, one = key["k"], run["one"]
    wanted = [(b, name, rule) for b in batches for name, rule in rules(b, k, one, step_budgets, raw_at, scans).items()]
    results = measure_cells(run, wanted, work)
    geo, settings = run["layers"][0].geo, run["layers"][0].settings
    report = {
        "settings": key
        | {
            "batches": batches,
            "step_budgets": args.step_budgets,
            "one_token_bytes": one,
            "routing": "uniform (accounting)",
            "machine": "CPU",
        },
        "full_model": full_model,
        "cells": results,
        "full_batch_x": {str(b): A.full_reads(geo, settings, A.expected_union(geo, b)) / one for b in batches},
        "geometries": accounting_rows(args.budget, 32, batches, [2.0]),
    }
    write_results(report, out / "report.json", page, out / "report.md")
    plot(report, out)
    print(table([c | {"acc": ""} for c in results], MEASURED))
    print()
    print(table(report["geometries"], GEOMETRY))


if __name__ == "__main__":
    main()
