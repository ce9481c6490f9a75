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

A kernel of the cache cut short (a disk that filled up, a copy stopped midway) would fail to load,
or crash the process that maps it: `use_cache_dir` removes each one, with one warning line, and
inductor builds it again from its source at its first use. A compile that the full disk of the cache
refuses is one error line naming the cache (`CompileError`), not torch's traceback.

Inductor's CPU code is C++, built by the compiler it finds (`$CXX`, else g++): without one there is
nothing to compile with, which `require_compiler` says before anything loads.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._inductor import cpp_builder
from torch._inductor.codecache import LOCK_TIMEOUT
from torch._inductor.exc import InvalidCxxCompiler
from torch.utils._filelock import FileLock

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
    drop_cut_kernels(path)
    return path


# a write refused for want of room: the errors a full cache reports (an OSError's errno, or a C++ compiler's words)
_FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded", errno.EFBIG: "File too large"}


def _whole_elf(path: Path) -> bool:
    """Whether `path` is a whole 64-bit ELF file (what inductor builds its kernels as): its header,
    its program and section header tables, and every segment it loads, within the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
            return False
        order = "<" if head[5] == 1 else ">"
        phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
        if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size or phentsize < 40:
            return False
        f.seek(phoff)
        for _ in range(phnum):
            entry = f.read(phentsize)
            (kind,) = struct.unpack_from(order + "I", entry)
            offset, filesz = struct.unpack_from(order + "Q16xQ", entry, 8)  # p_offset, p_filesz
            if kind == 1 and offset + filesz > size:  # PT_LOAD
                return False
    return True


def drop_cut_kernels(cache: Path) -> list[Path]:
    """Remove each compiled kernel (`*.so`) of inductor's cache `cache` that is not a whole ELF file,
    each under inductor's own lock of it (a process compiling it now is waited for), and say so in
    one warning line. Inductor builds a kernel it finds missing again from its source, kept beside it."""
    dropped = []
    for kernel in sorted(cache.rglob("*.so")):
        (cache / "locks").mkdir(exist_ok=True)
        with FileLock(str(cache / "locks" / f"{kernel.name.split('.')[0]}.lock"), timeout=LOCK_TIMEOUT):
            if kernel.is_file() and not _whole_elf(kernel):
                kernel.unlink()
                dropped.append(kernel)
    if dropped:
        log.warning(
            "compile cache %s: %d compiled kernel%s cut short (%s) removed; compiled again where used",
            cache,
            len(dropped),
            "s" if len(dropped) > 1 else "",
            ", ".join(str(k.relative_to(cache)) for k in dropped),
        )
    return dropped


def _drop_own_temp_files() -> None:
    """The temp files this process's writes into the cache left when the disk refused them
    (inductor writes a file as `.PID.THREAD.tmp`, then renames it, and leaves the temp file when
    the write fails)."""
    cache = os.environ.get(CACHE_ENV)
    if cache:
        for tmp in Path(cache).rglob(f".{os.getpid()}.*.tmp"):
            tmp.unlink(missing_ok=True)


def _full_disk(e: BaseException) -> str | None:
    """The words of a full disk (or quota, or file size limit) behind a failed compile, if one is:
    an OSError somewhere in its chain of causes, or a C++ compiler's message that says so."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return f"cannot write {e.filename}: {e.strerror}" if e.filename else e.strerror
        found = next((words for words in _FULL.values() if words in str(e)), None)
        if found is not None:
            return found
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return None


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
        try:
            with torch._dynamo.config.patch(recompile_limit=SHAPES_PER_GRAPH, fail_on_recompile_limit_hit=True):
                out = self.compiled(*inputs)
        except Exception as e:
            full = _full_disk(e)
            if full is None:
                raise
            _drop_own_temp_files()
            raise CompileError(
                f"compiling the {self.name} graph into the compile cache {os.environ.get(CACHE_ENV)}: {full}"
            ) from None
        self.shapes.add(shape)
        if self.progress is not None:
            found = counters["inductor"]
            cached = found["fxgraph_cache_hit"] > hits and found["fxgraph_cache_miss"] == misses
            rows, tokens = (*shape[0], 1)[:2]  # a first input [B] (the draft graph's last ids): one token a row
            self.progress(
                f"compiled the {self.name} graph ({rows} rows x {tokens} tokens) in "
                f"{time.perf_counter() - started:.1f} s ({'from the compile cache' if cached else 'compiled anew'})"
            )
        return out
