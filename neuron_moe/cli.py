"""`neuron-moe` entry point: parses the arguments (cli_parser.py, no torch), runs the command,
prints its report (the module's renderer). Each command imports its modules when it runs, so one
command never waits on another's imports (torch, transformers, boto3, uvicorn)."""

from __future__ import annotations

import os
import signal
import sys
import threading

from .cli_parser import max_threads, parser
from .errors import UserError
from .report import OutputError, check_output, write_json
from .spec import READS_BUDGET, Reader


def _json_out(report, args) -> bool:
    """Write the report as --json asks; True when the text report should print too (not when the
    JSON went to stdout)."""
    if args.json:
        write_json(report, args.json)
    return args.json != "-"


def cmd_ports(args) -> int:
    from .port import ports_report, render_ports

    rows = ports_report()
    if _json_out(rows, args):
        print(render_ports(rows))
    return 0


def cmd_info(args) -> int:
    from .info import info_report, render_info
    from .port import load_port

    port = load_port(args.model)
    report = info_report(port, args.per_token)
    if _json_out(report, args):
        print(render_info(report, port.description))
    return 0


def cmd_env(args) -> int:
    from . import environment

    report = environment.env_report()
    if _json_out(report, args):
        print(environment.render_env(report))
    return 0


def cmd_validate(args) -> int:
    from . import environment
    from .eval import seq_match
    from .eval.seq_match import DEFAULT_PROMPTS, render_validation, run_validation
    from .port import load_port
    from .tokenizer import load_tokenizer

    backend = seq_match.backend_from_cli_args(args)
    if args.compile_cache and not backend.compile:
        raise UserError(
            f"--compile-cache keeps the graphs torch.compile compiled; --backend {backend.name}"
            f"{' --no-compile' if args.no_compile else ''} compiles none"
        )
    if backend.compile:  # before anything loads: a C++ compiler, and the cache
        from .spec import compile_cache
        from .static import inductor

        inductor.require_compiler()
        inductor.use_cache_dir(compile_cache(args.compile_cache))
    # what a layer library or a reader kernel needs of this machine (environment.py's paths)
    layers_need = {"nxd": environment.VALIDATE_NXD}
    kernel_needs = {"nki": environment.READER_NKI, "triton": environment.READER_TRITON}
    for need in (layers_need.get(args.tp_layers), kernel_needs.get(args.reader_kernel)):
        if need is not None:
            environment.require(need)
    port = load_port(args.model)
    tokenizer = load_tokenizer(port, args.checkpoint)
    prompts = list(DEFAULT_PROMPTS) + list(args.prompt or [])
    report = run_validation(port, tokenizer, backend, args.max_new_tokens, prompts, args.checkpoint)
    if _json_out(report, args):
        print(render_validation(report))
    return 0 if report["all_match"] else 1


def cmd_publish(args) -> int:
    from .publish.s3 import publish, render_publish

    report = publish(args.dir, args.uri, overwrite=args.overwrite, deep=args.deep)
    if _json_out(report, args):
        print(render_publish(report))
    return 0


def cmd_pull(args) -> int:
    from .publish.s3 import pull_report, render_pull

    report = pull_report(args.uri, args.dir)
    if _json_out(report, args):
        print(render_pull(report))
    return 0


def cmd_verify(args) -> int:
    from .verify import render_verify, verify

    report = verify(args.artifact, args.model)
    if _json_out(report, args):
        print(render_verify(report))
    return 0


def cmd_plan(args) -> int:
    from .neuron.plan import GiB, port_plan, render_plan
    from .port import load_port, with_shapes

    reader = _optional_reader(args)
    if reader is not None and reader.budget is None:
        raise UserError("--reader plans the reader's decode graph at a read budget: pass --budget")
    port = load_port(args.model)
    if port.static is not None:  # the shapes trace-and-compile would build
        port = with_shapes(port, batch_size=args.batch_size, seq_len=args.seq_len, buckets=args.buckets)
        batch, seq = port.static.batch_size, port.static.max_cache_len
    elif args.buckets is not None:
        raise UserError(f"port {port.name!r} has no [static] table, whose buckets --buckets would replace")
    else:
        batch, seq = args.batch_size or 1, args.seq_len or 4096
    report = port_plan(
        port,
        args.instance,
        args.tp,
        args.quantization,
        batch,
        seq,
        args.runtime_reserve_gib * GiB,
        expert_layout=args.expert_layout,
        reader=reader,
    )
    if _json_out(report, args):
        print(render_plan(report))
    return 0 if report["fits"] else 1


def _optional_reader(args) -> Reader | None:
    """The reader's settings of a command where `--reader` turns it on (plan, trace-and-compile): None
    without it, and its flags refused then."""
    reader = Reader.from_cli_args(args)
    if not args.reader and reader != Reader():
        given = ", ".join(f"--{name.replace('_', '-')}" for name in reader.given())
        raise UserError(f"{given} configure the reader: pass --reader")
    return reader if args.reader else None


