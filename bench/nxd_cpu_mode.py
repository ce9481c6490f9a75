"""The rank modules over NxD's real layers in NxD's CPU mode, the tiny port, per TP degree (CPU).

NxD is the installed neuronx-distributed, else the source tree NXD_SRC names (`parallel/nxd_source.py`).
For each degree one set of t forked gloo processes runs every case of that degree over validate's
four default prompts and N new tokens (`parallel/nxd_generator.py`), each against its reference:

  channel, expert               HF eager fp32 (validate's reference)
  LAYOUT-FORMAT                 every quantized format (`formats.FORMATS`) in both layouts: the
                                layout's rank module at TP 1 on the gloo stand-in in that format
  reader B %                    the per-rank reader emulated in one process (`attach_reader(..., tp=t)`)
  wrong-shard (control)         HF eager: rank 1 loads rank 0's shard, and must fail

Reported per case: tokens equal on every prompt, max |Δlogit| at step 0 and over every step, the
seconds rank 0 spent on it (build, shard, generate; NxD's import and parallel state are paid once
per degree, in the degree's wall time). `--against-cpu` also runs the TP 2 layouts on the gloo
stand-in (`parallel/cpu.py`, traced once and replicated) and reports NxD's step-0 logits against it.

    NXD_SRC=/path/to/neuronx-distributed python -m bench.nxd_cpu_mode [--tp 2,4,8] [--new-tokens 32]
        [--budget 40] [--against-cpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from bench.harness import command
from neuron_moe.eval.seq_match import DEFAULT_PROMPTS
from neuron_moe.experts.channel_reader import attach_reader
from neuron_moe.formats import FORMATS
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model, prep_port
from neuron_moe.parallel import cpu, layout, nxd_source
from neuron_moe.parallel.rank_job import RankJob
from neuron_moe.parallel.nxd_generator import NxDGenerator, generate_nxd
from neuron_moe.parallel.tp_generator import TPGenerator, generate_replicated
from neuron_moe.port import load_port
from neuron_moe.reader import shard
from neuron_moe.reader.sidecar import Sidecar
from neuron_moe.report import table, write_json
from neuron_moe.spec import Reader, tp_backend
from neuron_moe.tokenizer import load_tokenizer


QUANTIZED = [(q, e) for q in FORMATS if q != "none" for e in layout.EXPERT_LAYOUTS]


def on_one_rank(port, ids, mask, n, quantization: str, expert_layout: str):
    """The experts in `quantization` as `expert_layout` holds them, the rank module at TP 1."""
    job = RankJob.prepare(port, tp_backend(1, quantization=quantization, expert_layout=expert_layout))
    return greedy(job.rank_zero(cpu)[0], ids, mask, n)


def compare(got, want) -> dict:
    return {
        "tokens_equal": bool(torch.equal(got.tokens, want.tokens)),
        "step0": float((got.logits[:, 0] - want.logits[:, 0]).abs().max()),
        "all_steps": float((got.logits - want.logits).abs().max()),
        "max_logit": float(want.logits.abs().max()),
    }


def references(port, ids, mask, n: int) -> dict:
    """The references the cases are held to, each greedy over the prompts in one process."""
    return {
        "HF eager": greedy(build_model(port, "eager", torch.float32), ids, mask, n),
        **{f"{e} {q} at TP 1": on_one_rank(port, ids, mask, n, q, e) for q, e in QUANTIZED},
    }


def nxd_generator(port, tp: int, shards=None, **options) -> NxDGenerator:
    """One case over NxD's layers (`shards`: the shard each rank loads, default its own)."""
    return NxDGenerator(port, tp_backend(tp, layers="nxd", **options), shards=shards)


def tp2_cases(budget: float, sidecar: str) -> dict[str, tuple[dict, str]]:
    """The cases run at TP 2 only: name -> (NxDGenerator options, the reference's name)."""
    return {
        **{f"{e}-{q}": ({"expert_layout": e, "quantization": q}, f"{e} {q} at TP 1") for q, e in QUANTIZED},
        f"reader {budget:g} %": ({"reader": Reader(sidecar=sidecar, budget=budget)}, f"reader {budget:g} % emulated"),
        "wrong-shard (control)": ({"shards": (0, 0)}, "HF eager"),
    }


def against_cpu(port, tp: int, cases: dict, rows: list[dict], out: dict, ids, mask, n: int) -> None:
    """The TP 2 layouts on the gloo stand-in: each row's step-0 logits of NxD against the stand-in's."""
    cpu_gens = {
        name: TPGenerator(port, tp_backend(tp, layers="cpu", **cases[name][0]))
        for name in ("channel", "expert", *(f"{e}-{q}" for q, e in QUANTIZED))
    }
    stand_in = generate_replicated(cpu_gens, ids, mask, n)
    for row in rows:
        if row["tp"] == tp and row["case"] in stand_in:
            got, cpu_out = out[row["case"]], stand_in[row["case"]]
            row["step0_vs_cpu_layers"] = float((got.logits[:, 0] - cpu_out.logits[:, 0]).abs().max())


