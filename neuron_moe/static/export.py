"""torch.export of the static decoder: a prefill program per bucket, one decode program.

`strict=True` (TorchDynamo) so that anything Python-side that would differ between calls —
a branch on data, a Python int taken from a tensor — fails here rather than in a compiler.
Every exported program is functionalised (`run_decompositions({})`: the cache's in-place commit
becomes a buffer mutation the program returns to its state, `graph_signature.buffers_to_mutate`)
and checked before it is handed out: no data-dependent op, the whole KV cache mutated state, and
nothing but the token (and, in a validation graph, the logits) among its outputs.
"""

from __future__ import annotations

import inspect
import warnings

import torch

from ..port import StaticSpec
from . import data_dependent_ops
from .cache import COUNTS, STATE
from .decoder import ProcessingPrefill, _Processing, _StaticGraph
from .sampling import greedy_sampling, neutral_inputs


def prefill_inputs(spec: StaticSpec, bucket: int, rows: int = 1) -> tuple[torch.Tensor, ...]:
    """Example (input_ids, attention_mask, position_ids, row_ids, sampling): only their shapes
    matter. A prefill fills `rows` cache rows."""
    shape = (rows, bucket)
    return (
        torch.zeros(shape, dtype=torch.long),
        torch.ones(shape, dtype=torch.long),
        torch.arange(bucket).expand(shape).contiguous(),
        torch.arange(rows),
        greedy_sampling(rows),
    )


def decode_inputs(spec: StaticSpec) -> tuple[torch.Tensor, ...]:
    """Example (input_ids, position_ids [batch, 1], sampling [batch, 4])."""
    return (
        torch.zeros(spec.batch_size, 1, dtype=torch.long),
        torch.zeros(spec.batch_size, 1, dtype=torch.long),
        greedy_sampling(spec.batch_size),
    )


def copy_inputs() -> tuple[torch.Tensor, ...]:
    """Example (src_row [1], dst_row [1]) of the copy graph (prefix caching)."""
    return torch.tensor([0]), torch.tensor([0])


def example_inputs(
    spec: StaticSpec, bucket: int | None, rows: int = 1, vocab: int | None = None
) -> tuple[torch.Tensor, ...]:
    """The example inputs of the prefill graph of `rows` rows and `bucket`, or of the decode graph
    (bucket None); with `vocab`, of their logits-processing variants (`ProcessingPrefill`,
    `ProcessingDecode`): the prefill's sampling replaced by its targets, the decode's neutral
    process, bias and mask inputs added."""
    if vocab is None:
        return decode_inputs(spec) if bucket is None else prefill_inputs(spec, bucket, rows)
    if bucket is None:
        return decode_inputs(spec) + neutral_inputs(spec.batch_size, vocab)
    return prefill_inputs(spec, bucket, rows)[:4] + (torch.zeros(rows, bucket, dtype=torch.long),)


def graph_inputs(graph: _StaticGraph, spec: StaticSpec, bucket: int | None, rows: int = 1) -> tuple:
    """The example inputs of `graph` (any of the four kinds)."""
    vocab = graph.model.config.vocab_size if isinstance(graph, _Processing) else None
    return example_inputs(spec, bucket, rows, vocab)


def functional(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The functional form: in-place ops replaced, the cache's commit a buffer mutation."""
    with warnings.catch_warnings():
        # torch 2.13's own pytree code, on every call: "isinstance(treespec, LeafSpec) is deprecated"
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        return program.run_decompositions({})


def state_problems(program: torch.export.ExportedProgram, graph: _StaticGraph) -> list[str]:
    """Why `program` does not carry `graph`'s KV cache as state (empty: it does): every state
    tensor mutated, none among the user inputs, and only the token (and logits) as user outputs."""
    sig, problems = program.graph_signature, []
    state = {f"{STATE}.{name}": tuple(t.shape) for name, t in zip(graph.cache.names, graph.cache.tensors())}
    if isinstance(graph, _Processing):
        state.update({f"{COUNTS}.{n}": tuple(t.shape) for n, t in zip(graph.counts.names, graph.counts.tensors())})
    unmutated = sorted(set(state) - set(sig.buffers_to_mutate.values()))
    if unmutated:
        problems.append(f"KV state not mutated by the graph: {unmutated[:4]}{'…' if len(unmutated) > 4 else ''}")
    nodes = {n.name: n for n in program.graph.nodes}
    outputs = [tuple(nodes[name].meta["val"].shape) for name in sig.user_outputs]
    inputs = [tuple(nodes[name].meta["val"].shape) for name in sig.user_inputs]
    expected_inputs = len(inspect.signature(graph.forward).parameters)  # the graph's own: none added
    ranks = 2 if not isinstance(graph, ProcessingPrefill) else 3  # the top logprobs of every column
    if len(outputs) != graph.user_outputs or any(len(s) > ranks for s in outputs):
        what = "the token" if not isinstance(graph, _Processing) else "the token or logprobs"
        problems.append(
            f"user outputs {outputs}: expected {what}{' and the logits' if graph.logits else ''} only, no KV tensor"
        )
    if len(inputs) != expected_inputs or any(s in state.values() for s in inputs):
        problems.append(
            f"user inputs {inputs}: expected {expected_inputs} (ids, positions, masks, row ids, sampling), no KV tensor"
        )
    return problems


def export(graph: _StaticGraph, inputs: tuple, what: str) -> torch.export.ExportedProgram:
    """torch.export (strict) of one graph, functional and checked (see the module docstring)."""
    with warnings.catch_warnings(), torch.no_grad():
        # Dynamo reports the Python-side effects it replays (transformers' output recorder), which
        # are not in the graph. (torch 2.9 says "exporting".)
        warnings.filterwarnings("ignore", message="While (compiling|exporting), we found certain side effects")
        program = functional(torch.export.export(graph, inputs, strict=True))
    return checked(program, graph, what)


class GraphError(RuntimeError):
    """An exported graph a compiler must not be given (a bug of the graph, not of the input)."""


def checked(program: torch.export.ExportedProgram, graph: _StaticGraph, what: str) -> torch.export.ExportedProgram:
    """`program`, or a GraphError naming what makes it unfit for a compiler."""
    bad = data_dependent_ops(program)
    problems = ([f"data-dependent ops in the exported graph: {sorted(set(bad))}"] if bad else []) + state_problems(
        program, graph
    )
    if problems:
        raise GraphError(f"{what}: {'; '.join(problems)}")
    return program
