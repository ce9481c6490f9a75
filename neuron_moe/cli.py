"""`neuron-moe` entry point: parses arguments, dispatches to the modules, prints reports."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .errors import UserError
from .parallel.layout import DEFAULT_EXPERT_LAYOUT
from .port import DEFAULT_PORT, DTYPES


def _json_out(report, args) -> bool:
    """Write the report as --json asks; True when the text report should print too (not when the
    JSON went to stdout)."""
    if args.json:
        from .report import write_json

        write_json(report, args.json)
    return args.json != "-"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _tcp_port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {value}")
    return value


def _expert_layout_arg(p: argparse.ArgumentParser, which: str = "") -> None:
    from .parallel.layout import EXPERT_LAYOUTS

    p.add_argument("--expert-layout", choices=EXPERT_LAYOUTS,
                   help=f"{which}how TP ranks split the experts: channel (every expert's I/t intermediate channels "
                        "per rank; decode gathers each token's k experts) or expert (E/t whole experts per rank, "
                        "the seed port's) (default: the port's [static] expert_layout, else channel)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_PORT, metavar="NAME|PATH",
                   help=f"port name or path to a port .toml (default: {DEFAULT_PORT}; `neuron-moe ports` lists them)")
    p.add_argument("--checkpoint", metavar="DIR", help="HF-layout checkpoint directory (overrides the port's weights)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON ('-' for stdout)")


def cmd_ports(args) -> int:
    from .port import builtin_ports, load_port
    from .report import table

    rows = []
    for name in builtin_ports():
        port = load_port(name)
        rows.append({"name": name, "weights": port.weights_source, "description": port.description})
    if _json_out(rows, args):
        print(table(rows, [("name", "port"), ("weights", "weights"), ("description", "description")]))
    return 0


def cmd_info(args) -> int:
    from .info import geometry, parameter_counts, per_token_costs
    from .port import load_port
    from .report import table

    port = load_port(args.model)
    report = {"model": port.name, "geometry": geometry(port.config), "parameters": parameter_counts(port.config)}
    if args.per_token:
        report["per_token"] = per_token_costs(port.config, port.dtype)
    if not _json_out(report, args):
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
    if args.per_token:
        _print_per_token(report["per_token"], port.config)
    return 0


def _print_per_token(costs: dict, config) -> None:
    from .report import table

    print(f"\nper decoded token (batch 1, weights in {costs['dtype']}; attention over the KV cache not counted)\n")
    rows = [{"experts": r["experts"], "read": r["experts_read_per_layer"], "mb_layer": r["expert_bytes_per_layer"] / 1e6,
             "gb_experts": r["expert_bytes_per_token"] / 1e9, "gb_all": r["weight_bytes_per_token"] / 1e9,
             "gflop": r["flops_per_token"] / 1e9, "x": f"{r['expert_bytes_reduction']:.0f}x"}
            for r in costs["implementations"]]
    print(table(rows, [
        ("experts", "experts impl"), ("read", "experts read/layer"), ("mb_layer", "expert MB/layer", "{:.1f}"),
        ("gb_experts", "expert GB/token", "{:.3f}"), ("gb_all", "all weights GB/token", "{:.3f}"),
        ("gflop", "GFLOP/token", "{:.3f}"), ("x", "expert bytes vs dense_masked"),
    ]))
    print(f"\nselective reads batch x {config.top_k_experts} experts per layer and step, dense_masked "
          f"{config.num_experts}: selective reads less below batch {costs['selective_below_batch']}")


def cmd_validate(args) -> int:
    from .eval.seq_match import DEFAULT_PROMPTS, run_validation
    from .port import load_port
    from .report import table
    from .tokenizer import load_tokenizer

    port = load_port(args.model)
    tokenizer = load_tokenizer(port, args.checkpoint)
    prompts = list(DEFAULT_PROMPTS) + list(args.prompt or [])
    dtype = DTYPES[args.dtype] if args.dtype else None
    reader_flags = {"sidecar": args.sidecar, "budget": args.budget, "rank": args.rank}
    options = {k: v for k, v in reader_flags.items() if v is not None}
    if args.reader_backend is not None:
        options["reader_backend"] = args.reader_backend
    if args.reader_weights is not None:
        options["reader_weights"] = args.reader_weights
    tp_reader = args.backend == "tp8" and bool(options)  # the reader in the TP 8 decode graph
    if tp_reader and ({"reader_backend", "reader_weights"} & options.keys() or args.sidecar is None):
        raise UserError("--backend tp8 runs the reader with --sidecar DIR (from `neuron-moe prep-reader --tp 8`) and "
                        "--budget; its kernels are the PyTorch reference over the bf16 experts "
                        "(no --reader-backend, no --reader-weights)")
    if options and args.backend != "reader" and not tp_reader:
        raise UserError(f"--{'/--'.join(options).replace('_', '-')} apply to --backend reader only "
                        f"(--sidecar, --budget and --rank also to tp8)")
    if args.expert_layout is not None:
        from .parallel.generate import BACKENDS as TP_BACKENDS

        if args.backend not in TP_BACKENDS:
            raise UserError(f"--expert-layout applies to the TP backends ({', '.join(TP_BACKENDS)}) only")
        options["expert_layout"] = args.expert_layout
    if args.backend == "reader":  # fail on a bad sidecar, budget or reader backend before the reference runs
        from .experts.channel_reader import plan_reader, reader_forward, reader_settings

        reader_forward(options.get("reader_backend", "reference"))
        plan_reader(port.config, *reader_settings(port, **reader_flags), options.get("reader_weights", "bf16"))
    if tp_reader:
        from .parallel.reader import check_reader, open_shards

        check_reader(args.expert_layout or (port.static.expert_layout if port.static else DEFAULT_EXPERT_LAYOUT), False,
                     args.budget)
        open_shards(port.config, args.sidecar, 8, args.budget, args.rank)
    report = run_validation(port, tokenizer, args.backend, args.max_new_tokens, prompts, dtype, args.checkpoint,
                            options)
    if _json_out(report, args):
        print(f"SEQ_MATCH  {report['model']}: {report['backend']} ({report['backend_dtype']}) "
              f"vs {report['reference']}, {args.max_new_tokens} new tokens\n")
        shown = [dict(r, prompt=repr(r["prompt"])) for r in report["prompts"]]  # newlines visible, one row each
        print(table(shown, [
            ("prompt", "prompt"), ("seq_match", "SEQ_MATCH"), ("first_divergence", "first diff"),
            ("max_abs_dlogit_step0", "max|Δlogit| step 0"), ("min_cosine", "min cosine", "{:.7f}"),
        ]))
        for row in report["prompts"]:
            if not row["finite_logits"]:
                print(f"\n{row['prompt']!r}: NaN or inf among the logits (a failed comparison)")
        print("\nreference (greedy) continuations, up to the first EOS:")
        for row in report["prompts"]:
            print(f"  {row['prompt']!r} -> {row['reference_text']!r}")
        print(f"\n{'PASS' if report['all_match'] else 'FAIL'}: "
              f"{sum(r['seq_match'] for r in report['prompts'])}/{len(report['prompts'])} prompts match")
    return 0 if report["all_match"] else 1


def cmd_publish(args) -> int:
    from .publish.s3 import publish
    from .report import table

    report = publish(args.dir, args.uri, overwrite=args.overwrite, deep=args.deep)
    if _json_out(report, args):
        print(table(report["files"], [("path", "file"), ("size", "bytes"), ("sha256", "sha256"), ("crc32", "CRC32")]))
        print(f"\npublished {len(report['files'])} files ({report['total_bytes']} bytes) to {report['uri']}, "
              f"each verified with head_object; manifest {report['manifest']}")
    return 0


def cmd_pull(args) -> int:
    from .publish.s3 import pull_report
    from .report import table

    report = pull_report(args.uri, args.dir)
    if _json_out(report, args):
        print(table(report["files"], [("path", "file"), ("size", "bytes"), ("sha256", "sha256"), ("action", "")]))
        print(f"\n{report['dest']}: {len(report['files'])} files verified against the manifest of {report['uri']} "
              f"({report['downloaded_bytes']} of {report['total_bytes']} bytes downloaded)")
    return 0


def cmd_plan(args) -> int:
    from .neuron.plan import GB, plan
    from .port import load_port
    from .report import table

    port = load_port(args.model)
    static = port.static
    expert_layout = args.expert_layout or (static.expert_layout if static else DEFAULT_EXPERT_LAYOUT)
    reader = None if args.reader_budget is None else \
        {"budget": args.reader_budget, "scan": args.reader_scan, "rank": args.reader_rank}
    report = plan(port.config, args.instance, args.tp, args.dtype, args.batch, args.seq,
                  args.runtime_reserve_gib * 2**30, model=port.name, expert_layout=expert_layout,
                  decode_experts=static.decode_experts if static else "selective", reader=reader)
    if _json_out(report, args):
        print(f"{port.name} on {args.instance}: TP {args.tp}, {args.dtype} experts in the {expert_layout} layout, "
              f"batch {args.batch}, seq {args.seq}\n")
        if "per_rank_bytes" in report:
            rows = [{"what": k, "GB": v / GB} for k, v in report["per_rank_bytes"].items()]
            rows.append({"what": "total", "GB": report["per_rank_total_bytes"] / GB})
            print(table(rows, [("what", "per rank"), ("GB", "GB", "{:.3f}")]))
            print(f"\nexperts on all ranks: {report['experts_all_ranks_bytes'] / GB:.2f} GB "
                  f"(graph and runtime rows are stated estimates, not measurements)\n")
            rows = [dict(r, expert_layout=r["expert_layout"] + (" + reader" if "reader" in r else "")
                         + (" (this plan)" if r["this_plan"] else "")) for r in report["decode"]]
            print(table(rows, [("expert_layout", "expert layout"), ("decode_graph", "its decode graph reads"),
                               ("GB_per_token", "GB/token/rank", "{:.3f}"), ("floor_ms", "HBM floor ms/token", "{:.2f}"),
                               ("tokens_per_s_ceiling", "tokens/s ceiling", "{:.1f}")]))
            print("\n(decode: the graphs trace-and-compile builds, at this batch; bytes read, not measured)\n")
            print(table(report["host_per_step"], [("what", "host <-> device per decode step"),
                                                   ("direction", ""), ("bytes", "bytes")]))
            print()
        print(f"{'FITS' if report['fits'] else 'DOES NOT FIT'}: {report['reason']}")
    return 0 if report["fits"] else 1


def cmd_trace_and_compile(args) -> int:
    from .neuron.compile import trace_and_compile
    from .port import load_port
    from .report import table

    port = load_port(args.model)
    flags = {"sidecar": args.sidecar, "budget": args.budget, "rank": args.rank}
    if not args.reader and any(v is not None for v in flags.values()):
        raise UserError("--sidecar, --budget and --rank configure the reader: pass --reader")
    report = trace_and_compile(port, args.dtype, args.tp, args.out, dry_run=args.dry_run, overwrite=args.overwrite,
                               checkpoint=args.checkpoint, expert_layout=args.expert_layout, logits=args.with_logits,
                               reader=flags if args.reader else None)
    if _json_out(report, args):
        rows = [{"file": f, "bytes": v["size"], "sha256": v["sha256"]} for f, v in report["files"].items()]
        print(table(rows, [("file", "file"), ("bytes", "bytes"), ("sha256", "sha256")]))
        what = "dry run (CPU, gloo layers; exported, not compiled)" if report["dry_run"] else "compiled for Neuron"
        print(f"\n{report['out']}: {port.name} {args.dtype} TP {args.tp}, {report['expert_layout']} expert layout, "
              f"keys {', '.join(report['keys'])}; {what}"
              + ("" if report["weights"] else "; no weights (meta device): exported, manifest and shard plan only"))
        if report.get("reader"):
            r = report["reader"]
            print(f"decode key reads through the reader: budget {r['budget']:g} %, {r['k_per_rank']} exact channels "
                  f"per token and rank, scan {r['scan']}, recovery rank {r['rank']} (each rank's sidecar shard in its "
                  f"weights)")
    return 0


def cmd_serve(args) -> int:
    try:
        from .serve.server import run
    except ModuleNotFoundError as e:
        if e.name in ("fastapi", "uvicorn", "starlette", "pydantic"):
            raise UserError(f"neuron-moe serve needs {e.name!r}: pip install 'neuron-moe[serve]'") from None
        raise
    return run(args)


def _serve_parser(sub) -> None:
    from .model import EXPERTS_IMPLEMENTATIONS

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and text completions, SSE streaming)",
                       description="Serve one model over the OpenAI API: POST /v1/chat/completions, "
                                   "/v1/completions; GET /v1/models, /health, /ping. The model loads after "
                                   "the socket is bound (/health answers 503 until it is ready). SIGTERM "
                                   "drains the requests in flight, then exits 0.")
    p.add_argument("--model", default=DEFAULT_PORT, metavar="NAME|PATH",
                   help=f"port name or path to a port .toml (default: {DEFAULT_PORT})")
    p.add_argument("--checkpoint", metavar="DIR", help="HF-layout checkpoint directory (overrides the port's weights)")
    p.add_argument("--backend", default="eager", choices=[*EXPERTS_IMPLEMENTATIONS, "static", "neuron"],
                   help="static: the port's static graphs on CPU, continuously batched (its [static] table); "
                        "neuron: the compiled artifact, continuously batched (needs the Neuron SDK); or an "
                        "experts implementation: transformers' model on CPU, one request per thread, any "
                        "prompt that fits the context (default: eager)")
    p.add_argument("--artifacts", metavar="DIR|s3://BUCKET/PREFIX",
                   help="what the backend loads: the trace-and-compile output for neuron, an HF checkpoint for "
                        "a CPU backend; an s3:// URI is pulled (and verified) into --artifacts-cache first")
    p.add_argument("--artifacts-cache", default="~/.cache/neuron-moe/artifacts", metavar="DIR",
                   help="where s3:// artifacts are pulled to (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="CPU backend dtype (default: the port's)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    p.add_argument("--port", type=_tcp_port, default=8080, help="TCP port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("NEURON_MOE_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $NEURON_MOE_API_KEY; unset: open)")
    p.add_argument("--batch-size", type=_positive_int, metavar="B",
                   help="--backend static: rows of the graphs' batch, the requests generating at once "
                        "(default: the port's [static] batch_size)")
    p.add_argument("--max-running", type=_positive_int, metavar="N",
                   help="per-request backends: requests generating at once (default: 1); the batching "
                        "backends run one request per row")
    p.add_argument("--max-queue", type=int, default=32, metavar="N",
                   help="requests waiting beyond those; more get 429 + Retry-After (default: 32)")
    p.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                   help="on SIGTERM, seconds to let requests in flight finish; those still running then end "
                        "with an error event (streams) or a 503 (default: 60)")
    p.add_argument("--max-body-bytes", type=_positive_int, metavar="N",
                   help="larger request bodies get 413 before they are read (default: 4194304, 4 MiB)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
def cmd_reads(args) -> int:
    from dataclasses import asdict

    from .port import load_port
    from .reader.accounting import ReaderSettings, batch_breakdown, breakdown, full_bytes
    from .reader.geometry import Geometry
    from .report import table

    explicit = (args.hidden, args.experts, args.top_k, args.intermediate)
    if any(v is not None for v in explicit):
        if None in explicit:
            raise UserError("an explicit geometry needs all four of --hidden --experts --top-k --intermediate")
        geo = Geometry(hidden=args.hidden, experts=args.experts, top_k=args.top_k, intermediate=args.intermediate)
        name = "explicit geometry"
    else:
        port = load_port(args.model)
        geo, name = Geometry.from_config(port.config), port.name
    layout = ReaderSettings(scan=args.scan, rank=args.rank, weights=args.dtype)
    whole, tp = geo, args.tp or 1
    if tp > 1 and (args.dtype != "bf16" or args.batch is not None):
        raise UserError("reads --tp T is the per-rank reader over bf16 experts, one token a step "
                        "(not with --dtype int8 or --batch)")
    if tp > 1:  # one rank of the channel layout: I/t channels of every expert
        from .reader.accounting import rank_geometry, solve_rank_k

        geo = rank_geometry(whole, tp)
        solve_rank_k(whole, layout, args.budget, tp)  # a budget below a rank's floor: the error names TP
    report = {"model": name, "geometry": asdict(whole), "scan": args.scan, "rank": args.rank, "tp": tp,
              "dtype": args.dtype,
              **breakdown(geo, layout, args.budget)}
    if args.dtype != "bf16":
        report["percent_of_bf16_full"] = 100 * sum(v["bytes"] for v in report["reads"].values()) / full_bytes(geo)
    if args.batch is not None:
        report["batch"] = batch_breakdown(geo, layout, args.budget, args.batch, args.step_budget)
    if not _json_out(report, args):
        return 0
    print(f"reads per token and MoE layer: {name} (hidden {geo.hidden}, {geo.experts} experts, top-{geo.top_k}, "
          f"intermediate {whole.intermediate})")
    if tp > 1:
        print(f"per rank at TP {tp} (channel expert layout: each rank its {geo.intermediate} of {whole.intermediate} "
              f"channels of every expert, its own sketch strips, the whole U); every rank reads the same")
    experts = "bf16" if args.dtype == "bf16" else "int8 exact rows with fp32 scales, the sketch and recovery bf16"
    print(f"layout: the sidecar's (base-3 codes, 5 per byte), scan {args.scan} of 128 per block, recovery rank {args.rank}, {experts}, 32-byte sectors")
    print(f"budget {args.budget}% -> k = {report['k']} exact channels of {report['channels']} "
          f"({100 * report['k'] / report['channels']:.1f}%)\n")
    rows = [{"part": p, **v} for p, v in report["reads"].items()]
    rows += [{"part": "total", "bytes": sum(v["bytes"] for v in report["reads"].values()),
              "percent": report["total_percent"]},
             {"part": "full model" if tp == 1 else "full (the rank's share)", "bytes": report["full_bytes"],
              "percent": 100.0}]
    print(table(rows, [("part", "read"), ("bytes", "bytes"), ("percent", "share of full", "{:.2f}%")]))
    print()
    rows = [{"part": p, **v} for p, v in report["resident"].items()]
    print(table(rows, [("part", "resident (per layer)"), ("bytes", "bytes"),
                       ("percent", "share of the bf16 experts", "{:.2f}%")]))
    if args.dtype != "bf16":
        print(f"\n{report['total_percent']:.2f}% of the {args.dtype} experts' full read is "
              f"{report['percent_of_bf16_full']:.2f}% of the bf16 experts'")
    if args.batch is not None:
        _print_batch(report["batch"])
    return 0


def _print_batch(b: dict) -> None:
    from .report import table

    print(f"\na decode step of batch {b['batch']} (uniform routing: {b['expected_union']:.1f} experts expected in the "
          f"union, taken as {b['union_experts']}), each row read once; one token reads {b['one_token_bytes']} B")
    rows = [{"rule": "full batch (the union's experts whole)", "bytes": b["full_bytes"], "percent": 100.0,
             "x": b["full_bytes"] / b["one_token_bytes"], "k": ""}]
    token, rule = b["rules"]["token"], b["rules"]["batch"]
    rows.append({"rule": f"independent top-k, k = {b['k_per_token']} per token (at most)", "bytes": token["bytes"],
                 "percent": token["percent_of_full_batch"], "x": token["x_one_token"], "k": ""})
    rows.append({"rule": f"batch rule within {b['step_budget']:g}x one token's reads", "bytes": rule["bytes"],
                 "percent": rule["percent_of_full_batch"], "x": rule["x_one_token"], "k": rule["k"]})
    print(table(rows, [("rule", "step reads"), ("bytes", "bytes"), ("percent", "share of full batch", "{:.2f}%"),
                       ("x", "x one token", "{:.2f}"), ("k", "channels of the step")]))


def cmd_prep_reader(args) -> int:
    from pathlib import Path

    from .port import load_port
    from .model import prep_port
    from .reader.sidecar import Sidecar

    if args.source and not args.tp:
        raise UserError("--from shards an existing sidecar: it needs --tp")
    port = load_port(args.model)
    out = Path(args.out)
    if args.tp:  # a directory: the whole sidecar and each rank's shard
        from .parallel.layout import check_degree
        from .reader.shard import WHOLE, write_shards

        check_degree(port.config, args.tp)
        path = Path(args.source) if args.source else out / WHOLE
        if not args.source:
            out.mkdir(parents=True, exist_ok=True)
            prep_port(port, path, args.checkpoint, seed=args.seed, rank=args.rank, scan=args.scan)
    else:
        path = prep_port(port, out, args.checkpoint, seed=args.seed, rank=args.rank, scan=args.scan)
    side = Sidecar(path)
    if side.tp is not None:
        raise UserError(f"{path}: already a TP shard (rank {side.tp_rank} of {side.tp}); shard the whole sidecar")
    files = [path] + (write_shards(side, out, args.tp) if args.tp else [])
    report = {"model": port.name, "sidecar": str(path), "bytes": path.stat().st_size, "layers": side.layers,
              "scan": side.scan, "rank": side.layout.rank, "seed": side.seed, "source_sha256": side.source_sha256,
              "tp": args.tp, "files": {str(f): f.stat().st_size for f in files}}
    if _json_out(report, args):
        for f in files:
            print(f"{'wrote' if f != path or not args.source else 'read'} {f}: {f.stat().st_size / 2**20:.2f} MiB")
        print(f"{side.layers} layers, scan {side.scan}, rank {side.layout.rank}, seed {side.seed}, "
              f"source sha256 {side.source_sha256[:16]}…"
              + (f"; shards for TP {args.tp}, channel expert layout" if args.tp else ""))
    return 0


def cmd_build_corpus(args) -> int:
    from .training.corpus import build_corpus

    counts = build_corpus(args.text_dir, args.out, seed=args.seed, scale=args.scale)
    if _json_out(counts, args):
        print(f"corpus in {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if isinstance(v, int)))
    return 0


def cmd_train_tiny(args) -> int:
    from .port import load_port
    from .training.tiny import train

    port = load_port(args.model)
    summary = train(port.config, args.corpus, args.out, steps=args.steps, batch_size=args.batch_size,
                    seq_len=args.seq_len, lr=args.lr, task_share=args.task_share, seed=args.seed,
                    threads=args.threads)
    if _json_out({k: v for k, v in summary.items() if k != "log"}, args):
        print(f"wrote {args.out}: {summary['steps']} steps, {summary['tokens']} tokens, "
              f"{summary['seconds']:.0f} s, final loss {summary['final_loss']:.4f}")
    return 0


def cmd_eval_tasks(args) -> int:
    from .eval.tasks import TASKS
    from .eval.tasks_eval import evaluate
    from .port import load_port
    from .report import table

    port = load_port(args.model)
    report = evaluate(port, args.backend, args.checkpoint, per_task=args.items, corpus=args.corpus,
                      text_docs=args.text_docs, tasks=tuple(args.task or TASKS), split=args.split)
    if not _json_out(report, args):
        return 0
    print(f"{report['model']}: {report['split']} split, greedy answers with {report['backend']}, "
          "exact match up to EOS\n")
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


def cmd_eval_reader(args) -> int:
    from pathlib import Path

    from .eval import reader_eval as R
    from .eval.reader_report import COLUMNS, table_rows
    from .port import load_port
    from .report import table

    budgets, specs, rules = R.parse_budgets(args.budgets), R.parse_selectors(args.selectors), R.parse_rules(args.rules)
    port = load_port(args.model)
    settings = R.Settings.quick(args.corpus) if args.quick else R.Settings(corpus=args.corpus)
    if args.items is not None:
        settings.per_task = args.items
    report = R.evaluate(port, args.checkpoint, budgets, specs, rules, args.out, settings)
    if _json_out(report, args):
        acc = report["full_model"]["accuracy"]
        print(f"{port.name}: selectors vs the full model (fp32), full model {acc['correct']}/{acc['items']} "
              f"items correct; generation: {report['generation']}\n")
        print(table(table_rows(report), COLUMNS))
        print(f"\n{args.out}: report.json, report.md, cells/, " + ", ".join(Path(p).name for p in report["plots"]))
    return 0


def parser() -> argparse.ArgumentParser:
    from .eval.seq_match import BACKENDS
    from .eval.tasks import SPLITS, TASKS

    import neuron_moe

    top = argparse.ArgumentParser(prog="neuron-moe", description=neuron_moe.__doc__)
    top.add_argument("--version", action="version", version=f"neuron-moe {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ports", help="list the built-in ports")
    p.add_argument("--json", metavar="FILE", help="also write the list as JSON ('-' for stdout)")
    p.set_defaults(func=cmd_ports)

    p = sub.add_parser("info", help="geometry, parameter counts and weight bytes of a port (meta device)")
    _common(p)
    p.add_argument("--per-token", action="store_true",
                   help="also weight bytes and FLOPs per decoded token for each experts implementation")
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
    p.add_argument("--sidecar", metavar="FILE|DIR", help="reader: the sidecar (default: the port's [reader] sidecar); "
                                                       "tp8: the directory of `prep-reader --tp 8`")
    p.add_argument("--budget", type=float, metavar="PERCENT",
                   help="reader: share of the routed-expert bytes read per token, in (0, 100]")
    p.add_argument("--rank", type=int, metavar="R", help="reader: recovery rank, 0 = off (default: the sidecar's)")
    p.add_argument("--reader-backend", choices=("reference", "triton", "nki"),
                   help="reader: decode-step kernels (default reference: PyTorch; triton: CUDA; nki: Neuron)")
    p.add_argument("--reader-weights", choices=("bf16", "int8"),
                   help="reader: the experts it reads, the model's own (bf16, default) or the int8 experts' numbers "
                        "(exact rows in int8 with their scales, prefill through the int8 experts; reference only)")
    _expert_layout_arg(p, "tp8, tp8-int8: ")
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
    p.add_argument("--steps", type=_positive_int, default=3000, help="optimizer steps (default 3000)")
    p.add_argument("--batch-size", type=_positive_int, default=4, help="windows per step (default 4)")
    p.add_argument("--seq-len", type=_positive_int, default=512, help="tokens per window (default 512)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--task-share", type=float, default=1.0, metavar="F",
                   help="task items fill up to this share of each window, running text the rest (default 1.0: "
                        "text fills only what the last whole item leaves)")
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
    p.add_argument("--split", default="eval", choices=SPLITS,
                   help="eval (default) or valid: the validation split, for choosing between training runs "
                        "(its text is the calibration text)")
    p.set_defaults(func=cmd_eval_tasks)

    p = sub.add_parser("eval-reader", help="channel selectors (TEAL, WINA, CATS, oracle, reader) vs the full model "
                                           "at read budgets: KL, top-1, task accuracy, reads, retention",
                       description="For each selector x retention rule x budget, on the evaluation split: "
                                   "teacher-forced KL(full || sparse) (mean, p99), top-1 agreement, greedy task "
                                   "accuracy as % of the full model's (the selector on every token), reads per "
                                   "token against the target, their distribution and their mean by position in the "
                                   "answer. Threshold rules are calibrated on the calibration split only. Writes "
                                   "OUT/cells/*.json (one per cell; a rerun skips those done), OUT/report.json, "
                                   "OUT/report.md and PNG plots. A budget a selector cannot reach is reported, "
                                   "not an error.")
    _common(p)
    p.add_argument("--budgets", default="12.8,17.8", metavar="B,B",
                   help="read budgets, %% of the full model's routed-expert reads (default %(default)s)")
    p.add_argument("--selectors", default="teal,wina,cats,oracle,reader", metavar="S,S",
                   help="teal, wina, cats, oracle, reader; reader-rN: the reader at recovery rank N; "
                        "reader[-rN]-int8: over the int8 experts (exact rows int8), -int8dq: with the sketch made "
                        "from the dequantised int8 (budgets stay %% of the bf16 read: equal bytes) "
                        "(default %(default)s)")
    p.add_argument("--rules", default="topk,threshold", metavar="R,R",
                   help="topk (fixed reads per token) and/or threshold (calibrated) (default %(default)s)")
    p.add_argument("--corpus", metavar="DIR", help="a build-corpus directory: adds held-out text (eval_text.jsonl) "
                                                 "to the evaluation and calib.jsonl text to the calibration")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (resumable)")
    p.add_argument("--items", type=_positive_int, help="evaluation items per task (default 20; --quick 2)")
    p.add_argument("--quick", action="store_true", help="a few short items (fact, kv, reverse) and 4 text "
                                                        "documents: a check in about a minute, not a measurement")
    p.set_defaults(func=cmd_eval_reader)

    p = sub.add_parser("publish", help="upload an artifact directory to S3, integrity-checked, manifest last",
                       description="Check every file (size stable while read; .pt files complete zip archives), "
                                   "upload each with a full-object CRC32 checksum and its sha256 in metadata, "
                                   "verify each with head_object, then write the manifest once. "
                                   "Credentials and endpoint come from boto3 (AWS_* variables, ~/.aws).")
    p.add_argument("dir", metavar="DIR", help="directory of artifacts to publish")
    p.add_argument("uri", metavar="s3://BUCKET/PREFIX", help="where to publish; must hold no objects yet")
    p.add_argument("--overwrite", action="store_true", help="replace whatever the prefix holds")
    p.add_argument("--deep", action="store_true", help="also CRC-check every member of .pt archives (reads them)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON ('-' for stdout)")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("pull", help="download a publication from S3, each file verified (sha256) before it lands",
                       description="Read the manifest at s3://BUCKET/PREFIX, download each file to a temp name, "
                                   "check its size and sha256, then rename it into DIR. Files already in DIR "
                                   "with the manifest's sha256 are kept.")
    p.add_argument("uri", metavar="s3://BUCKET/PREFIX", help="a prefix written by `neuron-moe publish`")
    p.add_argument("dir", metavar="DIR", help="destination directory (created if missing)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON ('-' for stdout)")
    p.set_defaults(func=cmd_pull)

    from .neuron.plan import DTYPES as PLAN_DTYPES, INSTANCES
    from .parallel.layout import TP_DEGREES

    p = sub.add_parser("plan", help="inf2 memory plan: bytes per NeuronCore at a TP degree, fit verdict, decode floor",
                       description="Per-rank bytes (experts, attention, dense MLP, embeddings, lm_head, KV cache, "
                                   "stated graph and runtime reserves) against 16 GiB per NeuronCore, the fit verdict "
                                   "with its reason, and the bytes read per decoded token with the HBM-bound floor. "
                                   "Exit 0 when it fits, 1 when not.")
    p.add_argument("--model", default=DEFAULT_PORT, metavar="NAME|PATH", help=f"port (default: {DEFAULT_PORT})")
    p.add_argument("--instance", required=True, choices=sorted(INSTANCES), help="inf2 instance type")
    p.add_argument("--tp", type=int, required=True, choices=TP_DEGREES, help="tensor-parallel degree")
    p.add_argument("--dtype", default="bf16", choices=PLAN_DTYPES, help="experts' dtype (the rest is bf16)")
    p.add_argument("--batch", type=_positive_int, default=1, metavar="B", help="batch size (default 1)")
    p.add_argument("--seq", type=_positive_int, default=4096, metavar="S", help="max sequence length: KV cache and largest prefill bucket (default 4096)")
    p.add_argument("--reader-budget", type=float, metavar="PERCENT",
                   help="also the channel layout's decode graph with the reader at this budget (bytes per token and "
                        "rank, each rank's sidecar shard in the memory plan)")
    p.add_argument("--reader-rank", type=int, default=32, metavar="R", help="with --reader-budget: recovery rank "
                                                                             "(default 32)")
    p.add_argument("--reader-scan", type=int, default=80, metavar="N", help="with --reader-budget: coordinates "
                                                                             "scanned per 128-block (default 80)")
    p.add_argument("--runtime-reserve-gib", type=float, default=1.0, metavar="GIB",
                   help="stated per-core runtime reserve (default 1.0)")
    _expert_layout_arg(p)
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON ('-' for stdout)")
    p.set_defaults(func=cmd_plan)

    from .neuron.compile import DTYPES as COMPILE_DTYPES

    p = sub.add_parser("trace-and-compile", help="rank graphs (a prefill key per bucket, a decode key), per-rank "
                                                 "weights and a manifest: Neuron, or --dry-run on CPU",
                       description="Build the full-model rank modules at TP T, trace each key once as rank 0 and "
                                   "(on Neuron, with ModelBuilder) compile them; write model.pt, "
                                   "weights/tp{r}_sharded_checkpoint.safetensors, shard_plan.json and manifest.json "
                                   "into DIR, built aside and renamed into place when complete. --dry-run does the "
                                   "same on CPU (exported programs under graphs/); a port without weights is built and "
                                   "exported on the meta device: manifest and shard plan only. The KV cache is the graphs' "
                                   "state (aliased, zero-initialised on each rank): only ids, pad masks, positions and "
                                   "row ids go in, the token comes out.")
    p.add_argument("--model", default=DEFAULT_PORT, metavar="NAME|PATH", help=f"port (default: {DEFAULT_PORT})")
    p.add_argument("--checkpoint", metavar="DIR", help="HF-layout checkpoint directory (overrides the port's weights)")
    p.add_argument("--dtype", default="bf16", choices=sorted(COMPILE_DTYPES),
                   help="bf16; int8 (int8 experts, the rest bf16); fp32 (default: bf16)")
    p.add_argument("--tp", type=int, required=True, choices=TP_DEGREES, help="tensor-parallel degree")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist, or be empty)")
    p.add_argument("--dry-run", action="store_true", help="no Neuron SDK: build and export on CPU, write the plan")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR (only once the new one is complete)")
    _expert_layout_arg(p)
    p.add_argument("--reader", action="store_true",
                   help="the decode key reads through the reader (channel layout, bf16/fp32): each rank's sidecar "
                        "shard goes into its weights; needs --budget and --sidecar DIR (a port without weights: "
                        "shapes only, no sidecar)")
    p.add_argument("--sidecar", metavar="DIR", help="with --reader: the directory of `prep-reader --tp T`")
    p.add_argument("--budget", type=float, metavar="PERCENT", help="with --reader: share of a rank's routed-expert "
                                                                   "bytes read per token, in (0, 100]")
    p.add_argument("--rank", type=int, metavar="R", help="with --reader: recovery rank, 0 = off (default: the sidecar's)")
    p.add_argument("--with-logits", action="store_true",
                   help="graphs that also return the fp32 logits (validation, host-side sampling: vocab x 4 bytes "
                        "per row and step to the host); default: the greedy token alone")
    p.add_argument("--json", metavar="FILE", help="also write the manifest as JSON ('-' for stdout)")
    p.set_defaults(func=cmd_trace_and_compile)

    _serve_parser(sub)
    p = sub.add_parser("reads", help="reader: bytes read per token and layer at a budget, and the k it buys",
                       description="Bytes the reader reads per token and MoE layer (whole 32-byte sectors, bf16, "
                                   "the sidecar layout) as a share of the full model's routed-expert reads; the "
                                   "k a budget buys; the memory the sidecar adds. Geometry from --model, or "
                                   "explicit with all of --hidden --experts --top-k --intermediate.")
    p.add_argument("--model", default=DEFAULT_PORT, metavar="NAME|PATH", help="port whose geometry to use")
    p.add_argument("--budget", type=float, default=17.8, metavar="PERCENT", help="read budget (default 17.8)")
    for flag in ("--hidden", "--experts", "--top-k", "--intermediate"):
        p.add_argument(flag, type=_positive_int, metavar="N", help="explicit geometry (instead of --model)")
    p.add_argument("--scan", type=int, default=80, metavar="N", help="coordinates scanned per 128-block "
                                                                     "(default 80; 128 = full scan)")
    p.add_argument("--rank", type=int, default=32, metavar="R", help="recovery rank (default 32; 0 = off)")
    p.add_argument("--dtype", choices=["bf16", "int8"], default="bf16",
                   help="the experts' weights: bf16, or int8 exact rows with fp32 scales (the sketch and recovery "
                        "stay bf16); --budget is a share of those experts' full read (default bf16)")
    p.add_argument("--batch", type=_positive_int, metavar="B",
                   help="also a decode step of B tokens, each row read once: the full batch, independent per-token "
                        "top-k, and the batch rule (one set of channels for the step), under uniform routing")
    p.add_argument("--step-budget", type=float, default=2.0, metavar="X",
                   help="with --batch: the batch rule's step reads, in units of one token's reads (default 2)")
    p.add_argument("--tp", type=int, choices=TP_DEGREES, metavar="T",
                   help="per rank at TP T on the channel expert layout (each rank its I/T channels of every expert)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON ('-' for stdout)")
    p.set_defaults(func=cmd_reads)

    p = sub.add_parser("prep-reader", help="reader: write the weight-prep sidecar of a model",
                       description="Prepare the reader's sidecar (ternary sketch, channel norms, recovery map) "
                                   "from the expert weights alone, layer by layer, and write it atomically.")
    _common(p)
    p.add_argument("--out", required=True, metavar="FILE|DIR",
                   help="sidecar file to write (.safetensors); with --tp a directory")
    p.add_argument("--tp", type=int, choices=TP_DEGREES, metavar="T",
                   help="also shard it for TP T on the channel expert layout: DIR/reader.safetensors (the whole "
                        "sidecar) and DIR/tpT-rankR.safetensors, rank R's channels of every expert, each tied to its "
                        f"rank, TP degree, layout and source weights ({', '.join(map(str, TP_DEGREES))})")
    p.add_argument("--from", dest="source", metavar="FILE",
                   help="with --tp: shard this existing whole sidecar instead of prepping one")
    p.add_argument("--seed", type=int, default=0, help="seed of the Hadamard sign vector (default 0)")
    p.add_argument("--rank", type=int, default=32, metavar="R", help="recovery-map rank (default 32)")
    p.add_argument("--scan", type=int, default=80, metavar="N", help="scan width recorded for readers (default 80)")
    p.set_defaults(func=cmd_prep_reader)
    return top


def _check_outputs(args) -> None:
    """Every output path a command was given, checked before its work starts (not after an upload
    or an hour of training). `--out` is a directory but for prep-reader's sidecar (without --tp)."""
    from .report import check_output

    if getattr(args, "json", None):
        check_output(args.json)
    if getattr(args, "out", None):
        file = args.command == "prep-reader" and not args.tp
        check_output(args.out, directory=not file, seekable=file)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _check_outputs(args)
        return args.func(args)
    except UserError as e:
        return _error(str(e))
    except OSError as e:  # the system refused (a full disk, a read-only or missing path): one line, not a bug
        return _error(f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e))


def _error(message: str) -> int:
    """One `error:` line, whatever the message (a library's may span several): exit 2."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