def cmd_trace_and_compile(args) -> int:
    from . import environment
    from .neuron.compile import Build, render_trace_and_compile, trace_and_compile
    from .port import load_port, with_shapes

    if not args.dry_run:
        environment.require(environment.TRACE_AND_COMPILE)
    port = with_shapes(load_port(args.model), batch_size=args.batch_size, seq_len=args.seq_len, buckets=args.buckets)
    report = trace_and_compile(port, Build.from_cli_args(args), _optional_reader(args))
    if _json_out(report, args):
        print(render_trace_and_compile(report))
    return 0


def cmd_serve(args) -> int:
    try:  # the `serve` extra (uvicorn, fastapi, prometheus-client): imported here, not for the other commands
        from .serve.server import run
    except ModuleNotFoundError as e:
        if e.name in ("fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client"):
            raise UserError(f"neuron-moe serve needs {e.name!r}: pip install 'neuron-moe[serve]'") from None
        raise
    return run(args)


def cmd_deploy(args) -> int:  # `deploy k8s`, the one engine that takes files (deploy/k8s.py)
    from .deploy import k8s as deploy_k8s
    from .port import load_port

    settings = deploy_k8s.Settings(
        model=args.model,
        instance=args.instance,
        artifacts=args.artifacts,
        quantization=args.quantization,
        tp=args.tp,
        resource=args.resource,
        replicas=args.replicas,
        max_replicas=args.max_replicas,
        target_waiting=args.target_waiting,
        name=args.name,
        image=args.image,
        api_key_secret=args.api_key_secret,
        service_account=args.service_account,
        drain_timeout=args.drain_timeout,
    )
    report = deploy_k8s.write(settings, load_port(args.model), args.out)
    if _json_out(report, args):
        print(deploy_k8s.render(report))
    return 0


def cmd_reads(args) -> int:
    from .port import load_port
    from .reader.accounting import reads_report, render_reads
    from .reader.geometry import Geometry

    explicit = (args.hidden, args.experts, args.top_k, args.intermediate)
    if any(v is not None for v in explicit):
        if None in explicit:
            raise UserError("an explicit geometry needs all four of --hidden --experts --top-k --intermediate")
        if args.top_k > args.experts:
            raise UserError(
                f"--top-k {args.top_k} is more than --experts {args.experts}: a token routes to at most "
                f"every expert once"
            )
        geo = Geometry(hidden=args.hidden, experts=args.experts, top_k=args.top_k, intermediate=args.intermediate)
        name, defaults = "explicit geometry", Reader()
    else:
        port = load_port(args.model)
        geo, name, defaults = Geometry.from_config(port.config), port.name, port.reader
    # a flag, else the port's [reader] setting, else the reader's own default (the port's sidecar: not read here)
    given = Reader(scan=args.scan, recovery_rank=args.recovery_rank, quantization=args.quantization)
    settings = given.over(Reader(recovery_rank=defaults.recovery_rank)).resolved()
    budget = next(b for b in (args.budget, defaults.budget, READS_BUDGET) if b is not None)
    report = reads_report(name, geo, settings, budget, args.tp or 1, args.batch_size, args.step_budget)
    if _json_out(report, args):
        print(render_reads(report))
    return 0


def cmd_prep_reader(args) -> int:
    from .model import prep_reader, render_prep_reader
    from .port import load_port

    if args.source and not args.tp:
        raise UserError("--from shards an existing sidecar: it needs --tp")
    report = prep_reader(
        load_port(args.model),
        args.out,
        args.checkpoint,
        tp=args.tp,
        source=args.source,
        seed=args.seed,
        rank=args.recovery_rank,
        scan=args.scan,
    )
    if _json_out(report, args):
        print(render_prep_reader(report, read_source=bool(args.source)))
    return 0


def cmd_build_corpus(args) -> int:
    from .training.corpus import build_corpus, render_corpus

    counts = build_corpus(args.text_dir, args.out, seed=args.seed, scale=args.scale)
    if _json_out(counts, args):
        print(render_corpus(counts, args.out))
    return 0


def cmd_train_tiny(args) -> int:
    from .port import load_port
    from .training.tiny import render_training, train

    port = load_port(args.model)
    summary = train(
        port.config,
        args.corpus,
        args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        task_share=args.task_share,
        seed=args.seed,
        threads=args.threads,
    )
    if _json_out({k: v for k, v in summary.items() if k != "log"}, args):
        print(render_training(summary, args.out))
    return 0


