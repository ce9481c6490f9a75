"""A simulated QAT checkpoint: a copy of the tiny port's checkpoint whose linears sit on Q4_0's grid.

Google's QAT Gemma checkpoints (`google/gemma-4-26B-A4B-it-qat-q4_0-unquantized`) are float weights
trained to sit on llama.cpp's Q4_0 grid. This makes the tiny model's stand-in without training: each
linear of the layer groups named (default experts, attention, mlp; lm_head is tied to the embedding
in the tiny port, and the embedding stays as it is) becomes `q4_0.dequantize(q4_0.quantize(w))`,
blocks of 32 along its input dim (an expert's weights through their [E, in, out] view,
`parallel.layout.fused`, and back to HF's layout). Everything else (embedding, norms, router, the
config, the tokenizer) is the source's.

Saved in float32, whatever the source's dtype: a float32 weight on the grid quantizes back to the
same nibbles and fp16 scales (so q4_0 holds it without loss); a bf16 copy of it would do so only
where each scale fits bf16's 8 significant bits (formats/q4_0.py). The directory is built beside
`--out` and renamed in (nothing half-written); the weights are never committed.

    python -m bench.simulated_qat --out DIR [--checkpoint SRC] [--quantized-layers experts,attention,mlp]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

from neuron_moe import spec
from neuron_moe.checkpoint import write_checkpoint
from neuron_moe.errors import UserError
from neuron_moe.formats import Format, get
from neuron_moe.model import build_model
from neuron_moe.parallel.layout import fused
from neuron_moe.port import load_port
from neuron_moe.report import atomic_dir
from neuron_moe.tokenizer import TOKENIZER_FILES

PORT = "tiny-gemma4-moe"
Q4_0 = get(spec.Q4_0_QUANTIZATION)
QAT_LAYERS = ("experts", "attention", "mlp")  # the issue's: experts, attention and the dense MLP


def untie_lm_head(model) -> None:
    """Give lm_head its own copy of the embedding's weight (Gemma ties them): the embedding stays float
    when lm_head is rounded."""
    if model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False


@torch.no_grad()
def round_linears(model, fmt: Format, layers) -> float:
    """Each linear of the groups `layers` (spec.LAYER_GROUPS) in `model` replaced, in place, by
    `fmt.dequantize(fmt.quantize(w), w.dtype)`: the weight a graph holding `fmt` computes with (int8
    applies its scale after the matmul instead, the same up to rounding). Experts through their
    [E, in, out] view, as the formats group them. Returns max |Δw| over those weights."""
    layers = spec.check_quantized_layers(layers)
    if "lm_head" in layers:
        untie_lm_head(model)
    worst = 0.0
    for name, p in model.named_parameters():
        # HF's experts hold `…experts.gate_up_proj` without `.weight`; layer_group names weights
        if spec.layer_group(name if name.endswith(".weight") else f"{name}.weight") not in layers:
            continue
        view = fused(p) if p.dim() == 3 else p  # the input dim at 1
        w = fmt.dequantize(fmt.quantize(view), p.dtype)
        worst = max(worst, float((w - view).abs().max()))
        view.copy_(w)
    return worst


def write(out: Path, checkpoint: Path | None = None, layers=QAT_LAYERS) -> float:
    """The simulated QAT copy of `checkpoint` (default the tiny port's) into `out`, float32, built
    beside it and renamed in. Returns max |Δw| of the rounding."""
    layers = spec.check_quantized_layers(layers)  # before the weights load
    port = load_port(PORT)
    source = Path(checkpoint or port.checkpoint)
    model = build_model(port, spec.EAGER, torch.float32, source)
    worst = round_linears(model, Q4_0, layers)
    with atomic_dir(out) as tmp:
        write_checkpoint(model, tmp)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the directory to write")
    p.add_argument("--checkpoint", type=Path, help=f"the source checkpoint directory (default {PORT}'s)")
    p.add_argument(
        "--quantized-layers", default=",".join(QAT_LAYERS), help=f"groups to round (default {','.join(QAT_LAYERS)})"
    )
    args = p.parse_args(argv)
    try:
        worst = write(args.out, args.checkpoint, args.quantized_layers)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {args.quantized_layers} on q4_0's grid, float32 (max |Δw| {worst:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
