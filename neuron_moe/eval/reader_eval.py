"""`neuron-moe eval-reader`: channel selectors against the full model at fixed read budgets.

The model runs in fp32 with HF's eager experts as the reference; for each cell (selector ×
retention rule × budget) every layer's routed experts go through `reader/selectors.py`
(`experts/selector_experts.py`, on every token, prefill and decode alike) and the rest stays exact.

Data. Evaluation: the task suite's evaluation items (`tasks.eval_items`, seed 1234; prompt +
answer + EOS, teacher forced: the scored positions are those that predict an answer token) and,
with a corpus, held-out text (eval_text.jsonl). Calibration, for the Threshold rules only: the
calibration split build-corpus uses (`eval_items(seed=4321)`, minus any item whose prompt is an
evaluation prompt) and, with a corpus, calib.jsonl text. Thresholds are set per layer on the
full model's activations there, so they meet the evaluation data as a deployment would: unseen.

Per cell, over the scored positions: KL(full ‖ sparse) (mean, p99), top-1 agreement, reads per
token (mean over layers, % of the full model's routed-expert reads: the retention) against the
target (the top-k plan at that budget), its distribution and its mean per answer position; and
greedy task accuracy as % of the full model's. A cell is one JSON file under OUT/cells, written
atomically, so a rerun skips what is done; a budget a selector cannot reach is a cell too. An OUT
the run made and that holds no cell yet is removed again when the run fails (a full disk, Ctrl-C).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .. import spec
from .. import tasks as T
from ..errors import UserError
from ..experts.int8 import int8_experts
from ..experts.selector_experts import attach_selector, moe_layers
from ..greedy import greedy
from ..model import build_model, prep_port
from ..reader import selectors
from ..reader.accounting import BudgetError, full_bytes, rank_geometry, solve_k, solve_rank_k
from ..reader.geometry import Geometry
from ..reader.prep import model_expert_weights, write_sidecar
from ..reader.sidecar import SECTOR, Sidecar
from ..report import made_dir, read_json_object, write_json
from ..tokenizer import load_tokenizer
from ..training.corpus import read_jsonl
from .reader_report import plot, write_markdown
from .tasks import accuracy_by_task, score_items

RULES = spec.RETENTION_RULES  # topk, threshold
SELECTORS = spec.SELECTOR_NAMES  # selectors.SELECTORS: teal, wina, cats, oracle, reader
# Bin edges of answer positions (position i predicts answer token i); the last bin is open.
ANSWER_BINS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
CALIB_TOKENS = 2048  # calibration tokens per layer (a seeded sample): the baselines gather [T, k, 2I, H] at once
QUICK = {
    "per_task": spec.EVAL_READER_QUICK_ITEMS,
    "tasks": ("fact", "kv", "reverse"),
    "text_docs": 4,
    "calib_tokens": 256,
}


class EvalError(UserError):
    pass


@dataclass
class Sequence:
    ids: list[int]
    source: str  # the task, or "text"
    start: int  # first scored position: it predicts token start + 1


@dataclass
class Settings:
    # the full run's size: two budgets, every selector and rule in <= 30 min on 2 CPU cores
    per_task: int = spec.EVAL_READER_ITEMS
    tasks: tuple = T.TASKS
    text_docs: int = 50
    calib_tokens: int = CALIB_TOKENS
    corpus: str | None = None

    @classmethod
    def quick(cls, corpus=None) -> "Settings":
        return cls(corpus=corpus, **QUICK)


# ---- input ----


def parse_budgets(text: str) -> list[float]:
    try:
        budgets = [float(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise EvalError(f"--budgets: expected comma-separated percentages, got {text!r}") from None
    bad = [b for b in budgets if not 0 < b <= 100]
    if not budgets or bad:
        raise EvalError(f"--budgets: each budget must be in (0, 100] percent, got {text!r}")
    return budgets


# Selector specs (`spec.SelectorSpec`, parsed by `spec.parse_selector`): a baseline's name, or
# reader[-rN][-tpT[variant]][-int8|-int8dq].
#   reader-rN                     recovery rank N (≤ the sidecar's; plain `reader`: the sidecar's)
#   reader-int8                   the reader over the int8 experts (exact rows in int8, sketch and recovery
#                                 from the model's weights); -int8dq: sketch and recovery from the dequantised
#                                 int8. Budgets stay a share of the bf16 full read: one budget is equal bytes.
# The reader at TP T on the channel layout (`reader/shard.py`), emulated in this one process:
#   reader[-rN]-tpT               per-rank quota: each rank its k_r of its own channels, k_r solved from
#                                 the accounting on the rank's geometry (every rank reads the budget)
#   reader[-rN]-tpT-global        one top-(T·k_r) over all ranks' scores (gathered): same total k, no quota
#   reader[-rN]-tpT-split         per-rank quota of ⌊k/T⌋, k the one-rank reader's at the budget: the quota's
#                                 cost at the one-rank reader's exact channels, whatever a rank then reads
#   reader[-rN]-tpT-split-global  one top-(T·⌊k/T⌋) over all ranks


def parse_selectors(text: str) -> list[spec.SelectorSpec]:
    """Selector specs (`spec.parse_selector`), each checked."""
    specs = [spec.parse_selector(s.strip(), SELECTORS) for s in text.split(",") if s.strip()]
    if not specs:
        raise EvalError("--selectors: none given")
    return specs


def parse_rules(text: str) -> list[str]:
    rules = [r.strip() for r in text.split(",") if r.strip()]
    if not rules or any(r not in RULES for r in rules):
        raise EvalError(f"--rules: expected a comma-separated subset of {', '.join(RULES)}, got {text!r}")
    return rules


def corpus_text(corpus: str | None, name: str, docs: int) -> list[str]:
    """The first `docs` text documents of a build-corpus file (none without a corpus)."""
    if corpus is None:
        return []
    return [r["text"] for r in read_jsonl(Path(corpus) / name) if r.get("kind", "text") == "text"][:docs]


def item_sequence(tokenizer, item: T.Item) -> Sequence:
    prompt = tokenizer.encode(item.prompt)
    ids = tokenizer.encode(item.prompt + item.answer) + [tokenizer.eos_token_id]
    if ids[: len(prompt)] != prompt:
        raise EvalError(f"the tokenizer does not split {item.prompt!r} where its answer begins")
    return Sequence(ids, item.task, len(prompt) - 1)


def text_sequences(tokenizer, texts: list[str], longest: int) -> list[Sequence]:
    return [Sequence(tokenizer.encode(t)[:longest], "text", 0) for t in texts]


def evaluation_items(s: Settings) -> list[T.Item]:
    return T.eval_items(s.per_task, tasks=s.tasks)


def calibration_items(s: Settings) -> list[T.Item]:
    """build-corpus's calibration split, minus items whose prompt an evaluation item has (the fact
    task draws both from the same few held-out countries)."""
    held_out = {i.prompt for i in evaluation_items(s)}
    return [i for i in T.eval_items(s.per_task, seed=4321, tasks=s.tasks) if i.prompt not in held_out]


def sequences(tokenizer, s: Settings, longest: int, split: str) -> list[Sequence]:
    """Teacher-forced sequences of the `evaluation` or `calibration` split."""
    items, text_file = (
        (evaluation_items(s), "eval_text.jsonl") if split == "evaluation" else (calibration_items(s), "calib.jsonl")
    )
    return [item_sequence(tokenizer, i) for i in items] + text_sequences(
        tokenizer, corpus_text(s.corpus, text_file, s.text_docs), longest
    )


# ---- running the model ----


@torch.no_grad()
def teacher_forced(model, seqs: list[Sequence], states=None, progress=None):
    """Per sequence: log-probs at the scored positions [n, V] and, with selector states, the reads
    of each layer at those positions [L, n] (bytes)."""
    out = []
    for seq in seqs:
        for state in states or ():
            state.results = []
        logits = model(input_ids=torch.tensor([seq.ids])).logits[0, seq.start : -1].float()
        reads = None
        if states:
            reads = torch.stack([torch.cat([r.reads for r in st.results])[seq.start : -1] for st in states])
            for state in states:
                state.results = None
        out.append((logits.log_softmax(-1), reads))
        if progress is not None:
            progress.update(1)
    return out


@torch.no_grad()
def calibration_inputs(model, seqs: list[Sequence], tokens: int, seed: int = 0) -> list[tuple]:
    """Each layer's routed-experts inputs (x, index, weights) on the calibration sequences, full
    model, the same seeded sample of `tokens` positions in every layer."""
    captured = [[] for _ in model.model.layers]
    hooks = [
        layer.experts.register_forward_pre_hook(lambda m, args, into=into: into.append(args))
        for layer, into in zip(model.model.layers, captured)
    ]
    try:
        for seq in seqs:
            model(input_ids=torch.tensor([seq.ids]))
    finally:
        for h in hooks:
            h.remove()
    layers = [tuple(torch.cat([args[i] for args in calls]) for i in range(3)) for calls in captured]
    total = layers[0][0].shape[0]
    pick = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:tokens]
    return [tuple(t[pick] for t in layer) for layer in layers]


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


# ---- statistics ----


def quantiles(values: torch.Tensor, qs=(0.05, 0.25, 0.5, 0.75, 0.95)) -> dict:
    v = values.double()
    return {f"p{round(100 * q)}": float(v.quantile(q)) for q in qs} | {"mean": float(v.mean())}


def answer_bins(positions: torch.Tensor, values: torch.Tensor) -> list[dict]:
    rows = []
    for lo, hi in zip(ANSWER_BINS, (*ANSWER_BINS[1:], None)):
        inside = (positions >= lo) & (positions < hi if hi is not None else True)
        if inside.any():
            rows.append({"lo": lo, "hi": hi, "tokens": int(inside.sum()), "mean": float(values[inside].mean())})
    return rows


def cell_stats(reference, sparse, seqs: list[Sequence], full: int) -> dict:
    """KL, top-1 agreement and reads (% of `full` bytes) over the scored positions."""
    kl, agree, reads, source, position = [], [], [], [], []
    for (ref, _), (got, r), seq in zip(reference, sparse, seqs):
        kl.append((ref.exp() * (ref - got)).sum(-1).clamp(min=0))
        agree.append(ref.argmax(-1) == got.argmax(-1))
        reads.append(100 * r.double().mean(0) / full)
        source += [seq.source] * len(ref)
        position.append(torch.arange(len(ref)) if seq.source != "text" else torch.full((len(ref),), -1))
    kl, agree, reads, position = torch.cat(kl), torch.cat(agree), torch.cat(reads), torch.cat(position)
    by_source = {}
    for name in dict.fromkeys(source):
        rows = torch.tensor([s == name for s in source])
        by_source[name] = {
            "positions": int(rows.sum()),
            "kl_mean": float(kl[rows].mean()),
            "top1": float(agree[rows].double().mean()),
            "reads_mean": float(reads[rows].mean()),
        }
    answer = position >= 0
    return {
        "positions": len(kl),
        "kl_mean": float(kl.mean()),
        "kl_p99": float(kl.double().quantile(0.99)),
        "top1": float(agree.double().mean()),
        "reads": quantiles(reads),
        "by_source": by_source,
        "reads_by_answer_position": answer_bins(position[answer], reads[answer]),
    }


def accuracy(rows: list[dict]) -> dict:
    return {
        "correct": sum(r["correct"] for r in rows),
        "items": len(rows),
        "by_task": {t["task"]: t["correct"] for t in accuracy_by_task(rows)} if rows else {},
    }


# ---- the run ----


def cell_name(selector: str, rule: str, budget: float) -> str:
    return f"{selector}-{rule}-{budget:g}"


@dataclass
class Run:
    """One evaluation: the model, its data and the full model's reference; `cell` measures one cell."""

    model: object
    tokenizer: object
    settings: Settings
    out: Path
    sidecar: object = None  # sidecar.Sidecar, when a reader cell is asked for
    reader_rank: int | None = None  # plain `reader`'s recovery rank: the port's [reader] rank (None: the sidecar's)
    evaluation: list = field(default_factory=list)
    items: list = field(default_factory=list)
    reference: list | None = None  # the full model's teacher-forced log-probs, computed on first need
    calibration: list | None = None  # per layer (x, index, weights), computed on first need

    def full_reference(self) -> list:
        """Computed only when a cell is measured: a resumed run whose cells are all done skips it."""
        if self.reference is None:
            with tqdm(total=len(self.evaluation), desc="eval-reader: full model, teacher forced", leave=False) as bar:
                self.reference = teacher_forced(self.model, self.evaluation, progress=bar)
        return self.reference

    def calibrate_inputs(self) -> list[tuple]:
        if self.calibration is None:
            longest = self.model.config.max_position_embeddings
            seqs = sequences(self.tokenizer, self.settings, longest, "calibration")
            spec.set_experts(self.model, spec.EAGER)
            self.calibration = calibration_inputs(self.model, seqs, self.settings.calib_tokens)
        return self.calibration

    def layers(self, selector: spec.SelectorSpec) -> list:
        if not selector.reader:
            return moe_layers(self.model)
        # plain `reader`: the port's [reader] rank, else the sidecar's
        rank = self.reader_rank if selector.rank is None else selector.rank
        if rank is not None and rank > self.sidecar.layout.rank:
            raise EvalError(f"{selector.text}: recovery rank {rank} above the sidecar's ({self.sidecar.layout.rank})")
        sidecar = self.dequantised_sidecar() if selector.dequantised else self.sidecar
        layers = moe_layers(self.model, sidecar, rank, int8=selector.quantization == spec.INT8_QUANTIZATION)
        for layer in layers:
            layer.tp = selector.tp or 1
        return layers

    def dequantised_sidecar(self):
        """The sidecar made from the int8 experts' dequantised weights: OUT/sidecar-int8dq.safetensors, once."""
        path = self.out / "sidecar-int8dq.safetensors"
        if not path.exists():
            c = self.model.config
            write_sidecar(
                path,
                [int8_experts(layer.experts).dequantized() for layer in self.model.model.layers],
                Geometry.from_config(c),
                layers=c.num_hidden_layers,
                seed=self.sidecar.seed,
                rank=self.sidecar.layout.rank,
                scan=self.sidecar.scan,
            )
        return Sidecar(path)

    def generate(self, progress=None) -> list[dict]:
        """Greedy answers, one batch per task (a batch runs as many steps as its longest answer)."""
        rows = []
        for task in dict.fromkeys(i.task for i in self.items):
            mine = [i for i in self.items if i.task == task]
            rows += score_items(
                lambda ids, mask, n: greedy(self.model, ids, mask, n),
                self.tokenizer,
                mine,
                batch_size=64,
                progress=progress,
            )
        return rows

    def cell(self, selector: spec.SelectorSpec, rule: str, budget: float, progress=None) -> dict:
        """One selector × rule × budget: its statistics, or why the budget is not reachable."""
        started = time.perf_counter()
        name, layers = selector.name, self.layers(selector)
        row = {"selector": selector.text, "rule": rule, "budget": budget}
        full = full_bytes(layers[0].geo)
        try:
            if layers[0].tp > 1:
                rules, planned, full, k = tp_plan(layers, selector, budget)
                row["k_per_rank"] = k
            else:
                planned = selectors.charged(
                    name,
                    layers[0].geo,
                    layers[0].settings,
                    selectors.plan(name, layers[0].geo, layers[0].settings, budget),
                )
                if rule == "topk":
                    rules = [selectors.top_k(name, layer, budget) for layer in layers]
                else:
                    rules = [
                        selectors.calibrate(name, layer, *inputs, budget)
                        for layer, inputs in zip(layers, self.calibrate_inputs())
                    ]
        except BudgetError as e:
            return row | {"status": "not reachable", "reason": str(e)}
        reference = self.full_reference()  # before the selector replaces the experts
        states = attach_selector(self.model, name, layers, rules)
        try:
            sparse = teacher_forced(self.model, self.evaluation, states, progress)
            rows = self.generate(progress)
        finally:
            spec.set_experts(self.model, spec.EAGER)
        stats = cell_stats(reference, sparse, self.evaluation, full)
        # top-k: the plan must be read on every token and layer (measured from what each kept);
        # threshold: what the calibrated rule read is reported against the same target, not checked
        deviation = max(int((r - planned).abs().max()) for _, r in sparse) if rule == "topk" else None
        return row | {
            "status": "ok",
            "target_reads": 100 * planned / full,
            **stats,
            "max_read_deviation_bytes": deviation,
            "within_one_sector": None if deviation is None else deviation <= SECTOR,
            "accuracy": accuracy(rows),
            "seconds": time.perf_counter() - started,
        }


