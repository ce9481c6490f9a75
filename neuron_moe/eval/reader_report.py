"""eval-reader's report, from its merged results: markdown tables and matplotlib plots (PNG).

report.md              every cell; each calibrated threshold's reads against its target (overall,
                       held-out text, start and end of the answer); top-k against the threshold
reads_vs_quality.png   actual mean reads against accuracy (% of full) and KL, per selector and rule
retention.png          per-token reads (% of full): box 25–75 %, whiskers 5–95 %, target marked
retention_by_position.png  mean reads as % of the target against the position in the answer
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import UserError
from ..report import atomic_write, table

RULE_STYLE = {"topk": ("o", "-"), "threshold": ("x", "--")}


def _pyplot():
    # matplotlib (the eval extra) is imported only to plot: the tables and JSON need nothing more
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise UserError("eval-reader plots need matplotlib: pip install 'neuron-moe[eval]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _ok(report):
    return [c for c in report["cells"] if c["status"] == "ok"]


def _colors(cells):
    names = list(dict.fromkeys(c["selector"] for c in cells))
    return {n: f"C{i}" for i, n in enumerate(names)}


def plot(report: dict, out: Path) -> list[Path]:
    plt = _pyplot()
    cells = _ok(report)
    if not cells:
        return []
    colors, budgets = _colors(cells), sorted({c["budget"] for c in cells})
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for sel, rule in dict.fromkeys((c["selector"], c["rule"]) for c in cells):
        mine = sorted((c for c in cells if (c["selector"], c["rule"]) == (sel, rule)), key=lambda c: c["budget"])
        x = [c["reads"]["mean"] for c in mine]
        marker, line = RULE_STYLE[rule]
        style = dict(color=colors[sel], marker=marker, linestyle=line, label=f"{sel} {rule}")
        axes[0].plot(x, [c.get("accuracy_percent_of_full") or float("nan") for c in mine], **style)
        axes[1].plot(x, [c["kl_mean"] for c in mine], **style)
    axes[0].set(xlabel="reads, % of full (mean per token)", ylabel="task accuracy, % of full", title="accuracy")
    axes[1].set(xlabel="reads, % of full (mean per token)", ylabel="KL(full ‖ sparse), mean", title="KL", yscale="log")
    axes[1].legend(fontsize=7)
    paths.append(_save(fig, out / "reads_vs_quality.png"))

    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        mine = [c for c in cells if c["budget"] == budget]
        stats = [
            {
                "label": f"{c['selector']}\n{c['rule']}",
                "med": c["reads"]["p50"],
                "q1": c["reads"]["p25"],
                "q3": c["reads"]["p75"],
                "whislo": c["reads"]["p5"],
                "whishi": c["reads"]["p95"],
                "mean": c["reads"]["mean"],
                "fliers": [],
            }
            for c in mine
        ]
        ax.bxp(stats, showmeans=True)
        ax.plot(range(1, len(mine) + 1), [c["target_reads"] for c in mine], "r_", markersize=20, label="target")
        ax.set(title=f"budget {budget:g} %", ylabel="reads per token, % of full")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "retention.png"))

    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
    edges = sorted({b["lo"] for c in cells for b in c["reads_by_answer_position"]})  # the bins' x positions
    for ax, budget in zip(axes[0], budgets):
        labels = {}
        for c in (c for c in cells if c["budget"] == budget):
            bins = c["reads_by_answer_position"]
            labels.update({b["lo"]: _bin_label(b) for b in bins})
            marker, line = RULE_STYLE[c["rule"]]
            ax.plot(
                [edges.index(b["lo"]) for b in bins],
                [100 * b["mean"] / c["target_reads"] for b in bins],
                color=colors[c["selector"]],
                marker=marker,
                linestyle=line,
                label=f"{c['selector']} {c['rule']}",
            )
        ax.set_xticks([edges.index(lo) for lo in labels], list(labels.values()), fontsize=7)
        ax.axhline(100, color="gray", linewidth=0.8)
        ax.set(
            title=f"budget {budget:g} %",
            xlabel="position in the answer (0 = predicts its first token)",
            ylabel="reads, % of target (mean)",
        )
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "retention_by_position.png"))
    return paths


def _bin_label(b) -> str:
    if b["hi"] is None:
        return f"{b['lo']}+"
    return str(b["lo"]) if b["hi"] == b["lo"] + 1 else f"{b['lo']}–{b['hi'] - 1}"


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt  # loaded by _pyplot already (the figure exists): no new import

    fig.tight_layout()
    try:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format="png", dpi=90)
    finally:
        plt.close(fig)
    return path


def unreachable(report: dict) -> list[str]:
    """One line per selector and budget that could not be measured, with why (its reads before any
    channel, above the budget): such a selector is missing from the plots, and the report says so."""
    lines = {}
    for c in report["cells"]:
        if c["status"] != "ok":
            lines.setdefault((c["selector"], c["budget"]), c.get("reason", "").removeprefix(f"{c['selector']}: "))
    return [
        f"{sel} at {budget:g} %: not reachable, so absent from the plots: {reason}"
        for (sel, budget), reason in lines.items()
    ]


def render_reader_eval(report: dict, out) -> str:
    """The console summary: every cell's row, a note per unreachable selector, and what was written to `out`."""
    acc = report["full_model"]["accuracy"]
    notes = unreachable(report)
    return (
        f"{report['model']}: selectors vs the full model (fp32), full model {acc['correct']}/{acc['items']} "
        f"items correct; generation: {report['generation']}\n\n"
        + table(table_rows(report), COLUMNS)
        + "".join(f"\nnote: {n}" for n in notes)
        + f"\n\n{out}: report.json, report.md, cells/, "
        + ", ".join(Path(p).name for p in report["plots"])
    )


