"""`neuron-moe`'s arguments: each command's options and help, built from plain data (spec.py's
vocabulary and defaults, tasks.py's names): this module imports no torch, so `--help` and a wrong
flag answer at once. What a command does with its arguments is in cli.py, which imports a command's
module only when that command runs."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import neuron_moe

from . import spec
from .errors import UserError
from .spec import (
    BLOCK,
    DEFAULT_NEURON_IMAGE,
    DEFAULT_PORT,
    DEFAULT_RUNTIME_RESERVE_GIB,
    DEPLOY_RESOURCES,
    DRAIN_TIMEOUT_S,
    DTYPE_NAMES,
    EXPERT_LAYOUTS,
    INSTANCE_CHIPS,
    QUANTIZATIONS,
    READER_KERNELS,
    READS_BUDGET,
    RECOVERY_RANK,
    SCAN,
    STEP_BUDGET,
    TP_DEGREES,
    LAYERS as TP_LAYERS,
    check_serve_backend,
)
from .tasks import SPLITS, TASKS
from .training.corpus import FORTUNES_DIR


# torch's intra-op threads, for every command. Measured (bench/threads.py, bench/results/threads-cpu.md): on
# 2 CPU cores with other processes running, one thread answers a 32-token eager request in 0.39 s where two
# take 4.65 s (validate: 0.59 s against 6.16 s): the tiny model's ops are too small to share, and two
# threads wait on each other whenever another process holds a core.
DEFAULT_THREADS = 1


# At most this many torch threads per CPU this process may run on: more only wait on each other, and a
# thread pool of 10^5 threads crashes the process (a segfault in its thread library).
THREADS_PER_CPU = 4


def max_threads() -> int:
    """The most `--threads` a command takes here: THREADS_PER_CPU x the CPUs this process may run on."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return THREADS_PER_CPU * (cpus or 1)


def _default_threads() -> int:
    """$OMP_NUM_THREADS where a user set it (a positive integer), else DEFAULT_THREADS. One above
    `max_threads()` is refused by cli.main, naming the variable."""
    text = os.environ.get("OMP_NUM_THREADS", "")
    return int(text) if text.isdigit() and int(text) > 0 else DEFAULT_THREADS


def number(
    kind: type = int, *, at_least: float | None = None, above: float | None = None, at_most: float | None = None
):
    """An argparse `type` for a numeric option: a finite `kind` (int or float) within the bounds, or
    argparse's error naming the option, the range and the value. Every numeric option takes one, so
    NaN, inf and out-of-range numbers are refused at the command line, not half-way through the work."""

    def show(bound) -> str:
        return str(bound) if isinstance(bound, int) else f"{bound:g}"

    low = f"[{show(at_least)}" if at_least is not None else f"({show(above)}" if above is not None else None
    if at_most is not None:
        wanted = f"in {low or '(-inf'}, {show(at_most)}]"
    else:
        wanted = f"at least {show(at_least)}" if at_least is not None else f"more than {show(above)}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if (
            (at_least is not None and value < at_least)
            or (above is not None and value <= above)
            or (at_most is not None and value > at_most)
        ):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    parse.kind, parse.bounds = kind, (at_least if at_least is not None else above, at_most)  # for the tests
    return parse


# Upper bounds of the integer options: what any model a port may declare could use (config.SIZES,
# port.MAX_BATCH; tests/test_cli.py holds these equal), and for plain counts a C int, what torch and
# the OS take. A larger number is a typo, refused by name before any work.
MAX_COUNT = 2**31 - 1
MAX_ROWS = 1024  # port.MAX_BATCH: rows of a batch, requests at once
MAX_TOKENS = 1 << 24  # config.SIZES' max_position_embeddings: no context is longer
MAX_ITEMS = 10_000  # evaluation items per task (each is generated before any is evaluated)
GEOMETRY_BOUNDS = {  # reads' explicit geometry: config.SIZES' bounds of the same sizes
    "--hidden": 1 << 16,  # hidden_size
    "--experts": 4096,  # num_experts
    "--top-k": 4096,  # top_k_experts
    "--intermediate": 1 << 18,  # moe_intermediate_size
}

# The numeric options' types (one check for all: `number`)
_positive_int = number(int, at_least=1, at_most=MAX_COUNT)  # counts of what must exist: steps, documents, bytes
_count = number(int, at_least=0, at_most=MAX_COUNT)  # counts that may be zero: a queue
_rows = number(int, at_least=1, at_most=MAX_ROWS)  # a batch's rows, requests at once
_tokens = number(int, at_least=1, at_most=MAX_TOKENS)  # a context, new tokens, a prefill length
_items = number(int, at_least=1, at_most=MAX_ITEMS)
_recovery_rank = number(int, at_least=0, at_most=GEOMETRY_BOUNDS["--intermediate"])  # 0 = off; at most I
_threads = number(int, at_least=1, at_most=max_threads())
_seed = number(int, at_least=0, at_most=2**64 - 1)  # what torch.Generator.manual_seed takes
_percent = number(float, above=0, at_most=100)  # a read budget
_positive = number(float, above=0)
# A client's deadline for its request's headers or body: under a second, an honest client on a slow
# network (or a server busy for a moment) would be cut; 1e-300 would cut every one
MIN_CLIENT_TIMEOUT_S = 1.0
_client_timeout = number(float, at_least=MIN_CLIENT_TIMEOUT_S)
_non_negative = number(float, at_least=0)  # seconds, GiB
_scan_width = number(int, at_least=1, at_most=BLOCK)  # coordinates scanned per Hadamard block
_tcp_port = number(int, at_least=0, at_most=65535)  # 0: the OS picks a free one


def _serve_backend(text: str) -> str:
    try:
        return check_serve_backend(text)
    except UserError as e:  # argparse's error, naming the option
        raise argparse.ArgumentTypeError(str(e)) from None


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts, e.g. 128,512,2048, got {text!r}"
        ) from None
    if any(n > MAX_TOKENS for n in lengths):
        raise argparse.ArgumentTypeError(f"a length is at most {MAX_TOKENS} tokens, got {text}")
    return lengths


# ---- the options as data: one `Option` per flag, one `Command` per subcommand, the parser built by a loop ----


