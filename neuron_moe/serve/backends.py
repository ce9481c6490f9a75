"""The engine behind `serve --backend`: the batching engine over the static graphs (CPU
runtime or a compiled Neuron artifact), or the per-request engine over transformers' model."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ..model import EXPERTS_IMPLEMENTATIONS, build_model
from ..neuron.artifact import artifact_tokenizer, read_manifest
from ..tokenizer import load_tokenizer
from .batching import BatchEngine
from .engine import Engine, HFBackend, eos_ids
from .neuron import neuron_runtime
from .runtime import static_runtime

STATIC = "static"  # the backend name of the port's static graphs on CPU
# Experts implementations that need more than the model's weights, which serve does not take:
# not offered, and a user who asks is told where they run.
NOT_SERVED = {
    "channel_reader": "the reader needs a sidecar and a budget, which serve does not take; "
                      "`neuron-moe validate --backend reader` and `eval-reader` run it",
    "selector": "a channel selector (TEAL, WINA, CATS, ...) needs its retention rule per layer, calibrated "
                "by `neuron-moe eval-reader`, which runs it",
}
BACKENDS = (*(e for e in EXPERTS_IMPLEMENTATIONS if e not in NOT_SERVED), STATIC, "neuron")  # see load_engine


def check_backend(backend: str) -> str:
    """`backend` if serve can run it; else a UserError saying why not and what runs it."""
    if backend in NOT_SERVED:
        raise UserError(f"{backend!r} is not served: {NOT_SERVED[backend]}")
    if backend not in BACKENDS:
        raise UserError(f"serve has no backend {backend!r}; choose from {', '.join(BACKENDS)}")
    return backend


def load_engine(port, backend: str, *, checkpoint: Path | None = None, artifacts: Path | None = None,
                dtype: torch.dtype | None = None, batch_size: int | None = None, prefill_rows=None,
                prefill_chunk: int | None = None) -> Engine:
    """The engine for `backend`: "static" (the port's static graphs on CPU, batched; `batch_size`
    rows, `prefill_rows` and `prefill_chunk`, each default the port's), "neuron" (a compiled
    artifact directory, batched) or an experts implementation name (transformers' model on CPU,
    one request per thread)."""
    check_backend(backend)
    if backend == "neuron":  # the artifact's own tokenizer (digest-checked), unless --checkpoint gives one
        tokenizer = load_tokenizer(port, checkpoint) if checkpoint else \
            artifact_tokenizer(artifacts, read_manifest(artifacts), port)
        return BatchEngine(neuron_runtime(artifacts, port), tokenizer, eos_ids(tokenizer, port.config))
    tokenizer = load_tokenizer(port, checkpoint)
    if backend == STATIC:
        spec = port.static_spec("--backend static")
        model = build_model(port, spec.decode_experts, dtype, checkpoint)
        runtime = static_runtime(model, spec, batch_size, prefill_rows=prefill_rows, chunk=prefill_chunk)
        return BatchEngine(runtime, tokenizer, eos_ids(tokenizer, model.config))
    model = build_model(port, backend, dtype, checkpoint)
    return Engine(HFBackend(model), tokenizer, model.config.max_position_embeddings,
                  eos_ids(tokenizer, model.config))
