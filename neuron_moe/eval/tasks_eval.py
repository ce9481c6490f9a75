"""`neuron-moe eval-tasks`: the task suite (`tasks.py`) run on a port's model through any SEQ_MATCH
backend, with held-out perplexity and expert load when a build-corpus directory is given."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from ..model import build_model
from ..report import table
from ..tokenizer import load_tokenizer
from ..training.corpus import read_jsonl
from .seq_match import BACKENDS
from .tasks import TASKS, accuracy_by_task, eval_items, score_items, text_metrics, unigram_counts


def evaluate(port, backend: str = "eager", checkpoint=None, per_task: int = 50, corpus=None,
             text_docs: int = 200, tasks=TASKS, split: str = "eval") -> dict:
    """Task accuracy on `split` with `backend` (any of seq_match.BACKENDS); with `corpus` (a
    build-corpus directory) also held-out perplexity, the unigram baseline and the expert load on
    that split's text (the calibration text for valid)."""
    tokenizer = load_tokenizer(port, checkpoint)
    items = eval_items(per_task, tasks=tasks, split=split)
    generate = BACKENDS[backend](port, None, checkpoint)
    with tqdm(total=len(items), desc=f"eval-tasks ({backend})", leave=False) as bar:
        rows = score_items(generate, tokenizer, items, progress=bar)
    report = {"model": port.name, "backend": backend, "split": split, "items_per_task": per_task,
              "tasks": accuracy_by_task(rows), "text": None, "items": rows}
    if corpus is not None:
        train_text = [r["text"] for r in read_jsonl(Path(corpus) / "train.jsonl") if r["kind"] == "text"]
        held_out = (read_jsonl(Path(corpus) / "eval_text.jsonl") if split == "eval" else
                    [r for r in read_jsonl(Path(corpus) / "calib.jsonl") if r["kind"] == "text"])
        held_out = [r["text"] for r in held_out][:text_docs]
        unigram = unigram_counts(tokenizer.encode(t) for t in train_text)
        model = build_model(port, "eager", torch.float32, checkpoint)
        longest = port.config.max_position_embeddings  # a few fortunes are longer than the training window
        docs = [tokenizer.encode(t)[:longest] for t in held_out]
        report["text"] = dict(text_metrics(model, docs, unigram, port.config.vocab_size), documents=len(held_out))
    return report


def render_tasks(report: dict, num_experts: int) -> str:
    lines = [f"{report['model']}: {report['split']} split, greedy answers with {report['backend']}, "
             "exact match up to EOS\n",
             table(report["tasks"], [("task", "task"), ("items", "items"), ("correct", "correct"),
                                     ("accuracy", "accuracy", "{:.1%}"), ("answer_tokens_min", "answer tokens min"),
                                     ("answer_tokens_max", "max")])]
    text = report["text"]
    if text is None:
        lines.append("\nno --corpus: held-out perplexity and expert load not measured")
    else:
        lines += [f"\nheld-out text ({text['tokens']} tokens): perplexity {text['perplexity']:.2f}, "
                  f"unigram baseline {text['unigram_perplexity']:.2f}",
                  f"expert share of routed slots on that text: min {text['expert_share_min']:.3f}, "
                  f"max {text['expert_share_max']:.3f} (uniform {1 / num_experts:.3f})"]
    return "\n".join(lines)