@dataclass(frozen=True)
class Option:
    """One flag (or positional) as argparse takes it: the names, then add_argument's keywords; a field
    left None is argparse's own default. `dest` is the field of the run configuration it fills where
    that differs from the flag's name (cli.py builds the configuration from the parsed values)."""

    names: tuple[str, ...]
    help: str | None = None
    type: Callable | None = None
    choices: Any = None
    default: Any = None
    metavar: str | None = None
    required: bool | None = None
    action: Any = None
    nargs: Any = None
    dest: str | None = None

    def but(self, **changes) -> Option:
        """This option with some keywords changed (a command's own help or default)."""
        return replace(self, **changes)

    def add_to(self, p: argparse.ArgumentParser) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)[1:]}
        kwargs = {k: v.make() if isinstance(v, Later) else v for k, v in values.items() if v is not None}
        p.add_argument(*self.names, **kwargs)


@dataclass(frozen=True)
class Later:
    """A keyword read when the parser is built, not when this module is imported: the environment
    (--threads, --api-key) and the registries' backends (spec.py), as they are then."""

    make: Callable[[], Any]


def opt(*names: str, **kwargs) -> Option:
    return Option(names, **kwargs)


@dataclass(frozen=True)
class Command:
    """A subcommand: its help line, its description, its options in the order --help lists them, and
    its own subcommands (`deploy k8s`)."""

    name: str
    help: str
    options: tuple[Option, ...] = ()
    description: str | None = None
    engines: tuple[Command, ...] = ()


def _json(what: str = "the report") -> Option:
    return opt("--json", metavar="FILE", help=f"also write {what} as JSON ('-' for stdout)")


MODEL = opt(
    "--model",
    default=DEFAULT_PORT,
    metavar="NAME|PATH",
    help=f"port name or path to a port .toml (default: {DEFAULT_PORT}; `neuron-moe ports` lists them)",
)
PORT_MODEL = MODEL.but(help=f"port (default: {DEFAULT_PORT})")
CHECKPOINT = opt(
    "--checkpoint",
    metavar="DIR|ORG/NAME",
    help="the weights (and tokenizer) instead of the port's: an HF-layout directory, or a Hugging Face "
    "Hub repository id, downloaded into the Hub cache (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE apply)",
)
REVISION = opt("--revision", metavar="REV", help="with --checkpoint ORG/NAME: a branch, tag or commit (default main)")
COMMON = (MODEL, CHECKPOINT, REVISION, _json())

# the graphs' shapes as flags (NxD Inference / optimum-neuron style) over the port's [static], the same
# for plan and trace-and-compile
BATCH_SIZE = opt(
    "--batch-size",
    type=_rows,
    metavar="B",
    help="rows of the decode graph and the KV cache (default: the port's [static] batch_size)",
)
MAX_CACHE_LEN = opt(
    "--max-cache-len",
    type=_tokens,
    metavar="S",
    help="positions of the KV cache, the most a prompt and its completion take (context: S + 1 "
    "tokens; default: the port's [static] max_cache_len)",
)
BUCKETS = opt(
    "--buckets",
    type=_lengths,
    metavar="B,B",
    help="prefill lengths, strictly increasing, the largest at most --max-cache-len (default: the port's "
    "[static] buckets)",
)
DECODE_LENGTHS = opt(
    "--decode-lengths",
    type=_lengths,
    metavar="L,L",
    help="KV lengths of the decode graphs, strictly increasing, each at most --max-cache-len, which is "
    "added as the last where absent: a step runs the smallest above every row's position (NxDI's "
    "token-generation buckets; default: the port's [static] decode_lengths)",
)
EXPERT_LAYOUT = opt(
    "--expert-layout",
    choices=EXPERT_LAYOUTS,
    help="how TP ranks split the experts: channel (every expert's I/t intermediate channels "
    "per rank; decode gathers each token's k experts) or expert (E/t whole experts per rank, "
    "as expert parallelism places them) (default: the port's [static] expert_layout, else channel)",
)
TP_REQUIRED = opt("--tp", type=_positive_int, required=True, choices=TP_DEGREES, help="tensor-parallel degree")
DTYPE = opt("--dtype", choices=DTYPE_NAMES, help="the compute dtype (default: the port's)")
QUANTIZATION = opt("--quantization", choices=QUANTIZATIONS)  # the format of --quantized-layers: help per command
# the linears --quantization applies to, checked where the backend is built (spec.quantized: one error line)
QUANTIZED_LAYERS = opt(
    "--quantized-layers",
    metavar="LIST",
    help=f"the linears --quantization applies to, comma-separated from {','.join(spec.LAYER_GROUPS)} (default "
    f"{','.join(spec.DEFAULT_QUANTIZED_LAYERS)}: the routed experts); embeddings, norms and the router stay in the "
    "compute dtype",
)
# --backend static: the graphs on CPU compiled by torch.compile (inductor)
COMPILE = (
    opt(
        "--no-compile",
        action="store_true",
        help="--backend static: run the graphs a module at a time, uncompiled (default: compiled by "
        "torch.compile with inductor's C++ kernels, which needs a C++ compiler: g++ or $CXX; without one "
        "the command stops with an error naming this flag)",
    ),
    opt(
        "--compile-cache",
        metavar="DIR",
        help="--backend static: where inductor keeps what it compiled, so the next start loads it instead "
        f"of compiling (default: $TORCHINDUCTOR_CACHE_DIR, else {spec.COMPILE_CACHE})",
    ),
)
# speculative decoding, vLLM's flag and JSON (speculative.SpeculativeConfig parses and checks it)
SPECULATIVE_CONFIG = opt(
    "--speculative-config",
    metavar="JSON",
    dest="speculative",
    help='speculative decoding, vLLM\'s JSON: {"model": NAME|PATH, "num_speculative_tokens": k} drafts with '
    'Gemma-4\'s assistant (k default 1), {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, '
    '"prompt_lookup_min": m} by prompt lookup (n and m default to each other, else 5); k in 1..16 (default: off)',
)
# the reader's settings, the same flags in every command that runs it (spec.Reader's fields)
SIDECAR = opt("--sidecar", metavar="FILE|DIR")
BUDGET = opt("--budget", type=_percent, metavar="PERCENT")
RECOVERY = opt("--recovery-rank", type=_recovery_rank, metavar="R")
SCAN_WIDTH = opt("--scan", type=_scan_width, metavar="N")