def write_markdown(report: dict, path: Path) -> None:
    acc = report["full_model"]["accuracy"]
    drift, versus = drift_rows(report), versus_rows(report)
    text = (
        f"# eval-reader: {report['model']}\n\nfull model: {acc['correct']}/{acc['items']} items correct "
        f"({', '.join(f'{t} {n}' for t, n in acc['by_task'].items())}); generation: {report['generation']}\n\n"
        + table(table_rows(report), COLUMNS, markdown=True)
        + "\n"
    )
    notes = unreachable(report)
    if notes:
        text += "\n" + "".join(f"- {n}\n" for n in notes)
    if drift:
        text += (
            "\n## Calibrated thresholds on the evaluation data\n\nreads as % of the target (the top-k plan the "
            "threshold was calibrated to match), by where the token is\n\n"
            + table(drift, DRIFT_COLUMNS, markdown=True)
            + "\n"
        )
    if versus:
        verdicts = [r[m] for r in versus for m in ("kl_verdict", "top1_verdict", "acc_verdict") if r[m]]
        text += (
            "\n## Top-k against the calibrated threshold, same scores\n\n"
            + table(versus, VERSUS_COLUMNS, markdown=True)
            + f"\n\ntop-k matches or beats the threshold in {sum(v != 'threshold' for v in verdicts)} of "
            f"{len(verdicts)} comparisons\n"
        )
    with atomic_write(path) as f:
        f.write(text)


COLUMNS = [
    ("selector", "selector"),
    ("rule", "rule"),
    ("budget", "budget %", "{:g}"),
    ("target", "target reads %", "{:.2f}"),
    ("reads_mean", "reads % mean", "{:.2f}"),
    ("reads_p50", "median", "{:.2f}"),
    ("reads_p5_95", "5–95 %"),
    ("kl_mean", "KL mean", "{:.4f}"),
    ("kl_p99", "KL p99", "{:.3f}"),
    ("top1", "top-1 %", "{:.1f}"),
    ("acc", "accuracy % of full", "{:.1f}"),
    ("k", "k/rank (TP)"),
    ("note", "note"),
]


def table_rows(report: dict) -> list[dict]:
    rows = []
    for c in report["cells"]:
        row = {"selector": c["selector"], "rule": c["rule"], "budget": c["budget"]}
        if c["status"] != "ok":
            rows.append(row | {"note": "not reachable"})
            continue
        r = c["reads"]
        note = "measured"
        if c["rule"] == "topk":
            note = (
                "reads = plan on every token"
                if c["within_one_sector"]
                else f"OFF the plan by up to {c['max_read_deviation_bytes']} B"
            )
        rows.append(
            row
            | {
                "target": c["target_reads"],
                "reads_mean": r["mean"],
                "reads_p50": r["p50"],
                "reads_p5_95": f"{r['p5']:.2f}–{r['p95']:.2f}",
                "kl_mean": c["kl_mean"],
                "kl_p99": c["kl_p99"],
                "top1": 100 * c["top1"],
                "acc": c["accuracy_percent_of_full"],
                "k": c.get("k_per_rank"),
                "note": note,
            }
        )
    return rows


