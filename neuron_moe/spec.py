"""What runs, typed: the experts implementations (`EXPERTS`), a backend (`Backend`: which experts in
which graphs, placed how, with which reader settings and weights), the backends validate and serve
offer, eval-reader's selector specs (`SelectorSpec`) and the commands' vocabulary (dtypes, the
experts' quantization, the reader's defaults). A definition: names and what each needs and reads, no
modules and no torch, so any layer may ask it, the command-line parser included.

Each experts implementation is one entry here. Its HF forward is bound to the entry in
`experts/__init__.py` (`FORWARDS`, one per entry), what a tensor-parallel rank module computes for
it in `parallel/moe.py`; what the commands offer is derived from the entries (`port.GRAPH_EXPERTS`,
the validate and serve backends, `info --per-token`, the planner's decode graph).

transformers dispatches an experts module on its config's `_experts_implementation`, read at call
time. Everything that names an implementation to transformers goes through the adapter at the end
of this file (`set_experts`, `dispatching`, `dispatched`): a model's implementation is set when it
is built, and each static graph is built over experts modules with configs of their own
(`experts/view.py`), so nothing switches it while a graph runs.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

# ---- placement vocabulary: TP degrees, expert layouts, scatters, layer libraries ----

TP_DEGREES = (1, 2, 4, 8, 24)  # what inf2 supports
CHANNEL, EXPERT = "channel", "expert"  # how TP ranks split the experts (parallel/layout.py)
EXPERT_LAYOUTS = (CHANNEL, EXPERT)
DEFAULT_EXPERT_LAYOUT = CHANNEL
SPMD, NAIVE = "spmd", "naive"  # the expert layout's router scatter: by the SPMDRank tensor, or the Python-int rank
SCATTERS = (SPMD, NAIVE)
LAYERS = ("cpu", "nxd")  # the parallel-layer libraries a rank module is built over (parallel/cpu.py, parallel/nxd.py)


class SpecError(UserError):
    pass


# ---- the commands' vocabulary: the same words in every command that takes them ----

DEFAULT_PORT = "tiny-gemma4-moe"
DTYPE_NAMES = ("bfloat16", "float32")  # --dtype: the compute dtype, torch's spellings (port.DTYPES: the torch dtypes)
# --quantization: the weight format of the linears --quantized-layers names (formats/: one module each);
# "none" computes them in the compute dtype, "int8" holds per-channel symmetric int8 numbers with fp32 scales,
# "int4" group-wise symmetric 4-bit numbers, two per byte, with a bf16 scale per group, "q4_0" llama.cpp's Q4_0
# (4-bit numbers -8 … 7, an fp16 scale per 32 input channels: the grid of Google's QAT checkpoints)
NO_QUANTIZATION, INT8_QUANTIZATION, INT4_QUANTIZATION, Q4_0_QUANTIZATION = "none", "int8", "int4", "q4_0"
QUANTIZATIONS = (NO_QUANTIZATION, INT8_QUANTIZATION, INT4_QUANTIZATION, Q4_0_QUANTIZATION)
# the experts the one-rank reader reads (no int4 reader is built; reader/accounting.py charges one)
READER_QUANTIZATIONS = (NO_QUANTIZATION, INT8_QUANTIZATION)
# --quantized-layers: the groups of linears --quantization applies to (embeddings, norms, the router and
# scalars stay in the compute dtype: a lookup reads one row, the rest is small)
LAYER_GROUPS = ("experts", "attention", "mlp", "lm_head")
DEFAULT_QUANTIZED_LAYERS = ("experts",)
_LAYER_GROUP = (
    (re.compile(r"(^|\.)experts\.(gate_up|down)_proj\.weight$"), "experts"),
    (re.compile(r"(^|\.)self_attn\.[a-z]+_proj\.weight$"), "attention"),
    (re.compile(r"(^|\.)mlp\.(gate|up|down)_proj\.weight$"), "mlp"),
    (re.compile(r"(^|\.)lm_head\.weight$"), "lm_head"),
)


def layer_group(name: str) -> str | None:
    """The group (LAYER_GROUPS) of the linear whose weight is `name` (a parallel-layout or HF
    parameter name), or None for any other tensor."""
    return next((group for pattern, group in _LAYER_GROUP if pattern.search(name)), None)


def check_quantized_layers(layers) -> tuple[str, ...]:
    """`layers` (a tuple, or --quantized-layers' comma-separated text) as a tuple in LAYER_GROUPS' order,
    each named once; else a UserError naming the choices."""
    names = [n.strip() for n in layers.split(",")] if isinstance(layers, str) else list(layers)
    unknown = [n for n in names if n not in LAYER_GROUPS]
    if unknown or not names:
        raise SpecError(
            f"--quantized-layers {','.join(names)!r}: expected a comma-separated list of {', '.join(LAYER_GROUPS)}"
        )
    return tuple(g for g in LAYER_GROUPS if g in names)


# The reader's defaults (reader/prep.py writes them into a sidecar; reader/accounting.py charges them)
BLOCK = 128  # coordinates per Hadamard block
SCAN = 80  # coordinates per block a token scans (recorded; a reader may scan any number)
RECOVERY_RANK = 32  # recovery-map rank
READS_BUDGET = 17.8  # `reads`' budget, percent, where neither the command line nor the port gives one: the paper's
READER_KERNELS = ("reference", "triton", "nki")  # the reader's decode-step kernels (experts/channel_reader.py)
STEP_BUDGET = 2.0  # the batch rule's reads per decode step, in units of one token's (reader/accounting.py)

# eval-reader's selectors and retention rules (reader/selectors.py, eval/reader_eval.py)
SELECTOR_NAMES = ("teal", "wina", "cats", "oracle", "reader")
RETENTION_RULES = ("topk", "threshold")
EVAL_READER_ITEMS, EVAL_READER_QUICK_ITEMS = 20, 2  # evaluation items per task: a full run, --quick

# plan: the inf2 instances (chips each) and the stated per-core runtime reserve
INSTANCE_CHIPS = {"inf2.xlarge": 1, "inf2.8xlarge": 1, "inf2.24xlarge": 6, "inf2.48xlarge": 12}
DEFAULT_RUNTIME_RESERVE_GIB = 1.0

# serve and deploy k8s: serve's --drain-timeout default; the Neuron serving image; the Neuron device
# plugin's resources a pod asks for (aws-neuron-sdk docs, "Kubernetes environment setup for Neuron")
DRAIN_TIMEOUT_S = 60.0
# serve --backend static and validate --backend static compile the static graphs with torch.compile
# (inductor; `--no-compile`: run them a module at a time); inductor's on-disk cache of what it compiled
# is --compile-cache, default $TORCHINDUCTOR_CACHE_DIR where set, else this
COMPILE_CACHE = "~/.cache/neuron-moe/compile"


def compile_cache(given: str | None) -> str:
    """The compile cache directory: --compile-cache as given, else $TORCHINDUCTOR_CACHE_DIR, else COMPILE_CACHE."""
    return given or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or COMPILE_CACHE


DEFAULT_NEURON_IMAGE = "neuron-moe:neuron"
DEPLOY_RESOURCES = {"neuroncore": "aws.amazon.com/neuroncore", "neuron": "aws.amazon.com/neuron"}


def check_quantization(quantization: str, offered=QUANTIZATIONS, where: str = "--quantization") -> str:
    """`quantization` if it is one of `offered`, else a UserError naming the choices."""
    if quantization not in offered:
        raise SpecError(f"{where} {quantization!r}: expected one of {', '.join(offered)}")
    return quantization


# ---- experts implementations ----

ALL, ROUTED, CHANNELS = "all", "routed", "channels"  # what an implementation reads of a layer's experts
SIDECAR, SELECTOR_RULES = "sidecar", "selector rules"  # what one needs attached before it runs


@dataclass(frozen=True)
class Experts:
    """One experts implementation: what transformers' model dispatches each MoE block's experts to."""

    name: str  # its name in transformers' experts registry
    graphs: bool  # a static graph may trace it: every shape fixed by the token count, nothing made on the fly
    reads: str  # ALL: every expert for every token; ROUTED: each token's top-k; CHANNELS: some of their channels
    needs: str | None = None  # SIDECAR or SELECTOR_RULES: attached to the model before it runs (None: nothing)
    backend: str | None = None  # `validate`'s name for it in HF's model (None: not a validate backend)

    def gathers(self, config, tokens: int) -> bool:
        """Whether a graph of `tokens` tokens gathers each token's k experts (selective loading) rather
        than computing all E: a fixed-shape implementation of the routed experts, while tokens·k < E
        (NxD's rule; the gathered copy of tokens·k experts outgrows the weights after). Fixed per graph
        by its row count."""
        return self.graphs and self.reads == ROUTED and tokens * config.top_k_experts < config.num_experts

    def experts_read(self, config, tokens: int = 1) -> int:
        """Experts whose weights one layer reads for `tokens` tokens: all E, or the tokens' top-k (at
        most E). For CHANNELS, the experts whose channels are read."""
        if self.reads == ALL:
            return config.num_experts
        return min(tokens * config.top_k_experts, config.num_experts)

    @property
    def static(self) -> bool:
        """A port's [static] table may name it: the graphs trace it and it needs nothing attached."""
        return self.graphs and self.needs is None


# HF's own loop: the experts some token picked (data-dependent shapes), the CPU reference of every other one
EAGER = Experts("eager", graphs=False, reads=ROUTED, backend="eager")
# every expert for every token, weighted by a dense router matrix: what the prefill graphs trace
DENSE_MASKED = Experts("dense_masked", graphs=True, reads=ALL, backend="dense_masked")
# each token gathers its top-k experts' weights: the decode graphs. Not a validate backend: at validate's
# prompts it is dense_masked (tokens·k ≥ E); its gather is validated in the graphs (`validate --backend traced`)
SELECTIVE = Experts("selective", graphs=True, reads=ROUTED)
# the sparse-channel reader on decode steps, full experts on prefill; at TP the decode graph with a rank's shard
CHANNEL_READER = Experts("channel_reader", graphs=True, reads=CHANNELS, needs=SIDECAR, backend="reader")
# a channel selector of reader/selectors.py (TEAL, WINA, CATS, oracle, the reader) in place of the experts
SELECTOR = Experts("selector", graphs=False, reads=CHANNELS, needs=SELECTOR_RULES)

EXPERTS = {e.name: e for e in (EAGER, DENSE_MASKED, SELECTIVE, CHANNEL_READER, SELECTOR)}


def experts(which: Experts | str) -> Experts:
    """The entry of `which` (an entry, or its name)."""
    if isinstance(which, Experts):
        return which
    if which not in EXPERTS:
        raise SpecError(f"unknown experts implementation {which!r}; choose from {tuple(EXPERTS)}")
    return EXPERTS[which]


# ---- a backend ----

# What a backend runs: HF's model itself, or the static graphs as modules, exported, or compiled (Neuron)
EAGER_GRAPHS, MODULES, EXPORTED, COMPILED = "eager", "modules", "exported", "compiled"


@dataclass(frozen=True)
class Placement:
    """Tensor-parallel ranks. None: the default (the backend's degree, the port's [static]
    expert_layout, the cpu layer library); a field given is what was asked."""

    tp: int | None = None
    expert_layout: str | None = None
    scatter: str = SPMD  # NAIVE exists in the expert layout only (the channel layout slices nothing by rank)
    layers: str | None = None

    def degree(self, default: int) -> int:
        return self.tp or default

    def layout(self, port_layout: str | None) -> str | None:
        """The expert layout: the one asked for, the naive scatter's (the expert layout), else the
        port's (`port_layout`; None: left to the caller, which has the port's [static])."""
        if self.scatter == NAIVE:
            if self.expert_layout not in (None, EXPERT):
                raise SpecError(f"this backend runs the {EXPERT!r} expert layout only, not {self.expert_layout!r}")
            return EXPERT
        return self.expert_layout or port_layout

    @property
    def library(self) -> str:
        return self.layers or LAYERS[0]


@dataclass(frozen=True)
class Reader:
    """The reader's settings, one object from the command line (`cli.from_options`) and the port's [reader]
    table (`port.Port.reader`, merged by `over`) down to the accounting and the kernels. A field None
    is not given: the port's, else the default (`resolved`); a sidecar records its own scan and rank."""

    sidecar: Path | None = None  # a sidecar file (one rank) or a `prep-reader --tp` directory (TP)
    budget: float | None = None  # percent of the full model's routed-expert reads, in (0, 100]
    recovery_rank: int | None = None  # the recovery map's rank (0: off)
    kernel: str | None = None  # one of READER_KERNELS
    quantization: str | None = None  # the experts it reads: QUANTIZATIONS ("none": the model's own)
    scan: int | None = None  # coordinates scanned per block (the planner's; a sidecar records its own)

    # the command-line option of each field where the two differ, for the errors that name it
    OPTIONS = {"kernel": "reader_kernel"}

    @classmethod
    def _fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def given(self) -> dict:
        """The fields given (not None), by their option's name."""
        return {self.OPTIONS.get(f, f): getattr(self, f) for f in self._fields() if getattr(self, f) is not None}

    def over(self, defaults: Reader) -> Reader:
        """These settings, each field not given taken from `defaults` (the port's [reader] table)."""
        return Reader(
            **{f: getattr(defaults, f) if getattr(self, f) is None else getattr(self, f) for f in self._fields()}
        )

    def resolved(self) -> Reader:
        """These settings with the defaults where not given: scan SCAN, RECOVERY_RANK, no quantization,
        the reference kernel (what the accounting charges)."""
        return self.over(
            Reader(recovery_rank=RECOVERY_RANK, kernel=READER_KERNELS[0], quantization=NO_QUANTIZATION, scan=SCAN)
        )


@dataclass(frozen=True)
class Backend:
    """What a command runs: experts in graphs, placed on ranks, with a reader and a dtype."""

    name: str  # what --backend called it
    graphs: str  # EAGER_GRAPHS, MODULES, EXPORTED or COMPILED
    experts: Experts | None = None  # HF's model's (EAGER_GRAPHS); None: each graph's, the port's [static]
    placement: Placement | None = None  # None: one rank (over the nxd layers, the graphs run as modules)
    reader: Reader | None = None  # the reader's settings (with CHANNEL_READER, or in the TP decode graph)
    quantization: str = NO_QUANTIZATION  # the weight format of the quantized layers (QUANTIZATIONS)
    quantized_layers: tuple[str, ...] = DEFAULT_QUANTIZED_LAYERS  # which linears are in it (LAYER_GROUPS)
    dtype: str | None = None  # the compute dtype (one of DTYPE_NAMES); None: the port's
    compile: bool = False  # MODULES: each graph compiled by torch.compile (inductor), else run a module at a time

    @property
    def formats(self) -> dict:
        """The weights' formats as `model.build_model` takes them: quantization, quantized_layers."""
        return {"quantization": self.quantization, "quantized_layers": self.quantized_layers}


def compiled_backend(
    name: str,
    tp: int,
    quantization: str = NO_QUANTIZATION,
    dtype: str | None = None,
    expert_layout: str | None = None,
    reader: Reader | None = None,
    quantized_layers=None,
) -> Backend:
    """The rank modules of a compiled artifact (what trace-and-compile builds, plan plans and deploy
    sizes): TP `tp` in `expert_layout` (None: the port's), `quantized_layers` in `quantization` (as
    `quantized` takes them: None, the routed experts), the reader in the decode key where given."""
    placement = Placement(tp=tp, expert_layout=expert_layout)
    backend = Backend(name, COMPILED, placement=placement, reader=reader, dtype=dtype)
    return quantized(backend, quantization, quantized_layers)


def tp_backend(
    tp: int,
    *,
    quantization: str = NO_QUANTIZATION,
    quantized_layers: tuple[str, ...] = DEFAULT_QUANTIZED_LAYERS,
    reader: Reader | None = None,
    **placement,
) -> Backend:
    """validate's tp backend as `--backend tp --tp T` builds it, for callers without a command line
    (tests, benches): degree `tp`, the weight format and the layers in it, the reader's settings,
    `placement` the Placement's other fields (expert_layout, scatter, layers)."""
    return Backend(
        "tp",
        EXPORTED,
        placement=Placement(tp=tp, **placement),
        reader=reader,
        quantization=quantization,
        quantized_layers=check_quantized_layers(quantized_layers),
    )


# ---- the backends validate and serve offer ----


def validate_backends() -> dict[str, Backend]:
    """validate's backends, derived from the registry when asked: every experts implementation that runs
    inside HF's model (`Experts.backend`; the reader on decode steps, full experts on prefill), the port's
    static graphs as modules as `serve --backend static` runs them (compiled unless --no-compile), those
    graphs through torch.export, and those graphs at TP on gloo (the degree: --tp); each in any weight
    format (--quantization, on the linears --quantized-layers names: `quantized`)."""
    return {
        **{e.backend: Backend(e.backend, EAGER_GRAPHS, e) for e in EXPERTS.values() if e.backend},
        "static": Backend("static", MODULES),
        "traced": Backend("traced", EXPORTED),
        "tp": Backend("tp", EXPORTED, placement=Placement()),
    }


STATIC_BACKEND, NEURON_BACKEND = "static", "neuron"
_NOT_TAKEN = {
    SIDECAR: "the reader needs a sidecar and a budget, which serve does not take; "
    "`neuron-moe validate --backend reader` and `eval-reader` run it",
    SELECTOR_RULES: "a channel selector (TEAL, WINA, CATS, ...) needs its retention rule per layer, calibrated "
    "by `neuron-moe eval-reader`, which runs it",
}


def not_served() -> dict[str, str]:
    """The experts implementations serve does not take, each with why and what runs it."""
    return {name: _NOT_TAKEN[e.needs] for name, e in EXPERTS.items() if e.needs is not None}


def serve_backends() -> dict[str, Backend]:
    """serve's backends, derived from the registry when asked: every experts implementation that needs
    nothing attached (transformers' model, as the engine's runtime), the port's static graphs on CPU (both
    in any format: --quantization, --quantized-layers) and a compiled artifact (batched, in its own)."""
    return {
        **{name: Backend(name, EAGER_GRAPHS, e) for name, e in EXPERTS.items() if e.needs is None},
        STATIC_BACKEND: Backend(STATIC_BACKEND, MODULES),
        NEURON_BACKEND: Backend(NEURON_BACKEND, COMPILED),
    }


def check_quantization_flags(quantization: str | None, quantized_layers=None) -> tuple[str, ...]:
    """The layer groups `quantized_layers` names (None: the routed experts) if `quantization` (None: not
    given) is a format and other groups than the experts' have one to be put in; else a UserError."""
    layers = DEFAULT_QUANTIZED_LAYERS if quantized_layers is None else check_quantized_layers(quantized_layers)
    if quantization in (None, NO_QUANTIZATION):
        if layers != DEFAULT_QUANTIZED_LAYERS:
            raise SpecError(
                "--quantized-layers names the linears --quantization puts in a format: pass --quantization "
                f"{' or '.join(QUANTIZATIONS[1:])} too"
            )
    else:
        check_quantization(quantization)
    return layers


def quantized(backend: Backend, quantization: str | None, quantized_layers=None) -> Backend:
    """`backend` with the linears of `quantized_layers` (LAYER_GROUPS, a tuple or --quantized-layers' text;
    None: not given, the routed experts) in `quantization` (None: not given, the compute dtype's): HF's
    model, the static graphs and the TP rank modules take any format on any group (`quantize.py`,
    `formats/`); the reader reads the model's own or the int8 experts (its `Reader.quantization`:
    READER_QUANTIZATIONS), nothing else; a compiled artifact's format is its own (its manifest's).
    Other layers than the experts without a format to put them in are refused, as is any format the
    backend lacks."""
    layers = check_quantization_flags(quantization, quantized_layers)
    if quantization in (None, NO_QUANTIZATION):
        return backend
    if backend.graphs == COMPILED and backend.placement is None:
        raise SpecError(
            f"--backend {backend.name} runs a compiled artifact in the format it was built with (its manifest's "
            "quantization and quantized_layers): drop --quantization and --quantized-layers"
        )
    if backend.experts is not None and backend.experts.needs == SIDECAR:
        if quantization not in READER_QUANTIZATIONS:
            raise SpecError(
                f"--backend {backend.name} reads the model's own or the int8 experts, not --quantization "
                f"{quantization} (no {quantization} reader is built; `neuron-moe reads --quantization "
                f"{quantization}` accounts one)"
            )
        if layers != DEFAULT_QUANTIZED_LAYERS:
            raise SpecError(
                f"--backend {backend.name} reads the routed experts alone in int8, not --quantized-layers "
                f"{','.join(layers)}"
            )
        return backend  # the reader's own setting (Reader.quantization)
    return dataclasses.replace(backend, quantization=quantization, quantized_layers=layers)


def check_serve_backend(name: str) -> Backend:
    """serve's backend `name` if serve can run it; else a UserError saying why not and what runs it."""
    if name in not_served():
        raise SpecError(f"{name!r} is not served: {not_served()[name]}")
    backends = serve_backends()
    if name not in backends:
        raise SpecError(f"serve has no backend {name!r}; choose from {', '.join(backends)}")
    return backends[name]


# ---- eval-reader's selectors ----

READER_SELECTOR = "reader"  # the selector that is the reader (its sidecar, rank, TP and int8 settings)
# The reader at TP T on the channel layout, emulated in one process: each rank its own quota (none),
# or one top-(T·k_r) over all ranks' gathered scores (-global); k_r solved on the rank's geometry, or
# the one-rank reader's k split evenly (-split)
TP_VARIANTS = ("", "-global", "-split", "-split-global")
_SELECTOR = re.compile(
    r"(?P<name>[a-z]+)(?:-r(?P<rank>\d+))?(?:-tp(?P<tp>\d+)(?P<variant>"
    + "|".join(v for v in TP_VARIANTS if v)
    + r")?)?(?:-(?P<weights>int8|int8dq))?"
)


@dataclass(frozen=True)
class SelectorSpec:
    """A selector spec of eval-reader: a baseline's name, or reader[-rN][-tpT[variant]][-int8|-int8dq]."""

    text: str  # as given: the cell's name
    name: str
    rank: int | None = None  # the reader's recovery rank; None: the port's [reader] rank, else the sidecar's
    tp: int | None = None  # the per-rank reader at this TP degree; None: one rank
    gathered: bool = False  # one top-(T·k_r) over all ranks' scores (-global), not each rank its quota
    split: bool = False  # k_r = ⌊k/T⌋ of the one-rank reader's k (-split), not solved on the rank's geometry
    quantization: str = NO_QUANTIZATION  # the experts it reads: INT8_QUANTIZATION with -int8, -int8dq
    dequantised: bool = False  # sketch and recovery from the dequantised int8 (-int8dq), not the model's weights

    @property
    def reader(self) -> bool:
        """The reader, which needs a sidecar."""
        return self.name == READER_SELECTOR


def parse_selector(text: str, known) -> SelectorSpec:
    """A selector spec, checked; `known`: the selectors' names (reader/selectors.py)."""
    m = _SELECTOR.fullmatch(text)
    if not m or m["name"] not in known or ((m["rank"] or m["tp"] or m["weights"]) and m["name"] != READER_SELECTOR):
        raise SpecError(
            f"unknown selector {text!r}; known: {', '.join(known)}, and reader-rN (the reader at "
            f"recovery rank N), reader[-rN]-tpT[-global|-split|-split-global] (the reader at TP T), "
            f"reader[-rN]-int8 / -int8dq (over the int8 experts)"
        )
    tp = int(m["tp"]) if m["tp"] else None
    if tp is not None and tp not in TP_DEGREES:
        raise SpecError(f"{text}: TP degree {tp} is not one of {TP_DEGREES}")
    if tp is not None and m["weights"]:
        raise SpecError(f"{text}: the reader over int8 experts runs at one rank; drop -tp{tp} or -{m['weights']}")
    variant = m["variant"] or ""
    return SelectorSpec(
        text,
        m["name"],
        int(m["rank"]) if m["rank"] else None,
        tp,
        gathered=variant.endswith("-global"),
        split=variant.startswith("-split"),
        quantization=INT8_QUANTIZATION if m["weights"] else NO_QUANTIZATION,
        dequantised=m["weights"] == "int8dq",
    )


# ---- the one adapter to transformers' experts registry ----


def set_experts(model, which: Experts | str) -> None:
    """Every MoE block of `model` dispatches to `which`: an entry, or the name of an implementation
    transformers registers itself (training runs its `grouped_mm`)."""
    model.set_experts_implementation(which.name if isinstance(which, Experts) else which)


def dispatching(config, which: Experts):
    """A copy of `config` naming `which`: what an experts module of one graph holds (`experts/view.py`)."""
    own = copy.copy(config)
    own._experts_implementation = which.name
    return own


def dispatched(config) -> Experts:
    """The implementation an experts module with `config` runs; None (a config no model set) is HF's
    own loop, as transformers' dispatch takes it."""
    return experts(config._experts_implementation or EAGER.name)
