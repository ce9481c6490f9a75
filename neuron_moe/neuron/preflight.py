"""`neuron-moe preflight`: what neuronx-cc documents it refuses, caught on any CPU before a compile.

Every graph of a trace-and-compile dry run (`graphs/{key}.pt2`) or one saved `torch.export` program is
read node by node — each node's op and its `meta["val"]` fake tensors: dtypes and shapes — against a
table of rules. Each rule is one frozen `Rule`: the error code (the compiler's own, `NCC_…`, where its
documentation has one; a name of ours where the rule comes from elsewhere), the documentation's sentence,
where it is (aws-neuron/aws-neuron-sdk at 81ce03a, or NxD), and the check of one node. A rule that
depends on the compile target (neuronx-cc's `--target`: inf2 and trn1 are NeuronCore-v2, trn2 is
NeuronCore-v3) takes it; inf2 is the default, the one target this project compiles for.

What counts as 64-bit integer compute (decided here, docs/neuron.md): on NeuronCore-v2 "64-bit integers
are always auto-converted to 32-bit integers", which is exact for every value inside int32. Our graphs'
int64 tensors are index plumbing — token ids, positions, row ids, ring offsets, top-k indices — whose
values the static shapes and the vocabulary bound far below 2^31, so they are not flagged. Flagged are
the two places the downcast changes a value whatever the inputs: `pow` on int64 (the one int64 op with
a compiler error of its own, NCC_EVRF062) and an int64 op given a constant outside int32's range.

Per key the report also gives the op histogram, the dtypes, the largest intermediate (bytes, shape) and
the bytes of the weights (parameters, buffers — the KV cache state among them — and constants).
trace-and-compile runs the rules on every key of a dry run before it writes it, and refuses with the
first broken rule's line; verify reports them for a dry-run artifact.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import Node

from ..errors import UserError
from ..report import table
from .artifact import GRAPHS, read_manifest
from .plan import CORE_HBM, GiB

SDK = "aws-neuron-sdk"  # github.com/aws-neuron/aws-neuron-sdk, read at 81ce03a (2026-08-21)
NXD = "neuronx-distributed"  # github.com/aws-neuron/neuronx-distributed, read at fbac349 (Release 2.29)

# neuronx-cc's --target -> (NeuronCore version, one NeuronCore's HBM). inf2: 32 GiB per chip of 2 cores
# (about-neuron/arch/neuron-hardware/inferentia2.rst; plan.CORE_HBM); trn1: 32 GiB per chip of 2 cores
# (trainium.rst); trn2: 96 GiB per chip of 8 physical cores, 4 logical ones at LNC=2, trn2's default
# (trainium2.rst).
TARGETS = {"inf2": (2, CORE_HBM), "trn1": (2, 16 * GiB), "trn2": (3, 24 * GiB)}
DEFAULT_TARGET = "inf2"


class PreflightError(UserError):
    """A file, artifact, target or rule name preflight cannot take (exit 2), or, from trace-and-compile,
    a graph that breaks a rule."""


@dataclass(frozen=True)
class Rule:
    """One thing the Neuron compiler documents it refuses: `check(node, target)` says what of it one
    node of an exported program does (None: nothing)."""

    code: str
    name: str  # what --rules also takes
    quote: str
    source: str
    check: Callable[[Node, str], str | None]

    def line(self, where: str, what: str) -> str:
        return f"{self.code}: {where} {what} ({self.quote}; {self.source})"


# ---- what a node is ----------------------------------------------------------------------------------


def _op(node: Node) -> tuple[str, str]:
    """(namespace, op name) of a call_function node: ("aten", "mm"); ("higher_order", "cond"); ("python",
    "getitem") for a Python callable."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace, target.overloadpacket.__name__
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "higher_order", target.__name__
    return "python", getattr(target, "__name__", str(target))


def _name(node: Node) -> str:
    return str(node.target) if isinstance(node.target, torch._ops.OpOverload) else ".".join(_op(node))