def _reader(applies: str, sidecar: str, recovery_default: str) -> tuple[Option, ...]:
    return (
        SIDECAR.but(help=sidecar),
        BUDGET.but(help=f"{applies}share of the routed-expert bytes read per token, in (0, 100]"),
        RECOVERY.but(help=f"{applies}rank of the recovery map, 0 = off (default: {recovery_default})"),
    )


THREADS = opt(
    "--threads",
    type=_threads,
    default=Later(_default_threads),
    metavar="N",
    help=f"torch's intra-op threads (default: $OMP_NUM_THREADS, else {DEFAULT_THREADS}: measured "
    "fastest for the tiny port on 2 shared cores; raise it for a full-size model on idle "
    f"cores; at most {THREADS_PER_CPU} per CPU this process may run on). train-tiny: part of what makes "
    "a run reproducible",
)


# ---- the commands ----

PORTS = Command("ports", "list the built-in ports", (_json("the list"),))

ENV = Command(
    "env",
    "versions, Neuron devices, GPU, and which paths this machine supports (and why not)",
    (_json(),),
    description="Python and the versions of every package a path needs (torch, transformers, "
    "torch-xla, torch-neuronx, neuronx-distributed, neuronx-cc, nki, triton), the "
    "Neuron devices and cores (neuron-ls or /dev/neuron*), any CUDA GPU; then per path "
    "(trace-and-compile, validate --tp-layers nxd, the reader's nki and triton kernels, "
    "serve --backend neuron) whether it is supported here, and why not. A command that "
    "needs a path refuses with the same reason before any work. Runs nothing.",
)

INFO = Command(
    "info",
    "geometry, parameter counts and weight bytes of a port (meta device)",
    (
        *COMMON,
        opt(
            "--per-token",
            action="store_true",
            help="also weight bytes and FLOPs per decoded token for each experts implementation",
        ),
    ),
)

VALIDATE = Command(
    "validate",
    "SEQ_MATCH: greedy tokens of a backend vs the CPU reference (HF eager fp32)",
    (
        *COMMON,
        opt(
            "--backend",
            default="dense_masked",
            choices=Later(lambda: sorted(spec.validate_backends())),
            help="backend under test: an experts implementation in HF's model (dense_masked, eager, reader), the "
            "port's static graphs as `serve --backend static` runs them (static: compiled unless --no-compile), "
            "those graphs through torch.export (traced), or at TP --tp on gloo (tp)",
        ),
        *COMPILE,
        DTYPE.but(help="the backend's compute dtype (default: the port's)"),
        QUANTIZATION.but(
            help="the weight format of the linears --quantized-layers names (default none): int8 per-channel int8 "
            "with fp32 scales, int4 group-wise int4 with a bf16 scale per 32 input channels, q4_0 llama.cpp's Q4_0 "
            "(an fp16 scale per 32); eager, dense_masked, "
            "static and traced hold them so in HF's model (dequantised inside each graph), tp in the rank modules; "
            "reader (int8 on the experts only) reads the int8 experts' numbers (exact rows in int8 with their "
            "scales, prefill through the int8 experts; reference kernel only)"
        ),
        QUANTIZED_LAYERS,
        SPECULATIVE_CONFIG,
        opt("--max-new-tokens", type=_tokens, default=32, metavar="N", help="tokens to generate (default 32)"),
        opt("--prompt", action="append", metavar="TEXT", help="an extra prompt (repeatable)"),
        *_reader(
            "reader, tp: ",
            "reader: the sidecar (default: the port's [reader] sidecar); tp: the directory of `prep-reader --tp T`",
            "the port's [reader] recovery_rank, else the sidecar's",
        ),
        opt(
            "--reader-kernel",
            choices=READER_KERNELS,
            dest="kernel",
            help="reader: decode-step kernels (default reference: PyTorch; triton: CUDA; nki: Neuron)",
        ),
        EXPERT_LAYOUT.but(help="tp: " + EXPERT_LAYOUT.help),
        opt(
            "--tp",
            type=_positive_int,
            choices=TP_DEGREES,
            metavar="T",
            help="tp: the degree, where the port's geometry splits over it (default 8; with --quantization int4 "
            "the ranks must hold whole groups of 32 channels: --tp 2 on the tiny port)",
        ),
        opt(
            "--tp-layers",
            choices=TP_LAYERS,
            help="tp: the parallel-layer library the rank modules are built over: cpu "
            "(parallel/cpu.py, NxD's names over gloo; the graphs traced once as rank 0 and replicated) "
            "or nxd (neuronx-distributed's own layers in its CPU mode, eager on every rank: the installed "
            "package, else the source tree $NXD_SRC names; docs/neuron.md) (default cpu)",
        ),
    ),
    description="Greedy-generate from fixed prompts with the CPU reference (HF eager, fp32) "
    "and with the backend under test; print one row per prompt. "
    "Exit 0 only when every prompt's tokens match.",
)

BUILD_CORPUS = Command(
    "build-corpus",
    "write the tiny model's corpus: English text plus the synthetic tasks",
    (
        opt("--text-dir", default=FORTUNES_DIR, help="the fortune files (default: %(default)s)"),
        opt("--out", required=True, metavar="DIR", help="output directory"),
        opt("--seed", type=_seed, default=0, help="seed of the training items (default 0)"),
        opt(
            "--scale",
            type=number(float, above=0, at_most=1000),
            default=1.0,
            help="multiplies the number of training task items (at most 1000)",
        ),
        _json("the counts"),
    ),
    description="Text from the Debian package 'fortunes' (apt-get install fortunes) plus "
    "the task mix of neuron_moe.tasks; fixed train/calib/eval splits.",
)

# the training commands' options
CORPUS = opt("--corpus", required=True, metavar="DIR", help="directory written by build-corpus")
SEQ_LEN = opt("--seq-len", type=_tokens, default=512, help="training: tokens per window (default 512)")
TRAIN_SEED = opt("--seed", type=_seed, default=0, help="seed of initialisation and data order (default 0)")


