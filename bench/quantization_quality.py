"""Weight formats' quality on the embedded tiny model (CPU): each quantized format on the experts and on
every linear, and the simulated QAT checkpoint that q4_0 holds without loss.

The table: the bf16 model, and for each format of `formats.FORMATS` but none (int8, int4, q4_0) and
each scope (the experts alone; all linears: experts, attention, mlp, lm_head) the bf16 model whose
linears of that scope hold `fmt.dequantize(fmt.quantize(w), bf16)` (`simulated_qat.round_linears`):
the weight the quantized graphs compute with, quantized from the bf16 weight as a bf16 run quantizes
it (int8's graphs apply its scale after the matmul instead: the same up to rounding). lm_head is
untied from the embedding for it; the embedding stays bf16. Per variant:

  tasks      eval-tasks' accuracy per task (greedy, exact match to EOS), --items per task
  KL         per-token KL(reference ‖ variant), teacher-forced over the same evaluation items (prompt
             and answer): mean and worst over the scored (answer) positions; the reference is the
             fp32 model (HF eager); max |Δlogit| over the same positions beside it
  SEQ_MATCH  against the section's first row (bf16): validate's default prompts (--new-tokens each),
             token for token; and the share of evaluation items whose greedy answer is that row's

The QAT section: a simulated QAT copy of the checkpoint (`bench/simulated_qat.py`: experts, attention
and the dense MLP rounded onto Q4_0's grid, float32) written to a temporary directory, run in fp32:
the copy itself (the reference, dense_masked as the variants), q4_0 on those layers, and int4 on them.
Its max |Δw| and max |Δlogit| are against the copy in fp32: q4_0 reads 0 (lossless), int4 does not.

`--int4-groups G,…` adds int4 on the experts at those group sizes (and `--int4-search`, each with the
calibration-free clip search too): the sweep `DEFAULT_GROUP` was chosen by (bench/results/int4-quality.md).

    python -m bench.quantization_quality [--items 100] [--new-tokens 32] [--int4-groups 64,32,16 [--int4-search]]
        --out bench/results/quantization-quality
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import simulated_qat
from bench.harness import code, command, cpu_host, write_results
from neuron_moe import spec
from neuron_moe.eval.reader_eval import item_sequence
from neuron_moe.eval.seq_match import DEFAULT_PROMPTS
from neuron_moe.eval.tasks import accuracy_by_task, score_items
from neuron_moe.formats import FORMATS, int4
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.port import load_port
from neuron_moe.tasks import eval_items
from neuron_moe.tokenizer import load_tokenizer

SCOPES = {"experts": ("experts",), "all linears": spec.LAYER_GROUPS}


class Int4At(int4.Int4):
    """int4 at a group size, with or without the clip search (`int4.quantize`'s `search`)."""

    def __init__(self, group: int, search: bool = False):
        super().__init__(group)
        self.search = search

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, scale = int4.quantize(w, self.group, search=self.search)
        return {"weight": packed, "group_scale": scale}


@dataclass(frozen=True)
class Variant:
    """A model to measure: the checkpoint (None: the port's) in `dtype` (dense_masked experts), with
    `layers` rounded through `fmt` (None: as it is)."""

    dtype: torch.dtype
    fmt: object = None
    layers: tuple[str, ...] = ()
    checkpoint: Path | None = None

    def build(self, port):
        """(the model, max |Δw| of its rounded linears; None where none are)."""
        model = build_model(port, spec.DENSE_MASKED, self.dtype, self.checkpoint)
        if self.fmt is None:
            return model, None
        return model, simulated_qat.round_linears(model, self.fmt, self.layers)


@dataclass(frozen=True)
class Workload:
    """What every variant is run on: the evaluation items, their teacher-forced sequences, and
    validate's default prompts."""

    tok: object
    items: list
    seqs: list
    ids: torch.Tensor
    mask: torch.Tensor
    new_tokens: int


@torch.no_grad()
def item_logits(model, seqs) -> list[torch.Tensor]:
    """Logits [n, V] (fp32) at each sequence's scored positions: the answer's tokens and its EOS."""
    return [model(input_ids=torch.tensor([s.ids])).logits[0, s.start : -1].float() for s in seqs]


def compare(reference: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    """KL(reference ‖ got) per scored position, mean and worst, and the largest |Δlogit|."""
    kl, worst = [], 0.0
    for r, g in zip(reference, got):
        lr, lg = r.log_softmax(-1), g.log_softmax(-1)
        kl.append((lr.exp() * (lr - lg)).sum(-1).clamp(min=0))
        worst = max(worst, float((r - g).abs().max()))
    kl = torch.cat(kl)
    return {"positions": len(kl), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "max_abs_dlogit": worst}


def measure(model, work: Workload, reference: list[torch.Tensor]) -> dict:
    """One variant: accuracy per task, the comparison with `reference`, and (private) its greedy
    answers and prompt generations for the comparison with the section's first row."""
    rows = score_items(lambda i, m, n: greedy(model, i, m, n), work.tok, work.items)
    return {
        "tasks": {a["task"]: a["accuracy"] for a in accuracy_by_task(rows)},
        **compare(reference, item_logits(model, work.seqs)),
        "_answers": [row["got"] for row in rows],
        "_prompts": greedy(model, work.ids, work.mask, work.new_tokens).tokens,
    }


def section(port, variants: dict[str, Variant], work: Workload, reference) -> dict:
    """Every variant measured against `reference` (a model) and against the first variant."""
    ref = item_logits(reference, work.seqs)
    del reference
    results, base = {}, None
    for name, v in variants.items():
        t0 = time.perf_counter()
        model, dw = v.build(port)
        r = {"format": v.fmt.name if v.fmt else "none", "layers": list(v.layers), "max_abs_dw": dw}
        r.update(measure(model, work, ref))
        base = base or r
        r["seq_match_prompts"] = [bool(torch.equal(a, b)) for a, b in zip(r["_prompts"], base["_prompts"])]
        r["same_answers_as_first"] = sum(a == b for a, b in zip(r["_answers"], base["_answers"])) / len(work.items)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = r
        print(name, {k: v for k, v in r.items() if not k.startswith("_")}, file=sys.stderr, flush=True)
    for r in results.values():
        del r["_answers"], r["_prompts"]
    return results


def table_variants(args) -> dict[str, Variant]:
    """bf16, then each quantized format × scope, then the int4 sweep asked for."""
    bf16 = torch.bfloat16
    variants = {"bf16": Variant(bf16)}
    for name, fmt in FORMATS.items():
        if name != spec.NO_QUANTIZATION:
            for scope, layers in SCOPES.items():
                variants[f"{name}, {scope}"] = Variant(bf16, fmt, layers)
    for g in args.int4_groups:
        for search in (False, True) if args.int4_search else (False,):
            variants[f"int4-g{g}{'-search' if search else ''}, experts"] = Variant(
                bf16, Int4At(g, search), ("experts",)
            )
    return variants


def qat_variants(checkpoint: Path) -> dict[str, Variant]:
    layers = simulated_qat.QAT_LAYERS
    return {
        "QAT copy, fp32": Variant(torch.float32, checkpoint=checkpoint),
        **{f: Variant(torch.float32, FORMATS[f], layers, checkpoint) for f in ("q4_0", "int4")},
    }


def workload(port, args) -> Workload:
    tok = load_tokenizer(port)
    items = eval_items(args.items)
    ids, mask = left_pad([tok.encode(p) for p in DEFAULT_PROMPTS], tok.pad_token_id)
    return Workload(tok, items, [item_sequence(tok, i) for i in items], ids, mask, args.new_tokens)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    port = load_port(simulated_qat.PORT)
    work = workload(port, args)
    report = {
        "command": command("bench.quantization_quality", sys.argv[1:]),
        "code": code(),
        "items_per_task": args.items,
        "new_tokens": args.new_tokens,
        "int4_group": int4.DEFAULT_GROUP,
        "table": section(port, table_variants(args), work, build_model(port, spec.EAGER, torch.float32)),
    }
    with tempfile.TemporaryDirectory(prefix="simulated-qat-") as tmp:
        qat = Path(tmp) / "checkpoint"
        simulated_qat.write(qat)
        reference = build_model(port, spec.DENSE_MASKED, torch.float32, qat)
        report["qat"] = {"layers": list(simulated_qat.QAT_LAYERS), "dtype": "float32"}
        report["qat"]["variants"] = section(port, qat_variants(qat), work, reference)
    report["machine"] = cpu_host()
    return report


def _number(x) -> str:
    return "—" if x is None else "0" if x == 0 else f"{x:.2e}"


def render_rows(variants: dict) -> str:
    """One markdown table of a section's variants, the deltas and matches against its first row."""
    first = next(iter(variants))
    tasks = list(variants[first]["tasks"])
    head = [
        "variant",
        r"max \|Δw\|",
        *tasks,
        f"worst Δ vs {first} (points)",
        "KL mean",
        "KL worst",
        r"max \|Δlogit\|",
        f"SEQ_MATCH prompts vs {first}",
        f"answers = {first}'s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, r in variants.items():
        worst = min(100 * (r["tasks"][t] - variants[first]["tasks"][t]) for t in tasks)
        cells = [
            name,
            _number(r["max_abs_dw"]),
            *(f"{100 * r['tasks'][t]:.0f} %" for t in tasks),
            f"{worst:+.0f}",
            _number(r["kl_mean"]),
            _number(r["kl_max"]),
            _number(r["max_abs_dlogit"]),
            f"{sum(r['seq_match_prompts'])}/{len(r['seq_match_prompts'])}",
            f"{100 * r['same_answers_as_first']:.0f} %",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def losses(variants: dict) -> dict[str, list[str]]:
    """Each variant (but the first) -> its tasks more than 2 points below the first row's, as text."""
    first = next(iter(variants.values()))["tasks"]
    return {
        name: [
            f"{t} {100 * a:.0f} % against {100 * first[t]:.0f} %" for t, a in r["tasks"].items() if first[t] - a > 0.02
        ]
        for name, r in list(variants.items())[1:]
    }


def reading(report: dict) -> str:
    """What the numbers say, as bullets made from them."""
    table, qat = report["table"], report["qat"]["variants"]
    lost = losses(table)
    kept = [n for n, v in lost.items() if not v]
    lines = [
        f"- **Within 2 points of bf16 on every task**: {'; '.join(kept) or 'none'}.",
        *(f"- **{n} loses more than 2 points**: {'; '.join(v)}." for n, v in lost.items() if v),
        f"- max |Δlogit| is over the whole vocabulary, and its largest differences fall on tokens of negligible "
        f"probability: bf16 alone against fp32 reads {table['bf16']['max_abs_dlogit']:.2f} at KL mean "
        f"{table['bf16']['kl_mean']:.1e}. KL is this table's measure; max |Δlogit| is the QAT section's exactness.",
    ]
    qat_lost = losses(qat)
    for name, r in list(qat.items())[1:]:
        exact = r["max_abs_dw"] == 0 and r["max_abs_dlogit"] == 0
        lines.append(
            f"- **{name} over the QAT copy{': lossless' if exact else ''}**: max |Δw| {_number(r['max_abs_dw'])}, "
            f"max |Δlogit| {_number(r['max_abs_dlogit'])}, KL mean {_number(r['kl_mean'])}, "
            f"SEQ_MATCH {sum(r['seq_match_prompts'])}/{len(r['seq_match_prompts'])}, "
            f"answers the copy's {100 * r['same_answers_as_first']:.0f} %"
            + (f"; loses {'; '.join(qat_lost[name])}" if qat_lost[name] else "")
            + "."
        )
    return "\n".join(lines) + "\n"


def render(report: dict) -> str:
    """The results page, from the JSON alone."""
    m, qat = report["machine"], report["qat"]["variants"]
    table = report["table"]
    positions = next(iter(table.values()))["positions"]
    lossless = [n for n, r in qat.items() if r["max_abs_dw"] == 0 and r["max_abs_dlogit"] == 0]
    return f"""# Weight formats: quality on the tiny model (CPU)

int8, int4 and q4_0 (`neuron_moe/formats/`), each on the routed experts alone and on every linear
(experts, attention, dense MLP, lm_head; the embedding stays bf16), against bf16, on the embedded
tiny model (`tiny-gemma4-moe`, 16 experts, top-4); then the simulated QAT checkpoint, where q4_0 is
lossless and int4 is not. Made by `bench/quantization_quality.py` (its docstring says how each
variant is built) from the JSON beside this page.

- **Variant**: the model whose linears of the scope hold `fmt.dequantize(fmt.quantize(w))`, the
  weight the quantized graphs compute with (int8's graphs apply the scale after the matmul instead:
  the same up to rounding). int4 at group {report["int4_group"]}, bf16 scales; q4_0 is llama.cpp's Q4_0 (blocks of
  32, fp16 scales). **max |Δw|**: the largest change the rounding made to a weight.
- **tasks**: `eval-tasks`' suite, {report["items_per_task"]} items per task, greedy, exact match of the answer up
  to EOS.
- **KL**: per-token KL(reference ‖ variant), teacher-forced over the same items, over the {positions:,}
  scored positions (the answer's and EOS): mean and worst; **max |Δlogit|** over the same positions.
  The reference: the fp32 model (HF eager) in the first table; the QAT copy in fp32 in the second.
- **SEQ_MATCH**: validate's four default prompts, {report["new_tokens"]} greedy tokens each, token for token
  against the table's first row; and the share of the evaluation items whose greedy answer is its.

**Machine**: {m["device"]} only ({m["cpu"]}, {m["cores"]} cores shared with other jobs; load average at
the end {", ".join(f"{x:.1f}" for x in m["load_average_at_end"])}), torch {m["torch"]}, {m["torch_threads"]} thread(s).
**Code**: `{report["code"]}`. **Nothing here ran on Neuron or a GPU.** The seconds in the JSON are
not speed measurements.

```sh
{report["command"]}
```

## Each format on the experts and on all linears (bf16)

{render_rows(table)}
## The simulated QAT checkpoint (fp32)

A copy of the checkpoint whose {", ".join(report["qat"]["layers"])} linears were rounded onto Q4_0's grid
(`python -m bench.simulated_qat --out DIR`, saved in {report["qat"]["dtype"]}: an fp32 weight on the grid
quantizes back to the same nibbles and scales), each format on those layers, in fp32, against the
copy itself (dense_masked, as every row). Lossless (max |Δw| and max |Δlogit| both 0):
{", ".join(lossless) or "none"}.

{render_rows(qat)}
## Reading

{reading(report)}"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=100, help="evaluation items per task (default 100)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per validate prompt (default 32)")
    p.add_argument("--int4-groups", default="", help="int4 group sizes to add on the experts (default none)")
    p.add_argument("--int4-search", action="store_true", help="each --int4-groups size with the clip search too")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    args.int4_groups = [int(g) for g in args.int4_groups.split(",") if g]
    report = run(args)
    page = render(report)
    print(page)
    if args.out:
        write_results(report, args.out.with_suffix(".json"), render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
