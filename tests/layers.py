"""The package's import graph, function-local imports included, and the layers it must respect
(docs/architecture.md): a module imports only its own layer and those below, and no modules
import each other in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "neuron_moe"

# Lowest first. A module's layer is its longest prefix here.
LAYERS = (
    ("foundations", ("", "errors", "report", "config", "tokenizer")),  # "": the package's __init__
    ("definitions", ("port", "ports", "checkpoint", "reader", "parallel.layout")),
    ("modules", ("experts", "static", "parallel", "generate")),
    # The generate loops over a port's graphs build the port's model: workflows, not modules.
    ("workflows", ("model", "static.generate", "parallel.generate", "neuron", "eval", "training", "publish",
                   "info")),
    ("surfaces", ("serve", "cli", "cli_parser", "__main__")),
)


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


def imports(package: Path = PACKAGE) -> list[tuple[str, str, int, bool]]:
    """(importer, imported, line, inside a function) for every import of one package module by another."""
    known = modules(package)
    edges = []
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
                names = [a.name.removeprefix("neuron_moe").lstrip(".") for a in node.names
                         if a.name.startswith("neuron_moe")]
                target = None
            else:
                continue
            local = node.col_offset > 0
            for full in names:
                imported = full if full in known else target  # `from pkg import module` or a name in pkg
                if imported is not None and imported in known and imported != name:
                    edges.append((name, imported, node.lineno, local))
    return edges


def upward(edges) -> list[str]:
    """Imports of a higher layer than the importer's, one line each."""
    return [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]}) at line {line}"
            + (" inside a function" if local else "")
            for a, b, line, local in edges if layer_of(b) > layer_of(a)]


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