def _task_share(default: float, why: str = "") -> Option:
    return opt(
        "--task-share",
        type=number(float, above=0, at_most=1),
        default=default,
        metavar="F",
        help=f"task items fill up to this share of each window, running text the rest (default {default}{why})",
    )


TRAIN_TINY = Command(
    "train-tiny",
    "train the port's model on a corpus (deterministic, CPU)",
    (
        MODEL.but(help="port whose config to train"),
        CORPUS,
        opt("--out", required=True, metavar="DIR", help="checkpoint directory to write"),
        opt("--steps", type=_positive_int, default=3000, help="optimizer steps (default 3000)"),
        opt("--batch-size", type=_rows, default=4, help="training: windows per optimizer step (default 4)"),
        SEQ_LEN,
        opt("--lr", type=_positive, default=3e-3, help="peak learning rate (default 3e-3)"),
        _task_share(1.0, ": text fills only what the last whole item leaves"),
        TRAIN_SEED,
        _json("the run summary"),
    ),
    description="Train a BPE tokenizer and the port's Gemma-4 MoE on the corpus from "
    "build-corpus; write an HF-layout checkpoint with the tokenizer and the loss log.",
)

TRAIN_ASSISTANT = Command(
    "train-assistant",
    "train a Gemma-4 MTP assistant for the port's model, the target frozen (deterministic, CPU)",
    (
        MODEL.but(help=f"port of the target (default: {DEFAULT_PORT})"),
        CHECKPOINT.but(help="the target's weights and tokenizer instead of the port's"),
        CORPUS,
        opt("--out", required=True, metavar="DIR", help="assistant directory to write"),
        opt("--steps", type=_positive_int, default=800, help="optimizer steps (default 800)"),
        opt(
            "--draft-steps",
            type=number(int, at_least=1, at_most=16),
            default=4,
            metavar="K",
            help="draft steps unrolled in training, each predicting one token further (default 4)",
        ),
        opt("--batch-size", type=_rows, default=2, help="training: windows per optimizer step (default 2)"),
        SEQ_LEN,
        opt(
            "--queries",
            type=_tokens,
            default=128,
            help="training: draft positions drawn from each window per step (default 128)",
        ),
        _task_share(0.05),
        opt("--lr", type=_positive, default=2e-3, help="peak learning rate (default 2e-3)"),
        TRAIN_SEED,
        _json("the run summary"),
    ),
    description="Teacher forcing from the frozen target over the corpus from build-corpus: the "
    "assistant drafts from the target's final hidden state and KV as the draft graph does, and learns "
    "the target's next-token distribution at each unrolled step. Writes config.json and "
    "model.safetensors (transformers' Gemma4AssistantForCausalLM) and the loss log, then measures "
    "the drafts accepted by HF's assisted generation on held-out text.",
)

EVAL_TASKS = Command(
    "eval-tasks",
    "task accuracy, held-out perplexity and expert load of a model",
    (
        *COMMON,
        opt(
            "--backend",
            default="eager",
            choices=Later(lambda: sorted(spec.validate_backends())),
            help="backend that generates (default eager)",
        ),
        QUANTIZATION.but(
            help="the weight format of the linears --quantized-layers names, as validate's (default none); the "
            "held-out text runs in it too"
        ),
        QUANTIZED_LAYERS,
        opt("--items", type=_items, default=50, help="evaluation items per task (default 50)"),
        opt("--task", action="append", choices=TASKS, help="only this task (repeatable; default: all)"),
        opt(
            "--corpus",
            metavar="DIR",
            help="a build-corpus directory: adds held-out text perplexity (vs a "
            "unigram baseline) and each expert's share of tokens on that text",
        ),
        opt("--text-docs", type=_positive_int, default=200, help="held-out text documents (default 200)"),
        opt(
            "--split",
            default="eval",
            choices=SPLITS,
            help="eval (default) or valid: the validation split, for choosing between training runs "
            "(its text is the calibration text)",
        ),
    ),
    description="Greedy answers to the evaluation items of each task (exact match up to EOS), "
    "perplexity of held-out text against a unigram baseline, and each expert's "
    "share of routed tokens on that text.",
)

EVAL_READER = Command(
    "eval-reader",
    "channel selectors (TEAL, WINA, CATS, oracle, reader) vs the full model "
    "at read budgets: KL, top-1, task accuracy, reads, retention",
    (
        *COMMON,
        opt(
            "--budgets",
            default="12.8,17.8",
            metavar="B,B",
            help="read budgets, %% of the full model's routed-expert reads (default %(default)s)",
        ),
        opt(
            "--selectors",
            default=",".join(spec.SELECTOR_NAMES),
            metavar="S,S",
            help="teal, wina, cats, oracle, reader; reader-rN: the reader at recovery rank N; "
            "reader[-rN]-int8: over the int8 experts (exact rows int8), -int8dq: with the sketch made "
            "from the dequantised int8 (budgets stay %% of the bf16 read: equal bytes) "
            "(default %(default)s)",
        ),
        opt(
            "--rules",
            default=",".join(spec.RETENTION_RULES),
            metavar="R,R",
            help="topk (fixed reads per token) and/or threshold (calibrated) (default %(default)s)",
        ),
        opt(
            "--corpus",
            metavar="DIR",
            help="a build-corpus directory: adds held-out text (eval_text.jsonl) "
            "to the evaluation and calib.jsonl text to the calibration",
        ),
        opt("--out", required=True, metavar="DIR", help="output directory (resumable)"),
        opt(
            "--items",
            type=_items,
            help=f"evaluation items per task (default {spec.EVAL_READER_ITEMS}; --quick "
            f"{spec.EVAL_READER_QUICK_ITEMS})",
        ),
        opt(
            "--quick",
            action="store_true",
            help="a few short items (fact, kv, reverse) and 4 text "
            "documents: a check (16 s on 2 shared cores), not a "
            "measurement",
        ),
    ),
    description="For each selector x retention rule x budget, on the evaluation split: "
    "teacher-forced KL(full || sparse) (mean, p99), top-1 agreement, greedy task "
    "accuracy as % of the full model's (the selector on every token), reads per "
    "token against the target, their distribution and their mean by position in the "
    "answer. Threshold rules are calibrated on the calibration split only. Writes "
    "OUT/cells/*.json (one per cell; a rerun skips those done), OUT/report.json, "
    "OUT/report.md and PNG plots. A budget a selector cannot reach is reported, "
    "not an error.",
)

