"""`neuron-moe eval-tasks`: a model scored on the task suite (`neuron_moe/tasks.py`) — greedy
generation through any SEQ_MATCH backend, exact match of the text up to the first EOS; perplexity
of held-out text against a unigram baseline; and the share of tokens each expert receives on the
evaluation text. The report names the backend's weight format and the linears in it (--quantization,
--quantized-layers); the held-out text runs through HF's eager model in fp32 with the same formats."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from ..greedy import left_pad
from ..model import build_model
from ..report import table
from ..spec import EAGER, NO_QUANTIZATION, Backend
from ..tasks import TASKS, Item, eval_items
from ..tokenizer import answer_text, load_tokenizer
from ..training.corpus import read_jsonl
from .seq_match import BACKENDS, backend_options, generator


def score_items(generate, tokenizer, items: list[Item], batch_size: int = 32, progress=None) -> list[dict]:
    """Greedy answers of `generate` (a SEQ_MATCH backend's generator), one row per item."""
    rows = []
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        ids, mask = left_pad([tokenizer.encode(i.prompt) for i in batch], tokenizer.pad_token_id)
        want = [len(tokenizer.encode(i.answer)) for i in batch]  # encode adds BOS: +1 leaves room for EOS
        gen = generate(ids, mask, max(want) + 1)
        for item, toks, n in zip(batch, gen.tokens.tolist(), want):
            got = answer_text(tokenizer, toks)
            rows.append(
                {
                    "task": item.task,
                    "prompt": item.prompt,
                    "answer": item.answer,
                    "got": got,
                    "correct": got == item.answer,
                    "answer_tokens": n - 1,
                }
            )
        if progress is not None:
            progress.update(len(batch))
    return rows


def accuracy_by_task(rows: list[dict]) -> list[dict]:
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        lengths = [r["answer_tokens"] for r in mine]
        out.append(
            {
                "task": task,
                "items": len(mine),
                "correct": sum(r["correct"] for r in mine),
                "accuracy": sum(r["correct"] for r in mine) / len(mine),
                "answer_tokens_min": min(lengths),
                "answer_tokens_max": max(lengths),
            }
        )
    return out


def unigram_counts(token_lists) -> tuple[Counter, int]:
    counts = Counter()
    for toks in token_lists:
        counts.update(toks[1:])  # BOS is given, never predicted
    return counts, sum(counts.values())


@torch.no_grad()
def text_metrics(model, docs: list[list[int]], unigram: tuple[Counter, int], vocab_size: int) -> dict:
    """Held-out perplexity of the model and of a unigram model of the training text (add-one
    smoothed), over the same tokens; plus each expert's share of the routed token slots."""
    counts, total = unigram
    nll = uni_nll = 0.0
    n = 0
    loads = None
    hooks, captured = [], []
    for layer in model.model.layers:
        hooks.append(layer.router.register_forward_hook(lambda m, i, out: captured.append(out[2])))
    try:
        for toks in docs:
            captured.clear()
            ids = torch.tensor([toks])
            logits = model(input_ids=ids).logits[0, :-1].float()
            target = ids[0, 1:]
            nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            uni_nll -= sum(math.log((counts[t] + 1) / (total + vocab_size)) for t in target.tolist())
            n += len(target)
            per_layer = torch.stack(
                [torch.bincount(idx.flatten(), minlength=model.config.num_experts) for idx in captured]
            )  # [L, E]
            loads = per_layer if loads is None else loads + per_layer
    finally:
        for h in hooks:
            h.remove()
    share = loads.double() / loads.sum(-1, keepdim=True)
    return {
        "tokens": n,
        "perplexity": math.exp(nll / n),
        "unigram_perplexity": math.exp(uni_nll / n),
        "expert_share": share.tolist(),  # [layer][expert], each row sums to 1
        "expert_share_min": float(share.min()),
        "expert_share_max": float(share.max()),
    }


def evaluate(
    port,
    backend: Backend = BACKENDS["eager"],
    checkpoint=None,
    per_task: int = 50,
    corpus=None,
    text_docs: int = 200,
    tasks=TASKS,
    split: str = "eval",
) -> dict:
    """Task accuracy on `split` with `backend` (any of seq_match.BACKENDS); with `corpus` (a
    build-corpus directory) also held-out perplexity, the unigram baseline and the expert load on
    that split's text (the calibration text for valid)."""
    tokenizer = load_tokenizer(port, checkpoint)
    items = eval_items(per_task, tasks=tasks, split=split)
    generate = generator(port, backend, checkpoint)
    with tqdm(total=len(items), desc=f"eval-tasks ({backend.name})", leave=False) as bar:
        rows = score_items(generate, tokenizer, items, progress=bar)
    options = backend_options(backend)
    report = {
        "model": port.name,
        "backend": backend.name,
        "quantization": options.get("quantization", NO_QUANTIZATION),
        "quantized_layers": options["quantized_layers"].split(",") if "quantized_layers" in options else [],
        "split": split,
        "items_per_task": per_task,
        "tasks": accuracy_by_task(rows),
        "text": None,
        "items": rows,
    }
    if corpus is not None:
        train_text = [r["text"] for r in read_jsonl(Path(corpus) / "train.jsonl") if r["kind"] == "text"]
        held_out = (
            read_jsonl(Path(corpus) / "eval_text.jsonl")
            if split == "eval"
            else [r for r in read_jsonl(Path(corpus) / "calib.jsonl") if r["kind"] == "text"]
        )
        held_out = [r["text"] for r in held_out][:text_docs]
        unigram = unigram_counts(tokenizer.encode(t) for t in train_text)
        model = build_model(port, EAGER, torch.float32, checkpoint, **backend.formats)
        longest = port.config.max_position_embeddings  # a few fortunes are longer than the training window
        docs = [tokenizer.encode(t)[:longest] for t in held_out]
        report["text"] = dict(text_metrics(model, docs, unigram, port.config.vocab_size), documents=len(held_out))
    return report


def render_tasks(report: dict, num_experts: int) -> str:
    formats = (
        f" ({report['quantization']} on {', '.join(report['quantized_layers'])})" if report["quantized_layers"] else ""
    )
    lines = [
        f"{report['model']}: {report['split']} split, greedy answers with {report['backend']}{formats}, "
        "exact match up to EOS\n",
        table(
            report["tasks"],
            [
                ("task", "task"),
                ("items", "items"),
                ("correct", "correct"),
                ("accuracy", "accuracy", "{:.1%}"),
                ("answer_tokens_min", "answer tokens min"),
                ("answer_tokens_max", "max"),
            ],
        ),
    ]
    text = report["text"]
    if text is None:
        lines.append("\nno --corpus: held-out perplexity and expert load not measured")
    else:
        lines += [
            f"\nheld-out text ({text['tokens']} tokens): perplexity {text['perplexity']:.2f}, "
            f"unigram baseline {text['unigram_perplexity']:.2f}",
            f"expert share of routed slots on that text: min {text['expert_share_min']:.3f}, "
            f"max {text['expert_share_max']:.3f} (uniform {1 / num_experts:.3f})",
        ]
    return "\n".join(lines)
