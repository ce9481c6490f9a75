"""Where neuronx-distributed (NxD) comes from when its layers run on CPU, in NxD's own CPU mode.

`--tp-layers nxd` runs the rank modules over NxD's real parallel-layer classes (`parallel/nxd.py`)
with `NXD_CPU_MODE=1`: NxD builds gloo groups and its mappings call torch.distributed instead of
torch-xla's collectives. NxD comes from, in this order:

- the installed `neuronx_distributed` (a Neuron box: the SDK's own package, imported as it is);
- else the source tree the environment variable NXD_SRC names: a checkout or unpacked archive of
  aws-neuron/neuronx-distributed, either its root (which holds `src/neuronx_distributed`) or its
  `src/` (which holds `neuronx_distributed`).

From a source tree, the packages `neuronx_distributed`, `.modules` and `.modules.moe` are registered
bare (their `__init__` not run: the top-level one imports kernels, tracing, pipeline and trainer,
some fifty Neuron-only modules), which leaves `parallel_layers`, `quantization` and
`modules.moe.moe_parallel_layers` importable. What those still import from the Neuron SDK is stood
in for here, minimally, and only for a package that is not installed: `torch_xla` (the reduce-op
names and an env-var name NxD reads at import), `torch_neuronx.utils.get_platform_target` (pinned to
"inf2": NeuronCore-v2), and `neuronxcc.nki` with the `CollectivesConfig` that
`initialize_model_parallel` constructs. A real package is never shadowed, and `libneuronxla` is never
stood in for (torch-xla takes an importable `libneuronxla` to mean it runs on Neuron). Any other
attribute of a stand-in raises, naming itself, so a Neuron-only call NxD's CPU mode reaches is an
error, never a silent no-op.

`activate` changes the process it runs in (environment, `sys.modules`): it is called in the forked
rank processes only, never in the process that parses, plans and compiles, so the Neuron SDK's
absence stays visible there (`nxd.sdk_available()`, `trace-and-compile`, `serve --backend neuron`).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

ENV = "NXD_SRC"
PACKAGE = "neuronx_distributed"
MISSING = (
    f"needs neuronx-distributed: install it (the Neuron SDK's package; docs/neuron.md) or set {ENV} to a "
    f"checkout of aws-neuron/neuronx-distributed (its root or its src/ directory)"
)
# source digest (`source_digest`) -> the public commit it is; checked against the git trees
KNOWN_SOURCES = {"b29398e883b73fa3": "fbac349 (Release 2.29)", "7ce5782b0e4827eb": "73ab227 (Release 2.28.0)"}
# modules that must not run their __init__ from a source tree (see the docstring)
_BARE = (PACKAGE, f"{PACKAGE}.modules", f"{PACKAGE}.modules.moe")


@dataclass(frozen=True)
class NxDSource:
    origin: str  # "installed" or ENV
    package: Path  # the neuronx_distributed directory
    version: str
    commit: str | None  # a git commit, or the release a known source digest is; None when unknown
    digest: str | None = None  # of a source tree's .py files (`source_digest`)
    root: Path | None = None  # what NXD_SRC names (the tree's root or its src/)

    def describe(self) -> str:
        where = "installed" if self.origin == "installed" else f"{ENV}={self.root}"
        what = self.commit or (f"source digest {self.digest}, not a known release" if self.digest else None)
        return f"neuronx-distributed {self.version} ({where}{'; ' + what if what else ''})"


def source_digest(package: Path) -> str:
    """16 hex digits of sha256 over the package's .py files (relative path and contents, sorted):
    names the tree when it is not a git checkout (an unpacked archive)."""
    h = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts):
        h.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _tree_package(root: Path) -> Path:
    for candidate in (root / "src" / PACKAGE, root / PACKAGE):
        if (candidate / "parallel_layers" / "layers.py").is_file():
            return candidate
    raise UserError(
        f"{ENV}={root}: no neuronx-distributed source there (expected {root / 'src' / PACKAGE} or "
        f"{root / PACKAGE}, with parallel_layers/layers.py)"
    )


def _version_of_tree(package: Path) -> str:
    try:
        found = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", (package / "_version.py").read_text())
    except OSError:
        found = None
    return found.group(1) if found else "unknown version"


def _git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"git {out.stdout.strip()}" if out.returncode == 0 and out.stdout.strip() else None


def locate() -> NxDSource | None:
    """The NxD a rank process would run, found without importing it; None when there is none."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        try:
            version = importlib.metadata.version("neuronx-distributed")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown version"
        return NxDSource("installed", Path(next(iter(spec.submodule_search_locations))), version, None)
    root = os.environ.get(ENV)
    if not root:
        return None
    root = Path(root).expanduser().resolve()
    package = _tree_package(root)
    digest = source_digest(package)
    commit = _git_commit(package.parent) or KNOWN_SOURCES.get(digest)
    return NxDSource(ENV, package, _version_of_tree(package), commit, digest, root)