PUBLISH = Command(
    "publish",
    "upload an artifact directory to S3, integrity-checked, manifest last",
    (
        opt("dir", metavar="DIR", help="directory of artifacts to publish"),
        opt(
            "uri",
            metavar="s3://BUCKET/PREFIX",
            help="where to publish: a prefix with no publication yet, none above it and none below it",
        ),
        opt(
            "--overwrite",
            action="store_true",
            help="replace the prefix's own publication, take over a run in progress there (it then "
            "fails instead of publishing), remove objects of no publication; never touch a "
            "publication below it",
        ),
        opt("--deep", action="store_true", help="also CRC-check every member of .pt archives (reads them)"),
        _json(),
    ),
    description="Check every file (size stable while read; .pt files complete zip archives), "
    "claim the prefix (a conditional write of its manifest), upload each file under "
    "this run's own key with its full-object CRC32 checksum (which S3 checks) and its "
    "sha256 in metadata, verify each with head_object, then write the manifest, on "
    "condition that the claim is still this run's. "
    "Credentials and endpoint come from boto3 (AWS_* variables, ~/.aws).",
)

PULL = Command(
    "pull",
    "download a publication from S3, each file verified (sha256) before it lands",
    (
        opt("uri", metavar="s3://BUCKET/PREFIX", help="a prefix written by `neuron-moe publish`"),
        opt("dir", metavar="DIR", help="destination directory (created if missing; replaced whole)"),
        _json(),
    ),
    description="Read the manifest at s3://BUCKET/PREFIX and build the publication beside DIR: "
    "each file downloaded and its size and sha256 checked (or, where DIR already holds it with "
    "that sha256, linked from there), then renamed onto DIR. DIR ends up holding exactly the "
    "manifest's files, or, when the pull is refused, as it was. Only a new, an empty or a "
    "pulled DIR is replaced.",
)

VERIFY = Command(
    "verify",
    "check a trace-and-compile artifact against its own manifest, no SDK needed",
    (
        opt("artifact", metavar="ARTIFACT|s3://BUCKET/PREFIX", help="a trace-and-compile output, or its publication"),
        opt(
            "--model",
            metavar="NAME|PATH",
            help="the port it must be built for (default: the built-in port its manifest names)",
        ),
        _json(),
    ),
    description="Check the artifact's manifest.json (every field of the contract in range and consistent "
    "with the files: a weight shard per rank, the experts' dtypes those of its quantization, model.pt "
    "unless a dry run), each file's size and sha256 against it, that it holds no file the manifest does "
    "not list and only regular files, and that it was built for the port. An s3:// publication is read "
    "from S3, each object (manifest.json too) checked against the publication's manifest, nothing "
    "written; a local manifest.json has no digest of its own, checked field by field. A local dry-run "
    "artifact's graphs are also preflighted for the target it was built for (neuron-moe preflight). "
    "Exit 0 when it is whole, 1 when a graph breaks a preflight rule, 2 (one error: line naming the "
    "file or field) when not whole. serve --artifacts makes the same checks.",
)

# preflight's own: a wrong target or rule name is preflight's one error: line (exit 2), not argparse's usage
PREFLIGHT_OPTIONS = (
    opt("path", metavar="ARTIFACT|FILE.pt2", help="a trace-and-compile --dry-run output, or one saved program"),
    opt(
        "--target",
        metavar="T",
        help="neuronx-cc's --target: inf2, trn1 or trn2 (default: the one an artifact was built for, its "
        "manifest's; inf2 for a .pt2)",
    ),
    opt("--rules", metavar="RULE,RULE", help="only these rules, by code or name (default: every rule)"),
    _json(),
)
PREFLIGHT = Command(
    "preflight",
    "check every graph against what the Neuron compiler documents it refuses, no SDK needed",
    PREFLIGHT_OPTIONS,
    description="Read every key's torch.export program (graphs/{key}.pt2 of a dry-run artifact, or the one "
    "file) node by node, dtypes and shapes, against the rules of docs/neuron.md#preflight: right shifts "
    "of non-32-bit integers (NCC_EVRF022), integer dots (NCC_EVRF035), iota scatters out of bounds "
    "(NCC_EVRF031), int64 pow and constants, u16, f64, dynamic shapes, data-dependent control flow, "
    "custom calls, a tensor over a NeuronCore's HBM, integer top-k. Per key: the op histogram, dtypes, "
    "the largest intermediate, the weights' bytes. Exit 0 when no rule is broken, 1 when one is, 2 (one "
    "error: line) for a target, rule, file or artifact it cannot take.",
)

PLAN = Command(
    "plan",
    "inf2 memory plan: bytes per NeuronCore at a TP degree, fit verdict, decode floor",
    (
        PORT_MODEL,
        opt("--instance", required=True, choices=sorted(INSTANCE_CHIPS), help="inf2 instance type"),
        TP_REQUIRED,
        DTYPE.but(
            choices=("bfloat16",),
            default="bfloat16",
            help="the compute dtype of every weight but int8 experts' (default bfloat16)",
        ),
        QUANTIZATION.but(
            default="none",
            help="the weight format of the linears --quantized-layers names: none (bfloat16), int8 with fp32 scales "
            "per channel, int4 or q4_0 (two values a byte, a 16-bit scale per group of inputs; the plan counts it) "
            "(default none)",
        ),
        QUANTIZED_LAYERS,
        BATCH_SIZE,
        MAX_CACHE_LEN,
        BUCKETS.but(
            help=BUCKETS.help + "; the graph estimate takes --max-cache-len as the prefill length, an upper bound. "
            "Without a [static] table: batch 1, seq 4096"
        ),
        DECODE_LENGTHS,
        opt(
            "--reader",
            action="store_true",
            help="also the channel layout's decode graph with the reader (bytes per token and rank, each rank's "
            "sidecar shard in the memory plan); needs --budget",
        ),
        BUDGET.but(help="with --reader: share of a rank's routed-expert bytes read per token, in (0, 100]"),
        RECOVERY.but(help=f"with --reader: rank of the recovery map, 0 = off (default {RECOVERY_RANK})"),
        SCAN_WIDTH.but(help=f"with --reader: coordinates scanned per {BLOCK}-block (default {SCAN})"),
        opt(
            "--runtime-reserve-gib",
            type=_non_negative,
            default=DEFAULT_RUNTIME_RESERVE_GIB,
            metavar="GIB",
            help="stated per-core runtime reserve (default %(default)s)",
        ),
        EXPERT_LAYOUT,
        SPECULATIVE_CONFIG.but(
            help=SPECULATIVE_CONFIG.help + "; the plan adds the cache's k slots per layer, the bytes one verify step "
            "reads (and an assistant's k draft steps) and its HBM floor per token kept, for 1 to k + 1 kept"
        ),
        _json("the plan"),
    ),
    description="Per-rank bytes (experts, attention, dense MLP, embeddings, lm_head, KV cache, "
    "stated graph and runtime reserves) against 16 GiB per NeuronCore, the fit verdict "
    "with its reason, and the bytes read per decoded token with the HBM-bound floor. "
    "Exit 0 when it fits, 1 when not.",
)

