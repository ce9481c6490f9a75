"""Static-shape Gemma-4 decoder for tracing: fixed-size KV cache, prefill buckets, export.

What a static graph may contain is defined here, once, for the exporter and the tests; the
experts implementations it may use are `port.GRAPH_EXPERTS`, which the port check holds.
"""

from pathlib import Path

# Ops whose output shape (or a host-side value) depends on tensor contents: any of them in a
# graph breaks static tracing. `aten.where.default` is the one-argument where (= nonzero).
DATA_DEPENDENT_OPS = (
    "aten.nonzero",
    "aten.index_add",
    "aten.masked_select",
    "aten.unique",
    "aten._local_scalar_dense",
    "aten.item",
    "aten.where.default",
)

# The ops of the exported graphs that torch-xla 2.9 (the Neuron SDK 2.31 stack) lowered to HLO
# with no CPU fallback and one compilation per graph: `make xla-check` runs these graphs on XLA:CPU
# (bench/xla_check.py), `make xla-ops` writes its result here (tools/xla_ops.py). Tests hold the
# graphs to this list.
XLA_LOWERED_OPS_FILE = Path(__file__).with_name("xla_lowered_ops.txt")


def graph_ops(program) -> set[str]:
    """The ops an ExportedProgram's graph calls, by name (`aten.mm.default`, ...)."""
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


def data_dependent_ops(program) -> list[str]:
    """The data-dependent ops in an ExportedProgram's graph (empty for a static graph)."""
    return sorted(t for t in graph_ops(program) if t.startswith(DATA_DEPENDENT_OPS))


def xla_lowered_ops() -> frozenset[str]:
    """The allow-list the XLA check established (blank lines and `#` comments skipped)."""
    lines = XLA_LOWERED_OPS_FILE.read_text().splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def ops_not_lowered(program) -> list[str]:
    """The ops of a graph that the XLA check has not seen lower (empty: the graph is covered)."""
    return sorted(graph_ops(program) - xla_lowered_ops())