def require() -> NxDSource:
    source = locate()
    if source is None:
        raise UserError(f"--tp-layers nxd {MISSING}")
    return source


class _StandIn(types.ModuleType):
    """A module standing in for an absent Neuron-only package: only the names given exist."""

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(
            f"{self.__name__}.{attr}: {self.__name__} is a neuron-moe stand-in for a Neuron-only "
            f"package (NxD's CPU mode reached a name it does not define)"
        )


class CollectivesConfig:
    """What `initialize_model_parallel` constructs from neuronxcc over the context-parallel replica
    groups: it reads each rank's ring-attention source/target pairs. Context parallelism is 1 here
    (`nxd.initialize_model_parallel`): every group is one rank, which has no ring."""

    def __init__(self, replica_groups):
        groups = [list(g) for g in replica_groups]
        if any(len(g) != 1 for g in groups):
            raise NotImplementedError(
                f"the CollectivesConfig stand-in covers context parallelism 1, got groups {groups}"
            )
        self.rank_src_tgt_pairs = {g[0]: [] for g in groups}


class _DeviceOnly:
    """A Neuron device kernel (or what launches one) that NxD imports or builds at module level and
    its CPU mode never calls: calling it, or indexing its launch grid, raises."""

    def __init__(self, name: str):
        self.name = name

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"{self.name}: a Neuron device kernel, stood in for on CPU (NxD's CPU mode called it)")

    __call__ = __getitem__ = _refuse


def _kernel_decorator(name: str):
    """`nki_jit(**flags)(kernel)`: the kernel as a _DeviceOnly."""
    return lambda *args, **kwargs: lambda kernel: _DeviceOnly(f"{name}({getattr(kernel, '__name__', kernel)})")


def _stand_ins() -> dict[str, dict]:
    """Module name -> its attributes, for the packages NxD's CPU-mode layers import at module level
    (fbac349; the torch_neuronx.xla_impl and neuronxcc.nki.* below them for 73ab227, Release 2.28.0,
    whose mappings build NKI collectives at import)."""
    return {
        "torch_xla": {},
        "torch_xla.core": {},
        "torch_xla.core.xla_model": {
            "REDUCE_SUM": "sum",
            "REDUCE_MAX": "max",
            "REDUCE_MIN": "min",
            "REDUCE_MUL": "mul",
            "REDUCE_AND": "and",
            "REDUCE_OR": "or",
        },
        "torch_xla.core.xla_env_vars": {"HOST_WORLD_SIZE": "XRT_HOST_WORLD_SIZE"},
        "torch_xla.runtime": {},
        "torch_xla.utils": {},
        "torch_xla.utils.serialization": {},
        "torch_neuronx": {},
        "torch_neuronx.utils": {"get_platform_target": lambda: "inf2"},
        "torch_neuronx.xla_impl": {},
        "torch_neuronx.xla_impl.ops": {"nki_jit": _kernel_decorator("torch_neuronx.xla_impl.ops.nki_jit")},
        "neuronxcc": {},
        "neuronxcc.nki": {},
        "neuronxcc.nki._pre_prod_kernels": {},
        "neuronxcc.nki._pre_prod_kernels.collectives": {"CollectivesConfig": CollectivesConfig},
        "neuronxcc.nki.nccl": {},
        "neuronxcc.nki.language": {},
        "neuronxcc.nki.compiler": {},
        "neuronxcc.nki.compiler.backends": {},
        "neuronxcc.nki.compiler.backends.neuron": {},
        "neuronxcc.nki.compiler.backends.neuron.dimensions": {
            "CCPipeline": _DeviceOnly("neuronxcc.nki.compiler.backends.neuron.dimensions.CCPipeline")
        },
    }


def _register(name: str, module: types.ModuleType) -> None:
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def stand_in_packages() -> list[str]:
    """The top-level packages `activate` stands in for here: those not installed."""
    tops = sorted({name.split(".")[0] for name in _stand_ins()})
    return [top for top in tops if top not in sys.modules and importlib.util.find_spec(top) is None]


def activate(source: NxDSource) -> list[str]:
    """Make this process run NxD's layers in its CPU mode (see the docstring: rank processes only).
    Returns the packages stood in for."""
    os.environ["NXD_CPU_MODE"] = "1"
    os.environ.setdefault("NXD_LOG_LEVEL", "warning")  # NxD logs its parallel state at info, per rank
    # NxD's own deprecated torch calls (torch.cuda.amp.autocast), not ours to fix
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"neuronx_distributed\.")
    absent = set(stand_in_packages())
    for name, attrs in _stand_ins().items():
        if name.split(".")[0] in absent:
            module = _StandIn(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            module.__path__ = []
            module.__dict__.update(attrs)
            module.__neuron_moe_stand_in__ = True
            _register(name, module)
    if source.origin == ENV:
        for name in _BARE:
            path = source.package.joinpath(*name.split(".")[1:])
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(path)]
            module = importlib.util.module_from_spec(spec)
            module.__path__ = [str(path)]
            _register(name, module)
    return sorted(absent)