TRACE_AND_COMPILE = Command(
    "trace-and-compile",
    "rank graphs (a prefill key per bucket, a decode key per decode length), per-rank "
    "weights and a manifest: Neuron, or --dry-run on CPU",
    (
        PORT_MODEL,
        CHECKPOINT,
        REVISION,
        DTYPE.but(default="bfloat16", help="the compute dtype (default bfloat16; float32: for CPU checks)"),
        QUANTIZATION.but(
            default="none",
            help="the weight format of the linears --quantized-layers names: none (the compute dtype), int8 with "
            "fp32 scales, int4 or q4_0 with a 16-bit scale per 32 input channels (the ranks must hold whole "
            "groups) (default none); the manifest records both",
        ),
        QUANTIZED_LAYERS,
        TP_REQUIRED,
        opt("--out", required=True, metavar="DIR", help="output directory (must not exist, or be empty)"),
        opt("--dry-run", action="store_true", help="no Neuron SDK: build and export on CPU, write the plan"),
        opt("--overwrite", action="store_true", help="replace an existing DIR (only once the new one is complete)"),
        BATCH_SIZE,
        MAX_CACHE_LEN,
        BUCKETS,
        DECODE_LENGTHS,
        EXPERT_LAYOUT,
        opt(
            "--reader",
            action="store_true",
            help="the decode key reads through the reader (channel layout, --quantization none): each rank's "
            "sidecar shard goes into its weights; needs --budget and --sidecar DIR (a port without weights: "
            "shapes only, no sidecar)",
        ),
        *_reader(
            "with --reader: ",
            "with --reader: the directory of `prep-reader --tp T`",
            "the port's [reader] recovery_rank, else the sidecar's",
        ),
        opt(
            "--with-logits",
            action="store_true",
            dest="logits",
            help="graphs that also return the fp32 logits (validation: vocab x 4 bytes per row and step "
            "to the host); default: the token each graph chose (greedy or sampled in the graph) alone",
        ),
        opt(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=False,
            dest="prefix_caching",
            help="also compile the copy key (a cache row copied into another) that serve's prefix caching calls, "
            "every key over a cache whose sliding layers keep every position (max_cache_len, not the window: "
            "more device memory); default off",
        ),
        SPECULATIVE_CONFIG,
        _json("the manifest"),
    ),
    description="Build the full-model rank modules at TP T, trace each key once as rank 0 and "
    "(on Neuron, with ModelBuilder) compile them; write model.pt, "
    "weights/tp{r}_sharded_checkpoint.safetensors, shard_plan.json and manifest.json "
    "into DIR, built aside and renamed into place when complete. --dry-run does the "
    "same on CPU (exported programs under graphs/); a port without weights is built and "
    "exported on the meta device: manifest and shard plan only. The KV cache is the graphs' "
    "state (aliased, zero-initialised on each rank): only ids, pad masks, positions and "
    "row ids go in, the token comes out.",
)

