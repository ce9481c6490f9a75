"""The engine behind `serve --backend`: the one engine (`engine.Engine`) over the runtime the
backend names: the static graphs on CPU, a compiled Neuron artifact, or transformers' model."""

from __future__ import annotations

from pathlib import Path

import torch

from ..model import build_model
from ..neuron.artifact import check_tokenizer, read_manifest
from ..spec import COMPILED, MODULES, Backend, check_serve_backend, not_served, serve_backends
from ..tokenizer import load_tokenizer
from .decoding import eos_ids
from .engine import Engine
from .hf_runtime import HFRuntime
from .neuron import neuron_runtime
from ..static.runtime import static_runtime

BACKENDS = serve_backends()  # spec.py: every experts implementation that needs nothing attached, static, neuron
NOT_SERVED = not_served()


def load_engine(
    port,
    backend: Backend | str,
    *,
    checkpoint: Path | None = None,
    artifacts: Path | None = None,
    dtype: torch.dtype | None = None,
    compile: bool = False,
    progress=None,
    prefix_caching: bool | None = None,
    rows: int | None = None,
    speculative=None,
) -> Engine:
    """The engine for `backend` (one of BACKENDS, or its name): the port's static graphs on CPU
    (MODULES, batched, at the shapes of the port's [static] table: `port.with_shapes`; `compile`: each
    graph compiled by torch.compile, `progress` told of each compile: `static/inductor.py`;
    `prefix_caching`, `static/prefix.py`: None on, False off), a compiled artifact directory
    (COMPILED, batched; `prefix_caching` None: as the artifact was built) or an experts
    implementation in transformers' model on CPU (`rows` of it, default 1, each with a cache of its
    own: `hf_runtime.py`). The CPU backends' linears
    are in the backend's formats (its quantization on its quantized_layers); an artifact's, its own.
    `speculative` (a `speculative.SpeculativeConfig`, MODULES only): the static graphs speculate."""
    if isinstance(backend, str):
        backend = check_serve_backend(backend)
    if backend.graphs == COMPILED:  # the artifact's own tokenizer (digest-checked), unless --checkpoint gives one
        tokenizer = load_tokenizer(port, checkpoint or check_tokenizer(artifacts, read_manifest(artifacts), port))
        runtime = neuron_runtime(artifacts, port, prefix_caching)
        return Engine(runtime, tokenizer, eos_ids(tokenizer, port.config))
    tokenizer = load_tokenizer(port, checkpoint)
    if backend.graphs == MODULES:
        spec = port.static_spec(f"--backend {backend.name}")
        model = build_model(port, spec.decode_experts, dtype, checkpoint, **backend.formats)
        runtime = static_runtime(
            model,
            spec,
            compile=compile,
            progress=progress,
            prefix_caching=prefix_caching is not False,
            speculative=speculative,
        )
        return Engine(runtime, tokenizer, eos_ids(tokenizer, model.config))
    model = build_model(port, backend.experts, dtype, checkpoint, **backend.formats)
    return Engine(HFRuntime(model, rows or 1), tokenizer, eos_ids(tokenizer, model.config))