def _read(path: Path) -> dict:
    """A file of OUT, written by an earlier run: a corrupt one is named, never a traceback."""
    return read_json_object(path, EvalError, f"{path}: missing")


def tp_plan(layers, selector: spec.SelectorSpec, budget: float) -> tuple[list, int, int, int]:
    """(rules, planned bytes per rank and token, a rank's full read, k per rank) of the reader at TP
    `layers[0].tp` (its variant: `selector.split`, `selector.gathered`); a BudgetError where a rank
    cannot reach the budget."""
    geo, settings, tp = layers[0].geo, layers[0].settings, layers[0].tp
    if selector.split:  # the one-rank reader's exact channels, split evenly
        k = solve_k(geo, settings, budget) // tp
    else:
        k = solve_rank_k(geo, settings, budget, tp)
    local = rank_geometry(geo, tp)
    if selector.gathered:
        rules = [selectors.TopK({"channel": tp * k}) for _ in layers]
    else:
        rules = [selectors.RankTopK({"channel": k}, tp, geo.intermediate) for _ in layers]
    return rules, selectors.charged(selector.name, local, settings, {"channel": k}), full_bytes(local), k


def open_run(port, checkpoint, settings: Settings, out: Path, need_sidecar: bool) -> Run:
    """Load the model and data; check OUT holds nothing from other weights or settings; prep the
    sidecar into OUT once."""
    model = build_model(port, spec.EAGER, torch.float32, checkpoint)
    tokenizer = load_tokenizer(port, checkpoint)
    key = {
        "model": port.name,
        "weights_sha256": weights_digest(model),
        "reader_rank": port.reader.recovery_rank,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in settings.__dict__.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / "run.json"
    if run_file.exists():
        before = _read(run_file)
        if before != key:
            changed = sorted(k for k in key if before.get(k) != key[k])
            raise EvalError(
                f"{out} holds cells of another run (different {', '.join(changed)}); pass another --out or remove it"
            )
    else:
        write_json(key, str(run_file))
    run = Run(model, tokenizer, settings, out, reader_rank=port.reader.recovery_rank)
    if need_sidecar:
        path = out / "sidecar.safetensors"
        if not path.exists():
            prep_port(port, path, checkpoint, model=model)  # a random-weights port's model is not built again
        run.sidecar = Sidecar(path)
        run.sidecar.check_source(model_expert_weights(model))
    run.evaluation = sequences(tokenizer, settings, model.config.max_position_embeddings, "evaluation")
    run.items = evaluation_items(settings)
    return run


def evaluate(
    port,
    checkpoint,
    budgets: list[float],
    specs: list[spec.SelectorSpec],
    rules: list[str],
    out: Path,
    settings: Settings,
) -> dict:
    """Every cell (skipping those OUT already holds), then the merged report: OUT/report.json."""
    out = Path(out)
    if settings.corpus is not None:
        for name in ("eval_text.jsonl", "calib.jsonl"):
            if not (Path(settings.corpus) / name).is_file():
                raise EvalError(
                    f"{Path(settings.corpus) / name}: missing; build the corpus first "
                    f"(neuron-moe build-corpus --out {settings.corpus})"
                )
    if "threshold" in rules and any(s.tp for s in specs):
        raise EvalError("the reader at TP T (reader-...-tpT) is a top-k rule per rank: pass --rules topk")
    # a folder this run made goes again if it fails before a cell is done (a full disk, Ctrl-C); cells stay
    with made_dir(out, keep=lambda: any((out / "cells").glob("*.json"))):
        run = open_run(port, checkpoint, settings, out, any(s.reader for s in specs))
        return _run(run, port.name, budgets, specs, rules)


def _run(run: Run, model: str, budgets: list[float], specs: list[spec.SelectorSpec], rules: list[str]) -> dict:
    """Every cell of `run` not yet in its OUT, then the merged report."""
    out = run.out
    for selector in specs:
        run.layers(selector)  # a reader rank above the sidecar's is refused before any cell runs
    per_cell = len(run.evaluation) + len(run.items)
    cells = out / "cells"
    full_file = cells / "full.json"
    if not full_file.exists():
        with tqdm(total=len(run.items), desc="eval-reader: full model", leave=False) as bar:
            write_json({"accuracy": accuracy(run.generate(bar))}, str(full_file))
    wanted = [(s, r, b) for b in budgets for s in specs for r in rules]
    results = []
    with tqdm(total=len(wanted), desc="eval-reader", unit="cell") as bar:
        for selector, rule, budget in wanted:
            name = cell_name(selector.text, rule, budget)
            path = cells / f"{name}.json"
            if not path.exists():
                bar.set_postfix_str(name)
                with tqdm(total=per_cell, desc=name, leave=False) as inner:
                    write_json(run.cell(selector, rule, budget, inner), str(path))
            results.append(_read(path))
            bar.update(1)
    full_acc = _read(full_file).get("accuracy")
    if not isinstance(full_acc, dict):
        raise EvalError(f"{full_file}: no 'accuracy' object; remove the file to recompute it")
    for row in results:
        if row["status"] == "ok":
            row["accuracy_percent_of_full"] = (
                100 * row["accuracy"]["correct"] / full_acc["correct"] if full_acc["correct"] else None
            )
    report = {
        "model": model,
        "settings": _read(out / "run.json"),
        "generation": "greedy, the selector on every token (prefill and decode alike)",
        "teacher_forced": "prompt + answer + EOS; scored: the positions that predict an answer token, and "
        "every position of the held-out text",
        "full_model": {"accuracy": full_acc},
        "cells": results,
    }
    write_json(report, str(out / "report.json"))
    write_markdown(report, out / "report.md")
    report["plots"] = [str(p) for p in plot(report, out)]
    return report
