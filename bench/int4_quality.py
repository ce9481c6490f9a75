"""int4 experts' quality on the embedded tiny model, against bf16 and int8 (CPU).

Every variant computes in bf16 (the rest of the model bf16 too) except the fp32 reference:

  bf16         the port's weights in bf16
  int8         the int8 experts (`experts/int8.py`, per-output-channel scales), HF's model
  int4-gG      the experts quantised by `experts/int4.py` at group size G, round to nearest
  int4-gG-search   the same with the calibration-free clip-ratio search per group

An int4 variant is the bf16 model whose experts hold `int4.unpack(*int4.quantize(w, G), bf16)`:
exactly the weight the int4 graphs dequantise before each matmul, in the same dtype, so the
experts' matmuls are the int4 forward's. Per variant:

  tasks      eval-tasks' accuracy per task (greedy, exact match to EOS), --items per task
  KL         per-token KL(fp32 ‖ variant), teacher-forced over the same evaluation items (prompt
             and answer): mean and worst, over the scored (answer) positions
  SEQ_MATCH  against bf16: validate's default prompts (--new-tokens each), token for token; and the
             share of evaluation items whose greedy answer is bf16's

    python -m bench.int4_quality [--items 100] [--groups 64,32,16] [--new-tokens 32] --out bench/results/int4-quality
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.harness import command, write_results
from neuron_moe.eval.reader_eval import item_sequence
from neuron_moe.eval.seq_match import DEFAULT_PROMPTS
from neuron_moe.eval.tasks import accuracy_by_task, score_items
from neuron_moe.experts import int4
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.port import load_port
from neuron_moe.tasks import eval_items
from neuron_moe.tokenizer import load_tokenizer


def int4_model(port, group: int, search: bool):
    """The bf16 model with its experts replaced by the int4 weights dequantised in bf16."""
    model = build_model(port, "dense_masked", torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            e = layer.experts
            for p in (e.gate_up_proj, e.down_proj):  # HF's [E, out, in]: the input dim is dim 2
                fused = p.detach().float().transpose(1, 2)  # [E, in, out], as the layouts hold it
                w = int4.unpack(*int4.quantize(fused, group, search=search), torch.bfloat16)
                p.copy_(w.transpose(1, 2))
    return model


@torch.no_grad()
def answer_logprobs(model, seqs) -> list[torch.Tensor]:
    """Log-probs [n, V] (fp32) at each sequence's scored positions: the answer's tokens and its EOS."""
    out = []
    for seq in seqs:
        logits = model(input_ids=torch.tensor([seq.ids])).logits[0, seq.start : -1].float()
        out.append(logits.log_softmax(-1))
    return out


def kl_stats(reference, got) -> dict:
    kl = torch.cat([(r.exp() * (r - g)).sum(-1).clamp(min=0) for r, g in zip(reference, got)])
    return {"positions": len(kl), "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def run(args) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    torch.set_num_threads(args.threads)
    port = load_port("tiny-gemma4-moe")
    tok = load_tokenizer(port)
    items = eval_items(args.items)
    seqs = [item_sequence(tok, i) for i in items]
    ids, mask = left_pad([tok.encode(p) for p in DEFAULT_PROMPTS], tok.pad_token_id)

    variants = {"bf16": lambda: build_model(port, "dense_masked", torch.bfloat16)}
    variants["int8"] = lambda: build_model(port, "int8", torch.bfloat16)
    for g in args.groups:
        variants[f"int4-g{g}"] = lambda g=g: int4_model(port, g, False)
        variants[f"int4-g{g}-search"] = lambda g=g: int4_model(port, g, True)

    reference = answer_logprobs(build_model(port, "eager", torch.float32), seqs)
    results, base = {}, None
    for name, make in variants.items():
        t0 = time.perf_counter()
        model = make()
        rows = score_items(lambda i, m, n: greedy(model, i, m, n), tok, items)
        prompts = greedy(model, ids, mask, args.new_tokens).tokens
        r = {
            "tasks": {a["task"]: a["accuracy"] for a in accuracy_by_task(rows)},
            **kl_stats(reference, answer_logprobs(model, seqs)),
            "_answers": [row["got"] for row in rows],
            "_prompts": prompts,
        }
        if base is None:
            base = r
        r["seq_match_prompts"] = [bool(torch.equal(a, b)) for a, b in zip(prompts, base["_prompts"])]
        r["same_answers_as_bf16"] = sum(a == b for a, b in zip(r["_answers"], base["_answers"])) / len(items)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = r
        print(name, {k: v for k, v in r.items() if not k.startswith("_")}, file=sys.stderr, flush=True)
    for r in results.values():
        del r["_answers"], r["_prompts"]
    return {
        "command": command("bench.int4_quality", sys.argv[1:]),
        "hardware": f"CPU ({platform.machine()}), {args.threads} thread(s); nothing here ran on Neuron or a GPU",
        "torch": torch.__version__,
        "commit": commit,
        "items_per_task": args.items,
        "new_tokens": args.new_tokens,
        "scale_dtype": str(int4.SCALE_DTYPE).removeprefix("torch."),
        "variants": results,
    }


def render(report: dict) -> str:
    variants = report["variants"]
    tasks = list(next(iter(variants.values()))["tasks"])
    bf16 = variants["bf16"]["tasks"]
    lines = [
        "| variant | " + " | ".join(tasks) + " | worst Δ vs bf16 (points) | KL mean | KL worst | "
        "SEQ_MATCH prompts vs bf16 | answers = bf16's |",
        "|---" * (len(tasks) + 6) + "|",
    ]
    for name, r in variants.items():
        worst = min(100 * (r["tasks"][t] - bf16[t]) for t in tasks)
        lines.append(
            f"| {name} | "
            + " | ".join(f"{100 * r['tasks'][t]:.0f} %" for t in tasks)
            + f" | {worst:+.0f} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | "
            f"{sum(r['seq_match_prompts'])}/{len(r['seq_match_prompts'])} | {100 * r['same_answers_as_bf16']:.0f} % |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=100, help="evaluation items per task (default 100)")
    p.add_argument("--groups", default="64,32,16", help="int4 group sizes (default 64,32,16)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per validate prompt (default 32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", type=Path, help="write OUT.json and OUT.table.md")
    args = p.parse_args(argv)
    args.groups = [int(g) for g in args.groups.split(",")]
    report = run(args)
    table = render(report)
    print(table)
    if args.out:
        write_results(report, args.out.with_suffix(".json"), render, args.out.with_suffix(".table.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
