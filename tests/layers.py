"""The package's import graph, function-local imports included, and the layers it must respect
(docs/architecture.md): a module imports only its own layer and those below, no modules import
each other in a cycle, and an import inside a function is only for an optional dependency."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "neuron_moe"

# Lowest first. A module's layer is its longest prefix here.
LAYERS = (
    ("foundations", ("", "errors", "report", "config", "tokenizer")),  # "": the package's __init__
    (
        "definitions",
        (
            "spec",
            "run_config",
            "speculative",
            "port",
            "tasks",
            "checkpoint",
            "hub",
            "reader",
            "formats",
            "parallel.layout",
        ),
    ),
    ("modules", ("experts", "static", "parallel", "greedy", "quantize")),
    # The generators over a port's graphs build the port's model: workflows, not modules.
    (
        "workflows",
        (
            "model",
            "static.generator",
            "parallel.tp_generator",
            "parallel.rank_job",
            "parallel.nxd_generator",
            "neuron",
            "eval",
            "training",
            "publish",
            "verify",
            "info",
            "environment",
        ),
    ),
    ("surfaces", ("serve", "cli", "cli_parser", "__main__", "deploy")),
)


# Packages a user may not have (extras, the Neuron SDK): imported on first use, inside a function.
OPTIONAL = (
    "boto3",
    "botocore",
    "matplotlib",
    "triton",
    "fastapi",
    "uvicorn",
    "llguidance",
    "torch_neuronx",
    "neuronx_distributed",
    "neuronxcc",
    "nki",
)

# Modules whose functions import the package's own modules on purpose: the entry point, whose commands
# each import what they run when they run, so `--help` and a wrong flag answer without torch; and the
# script's, which sets its Ctrl-C handler before it imports the entry point.
LAZY_DISPATCH = ("cli", "__main__")


def layer_of(module: str) -> int:
    """The layer index of `module` (a dotted name below the package, "" for the package itself)."""
    best, found = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or (prefix and module.startswith(prefix + "."))) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise KeyError(f"neuron_moe.{module} is in no layer of tests/layers.py")
    return found


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted names below the package (without "neuron_moe.") -> file."""
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def parse(package: Path = PACKAGE) -> dict[str, tuple[Path, ast.AST]]:
    """Dotted name -> (file, syntax tree), every module read once."""
    return {name: (path, ast.parse(path.read_text(), str(path))) for name, path in modules(package).items()}


def _in_functions(tree: ast.AST) -> set[int]:
    """ids of the import statements inside a function."""
    return {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }


def imports(package: Path = PACKAGE, parsed: dict | None = None) -> list[tuple[str, str, int, bool]]:
    """(importer, imported, line, inside a function) for every import of one package module by another
    (`parsed`: the package's `parse`, when the caller has it already)."""
    known = parsed or parse(package)
    edges = []
    for name, (path, tree) in known.items():
        is_package = path.name == "__init__.py"
        local_ids = _in_functions(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = name.split(".") if name else []
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" if target else a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("neuron_moe"):
                target = node.module.removeprefix("neuron_moe").lstrip(".")
                names = [f"{target}.{a.name}" if target else a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [
                    a.name.removeprefix("neuron_moe").lstrip(".") for a in node.names if a.name.startswith("neuron_moe")
                ]
                target = None
            else:
                continue
            local = id(node) in local_ids
            for full in names:
                imported = full if full in known else target  # `from pkg import module` or a name in pkg
                if imported is not None and imported in known and imported != name:
                    edges.append((name, imported, node.lineno, local))
    return edges


def _top_level_packages(tree: ast.AST) -> set[str]:
    """The outside packages a module imports at its top (not inside a function)."""
    local_ids = _in_functions(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in local_ids:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def needless_local_imports(package: Path = PACKAGE) -> list[str]:
    """Imports inside a function that are not of an OPTIONAL package, nor of a package module that
    imports one at its top (the one lazy step that keeps the dependency optional), one line each;
    the LAZY_DISPATCH modules' own are theirs by design."""
    parsed = parse(package)
    optional_modules = {name for name, (_, tree) in parsed.items() if _top_level_packages(tree) & set(OPTIONAL)}
    package_edges: dict[tuple[str, int], set[str]] = {}  # every module one local import statement names
    for a, b, line, local in imports(package, parsed):
        if local:
            package_edges.setdefault((a, line), set()).add(b)
    out = []
    for name, (_, tree) in parsed.items():
        if name in LAZY_DISPATCH:
            continue
        local_ids = _in_functions(tree)
        for node in ast.walk(tree):
            if id(node) not in local_ids:
                continue
            if isinstance(node, ast.Import):
                tops = {a.name.split(".")[0] for a in node.names}
            elif node.level or (node.module or "").startswith("neuron_moe"):
                imported = package_edges.get((name, node.lineno), set())
                if imported and imported <= optional_modules:
                    continue
                tops = {f"neuron_moe.{m}" for m in imported - optional_modules} or {"neuron_moe.?"}
            else:
                tops = {node.module.split(".")[0]}
            if not tops <= set(OPTIONAL):
                out.append(f"{name} line {node.lineno}: {', '.join(sorted(tops))} inside a function")
    return out


def upward(edges) -> list[str]:
    """Imports of a higher layer than the importer's, one line each."""
    return [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]}) at line {line}"
        + (" inside a function" if local else "")
        for a, b, line, local in edges
        if layer_of(b) > layer_of(a)
    ]


def cycles(edges) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out
