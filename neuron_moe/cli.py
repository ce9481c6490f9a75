"""`neuron-moe` entry point: parses the arguments (cli_parser.py, no torch), runs the command,
prints its report (the module's renderer). Each command imports its modules when it runs, so one
command never waits on another's imports (torch, transformers, boto3, uvicorn)."""

from __future__ import annotations

import sys
import threading
from dataclasses import fields

from .cli_parser import COMMANDS as TABLE, max_threads, parser
from .errors import UserError, error_exit, interrupted, restore_ctrl_c, take_ctrl_c
from .report import OutputError, check_output, write_json
from .run_config import RunConfig, Serving, Shapes
from .spec import READS_BUDGET, Reader, check_quantization_flags, compiled_backend


def from_options(cls, args, **given):
    """A dataclass from the parsed options named as its fields (vLLM's `from_cli_args`), lists made
    tuples; `given` sets fields the options do not."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in given and hasattr(args, f.name)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}, **given)


def run_config(args, backend=None) -> RunConfig:
    """The run configuration of a parsed command line: resolved here, once, and handed down whole."""
    return from_options(
        RunConfig,
        args,
        backend=backend,
        shapes=from_options(Shapes, args),
        compile=False if getattr(args, "no_compile", False) else None,
        serving=from_options(Serving, args),
        speculative=speculative_config(args),
    )


def speculative_config(args):
    """--speculative-config's JSON as a `SpeculativeConfig` (one error line if it is wrong), None when
    not given: speculative.py (torch) imported only then."""
    text = getattr(args, "speculative", None)
    if text is None:
        return None
    from .speculative import SpeculativeConfig

    return SpeculativeConfig.from_json(text)


def reader_settings(args) -> Reader:
    """The reader's settings the flags give (those a command does not take: None). --quantization is
    the experts' format of the whole command, not the reader's alone (`seq_match.backend`)."""
    return from_options(Reader, args, quantization=None)


def _report(report, args, render, *extra, json=None) -> int:
    """The report (or `json`, its part for --json) written as --json asks; `render(report, *extra)` printed.
    Returns 0, the exit status of a command whose report is all it has to say."""
    if args.json:
        write_json(report if json is None else json, args.json)
    if args.json != "-":
        print(render(report, *extra))
    return 0


def cmd_ports(args) -> int:
    from .port import ports_report, render_ports

    return _report(ports_report(), args, render_ports)


def cmd_info(args) -> int:
    from .info import info_report, render_info
    from .port import load_port

    port = load_port(args.model)
    return _report(info_report(port, args.per_token), args, render_info, port.description)


def cmd_env(args) -> int:
    from . import environment

    return _report(environment.env_report(), args, environment.render_env)


def cmd_validate(args) -> int:
    from .eval import seq_match

    options = {
        k: getattr(args, k) for k in ("quantization", "quantized_layers", "expert_layout", "tp", "tp_layers", "dtype")
    }
    compile = False if args.no_compile else None
    backend = seq_match.backend(args.backend, reader=reader_settings(args), compile=compile, **options)
    report = seq_match.validate(run_config(args, backend), args.max_new_tokens, args.prompt or [])
    _report(report, args, seq_match.render_validation)
    return 0 if report["all_match"] else 1


def cmd_publish(args) -> int:
    from .publish.s3 import publish, render_publish

    return _report(publish(args.dir, args.uri, overwrite=args.overwrite, deep=args.deep), args, render_publish)


def cmd_pull(args) -> int:
    from .publish.s3 import pull_report, render_pull

    return _report(pull_report(args.uri, args.dir), args, render_pull)


def cmd_verify(args) -> int:
    from .verify import render_verify, verify

    report = verify(args.artifact, args.model)
    _report(report, args, render_verify)
    return 0 if report["preflight"] is None or report["preflight"]["clean"] else 1


def cmd_preflight(args) -> int:
    from .neuron.preflight import preflight, render_preflight

    report = preflight(args.path, args.target, args.rules.split(",") if args.rules else None)
    _report(report, args, render_preflight)
    return 0 if report["clean"] else 1


def _planned(args):
    """plan's and trace-and-compile's port, its [static] shapes those the flags give, and the
    backend they build: the rank modules at --tp, their formats and dtype, the reader with --reader."""
    from .port import load_port, with_shapes

    reader = reader_settings(args)
    if not args.reader and reader != Reader():
        given = ", ".join(f"--{name.replace('_', '-')}" for name in reader.given())
        raise UserError(f"{given} configure the reader: pass --reader")
    reader = reader if args.reader else None
    backend = compiled_backend(
        args.command, args.tp, args.quantization, args.dtype, args.expert_layout, reader, args.quantized_layers
    )
    config = run_config(args, backend)
    port = load_port(args.model)
    if port.static is None and config.shapes.given():
        for what, flag, given in (
            ("buckets", "--buckets", args.buckets),
            ("decode lengths", "--decode-lengths", args.decode_lengths),
        ):
            if given is not None:
                raise UserError(f"port {port.name!r} has no [static] table, whose {what} {flag} would replace")
        return port, config
    return with_shapes(port, config.shapes), config


def cmd_plan(args) -> int:
    from .neuron.plan import GiB, port_plan, render_plan

    port, config = _planned(args)
    report = port_plan(port, config, args.instance, args.runtime_reserve_gib * GiB)
    _report(report, args, render_plan)
    return 0 if report["fits"] else 1


def cmd_trace_and_compile(args) -> int:
    from . import environment
    from .neuron.compile import Build, render_trace_and_compile, trace_and_compile

    if not args.dry_run:
        environment.require(environment.TRACE_AND_COMPILE)
    port, config = _planned(args)
    build = from_options(Build, args, config=config)
    return _report(trace_and_compile(port, build), args, render_trace_and_compile)


def cmd_serve(args) -> int:
    try:  # the `serve` extra (uvicorn, fastapi, prometheus-client): imported here, not for the other commands
        from .serve.server import run
    except ModuleNotFoundError as e:
        if e.name in ("fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client"):
            raise UserError(f"neuron-moe serve needs {e.name!r}: pip install 'neuron-moe[serve]'") from None
        raise
    return run(serve_config(args))


def serve_config(args) -> RunConfig:
    """serve's run configuration, from its parsed arguments or its argv: its backend (a
    `spec.serve_backends` entry, parsed by the command line), --quantized-layers in --quantization's format."""
    from .spec import quantized

    if isinstance(args, list):
        args = parser().parse_args(args)
    return run_config(args, quantized(args.backend, args.quantization, args.quantized_layers))


