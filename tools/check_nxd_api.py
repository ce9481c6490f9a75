"""Check neuron_moe.parallel.nxd.NXD_API against a checkout of aws-neuron/neuronx-distributed.

    python -m tools.check_nxd_api /path/to/neuronx-distributed

For every name in the table: the file it names defines it (a class, a function, a method, or a
class attribute such as an enum member), and every keyword we pass is a parameter of it (of
`__init__` for a class). Reads the source with `ast`; imports nothing from it. Exit 1 on any miss.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from neuron_moe.parallel.nxd import NXD_API, NXD_SOURCE


def _params(fn: ast.FunctionDef) -> set[str]:
    a = fn.args
    return {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}


def _member(body: list, name: str):
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.If):  # e.g. QuantizedDtype's members defined under a version check
            found = _member(node.body + node.orelse, name)
            if found is not None:
                return found
    return None


def check(src: Path) -> list[str]:
    problems = []
    for dotted, (path, kwargs) in NXD_API.items():
        file = src / path
        module_path = ".".join(
            Path(path).with_suffix("").parts[1:]
        )  # src/neuronx_distributed/x.py -> neuronx_distributed.x
        if not dotted.startswith(module_path + "."):
            problems.append(f"{dotted}: not in module {module_path} ({path})")
            continue
        if not file.is_file():
            problems.append(f"{dotted}: {path} does not exist")
            continue
        node, body = None, ast.parse(file.read_text()).body
        for part in dotted[len(module_path) + 1 :].split("."):
            node = _member(body, part)
            if node is None:
                break
            body = node.body if isinstance(node, ast.ClassDef) else []
        if node is None:
            problems.append(f"{dotted}: not defined in {path}")
            continue
        if kwargs is None:
            continue
        fn = node if isinstance(node, ast.FunctionDef) else _member(node.body, "__init__")
        if fn is None:
            problems.append(f"{dotted}: no __init__ in {path}")
            continue
        missing = sorted(set(kwargs) - _params(fn))
        if missing and fn.args.kwarg is None:
            problems.append(f"{dotted}: no parameter(s) {missing} in {path}:{fn.lineno}")
    return problems


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    problems = check(Path(sys.argv[1]))
    for p in problems:
        print("MISSING", p)
    print(
        f"{len(NXD_API) - len(problems)}/{len(NXD_API)} NxD names verified in {sys.argv[1]} "
        f"(table written against {NXD_SOURCE})"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
