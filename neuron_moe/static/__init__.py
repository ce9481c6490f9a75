"""Static-shape Gemma-4 decoder for tracing: fixed-size KV cache, prefill buckets, export.

What a static graph may contain is defined here, once, for the port check, the exporter and
the tests.
"""

# Experts implementations a static graph may use: fixed shapes, and exported in the tests.
# (Not every registered implementation qualifies: HF's eager loop has data-dependent shapes.)
GRAPH_EXPERTS = ("dense_masked", "selective")

# Ops whose output shape (or a host-side value) depends on tensor contents: any of them in a
# graph breaks static tracing. `aten.where.default` is the one-argument where (= nonzero).
DATA_DEPENDENT_OPS = ("aten.nonzero", "aten.index_add", "aten.masked_select", "aten.unique",
                      "aten._local_scalar_dense", "aten.item", "aten.where.default")


def data_dependent_ops(program) -> list[str]:
    """The data-dependent ops in an ExportedProgram's graph (empty for a static graph)."""
    targets = (str(n.target) for n in program.graph.nodes if n.op == "call_function")
    return [t for t in targets if t.startswith(DATA_DEPENDENT_OPS)]
