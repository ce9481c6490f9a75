"""A Dockerfile read as (INSTRUCTION, arguments) pairs: continuations joined, comments dropped."""

from __future__ import annotations

from pathlib import Path

DOCKER = Path(__file__).resolve().parents[1] / "docker"


def instructions(path: Path) -> list[tuple[str, str]]:
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    ins = instructions(path)
    last_from = max(i for i, (k, _) in enumerate(ins) if k == "FROM")
    return ins[last_from:]
