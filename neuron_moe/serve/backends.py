"""The engine behind `serve --backend`: the batching engine over the static graphs (CPU
runtime or a compiled Neuron artifact), or the per-request engine over transformers' model."""

from __future__ import annotations

from pathlib import Path

import torch

from ..model import EXPERTS_IMPLEMENTATIONS, build_model
from ..tokenizer import load_tokenizer
from .batching import BatchEngine
from .engine import Engine, HFBackend, eos_ids
from .neuron import neuron_runtime
from .runtime import static_runtime

STATIC = "static"  # the backend name of the port's static graphs on CPU
BACKENDS = (*EXPERTS_IMPLEMENTATIONS, STATIC, "neuron")  # `serve --backend`: see load_engine


def load_engine(port, backend: str, *, checkpoint: Path | None = None, artifacts: Path | None = None,
                dtype: torch.dtype | None = None, batch_size: int | None = None, prefill_rows=None,
                prefill_chunk: int | None = None) -> Engine:
    """The engine for `backend`: "static" (the port's static graphs on CPU, batched; `batch_size`
    rows, `prefill_rows` and `prefill_chunk`, each default the port's), "neuron" (a compiled
    artifact directory, batched) or an experts implementation name (transformers' model on CPU,
    one request per thread)."""
    if backend == "neuron":
        tokenizer = load_tokenizer(port, checkpoint or artifacts)  # the artifact may carry the tokenizer
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