def cmd_eval_tasks(args) -> int:
    from .eval import seq_match
    from .eval.tasks import evaluate, render_tasks
    from .port import load_port
    from .tasks import TASKS

    backend = seq_match.backend(args.backend, quantization=args.quantization)
    port = load_port(args.model)
    report = evaluate(
        port,
        backend,
        args.checkpoint,
        per_task=args.items,
        corpus=args.corpus,
        text_docs=args.text_docs,
        tasks=tuple(args.task or TASKS),
        split=args.split,
    )
    if _json_out(report, args):
        print(render_tasks(report, port.config.num_experts))
    return 0


def cmd_eval_reader(args) -> int:
    from .eval import reader_eval
    from .eval.reader_report import render_reader_eval
    from .port import load_port

    budgets = reader_eval.parse_budgets(args.budgets)
    specs, rules = reader_eval.parse_selectors(args.selectors), reader_eval.parse_rules(args.rules)
    port = load_port(args.model)
    settings = reader_eval.Settings.quick(args.corpus) if args.quick else reader_eval.Settings(corpus=args.corpus)
    if args.items is not None:
        settings.per_task = args.items
    report = reader_eval.evaluate(port, args.checkpoint, budgets, specs, rules, args.out, settings)
    if _json_out(report, args):
        print(render_reader_eval(report, args.out))
    return 0


COMMANDS = {
    "ports": cmd_ports,
    "env": cmd_env,
    "info": cmd_info,
    "validate": cmd_validate,
    "build-corpus": cmd_build_corpus,
    "train-tiny": cmd_train_tiny,
    "eval-tasks": cmd_eval_tasks,
    "eval-reader": cmd_eval_reader,
    "publish": cmd_publish,
    "pull": cmd_pull,
    "verify": cmd_verify,
    "plan": cmd_plan,
    "trace-and-compile": cmd_trace_and_compile,
    "serve": cmd_serve,
    "reads": cmd_reads,
    "prep-reader": cmd_prep_reader,
    "deploy": cmd_deploy,
}


# commands that read a checkpoint's weights and no text: its tokenizer is not asked for
WEIGHTS_ONLY = ("info", "prep-reader")


def _check_outputs(args) -> None:
    """Every output path a command was given, checked before its work starts (not after an upload
    or an hour of training). `--out` is a directory but for prep-reader's sidecar (without --tp)."""
    try:
        if getattr(args, "json", None):
            check_output(args.json)
    except OutputError as e:
        raise OutputError(f"--json: {e}") from None
    try:
        if getattr(args, "out", None):
            file = args.command == "prep-reader" and not args.tp
            check_output(args.out, directory=not file, seekable=file)
    except OutputError as e:
        raise OutputError(f"--out: {e}") from None


def _checkpoint(args) -> None:
    """`--checkpoint` made a checked local directory before the command's work starts (a Hub id
    downloaded: `hub.local_checkpoint`). serve makes the same check in its own order: its flags
    first, then the checkpoint, before it binds its socket."""
    if getattr(args, "checkpoint", None) is None:
        if getattr(args, "revision", None) is not None:
            raise UserError("--revision picks the revision of --checkpoint ORG/NAME: pass --checkpoint too")
        return
    if args.command != "serve":
        from . import hub
        from .port import load_port

        args.checkpoint = hub.local_checkpoint(
            args.checkpoint, args.revision, load_port(args.model), tokenizer=args.command not in WEIGHTS_ONLY
        )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads > max_threads():  # only $OMP_NUM_THREADS gets here: --threads is bounded by its type
        return _error(
            f"$OMP_NUM_THREADS={args.threads} is more torch threads than this machine runs (at most "
            f"{max_threads()} here); pass --threads N"
        )
    import torch  # after the arguments parse: --help and a wrong flag answer without it

    torch.set_num_threads(args.threads)  # every command's (cli_parser.DEFAULT_THREADS: measured)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupt) if main_thread else None
    try:
        _check_outputs(args)
        _checkpoint(args)
        return COMMANDS[args.command](args)
    except UserError as e:
        return _error(str(e))
    except OSError as e:  # the system refused (a full disk, a read-only or missing path): one line, not a bug
        return _error(f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e))
    except KeyboardInterrupt:  # Ctrl-C: what the command was writing was cleaned up on the way out
        _error(f"interrupted (Ctrl-C): neuron-moe {args.command} stopped")
        return INTERRUPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)


INTERRUPTED = 130  # a shell's status for a process ended by SIGINT (128 + 2)
RESEND_S = 0.05


def interrupt(signum, frame) -> None:
    """SIGINT as KeyboardInterrupt, as Python's own handler, except inside a finalizer (`__del__`, run
    by the garbage collector anywhere, in torch.export too), where Python prints the exception as
    'Exception ignored in' and carries on, the Ctrl-C lost: there the signal is sent again a moment
    later, once the finalizer is done."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            threading.Timer(RESEND_S, os.kill, (os.getpid(), signum)).start()
            return
        frame = frame.f_back
    raise KeyboardInterrupt


def _error(message: str) -> int:
    """One `error:` line, whatever the message (a library's may span several): exit 2."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
