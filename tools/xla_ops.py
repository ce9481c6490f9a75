"""The XLA op allow-list, `neuron_moe/static/xla_lowered_ops.txt`, from a result of the XLA check.

    python -m tools.xla_ops [RESULT ...] [--out FILE]   # RESULT: bench/results/xla-check.json (`make xla-ops`)

The XLA check (`make xla-check`: `python -m bench.xla_check` in .venv-xla) runs the static graphs on
XLA:CPU and records in its JSON the ops of the exported programs. Once every run of it passed (each
graph one compilation, no aten fallback, the CPU's tokens), those ops are known to lower, and the
normal test suite, which has no torch-xla, fails a graph that calls any other
(`neuron_moe.static.ops_not_lowered`). This writes them, the result they came from named in the
file's header; it refuses a result with a failed run, or one that records no ops. After a change
that adds an op: `make xla-check` (it reports the op missing), `make xla-ops`, `make xla-check`.
Several results make the list of their ops together: a run of the check alone (`--only new`, its own
OUT) beside the full check's, e.g. `python -m tools.xla_ops bench/results/xla-check-formats.json
bench/results/xla-check-new.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neuron_moe.errors import UserError
from neuron_moe.report import atomic_write, read_json_object
from neuron_moe.static import XLA_LOWERED_OPS_FILE

RESULT = Path("bench/results/xla-check.json")


def vouched(result: dict, source: str) -> tuple[list[str], list[str]]:
    """The ops and graphs an XLA check result records (`source`: where it was read, for the errors); a
    UserError where the result cannot vouch for its ops."""
    runs = result.get("runs") or []
    if not runs:
        raise UserError(f"{source}: no runs: not a result of the XLA check")
    failed = [run.get("run", "?") for run in runs if run.get("passed") is not True]
    if failed:
        raise UserError(
            f"{source}: not every run lowered cleanly (failed: {'; '.join(failed)}), so its ops are not known to lower"
        )
    ops, graphs = result.get("exported_ops"), result.get("exported_graphs")
    if not ops or not graphs:
        raise UserError(f"{source}: no exported_ops / exported_graphs recorded: run the check again (`make xla-check`)")
    return ops, graphs


def allow_list(result: dict, source: str) -> str:
    """The allow-list's text from an XLA check result (`source`: where it was read, for the header and
    the errors)."""
    return allow_list_of([(result, source)])


def allow_list_of(results: list[tuple[dict, str]]) -> str:
    """The allow-list's text from several results (result, where it was read), each vouching for its
    own ops: their union (a run of the check alone, `--only`, beside the full check's result)."""
    ops, graphs = set(), set()
    for result, source in results:
        more_ops, more_graphs = vouched(result, source)
        ops.update(more_ops)
        graphs.update(more_graphs)
    sources = ", ".join(source for _, source in results)
    envs = ", ".join(
        dict.fromkeys(
            f"{r.get('code', '?')}; torch {r.get('environment', {}).get('torch', '?')}, "
            f"torch-xla {r.get('environment', {}).get('torch_xla', '?')}"
            for r, _ in results
        )
    )
    return (
        f"# Ops of the exported static graphs ({', '.join(sorted(graphs))}) that lowered on XLA:CPU with no\n"
        f"# aten fallback and one compilation per graph. Written by `python -m tools.xla_ops` from {sources}\n"
        f"# ({envs}); do not edit by hand.\n" + "".join(f"{op}\n" for op in sorted(ops))
    )


def ops_of(text: str) -> list[str]:
    """The ops an allow-list names (its `#` lines are comments), as `neuron_moe.static` reads them."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "result",
        nargs="*",
        default=[str(RESULT)],
        help=f"the check's JSON (default {RESULT}); several: the union of their ops, each result's runs all passed",
    )
    parser.add_argument(
        "--out",
        default=str(XLA_LOWERED_OPS_FILE),
        help="the allow-list to write (default: the package's, where the tests read it)",
    )
    args = parser.parse_args(argv)
    results = [
        (read_json_object(Path(path), UserError, f"{path}: no such file (run `make xla-check`)"), path)
        for path in args.result
    ]
    text = allow_list_of(results)
    out = Path(args.out)
    before = set(ops_of(out.read_text())) if out.is_file() else set()
    with atomic_write(out) as f:
        f.write(text)
    ops = ops_of(text)
    added, removed = sorted(set(ops) - before), sorted(before - set(ops))
    print(
        f"wrote {out}: {len(ops)} ops"
        + (f"; added {', '.join(added)}" if added else "")
        + (f"; removed {', '.join(removed)}" if removed else "")
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        sys.exit(f"error: {e}")