def cmd_deploy(args) -> int:  # `deploy k8s`, the one engine that takes files (deploy/k8s.py)
    from .deploy import k8s as deploy_k8s
    from .port import load_port

    layers = check_quantization_flags(args.quantization, args.quantized_layers)  # before the plan tries each degree
    if speculative_config(args) is not None:
        raise UserError(
            "--speculative-config: deploy k8s takes none; an artifact speculates as it was built "
            "(trace-and-compile --speculative-config writes its verify key and the config into its manifest)"
        )
    settings = from_options(deploy_k8s.Settings, args, quantized_layers=layers)
    report = deploy_k8s.write(settings, load_port(args.model), args.out)
    return _report(report, args, deploy_k8s.render)


def cmd_reads(args) -> int:
    from .port import load_port
    from .reader.accounting import reads_report, render_reads
    from .reader.geometry import Geometry

    geo = Geometry.explicit(args.hidden, args.experts, args.top_k, args.intermediate)
    if geo is not None:
        name, defaults = "explicit geometry", Reader()
    else:
        port = load_port(args.model)
        geo, name, defaults = Geometry.from_config(port.config), port.name, port.reader
    # a flag, else the port's [reader] setting, else the reader's own default (the port's sidecar: not read here)
    given = Reader(scan=args.scan, recovery_rank=args.recovery_rank, quantization=args.quantization)
    settings = given.over(Reader(recovery_rank=defaults.recovery_rank)).resolved()
    budget = next(b for b in (args.budget, defaults.budget, READS_BUDGET) if b is not None)
    report = reads_report(name, geo, settings, budget, args.tp or 1, args.batch_size, args.step_budget)
    return _report(report, args, render_reads)


def cmd_prep_reader(args) -> int:
    from .model import prep_reader, render_prep_reader
    from .port import load_port

    if args.source and not args.tp:
        raise UserError("--from shards an existing sidecar: it needs --tp")
    options = {k: getattr(args, k) for k in ("tp", "source", "seed", "recovery_rank", "scan")}
    report = prep_reader(load_port(args.model), args.out, args.checkpoint, **options)
    return _report(report, args, render_prep_reader, bool(args.source))


def cmd_build_corpus(args) -> int:
    from .training.corpus import build_corpus, render_corpus

    counts = build_corpus(args.text_dir, args.out, seed=args.seed, scale=args.scale)
    return _report(counts, args, render_corpus, args.out)


def cmd_train_tiny(args) -> int:
    from .port import load_port
    from .training.tiny import render_training, train

    options = ("steps", "batch_size", "seq_len", "lr", "task_share", "seed", "threads")
    summary = train(load_port(args.model).config, args.corpus, args.out, **{k: getattr(args, k) for k in options})
    return _report(summary, args, render_training, args.out, json={k: v for k, v in summary.items() if k != "log"})


