"""XLA lowering check on CPU: the static prefill/decode graphs through torch-xla 2.9.

torch-neuronx (Neuron SDK 2.31, the last with inf2) lowers each graph to HLO through torch-xla
and hands the HLO to neuronx-cc. This runs the part of that path that is not Neuron-specific,
on XLA:CPU (`PJRT_DEVICE=CPU`): the tiny port's prefill (one graph per bucket) and decode graphs
move to the XLA device and generate greedily through the static host loop
(`StaticGenerator`: argmax in the graph, the token fed back on the device; never HF generate).

Per graph, from torch-xla's own metrics: compilations on the first call and on every later call
(a later one means a dynamic shape slipped in) and every `aten::` counter (an op that fell back
to eager CPU, which the Neuron compiler would never see). Tokens are compared with the CPU
reference (HF eager, fp32: SEQ_MATCH); the int8 run also with the same int8 model on the CPU.
Exit 0 only when every graph settles to one compilation, nothing falls back, the fp32 runs
match the reference and the int8 run matches CPU int8.

The exported runs run the `torch.export` programs themselves; their op sets, once every one of
them lowered cleanly, are the allow-list `neuron_moe/static/xla_lowered_ops.txt` that the normal
test suite (no torch-xla) holds the graphs to: `--write-ops` rewrites it.

    make xla-check        # = PJRT_DEVICE=CPU .venv-xla/bin/python bench/xla_check.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuron_moe import report  # noqa: E402
from neuron_moe.errors import UserError  # noqa: E402
from neuron_moe.eval.seq_match import DEFAULT_PROMPTS, compare  # noqa: E402
from neuron_moe.experts.int8 import _quantized  # noqa: E402
from neuron_moe.generate import greedy, left_pad  # noqa: E402
from neuron_moe.model import build_model  # noqa: E402
from neuron_moe.port import load_port  # noqa: E402
from neuron_moe.static import XLA_LOWERED_OPS_FILE, graph_ops, xla_lowered_ops  # noqa: E402
from neuron_moe.static.generate import StaticGenerator, generate_batches  # noqa: E402
from neuron_moe.tokenizer import ByteTokenizer  # noqa: E402

# The default prompts need the 56-token bucket; the short pair runs the 8-token one.
PROMPTS = (*DEFAULT_PROMPTS, "Hi", "2+2=")


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    prefill: str  # experts implementation of the prefill graphs
    decode: str  # ... and of the decode graph
    exported: bool  # the torch.export programs (True) or the modules (what lazy tracing sees)


RUNS = (
    Run("exported, dense_masked prefill, selective decode (the port's [static])", "dense_masked", "selective", True),
    Run("exported, dense_masked prefill and decode", "dense_masked", "dense_masked", True),
    Run("modules, dense_masked prefill, selective decode", "dense_masked", "selective", False),
    Run("modules, int8 prefill and decode", "int8", "int8", False),
)


class Metered:
    """One graph on the XLA device: each call runs it, syncs (one HLO graph per call) and records
    the compilations and `aten::` fallbacks that the call caused, and its wall time."""

    def __init__(self, xla, name: str, graph, hlo_dir: Path | None):
        self.xla, self.name, self.graph, self.hlo_dir = xla, name, graph, hlo_dir
        self.calls: list[tuple[int, dict[str, int], float]] = []
        self.cache_hits = 0  # graphs found already compiled (same HLO, e.g. by an earlier run)
        self.hlo_ops: dict[str, int] = {}  # HLO instructions worth a look before neuronx-cc sees them

    def __call__(self, *args):
        xla = self.xla
        compiles, fallbacks, hits, start = xla.compiles(), xla.fallbacks(), xla.cache_hits(), time.perf_counter()
        outs = self.graph(*args)
        if self.hlo_dir is not None and not self.calls:
            self.hlo_dir.mkdir(parents=True, exist_ok=True)
            text = xla.hlo(list(outs))
            (self.hlo_dir / f"{self.name.replace(' ', '-')}.hlo.txt").write_text(text)
            self.hlo_ops = {op: text.count(f" {op}(") for op in ("sort", "custom-call", "while", "conditional")}
        xla.sync()
        after = xla.fallbacks()
        new_fallbacks = {k: v - fallbacks.get(k, 0) for k, v in after.items() if v != fallbacks.get(k, 0)}
        self.calls.append((xla.compiles() - compiles, new_fallbacks, time.perf_counter() - start))
        if len(self.calls) == 1:
            self.cache_hits = xla.cache_hits() - hits
        return outs

    def summary(self) -> dict:
        later = self.calls[1:]
        fallbacks: dict[str, int] = {}
        for _, f, _ in self.calls:
            for k, v in f.items():
                fallbacks[k] = fallbacks.get(k, 0) + v
        return {
            "graph": self.name, "calls": len(self.calls),
            "compiles_first_call": self.calls[0][0], "cache_hit_first_call": self.cache_hits,
            "compiles_later_calls": sum(c for c, _, _ in later),
            "aten_fallbacks": fallbacks, "hlo_ops": self.hlo_ops,
            "first_call_s": self.calls[0][2],
            "later_call_ms": 1e3 * statistics.median(s for _, _, s in later) if later else None,
        }


class Xla:
    """The few torch-xla calls the check makes (imported lazily: the package never needs them)."""

    def __init__(self):
        try:
            import torch_xla
            import torch_xla.debug.metrics as met
        except ImportError as e:
            sys.exit(f"error: torch-xla is not installed in this Python ({sys.executable}): {e}. "
                     f"Run `make xla-check`, which creates .venv-xla with torch==2.9.0 and torch-xla==2.9.0.")
        if os.environ.get("PJRT_DEVICE") != "CPU":
            sys.exit("error: set PJRT_DEVICE=CPU (this check runs XLA on the CPU)")
        self.torch_xla, self.met = torch_xla, met
        self.device = torch_xla.device()
        self.version = torch_xla.__version__

    def compiles(self) -> int:
        data = self.met.metric_data("CompileTime")
        return data[0] if data else 0

    def cache_hits(self) -> int:
        return self.met.counter_value("CachedCompile") or 0

    def fallbacks(self) -> dict[str, int]:
        return {n: self.met.counter_value(n) for n in self.met.counter_names() if n.startswith("aten::")}

    def sync(self):
        self.torch_xla.sync(wait=True)

    def hlo(self, tensors) -> str:
        return self.torch_xla._XLAC._get_xla_tensors_hlo(tensors)


def seq_match(reference, got) -> dict:
    rows = compare(reference, got, list(PROMPTS))
    return {"all_match": all(r["seq_match"] for r in rows),
            "matched": sum(r["seq_match"] for r in rows),
            "first_divergence": [r["first_divergence"] for r in rows],
            "max_abs_dlogit_step0": max(r["max_abs_dlogit_step0"] for r in rows),
            "min_cosine": min(r["min_cosine"] for r in rows)}


def check_run(xla: Xla, port, run: Run, ids, mask, new_tokens: int, references: dict, hlo_dir) -> tuple[dict, dict]:
    """One run on XLA: (its report row, {graph name: op set} of its exported programs)."""
    spec = dataclasses.replace(port.static, prefill_experts=run.prefill, decode_experts=run.decode)
    model = build_model(port, run.decode)
    start = time.perf_counter()
    if not run.exported:
        model = model.to(xla.device)
    generator = StaticGenerator(model, spec, exported=run.exported, device=xla.device)
    size = spec.batch_size
    generator.prepare([generator.check(mask[i:i + size], new_tokens) for i in range(0, len(ids), size)])
    export_s = time.perf_counter() - start
    tag = f"{run.prefill}-{run.decode}-{'exported' if run.exported else 'modules'}"
    # the generator's graphs, each replaced by its metered self (the loop calls them by name)
    graphs = {name: Metered(xla, f"{tag} {name}", graph, hlo_dir) for name, graph in generator._graphs.items()}
    generator._graphs = dict(graphs)
    if run.decode == "int8":
        # the int8 copies are made on the device on first use: made first, as a graph of their own,
        # so that the prefill graph's one compilation is its own
        graphs["int8 quantise"] = Metered(xla, f"{tag} int8 quantise", lambda: [
            t for layer in model.model.layers for t in _quantized(layer.experts)], None)
        graphs["int8 quantise"]()
    compiles_before = xla.compiles()
    start = time.perf_counter()
    got = generate_batches(generator, ids, mask, new_tokens)
    generate_s = time.perf_counter() - start
    summaries = [g.summary() for g in graphs.values()]
    graph_compiles = sum(g["compiles_first_call"] + g["compiles_later_calls"] for g in summaries
                         if not g["graph"].endswith("int8 quantise"))
    row = {
        "run": run.name, "exported": run.exported, "prefill_experts": run.prefill, "decode_experts": run.decode,
        "graphs": summaries,
        # compilations outside the graphs: collecting the tokens and logits for the host
        "other_compiles": xla.compiles() - compiles_before - graph_compiles,
        "export_s": export_s if run.exported else None, "generate_s": generate_s,
        "vs_cpu_fp32": seq_match(references["fp32"], got),
    }
    if run.decode == "int8":
        row["vs_cpu_int8"] = seq_match(references["int8"], got)
    ops = {name: graph_ops(program) for name, program in generator.programs.items()}
    return row, ops


def passed(row: dict) -> bool:
    clean = all(g["compiles_first_call"] <= 1 and g["compiles_later_calls"] == 0 and not g["aten_fallbacks"]
                for g in row["graphs"])
    tokens = row["vs_cpu_int8"]["all_match"] if "vs_cpu_int8" in row else row["vs_cpu_fp32"]["all_match"]
    return clean and tokens


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        "# XLA lowering check (torch-xla on CPU)", "",
        f"Machine: {env['machine']} — CPU only, `PJRT_DEVICE=CPU` (XLA:CPU; no Neuron device, no neuronx-cc).",
        f"Packages: Python {env['python']}, torch {env['torch']}, torch-xla {env['torch_xla']}, "
        f"transformers {env['transformers']}. Port `{result['port']}` ({result['weights']}), "
        f"{len(PROMPTS)} prompts in batches of {result['batch_size']}, prefill + {result['new_tokens'] - 1} decode steps.",
        "", "Written by `make xla-check` (`bench/xla_check.py`). Compilations from `CompileTime`, fallbacks are "
        "torch-xla's `aten::*` counters, per graph; a call is one graph call plus `torch_xla.sync()`.", "",
    ]
    for row in result["runs"]:
        fp32 = row["vs_cpu_fp32"]
        lines += [f"## {row['run']}", "",
                  "| graph | calls | compiles, 1st call | compiles, later calls | aten fallbacks | HLO sort / custom-call / while / conditional | 1st call s | later call ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for g in row["graphs"]:
            fb = ", ".join(f"{k} ×{v}" for k, v in g["aten_fallbacks"].items()) or "none"
            later = "-" if g["later_call_ms"] is None else f"{g['later_call_ms']:.1f}"
            first = f"{g['compiles_first_call']}" + (" (cached: same HLO as an earlier run)" if g["cache_hit_first_call"] else "")
            lines.append(f"| {g['graph'].split(' ', 1)[1]} | {g['calls']} | {first} | "
                         f"{g['compiles_later_calls']} | {fb} | {' / '.join(map(str, g['hlo_ops'].values())) or '-'} | "
                         f"{g['first_call_s']:.1f} | {later} |")
        lines += ["", f"- SEQ_MATCH vs CPU fp32 reference (HF eager): **{fp32['all_match']}** "
                      f"({fp32['matched']}/{len(PROMPTS)}; first divergence per prompt {fp32['first_divergence']}; "
                      f"max |Δlogit| at step 0 {fp32['max_abs_dlogit_step0']:.2e}, lowest logit cosine {fp32['min_cosine']:.6f})"]
        if "vs_cpu_int8" in row:
            q = row["vs_cpu_int8"]
            lines.append(f"- SEQ_MATCH vs the same int8 model on the CPU (HF, int8 experts): **{q['all_match']}** "
                         f"({q['matched']}/{len(PROMPTS)}; max |Δlogit| at step 0 {q['max_abs_dlogit_step0']:.2e}, "
                         f"lowest cosine {q['min_cosine']:.6f})")
        export = "" if row["export_s"] is None else f"export {row['export_s']:.0f} s, "
        lines += [f"- wall: {export}generation {row['generate_s']:.1f} s (compiles included); "
                  f"{row['other_compiles']} compilation(s) outside the graphs (collecting tokens/logits for the host)",
                  f"- verdict: {'PASS' if row['passed'] else 'FAIL'}", ""]
    lines += [
        f"Allow-list: {result['allowlist']}", "",
        "Notes:",
        "- A first call with 0 compilations found its graph already compiled: the same HLO (same graph, same "
        "weights) ran in an earlier run of this process (torch-xla's `CachedCompile`).",
        "- int8 is compared with the fp32 reference and with the same int8 model on the CPU; the second is the "
        "check of the XLA lowering (on seeded random weights, whose logits are nearly flat, int8 rounding alone "
        "flips greedy picks).",
        "- int8 runs as modules (lazy tracing, what torch-neuronx traces); it is not exported (`torch.export`), "
        "since its int8 copies are made on first use, outside any graph.",
        "- HLO column (with `--hlo`): each `sort` is a router's `topk` (one per layer), which torch-xla lowers to a "
        "full sort; a custom-call would be an op outside plain HLO, a while or conditional control flow in the graph.",
        "- What this does not show: that neuronx-cc accepts this HLO (its sort support included), "
        "or anything about speed on a Neuron device. Times above are XLA:CPU on a shared 2-core machine.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-gemma4-moe", help="port with a [static] table")
    parser.add_argument("--new-tokens", type=int, default=33, help="tokens per prompt: prefill + N-1 decode steps")
    parser.add_argument("--out", default="bench/results/xla-check", help="result files: OUT.md and OUT.json")
    parser.add_argument("--hlo", metavar="DIR", help="also write each graph's HLO text into DIR")
    parser.add_argument("--write-ops", action="store_true",
                        help=f"rewrite the allow-list {XLA_LOWERED_OPS_FILE.name} from the exported graphs")
    args = parser.parse_args(argv)

    xla = Xla()
    import transformers

    port = load_port(args.model)
    if port.static is None:
        sys.exit(f"error: port {port.name!r} has no [static] table: it has no static graphs to check")
    tokenizer = ByteTokenizer()
    ids, mask = left_pad([tokenizer.encode(p) for p in PROMPTS], tokenizer.pad_token_id)
    references = {"fp32": greedy(build_model(port, "eager", torch.float32), ids, mask, args.new_tokens),
                  "int8": greedy(build_model(port, "int8", torch.float32), ids, mask, args.new_tokens)}
    hlo_dir = Path(args.hlo) if args.hlo else None

    rows, ops = [], {}
    for run in RUNS:
        print(f"== {run.name}", flush=True)
        row, run_ops = check_run(xla, port, run, ids, mask, args.new_tokens, references, hlo_dir)
        row["passed"] = passed(row)
        rows.append(row)
        for graph, names in run_ops.items():
            ops[f"{run.prefill}/{run.decode} {graph}"] = (names, row["passed"])
        print(report.table(row["graphs"], [("graph", "graph"), ("calls", "calls"),
                                           ("compiles_first_call", "compiles 1st"),
                                           ("compiles_later_calls", "compiles later"),
                                           ("aten_fallbacks", "aten fallbacks")]))
        print(f"SEQ_MATCH vs CPU fp32: {row['vs_cpu_fp32']['all_match']}"
              + (f"; vs CPU int8: {row['vs_cpu_int8']['all_match']}" if "vs_cpu_int8" in row else "")
              + f"  -> {'PASS' if row['passed'] else 'FAIL'}", flush=True)

    exported = set().union(*(names for names, _ in ops.values()))
    ok = all(row["passed"] for row in rows)
    if args.write_ops:
        if not ok:
            print("error: not writing the allow-list: a run failed", file=sys.stderr)
            return 1
        header = (f"# Ops of the exported static graphs ({', '.join(sorted(ops))}) that lowered on XLA:CPU with no\n"
                  f"# aten fallback and one compilation per graph. Written by bench/xla_check.py --write-ops\n"
                  f"# (torch {torch.__version__}, torch-xla {xla.version}); do not edit by hand.\n")
        with report.atomic_write(XLA_LOWERED_OPS_FILE) as f:
            f.write(header + "".join(f"{op}\n" for op in sorted(exported)))
        allowlist = f"`{XLA_LOWERED_OPS_FILE.name}` written: {len(exported)} ops."
    else:
        missing = sorted(exported - xla_lowered_ops())
        ok = ok and not missing
        allowlist = (f"every one of the {len(exported)} ops of the exported graphs is on `{XLA_LOWERED_OPS_FILE.name}`"
                     if not missing else f"ops of the exported graphs missing from the allow-list: {missing}")
    print(allowlist)

    result = {
        "port": port.name,
        "weights": f"seeded random weights, seed {port.seed}" if port.weights_source == "random"
                   else f"checkpoint {port.checkpoint.name}",
        "new_tokens": args.new_tokens, "batch_size": port.static.batch_size,
        "prompts": list(PROMPTS), "passed": ok, "allowlist": allowlist, "runs": rows,
        "environment": {"machine": f"CPU ({platform.machine()}, {os.cpu_count()} cores shared)",
                        "python": platform.python_version(), "torch": torch.__version__,
                        "torch_xla": xla.version, "transformers": transformers.__version__},
    }
    report.write_json(result, f"{args.out}.json")
    with report.atomic_write(Path(f"{args.out}.md")) as f:
        f.write(markdown(result))
    print(f"{'PASS' if ok else 'FAIL'}: written {args.out}.md and {args.out}.json")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:  # a bad --model: one line, as the CLI prints it
        sys.exit(f"error: {e}")
