"""Every module, class, function and constant that docs/architecture.md names in backticks exists.

The page is the project's map; a name that was renamed in the code but not on the page sends a
reader to nothing. Each backticked name that looks like code is looked up in neuron_moe/ by an
`ast` walk (no imports: fast, and torch-free):

- a path (`static/rows.py`, `reader/`, `parallel/layout`) must be a module or package;
- a dotted name (`spec.Backend`, `static/rows.Rows.step`, `moe.COMPUTE`) must resolve attribute by
  attribute: modules, then their top-level names, then class members;
- a bare name (`Port`, `GraphRuntime`) must be defined where the page says: inside the parentheses
  right after a module (`spec.py` (`EXPERTS`, ...)) in that module; in a package's paragraph
  (**`static/`.** ...) in a top-level module, one of that package's own or one the paragraph named
  before it; elsewhere (the tables, the names) in any module.

Paths outside the package (`tests/layers.py`, `docker/entrypoint.sh`) must exist in the repository.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "neuron_moe"
PAGE = ROOT / "docs" / "architecture.md"

CODE = re.compile(r"[A-Za-z_]\w*(?:[./][A-Za-z_]\w*)*/?")  # flags, commands, globs and tables are not
REPOSITORY_DIRS = ("tests", "docker", "ports", "docs", "bench", "recipes")
NOT_OURS = {
    "ast",  # the standard library's
    "nn.Module",  # torch's
    "LLMEngine",  # nano-vllm's (the model of the serving engine)
    "snapshot_download",  # huggingface_hub's
    "NXD_SRC",  # an environment variable (parallel/nxd_source.py reads it)
    "LAZY_DISPATCH",  # tests/layers.py's
    "neuron_moe.ports",  # ports/, installed under the package by pyproject.toml's package-dir
    "layers",  # the word for `--tp-layers`' choice, not a name in the code
    "validate",  # a command
    "serve",  # a command (and the package serve/)
}


def _names(body: list[ast.stmt]) -> dict[str, dict]:
    """The names a module or class body defines, each with its own members (a class's), else {}."""
    names: dict[str, dict] = {}
    for node in body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = _names(node.body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = {}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = {}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: {} for a in node.names})
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", ()))):
                names.update(_names(block))
    return names


@functools.cache
def package_index(package: Path = PACKAGE) -> dict[str, dict]:
    """Every module of the package by dotted name ("" the package, "static.rows"): its namespace, a
    package's holding its submodules beside its __init__'s names."""
    modules: dict[str, dict] = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules.setdefault(dotted, {}).update(_names(ast.parse(path.read_text()).body))
    for dotted in sorted(modules, key=lambda d: -d.count(".")):
        if dotted:
            parent, _, leaf = dotted.rpartition(".")
            modules.setdefault(parent, {})[leaf] = modules[dotted]
    return modules


def _walk(namespace: dict, segments: list[str]) -> dict | None:
    """The namespace `segments` lead to from `namespace`, or None."""
    for segment in segments:
        if segment not in namespace:
            return None
        namespace = namespace[segment]
    return namespace


def _own_modules(modules: dict[str, dict], package: str) -> list[dict]:
    """The namespaces of the package and of its own modules (not its subpackages' modules)."""
    depth = package.count(".") + 1 if package else 0
    inside = [name for name in modules if not package or name.startswith(package + ".")]
    return [modules[package]] + [modules[name] for name in inside if name.count(".") == depth]


def _module_of(token: str, modules: dict[str, dict], section: str | None) -> str | None:
    """The dotted module a `.py` token names, read in `section`'s package first."""
    if not token.endswith(".py"):
        return None
    dotted = token.removesuffix(".py").replace("/", ".")
    return next((c for c in ([f"{section}.{dotted}"] if section else []) + [dotted] if c in modules), None)


def exists(name: str, modules: dict[str, dict], section: str | None, held: str | None, earlier: list[str]) -> bool:
    """Whether backticked `name` resolves. `section`: the package whose paragraph holds it (None
    outside the packages' paragraphs); `held`: the module whose parentheses hold it; `earlier`: the
    modules its paragraph named before it."""
    if name.split("/")[0] in REPOSITORY_DIRS or ("/" not in name and (ROOT / name).is_file()):
        return (ROOT / name).exists()
    if name == "neuron_moe/":
        return PACKAGE.is_dir()
    segments = re.split(r"[./]", name.removesuffix(".py").rstrip("/"))
    if name.endswith((".py", "/")):  # a path: a module or package, from the root or the section's package
        found = [_walk(modules[start], segments) for start in {"", section or ""}]
        return any(ns is not None and any(ns is m for m in modules.values()) for ns in found)
    if held is not None and len(segments) == 1:
        starts = [modules[held]]
    elif section is None:
        starts = list(modules.values())
    else:
        starts = [modules[""], *_own_modules(modules, section), *(modules[m] for m in earlier)]
    return any(_walk(start, segments) is not None for start in starts)


def named(text: str, modules: dict[str, dict]) -> list[tuple]:
    """Each backticked code-like name of `text`, with what `exists` reads it in: its paragraph's
    package, the module whose parentheses hold it, the modules its paragraph named before it."""
    found = []
    section, parens, earlier, last = None, [], [], ""  # parens: per open one, the module before it or ""
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            parens, earlier = [], []
            section = None if line.startswith("#") else section
        heading = re.match(r"\*\*`([\w/.]+)`", line)
        if heading:
            section = heading[1].removeprefix("neuron_moe/").removesuffix("/") if heading[1].endswith("/") else ""
        for index, piece in enumerate(re.split(r"`([^`]*)`", line)):
            if index % 2:
                held = next((p for p in reversed(parens) if p), None)
                if CODE.fullmatch(piece) and piece not in NOT_OURS:
                    found.append((piece, section, held, list(earlier)))
                module = _module_of(piece, modules, section)
                earlier += [module] if module else []
                last = piece
                continue
            for char in piece:
                if char == "(":
                    parens.append((_module_of(last, modules, section) or "") if last else "")
                elif char == ")" and parens:
                    parens.pop()
                if not char.isspace():
                    last = ""
    return found


def missing(text: str, modules: dict[str, dict]) -> list[str]:
    return [name for name, *where in named(text, modules) if not exists(name, modules, *where)]


def test_every_name_the_architecture_page_gives_exists():
    modules = package_index()
    names = named(PAGE.read_text(), modules)
    assert len(names) > 150, "the page's names were not read"
    wrong = missing(PAGE.read_text(), modules)
    assert not wrong, f"docs/architecture.md names what neuron_moe/ does not have: {wrong}"


def test_a_wrong_name_is_caught():
    modules = package_index()
    page = (
        "`spec.Selector`, `static/rows.Rows.nope`, `reader/nope.py`, `nope/`, `experts.NOPE`, `tests/nope.py`\n"
        "`spec.py` (`EXPERTS`, `SidecarLayout`)\n"
        "**`static/`.** `rows.py` (`Rows.step`, `GraphRuntime`), `Port`\n"
    )
    assert missing(page, modules) == [
        "spec.Selector",
        "static/rows.Rows.nope",
        "reader/nope.py",
        "nope/",
        "experts.NOPE",
        "tests/nope.py",
        "SidecarLayout",
        "Port",
    ]