def _tensors(value) -> list:
    """The tensors a node's value holds (a tensor, or a tuple or list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _val(arg):
    """The fake tensor an argument node stands for (None for a constant or a non-tensor)."""
    value = arg.meta.get("val") if isinstance(arg, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _dtype(arg):
    value = _val(arg)
    return None if value is None else value.dtype


def _shape(t: torch.Tensor) -> list:
    return [int(n) if isinstance(n, int) else str(n) for n in t.shape]


def _nbytes(t: torch.Tensor) -> int | None:
    """Bytes of a static-shaped tensor (None where a dimension is symbolic)."""
    dims = list(t.shape)
    if not all(isinstance(n, int) for n in dims):
        return None
    count = 1
    for n in dims:
        count *= n
    return count * t.element_size()


def _calls(node: Node, *names: str) -> bool:
    return node.op == "call_function" and _op(node)[1] in names


def _str(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- the checks, one per rule ----------------------------------------------------------------------------

NOT_32_BIT = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int64, torch.uint64)


def _shift(node: Node, target: str) -> str | None:
    if not _calls(node, "bitwise_right_shift", "__rshift__", "__irshift__", "rshift"):
        return None
    first = _val(node.args[0]) if node.args else None
    if first is None:
        return None
    if first.dtype in NOT_32_BIT:
        return f"shifts right the {_str(first.dtype)} tensor {_shape(first)}"
    if len(node.args) > 1 and not isinstance(node.args[1], Node):  # torch-xla 2.9: an s64 shift (int4.unpack)
        return (
            f"shifts right the {_str(first.dtype)} tensor {_shape(first)} by a Python number, which torch-xla "
            "widens to 64 bits"
        )
    return None


DOTS = ("mm", "bmm", "matmul", "linear", "addmm", "baddbmm", "addbmm", "dot", "mv", "addmv", "einsum", "_int_mm")


def _int_dot(node: Node, target: str) -> str | None:
    if not _calls(node, *DOTS):
        return None
    operands = [a for arg in node.args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
    dtypes = {d for d in map(_dtype, operands) if d is not None}
    banned = {torch.int64, torch.uint64} | ({torch.int32, torch.uint32} if TARGETS[target][0] >= 3 else set())
    found = sorted(_str(d) for d in dtypes & banned)
    return f"multiplies {'/'.join(found)} matrices on {target}" if found else None


VIEWS = ("view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "clone", "_to_copy", "alias")


def _iota(node) -> tuple[int, int] | None:
    """(smallest, largest) value of an index tensor made by `arange` (through views, casts and an
    added constant), or None where it is not one."""
    offset = 0
    while isinstance(node, Node) and node.op == "call_function":
        if _calls(node, "arange"):
            ints = [a for a in node.args if isinstance(a, int)]
            if not ints:
                return None
            start, end, step = (0, ints[0], 1) if len(ints) == 1 else (ints + [1])[:3]
            values = range(start, end, step) if step else range(0)
            return (min(values) + offset, max(values) + offset) if values else None
        if _calls(node, *VIEWS):
            node = node.args[0]
        elif _calls(node, "add") and len(node.args) == 2 and isinstance(node.args[1], int):
            node, offset = node.args[0], offset + node.args[1]
        else:
            return None
    return None


def _iota_scatter(node: Node, target: str) -> str | None:
    if _calls(node, "index_put", "index_put_"):
        indexed = list(enumerate(node.args[1]))  # one index tensor per leading dim (None: all of it)
    elif _calls(node, "scatter", "scatter_add", "scatter_reduce", "index_copy", "index_add", "index_fill"):
        indexed = [(node.args[1], node.args[2])]
    else:
        return None
    operand = _val(node.args[0])
    if operand is None:
        return None
    for dim, index in indexed:
        span = _iota(index)
        size = operand.shape[dim] if isinstance(dim, int) and -operand.dim() <= dim < operand.dim() else None
        if span is not None and isinstance(size, int) and (span[0] < 0 or span[1] >= size):
            return f"scatters iota indices {span[0]}…{span[1]} into dim {dim} of size {size}"
    return None


def _int64_pow(node: Node, target: str) -> str | None:
    if not _calls(node, "pow"):
        return None
    if any(_dtype(a) == torch.int64 for a in node.args):
        return "raises an int64 tensor to a power"
    return None


INT32 = torch.iinfo(torch.int32)
# ops whose integer arguments are values the op computes with (a slice's end, a view's size are not)
VALUE_OPS = (
    *("add", "sub", "rsub", "mul", "div", "remainder", "floor_divide", "fmod", "maximum", "minimum", "where"),
    *("full", "full_like", "new_full", "fill", "masked_fill", "clamp", "clamp_min", "clamp_max", "scalar_tensor"),
    *("bitwise_and", "bitwise_or", "bitwise_xor", "__and__", "__or__", "__xor__", "bitwise_left_shift", "__lshift__"),
)


def _int64_constant(node: Node, target: str) -> str | None:
    values = [t for t in _tensors(node.meta.get("val")) if t.dtype == torch.int64]
    if not _calls(node, *VALUE_OPS) or not values:
        return None
    big = [a for a in [*node.args, *node.kwargs.values()] if type(a) is int and not INT32.min <= a <= INT32.max]
    return f"computes int64 with the constant {big[0]}, outside int32" if big else None


def _dtype_anywhere(dtype) -> Callable[[Node, str], str | None]:
    def check(node: Node, target: str) -> str | None:
        found = [t for t in _tensors(node.meta.get("val")) if t.dtype == dtype]
        return f"holds a {_str(dtype)} tensor {_shape(found[0])}" if found else None

    return check


def _dynamic(node: Node, target: str) -> str | None:
    for t in _tensors(node.meta.get("val")):
        if not all(isinstance(n, int) for n in t.shape):
            return f"has the dynamic shape {_shape(t)}"
    return None


CONTROL_FLOW = ("cond", "while_loop", "map_impl", "scan", "associative_scan")
HOST_VALUES = ("_local_scalar_dense", "item")  # a tensor's value read on the host: a branch follows


def _control_flow(node: Node, target: str) -> str | None:
    namespace, name = _op(node) if node.op == "call_function" else ("", "")
    if (namespace == "higher_order" and name in CONTROL_FLOW) or (namespace == "aten" and name in HOST_VALUES):
        return f"branches or loops on a tensor's value ({_name(node)})"
    return None


# The ops a graph may call besides aten's and prims': functional collectives (the dry run's gloo layers;
# on Neuron, NxD's layers trace to XLA's own collectives) and Python's getitem and SymInt arithmetic (the
# host's; SymInts are the dynamic-shape rule's).
COLLECTIVES = "_c10d_functional"
PYTHON = {f.__name__ for f in (operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv)}


def _custom_call(node: Node, target: str) -> str | None:
    if node.op != "call_function":
        return None
    namespace, name = _op(node)
    if namespace in ("aten", "prims", COLLECTIVES) or (namespace == "python" and name in PYTHON):
        return None
    if namespace == "higher_order" and name in CONTROL_FLOW:
        return None  # the control-flow rule's
    return f"calls {_name(node)}, outside aten and prims"


def _hbm(node: Node, target: str) -> str | None:
    limit = TARGETS[target][1]
    for t in _tensors(node.meta.get("val")):
        size = _nbytes(t)
        if size is not None and size > limit:
            return f"holds {size} bytes {_shape(t)} ({_str(t.dtype)}), over one {target} NeuronCore's {limit}"
    return None


def _int_topk(node: Node, target: str) -> str | None:
    if _calls(node, "topk") and _dtype(node.args[0]) in (torch.int32, torch.int64):
        return f"takes the top-k of a {_str(_dtype(node.args[0]))} tensor"
    return None


def _doc(code: str) -> str:
    return f"{SDK} compiler/error-codes/{code}.rst"


DATA_TYPES = f"{SDK} about-neuron/arch/neuron-features/data-types.rst"
TRACE_DOC = f"{SDK} frameworks/torch/torch-neuronx/api-reference-guide/inference/api-torch-neuronx-trace.rst"

RULES = (
    Rule(
        "NCC_EVRF022",
        "shift",
        "Shift-right-arithmetic operation on non 32-bit inputs is not supported. Cast the first argument's "
        "data type to be S32, U32, or F32.",
        _doc("EVRF022"),
        _shift,
    ),
    Rule(
        "NCC_EVRF035",
        "int-dot",
        "Opcode (dot) does not support 32-bit or 64-bit integer operands on this target. … This error applies "
        "to int32 operands on Trainium2 and later, and to int64 operands on all targets.",
        _doc("EVRF035"),
        _int_dot,
    ),
    Rule(
        "NCC_EVRF031",
        "iota-scatter",
        "The compiler encountered a scatter out-of-bounds error. The indices created via iota instruction "
        "contain values that are beyond the size of the operand dimension.",
        _doc("EVRF031"),
        _iota_scatter,
    ),
    Rule(
        "NCC_EVRF062",
        "int64-pow",
        "Opcode (power) does not support 64-bit integer operands on this target; they are downcast to 32-bit "
        "integer, which loses precision for values larger than 2^31.",
        _doc("EVRF062"),
        _int64_pow,
    ),
    Rule(
        "INT64",
        "int64",
        "On Trn1, 64-bit integers are always auto-converted to 32-bit integers.",
        f"{DATA_TYPES} (NeuronCore v2: inf2 and trn1; trn2 the same unless --native-int64)",
        _int64_constant,
    ),
    Rule(
        "U16",
        "u16",
        "A limitation of Torch XLA is that u16 is not supported.",
        f"{NXD} src/neuronx_distributed/quantization/quantization_config.py",
        _dtype_anywhere(torch.uint16),
    ),
    Rule(
        "F64",
        "f64",
        "Trn1 supports the following data types: 32 and 16-bit Floating Point (FP32 / FP16), TensorFloat-32 "
        "(TF32), Brain Floating Point (BFloat16), … (no 64-bit float)",
        f"{DATA_TYPES} (Trn1 / Inf2 (NeuronCore v2))",
        _dtype_anywhere(torch.float64),
    ),
    Rule(
        "NCC_EMOD025",
        "dynamic-shape",
        "Dynamic shape is not supported … The Neuron compiler requires all tensor dimensions to be statically sized.",
        _doc("EMOD025"),
        _dynamic,
    ),
    Rule(
        "CONTROL_FLOW",
        "control-flow",
        "tracing a model with Neuron statically preserves control flow … If a model result is based on "
        "data-dependent control flow, the traced function may produce inaccurate results.",
        f"{TRACE_DOC} (Fixed Control Flow)",
        _control_flow,
    ),
    Rule(
        "NCC_EHCA005",
        "custom-call",
        "The compiler encountered a custom call instruction with a target name that is not recognized.",
        _doc("EHCA005"),
        _custom_call,
    ),
    Rule(
        "NCC_EVRF009",
        "hbm",
        "The combined memory needed for the model's activation tensors exceeds the high-bandwidth memory limit.",
        f"{_doc('EVRF009')}; one NeuronCore's HBM: {SDK} about-neuron/arch/neuron-hardware/",
        _hbm,
    ),
    Rule("NCC_EVRF013", "int-topk", "TopK does not support int32 or int64 input tensors.", _doc("EVRF013"), _int_topk),
)

RULE_NAMES = {r.code.lower(): r for r in RULES} | {r.name: r for r in RULES}


# ---- a program, an artifact -------------------------------------------------------------------------------


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise PreflightError(f"--target {target!r}: not one of {', '.join(TARGETS)} (neuronx-cc's --target)")
    return target


def select_rules(names=None) -> tuple[Rule, ...]:
    """The rules `names` (codes or names, any case) name, in the table's order; None: every rule."""
    if not names:
        return RULES
    names = [n.strip() for n in names]
    unknown = [n for n in names if n.lower() not in RULE_NAMES]
    if unknown:
        known = ", ".join(f"{r.code} ({r.name})" for r in RULES)
        raise PreflightError(f"unknown rule {unknown[0]!r}: the rules are {known}")
    chosen = {RULE_NAMES[n.lower()] for n in names}
    return tuple(r for r in RULES if r in chosen)


