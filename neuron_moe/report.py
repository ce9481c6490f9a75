"""Plain-text tables, `--json FILE` output, and reading the project's own JSON files."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def table(rows: list[dict[str, Any]], columns: list[tuple], markdown: bool = False) -> str:
    """columns: (key, header) or (key, header, format); floats default to 4 significant digits.
    `markdown`: a pipe table instead of aligned text."""

    def cell(v, fmt):
        if v is None:
            return "-"
        if fmt:
            return fmt.format(v)
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    fmts = [c[2] if len(c) > 2 else None for c in columns]
    grid = [[c[1] for c in columns]] + [[cell(r.get(c[0]), f) for c, f in zip(columns, fmts)] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(line) + " |" for line in grid]
        lines.insert(1, "|" + "---|" * len(columns))
        return "\n".join(lines)
    widths = [max(len(line[i]) for line in grid) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in grid]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@contextmanager
def atomic_write(path: Path, mode: str = "w"):
    """Open a temp file in path's folder (creating the folder), yield it, then rename it onto
    path; on any failure the temp file is removed and path is untouched. The file gets the mode a
    plain open() would give it (mkstemp's own is 0600: results unreadable by anyone else)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(obj: Any, dest: str) -> None:
    """'-' is stdout; a path is written atomically (temp file in the same folder, then rename)."""
    text = json.dumps(obj, indent=2, sort_keys=False) + "\n"
    if dest == "-":
        sys.stdout.write(text)
        return
    with atomic_write(Path(dest)) as f:
        f.write(text)


def read_json_object(path: Path, error: type[Exception], missing: str) -> dict:
    """A JSON file that must hold an object; `error(message)` names the file and the problem."""
    if not path.is_file():
        raise error(missing)
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object")
    return raw
