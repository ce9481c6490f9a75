"""`neuron-moe` entry point: parses arguments, dispatches to the modules, prints reports."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .errors import UserError
from .port import DEFAULT_PORT, DTYPES


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_PORT, metavar="NAME|PATH",
                   help=f"port name or path to a port .toml (default: {DEFAULT_PORT}; `neuron-moe ports` lists them)")
    p.add_argument("--checkpoint", metavar="DIR", help="HF-layout checkpoint directory (overrides the port's weights)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON ('-' for stdout)")


def cmd_ports(args) -> int:
    from .port import builtin_ports, load_port
    from .report import table, write_json

    rows = []
    for name in builtin_ports():
        port = load_port(name)
        rows.append({"name": name, "weights": port.weights_source, "description": port.description})
    if args.json:
        write_json(rows, args.json)
    if args.json != "-":
        print(table(rows, [("name", "port"), ("weights", "weights"), ("description", "description")]))
    return 0


def cmd_info(args) -> int:
    from .info import geometry, parameter_counts
    from .port import load_port
    from .report import table, write_json

    port = load_port(args.model)
    report = {"model": port.name, "geometry": geometry(port.config), "parameters": parameter_counts(port.config)}
    if args.json:
        write_json(report, args.json)
    if args.json == "-":
        return 0
    params = report["parameters"]
    print(f"{port.name}: {port.description}\n")
    print(table([{"field": k, "value": v} for k, v in report["geometry"].items()], [("field", "geometry"), ("value", "")]))
    print()
    rows = [{"what": g, "count": n, "B": n / 1e9, "share": f"{100 * n / params['total']:.1f}%"}
            for g, n in params["groups"].items()]
    rows += [{"what": "total", "count": params["total"], "B": params["total"] / 1e9, "share": "100.0%"},
             {"what": "active per token", "count": params["active_per_token"],
              "B": params["active_per_token"] / 1e9,
              "share": f"{100 * params['active_per_token'] / params['total']:.1f}%"}]
    print(table(rows, [("what", "parameters"), ("count", "count"), ("B", "billions"), ("share", "share")]))
    print()
    unit, scale = ("GiB", 2**30) if params["bytes"]["bfloat16"] >= 2**30 else ("MiB", 2**20)
    print(table([{"dtype": k, "size": v / scale} for k, v in params["bytes"].items()],
                [("dtype", "weights as"), ("size", unit, "{:.2f}")]))
    return 0


def cmd_validate(args) -> int:
    from .eval.seq_match import DEFAULT_PROMPTS, run_validation
    from .port import load_port
    from .report import table, write_json
    from .tokenizer import load_tokenizer

    port = load_port(args.model)
    tokenizer = load_tokenizer(port, args.checkpoint)
    prompts = list(DEFAULT_PROMPTS) + list(args.prompt or [])
    dtype = DTYPES[args.dtype] if args.dtype else None
    report = run_validation(port, tokenizer, args.backend, args.max_new_tokens, prompts, dtype, args.checkpoint)
    if args.json:
        write_json(report, args.json)
    if args.json != "-":
        print(f"SEQ_MATCH  {report['model']}: {report['backend']} ({report['backend_dtype']}) "
              f"vs {report['reference']}, {args.max_new_tokens} new tokens\n")
        shown = [dict(r, prompt=repr(r["prompt"])) for r in report["prompts"]]  # newlines visible, one row each
        print(table(shown, [
            ("prompt", "prompt"), ("seq_match", "SEQ_MATCH"), ("first_divergence", "first diff"),
            ("max_abs_dlogit_step0", "max|Δlogit| step 0"), ("min_cosine", "min cosine", "{:.7f}"),
        ]))
        print("\nreference (greedy) continuations:")
        for row in report["prompts"]:
            print(f"  {row['prompt']!r} -> {row['reference_text']!r}")
        print(f"\n{'PASS' if report['all_match'] else 'FAIL'}: "
              f"{sum(r['seq_match'] for r in report['prompts'])}/{len(report['prompts'])} prompts match")
    return 0 if report["all_match"] else 1


def cmd_build_corpus(args) -> int:
    from .report import write_json
    from .training.corpus import build_corpus

    counts = build_corpus(args.text_dir, args.out, seed=args.seed, scale=args.scale)
    if args.json:
        write_json(counts, args.json)
    if args.json != "-":
        print(f"corpus in {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if isinstance(v, int)))
    return 0


def cmd_train_tiny(args) -> int:
    from .port import load_port
    from .report import write_json
    from .training.tiny import train

    port = load_port(args.model)
    summary = train(port.config, args.corpus, args.out, steps=args.steps, batch_size=args.batch_size,
                    seq_len=args.seq_len, lr=args.lr, seed=args.seed, threads=args.threads)
    if args.json:
        write_json({k: v for k, v in summary.items() if k != "log"}, args.json)
    if args.json != "-":
        print(f"wrote {args.out}: {summary['steps']} steps, {summary['tokens']} tokens, "
              f"{summary['seconds']:.0f} s, final loss {summary['final_loss']:.4f}")
    return 0


def cmd_eval_tasks(args) -> int:
    from .eval.tasks import TASKS, evaluate
    from .port import load_port
    from .report import table, write_json

    port = load_port(args.model)
    report = evaluate(port, args.backend, args.checkpoint, per_task=args.items, corpus=args.corpus,
                      text_docs=args.text_docs, tasks=tuple(args.task or TASKS))
    if args.json:
        write_json(report, args.json)
    if args.json == "-":
        return 0
    print(f"{report['model']}: greedy answers with {report['backend']}, exact match up to EOS\n")
    print(table(report["tasks"], [("task", "task"), ("items", "items"), ("correct", "correct"),
                                  ("accuracy", "accuracy", "{:.1%}"), ("answer_tokens_min", "answer tokens min"),
                                  ("answer_tokens_max", "max")]))
    text = report["text"]
    if text is None:
        print("\nno --corpus: held-out perplexity and expert load not measured")
        return 0
    print(f"\nheld-out text ({text['tokens']} tokens): perplexity {text['perplexity']:.2f}, "
          f"unigram baseline {text['unigram_perplexity']:.2f}")
    print(f"expert share of routed slots on that text: min {text['expert_share_min']:.3f}, "
          f"max {text['expert_share_max']:.3f} (uniform {1 / port.config.num_experts:.3f})")
    return 0


def parser() -> argparse.ArgumentParser:
    from .eval.seq_match import BACKENDS
    from .eval.tasks import TASKS

    import neuron_moe

    top = argparse.ArgumentParser(prog="neuron-moe", description=neuron_moe.__doc__)
    top.add_argument("--version", action="version", version=f"neuron-moe {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ports", help="list the built-in ports")
    p.add_argument("--json", metavar="FILE", help="also write the list as JSON ('-' for stdout)")
    p.set_defaults(func=cmd_ports)

    p = sub.add_parser("info", help="geometry, parameter counts and weight bytes of a port (meta device)")
    _common(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("validate", help="SEQ_MATCH: greedy tokens of a backend vs the CPU reference (HF eager fp32)",
                       description="Greedy-generate from fixed prompts with the CPU reference (HF eager, fp32) "
                                   "and with the backend under test; print one row per prompt. "
                                   "Exit 0 only when every prompt's tokens match.")
    _common(p)
    p.add_argument("--backend", default="dense_masked", choices=sorted(BACKENDS), help="backend under test")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="backend dtype (default: the port's)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32, metavar="N", help="tokens to generate (default 32)")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="an extra prompt (repeatable)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("build-corpus", help="write the tiny model's corpus: English text plus the synthetic tasks",
                       description="Text from the Debian package 'fortunes' (apt-get install fortunes) plus "
                                   "the task mix of neuron_moe.eval.tasks; fixed train/calib/eval splits.")
    p.add_argument("--text-dir", default="/usr/share/games/fortunes", help="the fortune files (default: %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the training items (default 0)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the number of training task items")
    p.add_argument("--json", metavar="FILE", help="also write the counts as JSON ('-' for stdout)")
    p.set_defaults(func=cmd_build_corpus)

    p = sub.add_parser("train-tiny", help="train the port's model on a corpus (deterministic, CPU)",
                       description="Train a BPE tokenizer and the port's Gemma-4 MoE on the corpus from "
                                   "build-corpus; write an HF-layout checkpoint with the tokenizer and the loss log.")
    p.add_argument("--model", default=DEFAULT_PORT, metavar="NAME|PATH", help="port whose config to train")
    p.add_argument("--corpus", required=True, metavar="DIR", help="directory written by build-corpus")
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    p.add_argument("--steps", type=_positive_int, default=1500, help="optimizer steps (default 1500)")
    p.add_argument("--batch-size", type=_positive_int, default=4, help="windows per step (default 4)")
    p.add_argument("--seq-len", type=_positive_int, default=512, help="tokens per window (default 512)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation and data order (default 0)")
    p.add_argument("--threads", type=_positive_int, default=1,
                   help="torch threads (default 1: on shared cores two threads wait on each other and run "
                        "several times slower; the thread count is part of what makes a run reproducible)")
    p.add_argument("--json", metavar="FILE", help="also write the run summary as JSON ('-' for stdout)")
    p.set_defaults(func=cmd_train_tiny)

    p = sub.add_parser("eval-tasks", help="task accuracy, held-out perplexity and expert load of a model",
                       description="Greedy answers to the evaluation items of each task (exact match up to EOS), "
                                   "perplexity of held-out text against a unigram baseline, and each expert's "
                                   "share of routed tokens on that text.")
    _common(p)
    p.add_argument("--backend", default="eager", choices=sorted(BACKENDS), help="backend that generates (default eager)")
    p.add_argument("--items", type=_positive_int, default=50, help="evaluation items per task (default 50)")
    p.add_argument("--task", action="append", choices=TASKS,
                   help="only this task (repeatable; default: all)")
    p.add_argument("--corpus", metavar="DIR", help="a build-corpus directory: adds held-out text perplexity (vs a "
                                                 "unigram baseline) and each expert's share of tokens on that text")
    p.add_argument("--text-docs", type=_positive_int, default=200, help="held-out text documents (default 200)")
    p.set_defaults(func=cmd_eval_tasks)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