def _weight_bytes(program: torch.export.ExportedProgram, nodes: dict[str, Node]) -> dict[str, int]:
    """Bytes of the program's parameters, buffers (its state among them) and lifted constants."""
    sig = program.graph_signature
    groups = {
        "parameters": sig.inputs_to_parameters,
        "buffers": sig.inputs_to_buffers,
        "constants": sig.inputs_to_lifted_tensor_constants,
    }
    return {
        kind: sum(_nbytes(t) or 0 for name in names for t in _tensors(nodes[name].meta.get("val")))
        for kind, names in groups.items()
    }


def check_program(program, key: str = "program", target: str = DEFAULT_TARGET, rules=RULES) -> dict:
    """One program's report: every broken rule's line (node by node, in graph order), its op histogram,
    its dtypes, its largest intermediate and its weights' bytes."""
    check_target(target)
    nodes = {n.name: n for n in program.graph.nodes}
    violations, ops, dtypes, largest = [], Counter(), set(), None
    for node in program.graph.nodes:
        values = _tensors(node.meta.get("val"))
        dtypes.update(_str(t.dtype) for t in values)
        if node.op == "call_function":
            ops[_name(node)] += 1
            for t in values:
                size = _nbytes(t)
                if size is not None and (largest is None or size > largest["bytes"]):
                    largest = {"node": node.name, "bytes": size, "shape": _shape(t), "dtype": _str(t.dtype)}
        for rule in rules:
            what = rule.check(node, target)
            if what is not None:
                violations.append(rule.line(f"{key} node {node.name}", what))
    return {
        "key": key,
        "nodes": len(nodes),
        "ops": dict(sorted(ops.items())),
        "dtypes": sorted(dtypes),
        "largest": largest,
        "weight_bytes": _weight_bytes(program, nodes),
        "violations": violations,
    }


