"""Where the reader's error comes from, layer by layer, at a read budget (top-k rules).

On the full model's routed-expert inputs of the *calibration* split (the same sample eval-reader
calibrates thresholds on; the evaluation split is not touched), for every MoE layer: the relative
error ‖y − y_full‖ / ‖y_full‖ of each selector's routed output at the budget, and the reader's
error decomposed against the exact-activation oracle:

  oracle@budget    the oracle's channels at the budget (it pays nothing to screen)
  oracle@k         the oracle at the reader's k: what the sketch and recovery reads cost in channels
  reader-r0@k      the reader's sketch choosing those k channels, no recovery: the sketch's quality
  recall           share of the reader's k channels that are among the oracle's top k
  reader-rN        the reader at recovery rank N at the budget: fewer exact channels, plus recovery

    python -m bench.reader_layers [--budget 17.8] [--corpus build/tiny/corpus] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from neuron_moe.eval import reader_eval as R
from neuron_moe.experts.selector_experts import moe_layers
from neuron_moe.model import build_model, prep_port
from neuron_moe.port import load_port
from neuron_moe.reader import selectors as S
from neuron_moe.reader.accounting import BudgetError, full_bytes
from neuron_moe.reader.sidecar import Sidecar
from neuron_moe.report import table, write_json
from neuron_moe.tokenizer import load_tokenizer


def rel_err(y, full) -> float:
    return float((y - full).norm() / full.norm())


def layer_rows(layers_by_rank: dict, inputs, budget: float, ranks: list[int]) -> dict:
    x, index, weights = inputs
    base = layers_by_rank[0]
    full = S.run("oracle", base, x, index, weights, S.top_k("oracle", base, 100.0)).out
    row = {}
    for name in ("teal", "wina", "oracle"):
        row[name] = rel_err(S.run(name, base, x, index, weights, S.top_k(name, base, budget)).out, full)
    k = S.plan("reader", base.geo, base.settings, budget)["channel"]
    reader_out = S.run("reader", base, x, index, weights, S.TopK({"channel": k}))
    oracle_k = S.run("oracle", base, x, index, weights, S.TopK({"channel": k}))
    row |= {
        "reader_k": k,
        "oracle_channels": S.plan("oracle", base.geo, base.settings, budget)["channel"],
        "oracle@k": rel_err(oracle_k.out, full),
        "reader-r0": rel_err(reader_out.out, full),
        "recall": recall(base, x, index, weights, k),
    }
    for rank in ranks:
        layer = layers_by_rank[rank]
        try:
            rule = S.top_k("reader", layer, budget)
        except BudgetError:
            row[f"reader-r{rank}"] = None
            continue
        row[f"reader-r{rank}"] = rel_err(S.run("reader", layer, x, index, weights, rule).out, full)
        row[f"k-r{rank}"] = rule.counts["channel"]
    return row


def recall(layer, x, index, weights, k: int) -> float:
    """Share of the reader's k channels (sketch scores) that the exact scores also rank in the top k."""
    masks = {}
    for name in ("reader", "oracle"):
        captured = {}

        def rule(part, score, into=captured):
            into["mask"] = S.TopK({"channel": k})(part, score)
            return into["mask"]

        S.run(name, layer, x, index, weights, rule)
        masks[name] = captured["mask"]
    return float((masks["reader"] & masks["oracle"]).sum() / masks["reader"].sum())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-gemma4-moe")
    p.add_argument("--checkpoint")
    p.add_argument("--budget", type=float, default=17.8)
    p.add_argument("--ranks", default="16,32", help="recovery ranks of the reader to compare with rank 0")
    p.add_argument("--corpus", help="a build-corpus directory: calib.jsonl text joins the calibration items")
    p.add_argument("--tokens", type=int, default=R.CALIB_TOKENS)
    p.add_argument("--json", help="write the rows as JSON")
    args = p.parse_args()

    port = load_port(args.model)
    model = build_model(port, "eager", torch.float32, args.checkpoint)
    settings = R.Settings(corpus=args.corpus)
    seqs = R.sequences(
        load_tokenizer(port, args.checkpoint), settings, model.config.max_position_embeddings, "calibration"
    )
    inputs = R.calibration_inputs(model, seqs, args.tokens)
    ranks = [int(r) for r in args.ranks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        side = Sidecar(prep_port(port, Path(tmp) / "sidecar.safetensors", args.checkpoint))
        by_rank = {r: moe_layers(model, side, r) for r in [0, *ranks]}
        rows = [
            {"layer": i, **layer_rows({r: ls[i] for r, ls in by_rank.items()}, inputs[i], args.budget, ranks)}
            for i in range(len(model.model.layers))
        ]
    geo = by_rank[0][0].geo
    print(
        f"{port.name}: relative error of the routed output per layer at {args.budget} % top-k, "
        f"{args.tokens} calibration-split tokens (full reads {full_bytes(geo)} B per token and layer)\n"
    )
    cols = [
        ("layer", "layer"),
        ("teal", "teal"),
        ("wina", "wina"),
        ("oracle", "oracle"),
        ("oracle_channels", "oracle k"),
        ("reader_k", "reader k (r0)"),
        ("oracle@k", "oracle@k"),
        ("reader-r0", "reader-r0"),
        ("recall", "sketch recall"),
    ]
    for r in ranks:
        cols += [(f"k-r{r}", f"k (r{r})"), (f"reader-r{r}", f"reader-r{r}")]
    print(table(rows, cols))
    if args.json:
        write_json(
            {"model": port.name, "budget": args.budget, "tokens": args.tokens, "split": "calibration", "layers": rows},
            args.json,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
