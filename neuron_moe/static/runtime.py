"""The port's static graphs on CPU, as modules over one KV cache, as the batching engine's runtime
(`static.rows.GraphRuntime`: what goes in and out; on Inferentia2 the compiled artifact, `serve/neuron.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .decoder import Copy, Decode, Prefill, ProcessingDecode, ProcessingPrefill, Step, Verify, new_cache, new_counts
from ..hub import check_assistant
from .draft import Draft, load_assistant
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
    speculative=None,
    assistant=None,
    draft_tokens: int = 4,
    fused: bool = True,
) -> GraphRuntime:
    """The port's static graphs on CPU, as modules: `Prefill` (every bucket and row count) and a
    `Decode` per decode length (`Shapes.decode_lengths`: each attends over that many positions) over
    one KV cache of `batch` rows (default: the port's [static] batch_size), each graph with the
    experts implementation the port names for it, choosing its tokens itself, and their
    logits-processing variants (`ProcessingPrefill`, `ProcessingDecode`) over the same cache and one
    set of token counts, for the requests that ask for them. `prefill_rows` and `chunk` default to the
    port's; `logits=True` also returns the logits (validation, tests). `compile`: every graph compiled
    by torch.compile at its first call of each shape (`progress` told of each compile, each decode
    length its own graph; the caller checked for a C++ compiler and chose the cache: `inductor.py`).
    `prefix_caching`: the cache in the whole-row layout and the `Copy` graph over it
    (`static/prefix.py`). `assistant`: a `Gemma4AssistantForCausalLM` for the model, and its draft
    graph of `draft_tokens` steps over the same cache (`draft.Draft`; its sliding rings must hold the
    window + 1 positions it reads). `speculative` (a `speculative.SpeculativeConfig`): the `Verify`
    graph of its k drafts too (and k draft steps of the `assistant` an mtp config needs), over a cache
    with the slack they need (`cache.cache_layout`): the verify graph writes k positions past a row's
    latest, which the draft, reading the window + 1 positions before its query, must not find there
    either. `fused`: also the `Step` graph (a prefill chunk and the decode step in one call, with the
    prefill's experts), which the rows call in place of the two when a step has both."""
    shapes = spec.shapes(batch)
    if prefill_rows or chunk:  # the caller's own, over the table's
        rows = tuple(sorted({min(p, shapes.batch_size) for p in prefill_rows})) if prefill_rows else shapes.prefill_rows
        shapes = replace(shapes, prefill_rows=rows, prefill_chunk=chunk or shapes.prefill_chunk)
    if speculative and speculative.method == "mtp" and assistant is None:
        assistant = load_assistant(check_assistant(speculative, model.config), model)
    draft_tokens = speculative.num_speculative_tokens if speculative else draft_tokens
    # a verify step's k slots past the row, and one more ahead of the window + 1 a draft reads
    slack = draft_tokens + (assistant is not None) if speculative else 0
    lengths = shapes.decode_lengths
    cache = new_cache(model, spec.max_cache_len, shapes.batch_size, whole_rows=prefix_caching, slack=slack)
    counts = new_counts(model, shapes.batch_size)
    graphs = {
        "prefill": Prefill(model, cache, spec.prefill_experts, logits=logits),
        "decode": {n: Decode(model, cache, spec.decode_experts, logits=logits, span=_span(n, shapes)) for n in lengths},
        "logits-processing prefill": ProcessingPrefill(model, cache, counts, spec.prefill_experts),
        "logits-processing decode": {
            n: ProcessingDecode(model, cache, counts, spec.decode_experts, logits=logits, span=_span(n, shapes))
            for n in lengths
        },
        "copy": Copy(cache) if prefix_caching else None,
        "step": Step(model, cache, spec.prefill_experts, logits=logits) if fused else None,
        "verify": speculative
        and Verify(model, cache, spec.decode_experts, logits=logits, hidden=assistant is not None),
        "draft": None if assistant is None else Draft(assistant, model, cache, draft_tokens),
    }
    if compile:
        graphs = {name: _compiled(name, graph, progress) for name, graph in graphs.items()}
    return GraphRuntime(
        graphs["prefill"],
        graphs["decode"],
        shapes,
        logits=logits,
        candidates=min(CANDIDATES, model.config.vocab_size),
        pad_id=model.config.pad_token_id or 0,
        prefill_processing=graphs["logits-processing prefill"],
        decode_processing=graphs["logits-processing decode"],
        vocab=model.config.vocab_size,
        copy=graphs["copy"],
        verify=graphs["verify"],
        speculative=speculative,
        draft=graphs["draft"],
        step=graphs["step"],
    )


def _compiled(name: str, graph, progress):
    """A graph compiled by torch.compile at its first call of each shape (`CompiledGraph`, its progress
    lines naming it), or {KV length: graph} each compiled; None stays None."""
    if isinstance(graph, dict):
        return {n: CompiledGraph(g, f"{name} {n}", progress) for n, g in graph.items()}
    return graph and CompiledGraph(graph, name, progress)


def _span(length: int, shapes) -> int | None:
    """A decode graph's span: its length, None for the whole cache's (the graph of every position)."""
    return None if length == shapes.max_cache_len else length