def refuse(program, key: str, target: str = DEFAULT_TARGET) -> None:
    """trace-and-compile's gate: a PreflightError naming the first broken rule of `key`'s program (and how
    many more there are), before the program is written or compiled."""
    found = check_program(program, key, target)["violations"]
    if found:
        more = f" (and {len(found) - 1} more: neuron-moe preflight lists them)" if len(found) > 1 else ""
        raise PreflightError(f"preflight for {target}: {found[0]}{more}")


def _load(path: Path) -> torch.export.ExportedProgram:
    try:
        return torch.export.load(path)
    except Exception as e:  # a truncated zip, a pickle of something else, a file of another torch
        raise PreflightError(f"{path}: not a saved torch.export program ({type(e).__name__}: {e})") from None


def graph_files(manifest: dict) -> dict[str, str]:
    """Key -> its program's file in an artifact, for each key whose program the manifest lists (a dry run
    with weights and its keys exported writes one per key; a compiled or shapes-only build, none)."""
    return {k: GRAPHS.format(key=k) for k in manifest["keys"] if GRAPHS.format(key=k) in manifest["files"]}


def programs(path: Path) -> tuple[dict[str, Path], str | None]:
    """(key -> program file, the compile target it was built for) of `path`: a dry-run artifact's every
    exported key (its manifest's) and its manifest's target, or one .pt2 and None."""
    if path.is_file():
        return {path.stem: path}, None
    if not path.is_dir():
        raise PreflightError(f"{path}: no such file or directory (an artifact directory or a .pt2 program)")
    manifest = read_manifest(path)  # an ArtifactError (exit 2) for a directory that is not an artifact
    if not manifest["dry_run"]:
        raise PreflightError(
            f"{path}: compiled for Neuron, its graphs in model.pt, not torch.export programs: preflight the "
            "trace-and-compile --dry-run artifact of the same build"
        )
    if not manifest["weights"]:
        raise PreflightError(f"{path}: built without weights (meta device): no graphs were written to check")
    files = {key: path / name for key, name in graph_files(manifest).items()}
    if not files:
        raise PreflightError(f"{path}: built without exporting its keys: no graphs were written to check")
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise PreflightError(f"{missing[0]}: missing (the manifest lists its key)")
    return files, manifest["target"]["name"]