def cmd_train_assistant(args) -> int:
    from .training.assistant import render_assistant, train_for_port

    options = ("checkpoint", "steps", "draft_steps", "batch_size", "seq_len", "queries", "task_share", "lr", "seed")
    options += ("threads",)
    summary = train_for_port(args.model, args.corpus, args.out, **{k: getattr(args, k) for k in options})
    return _report(summary, args, render_assistant, args.out, json={k: v for k, v in summary.items() if k != "log"})


def cmd_eval_tasks(args) -> int:
    from .eval import seq_match
    from .eval.tasks import evaluate, render_tasks
    from .port import load_port
    from .tasks import TASKS

    backend = seq_match.backend(args.backend, quantization=args.quantization, quantized_layers=args.quantized_layers)
    port = load_port(args.model)
    options = {k: getattr(args, k) for k in ("corpus", "text_docs", "split")}
    report = evaluate(port, backend, args.checkpoint, per_task=args.items, tasks=tuple(args.task or TASKS), **options)
    return _report(report, args, render_tasks, port.config.num_experts)


def cmd_eval_reader(args) -> int:
    from .eval import reader_eval
    from .eval.reader_report import render_reader_eval
    from .port import load_port

    budgets = reader_eval.parse_budgets(args.budgets)
    specs, rules = reader_eval.parse_selectors(args.selectors), reader_eval.parse_rules(args.rules)
    port = load_port(args.model)
    settings = reader_eval.Settings.quick(args.corpus) if args.quick else reader_eval.Settings(corpus=args.corpus)
    settings.per_task = args.items or settings.per_task
    report = reader_eval.evaluate(port, args.checkpoint, budgets, specs, rules, args.out, settings)
    return _report(report, args, render_reader_eval, args.out)


# each command of the parser's table runs the function named for it here
COMMANDS = {c.name: globals()[f"cmd_{c.name.replace('-', '_')}"] for c in TABLE}


# commands that read a checkpoint's weights and no text: its tokenizer is not asked for
WEIGHTS_ONLY = ("info", "prep-reader")


def _check_outputs(args) -> None:
    """Every output path a command was given, checked before its work starts (not after an upload
    or an hour of training). `--out` is a directory but for prep-reader's sidecar (without --tp)."""
    file = args.command == "prep-reader" and not args.tp
    for flag, path, kind in (("--json", "json", {}), ("--out", "out", dict(directory=not file, seekable=file))):
        try:
            if getattr(args, path, None):
                check_output(getattr(args, path), **kind)
        except OutputError as e:
            raise OutputError(f"{flag}: {e}") from None


def _checkpoint(args) -> None:
    """`--checkpoint` made a checked local directory before the command's work starts (a Hub id
    downloaded: `hub.local_checkpoint`). serve makes the same check in its own order: its flags
    first, then the checkpoint, before it binds its socket."""
    checkpoint, revision = getattr(args, "checkpoint", None), getattr(args, "revision", None)
    if checkpoint is None and revision is not None:
        raise UserError("--revision picks the revision of --checkpoint ORG/NAME: pass --checkpoint too")
    if checkpoint is not None and args.command != "serve":
        from . import hub
        from .port import load_port

        tokenizer = args.command not in WEIGHTS_ONLY
        args.checkpoint = hub.local_checkpoint(checkpoint, revision, load_port(args.model), tokenizer=tokenizer)


def main(argv: list[str] | None = None) -> int:
    """Run one command line: its exit status. Ctrl-C is taken before anything else (the parsing,
    torch's import, the work alike) and is one line, exit 130."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = take_ctrl_c() if main_thread else None
    command = None
    try:
        args = parser().parse_args(argv)
        command = args.command
        if args.threads > max_threads():  # only $OMP_NUM_THREADS gets here: --threads is bounded by its type
            return error_exit(
                f"$OMP_NUM_THREADS={args.threads} is more torch threads than this machine runs (at most "
                f"{max_threads()} here); pass --threads N"
            )
        import torch  # after the arguments parse: --help and a wrong flag answer without it

        torch.set_num_threads(args.threads)  # every command's (cli_parser.DEFAULT_THREADS: measured)
        _check_outputs(args)
        _checkpoint(args)
        return COMMANDS[args.command](args)
    except UserError as e:
        return error_exit(str(e))
    except OSError as e:  # the system refused (a full disk, a read-only or missing path): one line, not a bug
        return error_exit(f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e))
    except KeyboardInterrupt:  # Ctrl-C: what the command was writing was cleaned up on the way out
        return interrupted(command)
    finally:
        if main_thread:
            restore_ctrl_c(previous)


if __name__ == "__main__":
    sys.exit(main())