def run_degree(port, tp: int, whole: Sidecar, tmp: str, refs: dict, args, ids, mask) -> tuple[list[dict], dict]:
    """One TP degree's cases on t forked gloo processes: a row per case, and the degree's wall time."""
    n = args.new_tokens
    cases = {"channel": ({}, "HF eager"), "expert": ({"expert_layout": layout.EXPERT}, "HF eager")}
    if tp == 2:
        shard.write_shards(whole, tmp, tp, progress=False)
        emulated = build_model(port, "eager", torch.float32)
        # the TP backend reads at the port's [reader] recovery rank unless told: the emulation too
        attach_reader(emulated, whole.path, args.budget, port.reader.recovery_rank, tp=tp)
        refs[f"reader {args.budget:g} % emulated"] = greedy(emulated, ids, mask, n)
        cases.update(tp2_cases(args.budget, tmp))
    gens = {name: nxd_generator(port, tp, **options) for name, (options, _) in cases.items()}
    t0 = time.time()
    out = generate_nxd(gens, ids, mask, n)
    degree = {"tp": tp, "wall_seconds": time.time() - t0, "processes": tp}
    rows = [
        {
            "tp": tp,
            "case": name,
            "reference": ref,
            **compare(out[name], refs[ref]),
            "seconds": gens[name].ran["seconds"],
            "expected": "fail" if "control" in name else "pass",
        }
        for name, (_, ref) in cases.items()
    ]
    if tp == 2 and args.against_cpu:
        against_cpu(port, tp, cases, rows, out, ids, mask, n)
    print(f"TP {tp}: {time.time() - t0:.1f} s", file=sys.stderr)
    return rows, degree


COLUMNS = [
    ("tp", "TP"),
    ("case", "case"),
    ("reference", "against"),
    ("tokens_equal", "tokens equal"),
    ("step0", "max|Δlogit| step 0", "{:.1e}"),
    ("all_steps", "max|Δlogit| all steps", "{:.1e}"),
    ("seconds", "s (rank 0)", "{:.2f}"),
    ("expected", "expected"),
    ("ok", "as expected"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="2,4,8", help="TP degrees (default 2,4,8)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--budget", type=float, default=40.0, help="the reader's budget at TP 2 (default 40)")
    ap.add_argument("--against-cpu", action="store_true", help="also the TP 2 layouts on the gloo stand-in")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    source = nxd_source.require()
    port = load_port("tiny-gemma4-moe")
    tok = load_tokenizer(port)
    ids, mask = left_pad([tok.encode(p) for p in DEFAULT_PROMPTS], tok.pad_token_id)
    refs = references(port, ids, mask, args.new_tokens)
    rows, degrees, started = [], [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        whole = Sidecar(prep_port(port, Path(tmp) / shard.WHOLE))
        for tp in [int(t) for t in args.tp.split(",")]:
            degree_rows, degree = run_degree(port, tp, whole, tmp, refs, args, ids, mask)
            rows += degree_rows
            degrees.append(degree)
    for row in rows:
        row["ok"] = (
            row["tokens_equal"]
            and row["step0"] <= 2e-6 * row["max_logit"]
            and row["all_steps"] <= 1e-4 * row["max_logit"]
        ) == (row["expected"] == "pass")
    columns = list(COLUMNS)
    if args.against_cpu:
        columns.insert(6, ("step0_vs_cpu_layers", "step 0 vs cpu layers", "{:.1e}"))
    print(table(rows, columns))
    report = {
        "nxd": source.describe(),
        "nxd_version": source.version,
        "nxd_commit": source.commit,
        "nxd_source_digest": source.digest,
        "new_tokens": args.new_tokens,
        "prompts": list(DEFAULT_PROMPTS),
        "budget": args.budget,
        "rows": rows,
        "degrees": degrees,
        "seconds": time.time() - started,
        "machine": f"CPU ({platform.machine()}), gloo ranks as forked processes, one torch thread each",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": command("bench.nxd_cpu_mode", sys.argv[1:]),
    }
    if args.json:
        write_json(report, args.json)
    ok = all(r["ok"] for r in rows)
    print(
        f"\n{'PASS' if ok else 'FAIL'}: every case matches its reference (tokens; step 0 to 2e-6 of the largest "
        f"logit, every step to 1e-4) and the control does not ({source.describe()})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
