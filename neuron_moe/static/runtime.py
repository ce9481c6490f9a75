"""The port's static graphs on CPU, as modules over one KV cache, as the batching engine's runtime
(`static.rows.GraphRuntime`: what goes in and out; on Inferentia2 the compiled artifact, `serve/neuron.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .decoder import Copy, Decode, Prefill, ProcessingDecode, ProcessingPrefill, new_cache, new_counts
from .inductor import CompiledGraph
from .rows import GraphRuntime
from .sampling import CANDIDATES


def static_runtime(
    model,
    spec,
    batch: int | None = None,
    *,
    prefill_rows=None,
    chunk: int | None = None,
    logits: bool = False,
    compile: bool = False,
    progress: Callable[[str], None] | None = None,
    prefix_caching: bool = False,
) -> GraphRuntime:
    """The port's static graphs on CPU, as modules: `Prefill` (every bucket and row count) and a
    `Decode` per decode length (`Shapes.decode_lengths`: each attends over that many positions) over one
    KV cache of `batch` rows (default: the port's [static] batch_size), each graph
    with the experts implementation the port names for it, choosing its tokens itself, and their
    logits-processing variants (`ProcessingPrefill`, `ProcessingDecode`) over the same cache and one
    set of token counts, for the requests that ask for them. `prefill_rows` and `chunk` default to the
    port's; `logits=True` also returns the logits (validation, tests). `compile`: the prefill and
    decode graphs compiled by torch.compile at their first call of each shape (`progress` told of each
    compile, each decode length its own graph; the caller checked for a C++ compiler and chose the cache:
    `inductor.py`); the
    logits-processing variants and the copy run as modules. `prefix_caching`: the cache in the
    whole-row layout and the `Copy` graph over it (`static/prefix.py`)."""
    shapes = spec.shapes(batch)
    if prefill_rows or chunk:  # the caller's own, over the table's
        rows = tuple(sorted({min(p, shapes.batch_size) for p in prefill_rows})) if prefill_rows else shapes.prefill_rows
        shapes = replace(shapes, prefill_rows=rows, prefill_chunk=chunk or shapes.prefill_chunk)
    lengths = shapes.decode_lengths
    cache = new_cache(model, spec.max_cache_len, shapes.batch_size, whole_rows=prefix_caching)
    counts = new_counts(model, shapes.batch_size)
    prefill = Prefill(model, cache, spec.prefill_experts, logits=logits)
    decode = {n: Decode(model, cache, spec.decode_experts, logits=logits, span=_span(n, shapes)) for n in lengths}
    if compile:
        prefill = CompiledGraph(prefill, "prefill", progress)
        decode = {n: CompiledGraph(graph, f"decode {n}", progress) for n, graph in decode.items()}
    processing = {
        n: ProcessingDecode(model, cache, counts, spec.decode_experts, logits=logits, span=_span(n, shapes))
        for n in lengths
    }
    return GraphRuntime(
        prefill,
        decode,
        shapes,
        logits=logits,
        candidates=min(CANDIDATES, model.config.vocab_size),
        pad_id=model.config.pad_token_id or 0,
        prefill_processing=ProcessingPrefill(model, cache, counts, spec.prefill_experts),
        decode_processing=processing,
        vocab=model.config.vocab_size,
        copy=Copy(cache) if prefix_caching else None,
    )


def _span(length: int, shapes) -> int | None:
    """A decode graph's span: its length, None for the whole cache's (the graph of every position)."""
    return None if length == shapes.max_cache_len else length