SERVE = Command(
    "serve",
    "OpenAI-compatible HTTP server (chat and text completions, SSE streaming)",
    (
        MODEL.but(help=f"port name or path to a port .toml (default: {DEFAULT_PORT})"),
        CHECKPOINT,
        REVISION,
        opt(
            "--backend",
            default="eager",
            type=_serve_backend,
            metavar=Later(lambda: "{" + ",".join(spec.serve_backends()) + "}"),
            help="static: the port's static graphs on CPU, continuously batched (its [static] table); "
            "neuron: the compiled artifact, continuously batched (needs the Neuron SDK); or an "
            "experts implementation but the reader's: transformers' model on CPU, one request per "
            "thread, any prompt that fits the context (default: eager)",
        ),
        opt(
            "--artifacts",
            metavar="DIR|s3://BUCKET/PREFIX",
            help="what the backend loads: the trace-and-compile output for neuron, an HF checkpoint for "
            "a CPU backend; an s3:// URI is pulled (and verified) into --artifacts-cache first",
        ),
        opt(
            "--artifacts-cache",
            default="~/.cache/neuron-moe/artifacts",
            metavar="DIR",
            help="where s3:// artifacts are pulled to (default: %(default)s)",
        ),
        DTYPE.but(help="a CPU backend's compute dtype (default: the port's)"),
        QUANTIZATION.but(
            help="the weight format of the linears --quantized-layers names (default none), with the CPU backends "
            "(transformers' model or the static graphs, dequantised inside each graph); --backend neuron runs the "
            "artifact's own (its manifest's)"
        ),
        QUANTIZED_LAYERS.but(help=QUANTIZED_LAYERS.help + "; the CPU backends only"),
        opt("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)"),
        opt(
            "--port",
            type=_tcp_port,
            default=8080,
            metavar="PORT",
            dest="tcp_port",
            help="TCP port; 0 picks a free one (default: %(default)s)",
        ),
        opt(
            "--api-key",
            default=Later(lambda: os.environ.get("NEURON_MOE_API_KEY")),
            metavar="KEY",
            help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /version and /metrics "
            "(default: $NEURON_MOE_API_KEY; unset: open)",
        ),
        opt(
            "--served-model-name",
            nargs="+",
            metavar="NAME",
            help="the name(s) requests give as 'model' and /v1/models lists; responses carry the first "
            "(default: the port's name)",
        ),
        opt(
            "--max-model-len",
            type=_tokens,
            metavar="N",
            help="context in tokens, prompt and completion together (default and most: what the backend "
            "holds: the graphs' max_cache_len + 1, or the model's max_position_embeddings)",
        ),
        BATCH_SIZE.but(
            help="--backend static: rows of the graphs' batch, the requests generating at once "
            "(default: the port's [static] batch_size)"
        ),
        MAX_CACHE_LEN.but(
            help="--backend static: positions of the KV cache a row holds, the most a prompt and its "
            "completion take (context: S + 1 tokens; default: the port's [static] max_cache_len)"
        ),
        opt(
            "--prefill-rows",
            type=_rows,
            nargs="+",
            metavar="P",
            help="--backend static: the prompts one prefill call takes, one graph per count (e.g. 1 4; "
            "default: the port's [static] prefill_rows)",
        ),
        opt(
            "--prefill-chunk",
            type=_tokens,
            metavar="N",
            help="--backend static: a prompt longer than N tokens is prefilled N at a time, between decode "
            "steps; one of the buckets (default: the port's [static] prefill_chunk)",
        ),
        *COMPILE,
        opt(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            dest="prefix_caching",
            help="batching backends: a request whose prompt begins with a prefix a row of the cache holds "
            "(whole blocks of 16 tokens) takes it from that row instead of prefilling it; rows keep what they "
            "hold until needed. --backend static: default on, as in vLLM (the cost: the sliding layers keep "
            "every position, max_cache_len, not the window, so that any prefix can be taken); --backend "
            "neuron: default what the artifact was built with (trace-and-compile --enable-prefix-caching), "
            "on needs it",
        ),
        SPECULATIVE_CONFIG,
        opt(
            "--max-running",
            type=_rows,
            metavar="N",
            help="backends over transformers' model: requests generating at once, its rows (default: 1); the graphs' "
            "backends run one request per row",
        ),
        opt(
            "--max-queue",
            type=_count,
            default=32,
            metavar="N",
            help="requests waiting beyond those; more get 429 + Retry-After (default: 32)",
        ),
        opt(
            "--drain-timeout",
            type=_non_negative,
            default=DRAIN_TIMEOUT_S,
            metavar="S",
            help="on SIGTERM, seconds to let requests in flight finish; those still running then end "
            "with an error event (streams) or a 503 (default: 60)",
        ),
        opt(
            "--max-body-bytes",
            type=_positive_int,
            metavar="N",
            help="larger request bodies get 413 before they are read (default: 4194304, 4 MiB)",
        ),
        opt(
            "--header-timeout",
            type=_client_timeout,
            metavar="S",
            help="a connection that has not sent a request's complete headers S seconds after it opened "
            "(or after the first byte of its next request) is closed (default: 10; at least 1)",
        ),
        opt(
            "--body-timeout",
            type=_client_timeout,
            metavar="S",
            help="a request whose body has not all come S seconds after its headers gets 408 (default: 30; at least 1)",
        ),
        opt("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]),
    ),
    description="Serve one model over the OpenAI API as vLLM does: POST /v1/chat/completions, "
    "/v1/completions, /tokenize, /detokenize; GET /v1/models, /version, /health, "
    "/ping. The model loads after the socket is bound and runs one request per "
    "graph to warm up, --backend static compiling each graph then (minutes at a first start, seconds "
    "from the compile cache after) (/health answers 503 until it is ready). SIGTERM drains the "
    "requests in flight, then exits 0.",
)

READS = Command(
    "reads",
    "reader: bytes read per token and layer at a budget, and the k it buys",
    (
        MODEL.but(help="port whose geometry to use"),
        BUDGET.but(
            help=f"read budget (default: the port's [reader] budget, else {READS_BUDGET:g}; an explicit "
            f"geometry: {READS_BUDGET:g})"
        ),
        *(
            opt(
                flag,
                type=number(int, at_least=1, at_most=most),
                metavar="N",
                help="explicit geometry (instead of --model)",
            )
            for flag, most in GEOMETRY_BOUNDS.items()
        ),
        SCAN_WIDTH.but(
            default=SCAN, help=f"coordinates scanned per {BLOCK}-block (default {SCAN}; {BLOCK} = full scan)"
        ),
        RECOVERY.but(
            help=f"rank of the recovery map, 0 = off (default: the port's [reader] recovery_rank, else "
            f"{RECOVERY_RANK}; an explicit geometry: {RECOVERY_RANK})"
        ),
        QUANTIZATION.but(
            default="none",
            help="the routed experts' weight format: none (bfloat16), int8 exact rows with fp32 scales, or int4 "
            "rows with a bf16 scale per 32 (accounted only: no int4 reader is built) (the sketch and recovery "
            "stay bfloat16); --budget is a share of those experts' full read (default none)",
        ),
        BATCH_SIZE.but(
            help="also a decode step of B tokens, each row read once: the full batch, independent per-token "
            "top-k, and the batch rule (one set of channels for the step), under uniform routing"
        ),
        opt(
            "--step-budget",
            type=_positive,
            default=STEP_BUDGET,
            metavar="X",
            help=f"with --batch-size: the batch rule's step reads, in units of one token's reads (default "
            f"{STEP_BUDGET:g})",
        ),
        opt(
            "--tp",
            type=_positive_int,
            choices=TP_DEGREES,
            metavar="T",
            help="per rank at TP T on the channel expert layout (each rank its I/T channels of every expert)",
        ),
        _json(),
    ),
    description="Bytes the reader reads per token and MoE layer (whole 32-byte sectors, bf16, "
    "the sidecar layout) as a share of the full model's routed-expert reads; the "
    "k a budget buys; the memory the sidecar adds. Geometry from --model, or "
    "explicit with all of --hidden --experts --top-k --intermediate.",
)

PREP_READER = Command(
    "prep-reader",
    "reader: write the weight-prep sidecar of a model",
    (
        *COMMON,
        opt(
            "--out",
            required=True,
            metavar="FILE|DIR",
            help="sidecar file to write (.safetensors); with --tp a directory",
        ),
        opt(
            "--tp",
            type=_positive_int,
            choices=TP_DEGREES,
            metavar="T",
            help="also shard it for TP T on the channel expert layout: DIR/reader.safetensors (the whole "
            "sidecar) and DIR/tpT-rankR.safetensors, rank R's channels of every expert, each tied to its "
            f"rank, TP degree, layout and source weights ({', '.join(map(str, TP_DEGREES))})",
        ),
        opt(
            "--from",
            dest="source",
            metavar="FILE",
            help="with --tp: shard this existing whole sidecar instead of prepping one",
        ),
        opt("--seed", type=_seed, default=0, help="seed of the Hadamard sign vector (default 0)"),
        RECOVERY.but(default=RECOVERY_RANK, help=f"rank of the recovery map (default {RECOVERY_RANK})"),
        SCAN_WIDTH.but(default=SCAN, help=f"scan width recorded for readers (default {SCAN})"),
    ),
    description="Prepare the reader's sidecar (ternary sketch, channel norms, recovery map) "
    "from the expert weights alone, layer by layer, and write it atomically.",
)

DEPLOY_K8S = Command(
    "k8s",
    "plain YAML for EKS with the Neuron device plugin",
    (
        PORT_MODEL,
        opt("--instance", required=True, choices=sorted(INSTANCE_CHIPS), help="inf2 instance type of the nodes"),
        opt(
            "--artifacts",
            required=True,
            metavar="s3://BUCKET/PREFIX",
            help="the artifact, published by `neuron-moe publish`",
        ),
        QUANTIZATION.but(
            default="none",
            help="the artifact's weight format of the linears --quantized-layers names, for the plan (default: none)",
        ),
        QUANTIZED_LAYERS.but(help=QUANTIZED_LAYERS.help + ": the artifact's, for the plan"),
        SPECULATIVE_CONFIG,
        opt(
            "--tp",
            type=_positive_int,
            choices=TP_DEGREES,
            metavar="T",
            help="the artifact's TP degree (default: the smallest whose plan fits the instance)",
        ),
        opt(
            "--resource",
            default="neuroncore",
            choices=sorted(DEPLOY_RESOURCES),
            help="ask the device plugin for T NeuronCores (aws.amazon.com/neuroncore) or for whole chips "
            "(aws.amazon.com/neuron) (default: %(default)s)",
        ),
        opt("--replicas", type=_positive_int, default=1, metavar="N", help="pods, at least (default 1)"),
        opt("--max-replicas", type=_positive_int, metavar="M", help="the autoscaler's most (default 4 x N)"),
        opt(
            "--target-waiting",
            type=_positive,
            default=2.0,
            metavar="X",
            help="the autoscaler adds pods while their average waiting requests exceed X (default 2)",
        ),
        opt("--name", default="neuron-moe", help="the objects' name (default: %(default)s)"),
        opt(
            "--image",
            default=DEFAULT_NEURON_IMAGE,
            help="the Neuron serving image, in a registry the nodes pull from (default: %(default)s)",
        ),
        opt(
            "--api-key-secret",
            metavar="NAME",
            help="Secret whose key 'api-key' holds the API key (default: NAME-api-key)",
        ),
        opt("--service-account", metavar="NAME", help="the pods' service account (S3 read access for the pull)"),
        opt(
            "--drain-timeout",
            type=_non_negative,
            default=DRAIN_TIMEOUT_S,
            metavar="S",
            help="serve's --drain-timeout, at most 86400 (a day); the grace period is set above it "
            "(default: %(default)g)",
        ),
        opt(
            "--out",
            required=True,
            metavar="DIR",
            help="directory to write (replaced whole; a symbolic link is written through)",
        ),
        _json(),
    ),
    description="Deployment (Neuron resources for the TP degree, the aws.amazon.com/neuron toleration, "
    "the instance type's node selector, an init step that pulls and verifies the artifact into the "
    "node's cache, probes, the API key from a Secret), Service, HorizontalPodAutoscaler on the waiting "
    "requests, and the Prometheus scrape job and adapter rule it reads. Not run on a cluster.",
)

# deploy: files for the engines that scale a server out (neuron_moe/deploy/, docs/deploy.md)
DEPLOY = Command(
    "deploy",
    "Kubernetes manifests for inf2 nodes, derived from the plan (docs/deploy.md)",
    description="Write what an engine needs to run the serving image. SageMaker needs no files: "
    "the image answers its contract itself (docs/deploy.md).",
    engines=(DEPLOY_K8S,),
)

COMMANDS = (
    PORTS,
    ENV,
    INFO,
    VALIDATE,
    BUILD_CORPUS,
    TRAIN_TINY,
    TRAIN_ASSISTANT,
    EVAL_TASKS,
    EVAL_READER,
    PUBLISH,
    PULL,
    VERIFY,
    PREFLIGHT,
    PLAN,
    TRACE_AND_COMPILE,
    SERVE,
    READS,
    PREP_READER,
    DEPLOY,
)


def parser() -> argparse.ArgumentParser:
    """The parser of every command, built from the tables above; each command also takes --threads."""
    top = argparse.ArgumentParser(prog="neuron-moe", description=neuron_moe.__doc__, allow_abbrev=False)
    top.add_argument("--version", action="version", version=f"neuron-moe {neuron_moe.__version__}")
    _add_commands(top, COMMANDS, "command", (THREADS,))
    return top


def _add_commands(p: argparse.ArgumentParser, commands, dest: str, shared: tuple[Option, ...] = ()) -> None:
    sub = p.add_subparsers(dest=dest, required=True, metavar=dest.upper())
    for command in commands:
        # allow_abbrev off: one name per option, no prefix of it parses as the option
        child = sub.add_parser(command.name, help=command.help, description=command.description, allow_abbrev=False)
        for option in command.options:
            option.add_to(child)
        if command.engines:
            _add_commands(child, command.engines, "engine")
        for option in shared:
            option.add_to(child)