def preflight(path, target: str | None = None, rules=None) -> dict:
    """The report on an artifact directory or one .pt2 program: each key's, then every broken rule.
    `target` None: the one the artifact was built for (its manifest's), else DEFAULT_TARGET."""
    files, built_for = programs(Path(path))
    target, chosen = check_target(target or built_for or DEFAULT_TARGET), select_rules(rules)
    keys = [check_program(_load(f), key, target, chosen) for key, f in files.items()]
    violations = [line for k in keys for line in k["violations"]]
    return {
        "source": str(path),
        "target": target,
        "rules": [r.code for r in chosen],
        "keys": keys,
        "violations": violations,
        "clean": not violations,
    }


def summary(report: dict) -> dict:
    """What verify carries of a preflight report: the target, the keys checked, the broken rules' lines."""
    return {k: report[k] for k in ("target", "violations", "clean")} | {"keys": len(report["keys"])}


def render_summary(summary: dict) -> str:
    head = f"preflight ({summary['target']}): {summary['keys']} keys, "
    if summary["clean"]:
        return head + "no rule broken"
    return "\n".join([head + f"{len(summary['violations'])} rule violations:", *summary["violations"]])


def render_preflight(report: dict) -> str:
    rows = []
    for k in report["keys"]:
        big = k["largest"]
        top = ", ".join(f"{op} {n}" for op, n in Counter(k["ops"]).most_common(4))
        rows.append(
            {
                "key": k["key"],
                "nodes": k["nodes"],
                "ops": f"{len(k['ops'])}: {top}",
                "dtypes": " ".join(k["dtypes"]),
                "largest": "" if big is None else f"{big['bytes']} B {big['shape']}",
                "weights": sum(k["weight_bytes"].values()),
                "broken": len(k["violations"]),
            }
        )
    columns = [(c, c) for c in ("key", "nodes", "ops", "dtypes", "largest", "weights", "broken")]
    lines = [table(rows, columns), ""]
    lines.append(
        f"{report['source']}: {len(report['keys'])} keys against {len(report['rules'])} rules for "
        f"{report['target']}: " + ("clean" if report["clean"] else f"{len(report['violations'])} broken")
    )
    return "\n".join(lines + report["violations"])
