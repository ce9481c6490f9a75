"""The static graphs compiled for the CPU by torch.compile (inductor): C++ kernels of fused ops in
place of PyTorch's dispatch of one op at a time.

Each graph (a `Prefill` or `Decode` module, `decoder.py`) is compiled whole (`fullgraph=True`: a
graph break would run Python between two parts of a step) for the shapes it is called with
(`dynamic=False`: every shape of the graphs is fixed, and each prefill row count x bucket is a graph
of its own, compiled at its first call; the server's warm-up makes every one). The KV cache stays
module state: the compiled graph takes its buffers as inputs and writes the new state into those
same tensors, so the prefill and decode graphs still share one cache.

A compile takes tens of seconds per graph; inductor keeps what it compiled on disk (its FX graph
cache and AOTAutograd cache, under TORCHINDUCTOR_CACHE_DIR: `use_cache_dir`), so a process that
compiles the same graphs again loads the kernels instead (dynamo still traces each graph, a few
seconds). The cache is keyed on the graph, torch's version and the machine's compiler and CPU; a
changed model or shape compiles anew beside what is there.

Inductor's CPU code is C++, built by the compiler it finds (`$CXX`, else g++): without one there is
nothing to compile with, which `require_compiler` says before anything loads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._inductor import cpp_builder
from torch._inductor.exc import InvalidCxxCompiler

from ..errors import UserError

log = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # where inductor keeps its caches (torch._inductor.runtime.cache_dir_utils)
# Compiled shapes a graph may hold before dynamo would run it uncompiled: every prefill row count x
# bucket of a runtime, and more runtimes in one process (a benchmark's batch sizes). Past it a call fails
# (`fail_on_recompile_limit_hit`) instead of falling back to the modules unsaid.
SHAPES_PER_GRAPH = 64


class CompileError(UserError):
    pass


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build its CPU kernels with (its own search: `$CXX` or g++,
    `torch._inductor.cpp_builder.get_cpp_compiler`), or None when it finds none that runs."""
    try:
        return cpp_builder.get_cpp_compiler()
    except InvalidCxxCompiler:
        return None


def require_compiler(opt_out: str = "--no-compile") -> str:
    """The C++ compiler, or a CompileError naming what is missing and `opt_out`, the flag that runs
    the graphs uncompiled."""
    compiler = cpp_compiler()
    if compiler is None:
        raise CompileError(
            "compiling the static graphs (torch.compile, inductor) needs a C++ compiler and none runs here "
            f"($CXX or g++): install one (e.g. apt-get install g++) or pass {opt_out}"
        )
    return compiler


def use_cache_dir(directory: str | Path) -> Path:
    """Make `directory` (created if missing) inductor's cache for this process: TORCHINDUCTOR_CACHE_DIR,
    read at each compile. A directory that cannot be written is a CompileError naming it."""
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CompileError(f"--compile-cache {directory}: cannot create it: {e.strerror or e}") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise CompileError(f"--compile-cache {directory}: not a directory this process can write")
    os.environ[CACHE_ENV] = str(path)
    return path


class CompiledGraph:
    """A static graph module compiled by torch.compile (inductor), called as the module is. The first
    call of each input shape compiles (or loads from the cache) and says so through `progress`: the
    graph, its shape, the seconds, and whether inductor's cache held it."""

    def __init__(self, module: torch.nn.Module, name: str, progress: Callable[[str], None] | None = None):
        self.module, self.name, self.progress = module, name, progress
        # transformers' Gemma-4 decoder makes the rotary embeddings of each layer type in the order of a
        # set of strings, which follows the process's hash seed: so would the traced graph and inductor's
        # cache key, and a restart would miss the cache half the time. The graph's view of the decoder
        # (its own shallow copy: `experts/view.py`) takes them sorted.
        decoder = module.model.model
        if isinstance(getattr(decoder, "unique_layer_types", None), (set, frozenset)):
            decoder.unique_layer_types = sorted(decoder.unique_layer_types)
        self.compiled = torch.compile(module, backend="inductor", fullgraph=True, dynamic=False)
        self.shapes: set[tuple] = set()  # the input shapes compiled so far

    def __call__(self, *inputs):
        shape = tuple(tuple(x.shape) for x in inputs)
        if shape in self.shapes:
            return self.compiled(*inputs)
        hits, misses = (counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss"))
        started = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=SHAPES_PER_GRAPH, fail_on_recompile_limit_hit=True):
            out = self.compiled(*inputs)
        self.shapes.add(shape)
        if self.progress is not None:
            found = counters["inductor"]
            cached = found["fxgraph_cache_hit"] > hits and found["fxgraph_cache_miss"] == misses
            self.progress(
                f"compiled the {self.name} graph ({shape[0][0]} rows x {shape[0][1]} tokens) in "
                f"{time.perf_counter() - started:.1f} s ({'from the compile cache' if cached else 'compiled anew'})"
            )
        return out
