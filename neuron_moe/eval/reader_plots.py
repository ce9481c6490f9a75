"""The eval-reader plots, from its merged report (matplotlib, PNG files).

reads_vs_quality.png   actual mean reads against accuracy (% of full) and KL, per selector and rule
retention.png          per-token reads (% of full): box 25–75 %, whiskers 5–95 %, target marked
retention_by_position.png  mean reads as % of the target against the position in the answer
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .reader_eval import ANSWER_BINS

RULE_STYLE = {"topk": ("o", "-"), "threshold": ("x", "--")}


def _pyplot():
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
    for (sel, rule) in dict.fromkeys((c["selector"], c["rule"]) for c in cells):
        mine = sorted((c for c in cells if (c["selector"], c["rule"]) == (sel, rule)), key=lambda c: c["budget"])
        x = [c["reads"]["mean"] for c in mine]
        marker, line = RULE_STYLE[rule]
        style = dict(color=colors[sel], marker=marker, linestyle=line, label=f"{sel} {rule}")
        axes[0].plot(x, [c.get("accuracy_percent_of_full") or float("nan") for c in mine], **style)
        axes[1].plot(x, [c["kl_mean"] for c in mine], **style)
    axes[0].set(xlabel="reads, % of full (mean per token)", ylabel="task accuracy, % of full", title="accuracy")
    axes[1].set(xlabel="reads, % of full (mean per token)", ylabel="KL(full ‖ sparse), mean", title="KL",
                yscale="log")
    axes[1].legend(fontsize=7)
    paths.append(_save(fig, out / "reads_vs_quality.png"))

    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        mine = [c for c in cells if c["budget"] == budget]
        stats = [{"label": f"{c['selector']}\n{c['rule']}", "med": c["reads"]["p50"], "q1": c["reads"]["p25"],
                  "q3": c["reads"]["p75"], "whislo": c["reads"]["p5"], "whishi": c["reads"]["p95"],
                  "mean": c["reads"]["mean"], "fliers": []} for c in mine]
        ax.bxp(stats, showmeans=True)
        ax.plot(range(1, len(mine) + 1), [c["target_reads"] for c in mine], "r_", markersize=20, label="target")
        ax.set(title=f"budget {budget:g} %", ylabel="reads per token, % of full")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "retention.png"))

    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        labels = {}
        for c in (c for c in cells if c["budget"] == budget):
            bins = c["reads_by_answer_position"]
            labels.update({b["lo"]: _bin_label(b) for b in bins})
            marker, line = RULE_STYLE[c["rule"]]
            ax.plot([ANSWER_BINS.index(b["lo"]) for b in bins], [100 * b["mean"] / c["target_reads"] for b in bins],
                    color=colors[c["selector"]], marker=marker, linestyle=line, label=f"{c['selector']} {c['rule']}")
        ax.set_xticks([ANSWER_BINS.index(lo) for lo in labels], list(labels.values()), fontsize=7)
        ax.axhline(100, color="gray", linewidth=0.8)
        ax.set(title=f"budget {budget:g} %", xlabel="position in the answer (0 = predicts its first token)",
               ylabel="reads, % of target (mean)")
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "retention_by_position.png"))
    return paths


def _bin_label(b) -> str:
    if b["hi"] is None:
        return f"{b['lo']}+"
    return str(b["lo"]) if b["hi"] == b["lo"] + 1 else f"{b['lo']}–{b['hi'] - 1}"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=90)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    tmp.replace(path)
    return path
