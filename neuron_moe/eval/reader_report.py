"""eval-reader's report, from its merged results: markdown tables and matplotlib plots (PNG).

report.md              every cell; each calibrated threshold's reads against its target (overall,
                       held-out text, start and end of the answer); top-k against the threshold
reads_vs_quality.png   actual mean reads against accuracy (% of full) and KL, per selector and rule
retention.png          per-token reads (% of full): box 25–75 %, whiskers 5–95 %, target marked
retention_by_position.png  mean reads as % of the target against the position in the answer
"""

from __future__ import annotations

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
