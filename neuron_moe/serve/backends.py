"""The engine behind `serve --backend`: the batching engine over the static graphs (CPU
runtime or a compiled Neuron artifact), or the per-request engine over transformers' model."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ..model import build_model
from ..neuron.artifact import artifact_tokenizer, read_manifest
from ..spec import COMPILED, EAGER_GRAPHS, EXPERTS, MODULES, SELECTOR_RULES, SIDECAR, Backend
from ..tokenizer import load_tokenizer
from .batching import BatchEngine
from .engine import Engine, HFBackend, eos_ids
from .neuron import neuron_runtime
from .runtime import static_runtime

STATIC = "static"  # the backend name of the port's static graphs on CPU
# What an experts implementation may need that serve does not take: it is not offered, and a user who
# asks is told where it runs.
_NOT_TAKEN = {
    SIDECAR: "the reader needs a sidecar and a budget, which serve does not take; "
    "`neuron-moe validate --backend reader` and `eval-reader` run it",
    SELECTOR_RULES: "a channel selector (TEAL, WINA, CATS, ...) needs its retention rule per layer, calibrated "
    "by `neuron-moe eval-reader`, which runs it",
}
NOT_SERVED = {name: _NOT_TAKEN[e.needs] for name, e in EXPERTS.items() if e.needs is not None}
# Every experts implementation that needs nothing attached (transformers' model, one request per
# thread), the port's static graphs and a compiled artifact (both batched): see load_engine
BACKENDS = {
    **{name: Backend(name, EAGER_GRAPHS, e) for name, e in EXPERTS.items() if e.needs is None},
    STATIC: Backend(STATIC, MODULES),
    "neuron": Backend("neuron", COMPILED),
}


def check_backend(backend: str) -> Backend:
    """The backend named `backend` if serve can run it; else a UserError saying why not and what runs it."""
    if backend in NOT_SERVED:
        raise UserError(f"{backend!r} is not served: {NOT_SERVED[backend]}")
    if backend not in BACKENDS:
        raise UserError(f"serve has no backend {backend!r}; choose from {', '.join(BACKENDS)}")
    return BACKENDS[backend]


def load_engine(
    port,
    backend: Backend | str,
    *,
    checkpoint: Path | None = None,
    artifacts: Path | None = None,
    dtype: torch.dtype | None = None,
    batch_size: int | None = None,
    prefill_rows=None,
    prefill_chunk: int | None = None,
) -> Engine:
    """The engine for `backend` (one of BACKENDS, or its name): the port's static graphs on CPU
    (MODULES, batched; `batch_size` rows, `prefill_rows` and `prefill_chunk`, each default the
    port's), a compiled artifact directory (COMPILED, batched) or an experts implementation in
    transformers' model on CPU (one request per thread)."""
    if isinstance(backend, str):
        backend = check_backend(backend)
    if backend.graphs == COMPILED:  # the artifact's own tokenizer (digest-checked), unless --checkpoint gives one
        tokenizer = (
            load_tokenizer(port, checkpoint)
            if checkpoint
            else artifact_tokenizer(artifacts, read_manifest(artifacts), port)
        )
        return BatchEngine(neuron_runtime(artifacts, port), tokenizer, eos_ids(tokenizer, port.config))
    tokenizer = load_tokenizer(port, checkpoint)
    if backend.graphs == MODULES:
        spec = port.static_spec(f"--backend {backend.name}")
        model = build_model(port, spec.decode_experts, dtype, checkpoint)
        runtime = static_runtime(model, spec, batch_size, prefill_rows=prefill_rows, chunk=prefill_chunk)
        return BatchEngine(runtime, tokenizer, eos_ids(tokenizer, model.config))
    model = build_model(port, backend.experts, dtype, checkpoint)
    return Engine(HFBackend(model), tokenizer, model.config.max_position_embeddings, eos_ids(tokenizer, model.config))
