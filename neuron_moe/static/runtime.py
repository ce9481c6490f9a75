"""The port's static graphs on CPU, as modules over one KV cache, as the batching engine's runtime
(`static.rows.GraphRuntime`: what goes in and out; on Inferentia2 the compiled artifact, `serve/neuron.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .decoder import Copy, Decode, Prefill, ProcessingDecode, ProcessingPrefill, Step, new_cache, new_counts
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
    fused: bool = True,
) -> GraphRuntime:
    """The port's static graphs on CPU, as modules: `Prefill` (every bucket and row count) and
    `Decode` over one KV cache of `batch` rows (default: the port's [static] batch_size), each graph
    with the experts implementation the port names for it, choosing its tokens itself, and their
    logits-processing variants (`ProcessingPrefill`, `ProcessingDecode`) over the same cache and one
    set of token counts, for the requests that ask for them. `prefill_rows` and `chunk` default to the
    port's; `logits=True` also returns the logits (validation, tests). `compile`: the prefill and
    decode graphs compiled by torch.compile at their first call of each shape (`progress` told of each
    compile; the caller checked for a C++ compiler and chose the cache: `inductor.py`); the
    logits-processing variants and the copy run as modules. `prefix_caching`: the cache in the
    whole-row layout and the `Copy` graph over it (`static/prefix.py`). `fused`: also the `Step` graph
    (a prefill chunk and the decode step in one call, with the prefill's experts; compiled as the
    prefill and decode graphs are), which the rows call in place of the two when a step has both."""
    shapes = spec.shapes(batch)
    if prefill_rows or chunk:  # the caller's own, over the table's
        rows = tuple(sorted({min(p, shapes.batch_size) for p in prefill_rows})) if prefill_rows else shapes.prefill_rows
        shapes = replace(shapes, prefill_rows=rows, prefill_chunk=chunk or shapes.prefill_chunk)
    cache = new_cache(model, spec.max_cache_len, shapes.batch_size, whole_rows=prefix_caching)
    counts = new_counts(model, shapes.batch_size)
    prefill = Prefill(model, cache, spec.prefill_experts, logits=logits)
    decode = Decode(model, cache, spec.decode_experts, logits=logits)
    step = Step(model, cache, spec.prefill_experts, logits=logits) if fused else None
    if compile:
        prefill, decode = CompiledGraph(prefill, "prefill", progress), CompiledGraph(decode, "decode", progress)
        step = step and CompiledGraph(step, "step", progress)
    return GraphRuntime(
        prefill,
        decode,
        shapes,
        logits=logits,
        candidates=min(CANDIDATES, model.config.vocab_size),
        pad_id=model.config.pad_token_id or 0,
        prefill_processing=ProcessingPrefill(model, cache, counts, spec.prefill_experts),
        decode_processing=ProcessingDecode(model, cache, counts, spec.decode_experts, logits=logits),
        vocab=model.config.vocab_size,
        copy=Copy(cache) if prefix_caching else None,
        step=step,
    )