DRIFT_COLUMNS = [
    ("selector", "selector"),
    ("budget", "budget %", "{:g}"),
    ("target", "target reads %", "{:.2f}"),
    ("all", "all tokens", "{:.1f}"),
    ("text", "held-out text", "{:.1f}"),
    ("first", "answer position 0", "{:.1f}"),
    ("last", "last answer bin", "{:.1f}"),
    ("last_bin", "(positions)"),
]


def drift_rows(report: dict) -> list[dict]:
    """Each calibrated threshold's reads as % of its target: overall, on text, at the answer's start and end."""
    rows = []
    for c in report["cells"]:
        if c["status"] != "ok" or c["rule"] != "threshold":
            continue
        pct = 100 / c["target_reads"]
        bins = c["reads_by_answer_position"]
        text = c["by_source"].get("text")
        rows.append(
            {
                "selector": c["selector"],
                "budget": c["budget"],
                "target": c["target_reads"],
                "all": pct * c["reads"]["mean"],
                "text": pct * text["reads_mean"] if text else None,
                "first": pct * bins[0]["mean"] if bins else None,
                "last": pct * bins[-1]["mean"] if bins else None,
                "last_bin": f"{bins[-1]['lo']}+" if bins else None,
            }
        )
    return rows


VERSUS_COLUMNS = [
    ("selector", "selector"),
    ("budget", "budget %", "{:g}"),
    ("reads", "reads % top-k / thr"),
    ("kl", "KL mean top-k / thr"),
    ("kl_verdict", "better"),
    ("top1", "top-1 % top-k / thr"),
    ("top1_verdict", "better"),
    ("acc", "correct top-k / thr"),
    ("acc_verdict", "better"),
]


def _verdict(top, thr, higher_is_better: bool) -> str:
    if top == thr:
        return "tie"
    return "top-k" if (top > thr) == higher_is_better else "threshold"


def versus_rows(report: dict) -> list[dict]:
    """Per selector and budget where both rules ran: top-k against the calibrated threshold."""
    cells = {(c["selector"], c["budget"], c["rule"]): c for c in report["cells"] if c["status"] == "ok"}
    rows = []
    for (sel, budget, rule), top in cells.items():
        thr = cells.get((sel, budget, "threshold"))
        if rule != "topk" or thr is None:
            continue
        rows.append(
            {
                "selector": sel,
                "budget": budget,
                "reads": f"{top['reads']['mean']:.2f} / {thr['reads']['mean']:.2f}",
                "kl": f"{top['kl_mean']:.4f} / {thr['kl_mean']:.4f}",
                "kl_verdict": _verdict(top["kl_mean"], thr["kl_mean"], False),
                "top1": f"{100 * top['top1']:.1f} / {100 * thr['top1']:.1f}",
                "top1_verdict": _verdict(top["top1"], thr["top1"], True),
                "acc": f"{top['accuracy']['correct']} / {thr['accuracy']['correct']}",
                "acc_verdict": _verdict(top["accuracy"]["correct"], thr["accuracy"]["correct"], True),
            }
        )
    return rows


# ---- bench/results/reader-eval.md: the results page, written from the run's files -------------------------

_PLOTS = [
    ("Reads against accuracy and KL (left: accuracy, right: KL, log scale)", "reads_vs_quality.png"),
    ("Per-token reads (box 25–75 %, whiskers 5–95 %, triangle the mean, red the target)", "retention.png"),
    (
        "Mean reads as % of the target by position in the answer (bins; the last ones hold series items only)",
        "retention_by_position.png",
    ),
]


def _pair(top, thr, fmt: str) -> str:
    return f"{fmt.format(top)} / {fmt.format(thr)}"


def _span(values, fmt="{:.1f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def results_page(report: dict, layers: dict | None, folder: str = "reader-eval") -> str:
    """bench/results/reader-eval.md from the run that `folder` holds (its report.json and, from
    bench/reader_layers.py, layers.json): every number on the page is computed here from those files,
    so the page cannot describe another run than the one beside it."""
    cells = {(c["selector"], c["budget"], c["rule"]): c for c in report["cells"] if c["status"] == "ok"}
    budgets = sorted({c["budget"] for c in report["cells"]})
    pairs = [(sel, b) for (sel, b, rule) in cells if rule == "topk" and (sel, b, "threshold") in cells]
    lines = _intro_lines(report, cells, folder)
    for sel, b in pairs:
        top, thr = cells[(sel, b, "topk")], cells[(sel, b, "threshold")]
        lines.append(
            f"| {sel} | {b:g} | {_pair(top['reads']['mean'], thr['reads']['mean'], '{:.2f}')} "
            f"| {_pair(top['accuracy_percent_of_full'], thr['accuracy_percent_of_full'], '{:.1f}')} "
            f"| {_pair(top['kl_mean'], thr['kl_mean'], '{:.4f}')} "
            f"| {_pair(100 * top['top1'], 100 * thr['top1'], '{:.1f}')} |"
        )
    lines.append("")
    lines += [f"- {n}" for n in unreachable(report)]
    tops = [c for (_, _, rule), c in cells.items() if rule == "topk"]
    drift = drift_rows(report)
    lines += [
        "",
        f"Top-k reads its plan in every top-k cell: max deviation "
        f"{max((c['max_read_deviation_bytes'] for c in tops), default=0)} bytes. The calibrated thresholds read "
        f"{_span([r['all'] for r in drift])} % of their target on average, {_span([r['text'] for r in drift])} % "
        f"on held-out text alone, {_span([r['first'] for r in drift])} % at answer position 0 and "
        f"{_span([r['last'] for r in drift])} % in the last answer bin.",
        "",
    ]
    for caption, name in _PLOTS:
        lines += [f"{caption}:", "", f"![{name[:-4]}]({folder}/{name})", ""]
    if layers:
        lines += _layer_lines(layers, folder)
    lines += _versus_lines(report, folder)
    lines += _accuracy_lines(cells, budgets)
    return "\n".join(lines).rstrip() + "\n"


def _intro_lines(report: dict, cells: dict, folder: str) -> list[str]:
    """The page's title, the run it describes, the set-up, and the head of the results table."""
    s, acc = report["settings"], report["full_model"]["accuracy"]
    by_task = ", ".join(f"{t} {n}" for t, n in acc["by_task"].items())
    seconds = sum(c.get("seconds", 0) for c in report["cells"])
    return [
        "# The reader against TEAL, WINA, CATS and the oracle on the tiny model (`eval-reader`)",
        "",
        f"Written by `python -m neuron_moe.eval.reader_report bench/results/{folder}` from the run in "
        f"[{folder}/]({folder}/): `{report['model']}`, weights sha256 `{s.get('weights_sha256', '?')[:16]}…` "
        f"(`report.json` → `settings.weights_sha256`); {s.get('per_task')} items per task "
        f"({', '.join(s.get('tasks', []))}), {s.get('text_docs')} held-out texts, {s.get('calib_tokens')} "
        f"calibration tokens; the cells' own time {seconds:.0f} s. Everything is seeded, so a rerun on the "
        "same weights gives the same numbers (only `seconds` differs). "
        f"[{folder}/report.md]({folder}/report.md) holds every table as generated.",
        "",
        "```sh",
        "recipes/cpu/reader-eval.sh            # [CHECKPOINT_DIR]: the run, the per-layer analysis and this page",
        "```",
        "",
        "## Set-up",
        "",
        "- **Selectors**: each layer's routed experts are replaced by the selector "
        "(`experts/selector.py`) on every token, prefill and decode alike; the router, the dense MLP "
        "beside the MoE, attention and the rest are exact.",
        f"- **Evaluation**: {report['teacher_forced']}; {next(iter(cells.values()))['positions'] if cells else 0} "
        "positions scored. Task accuracy: greedy generation of every item with the selector, exact match "
        "up to EOS, as % of the full model's correct answers.",
        "- **Reads**: per token and layer, in 32-byte sectors, each selector in its natural layout "
        "(`reader/selectors.py`), as % of the full model's routed-expert reads. The **target** of a cell is "
        "the top-k plan's reads at that budget; a threshold is calibrated (on the calibration split) to keep "
        "the same fraction of units as that plan.",
        "",
        "## Results",
        "",
        f"Full model: **{acc['correct']} of {acc['items']} items correct ({by_task})**. Top-k / calibrated "
        "threshold, per selector and budget:",
        "",
        "| selector | budget % | reads % (top-k / thr, mean) | accuracy % of full | KL mean | top-1 % |",
        "|---|---|---|---|---|---|",
    ]


def _versus_lines(report: dict, folder: str) -> list[str]:
    """Top-k against the calibrated threshold on the same scores: how often each wins."""
    versus = versus_rows(report)
    verdicts = [r[m] for r in versus for m in ("kl_verdict", "top1_verdict", "acc_verdict")]
    acc_wins = [r["acc_verdict"] for r in versus]
    return [
        "## Top-k against the calibrated threshold, same scores",
        "",
        f"Top-k matches or beats the threshold in {sum(v != 'threshold' for v in verdicts)} of {len(verdicts)} "
        f"comparisons (KL, top-1, correct answers; {len(versus)} selector × budget pairs); on correct answers "
        f"in {sum(v != 'threshold' for v in acc_wins)} of {len(acc_wins)}. Per pair in "
        f"[{folder}/report.md]({folder}/report.md).",
        "",
    ]


def _layer_lines(layers: dict, folder: str) -> list[str]:
    rows = layers["layers"]
    k, k16, oracle = rows[0].get("reader_k"), rows[0].get("k-r16"), rows[0].get("oracle_channels")
    out = [
        f"Per-layer relative error of the routed output, ‖y − y_full‖ / ‖y_full‖, at {layers['budget']:g} % top-k "
        f"on {layers['tokens']} {layers['split']}-split tokens (`bench/reader_layers.py`, "
        f"[{folder}/layers.json]({folder}/layers.json); oracle@k: the oracle at the reader's k; recall: share "
        "of the reader-r0's channels that the exact scores also rank in its top k):",
        "",
        f"| layer | TEAL | WINA | oracle ({oracle} ch) | oracle@k ({k} ch) | reader-r0 ({k} ch) | sketch recall "
        f"| reader-r16 ({k16} ch + rank 16) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    for r in rows:
        out.append(
            f"| {r['layer']} | {fmt(r['teal'])} | {fmt(r['wina'])} | {fmt(r['oracle'])} | {fmt(r['oracle@k'])} "
            f"| {fmt(r['reader-r0'])} | {fmt(r['recall'])} | {fmt(r['reader-r16'])} |"
        )
    if all(r.get("reader-r32") is None for r in rows):
        out += ["", f"reader (rank 32): not reachable at {layers['budget']:g} %."]
    return out + [""]


def _accuracy_lines(cells: dict, budgets: list[float]) -> list[str]:
    """Each selector's worst and best accuracy (% of full) over its rules, per budget."""
    out = [
        "## Accuracy kept (% of the full model's), over the rules",
        "",
        "| selector | " + " | ".join(f"{b:g} %" for b in budgets) + " |",
    ]
    out.append("|---|" + "---|" * len(budgets))
    for sel in dict.fromkeys(sel for sel, _, _ in cells):
        row = []
        for b in budgets:
            got = [c["accuracy_percent_of_full"] for (s, bb, _), c in cells.items() if s == sel and bb == b]
            row.append(_span(got) if got else "not reachable")
        out.append(f"| {sel} | " + " | ".join(row) + " |")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    """python -m neuron_moe.eval.reader_report DIR [PAGE]: the results page from DIR's report.json (and
    layers.json, if there), to PAGE (default: DIR.md beside DIR)."""
    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2:
        print("usage: python -m neuron_moe.eval.reader_report DIR [PAGE]", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    page = Path(argv[1]) if len(argv) == 2 else folder.with_suffix(".md")
    try:
        report = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError) as e:
        print(f"error: {folder / 'report.json'}: {e}", file=sys.stderr)
        return 2
    layers_path = folder / "layers.json"
    layers = json.loads(layers_path.read_text()) if layers_path.exists() else None
    with atomic_write(page) as f:
        f.write(results_page(report, layers, folder.name))
    print(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
