"""Test helper: `neuron-moe ARGS` as its script runs it (`neuron_moe.__main__`), sent SIGINT by
itself at a chosen point, so that where the signal lands does not depend on timing: as the first
`import NAME` starts (start-up: the command line parsed, its imports under way), or once a function
returns (its module's attribute, looked up at each call), or inside a weakref callback that runs
there, as the garbage collector runs them anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STOPPED = "error: interrupted (Ctrl-C): neuron-moe {} stopped"

INTERRUPTING = r"""
import importlib, os, signal, sys, weakref
where, inside = sys.argv[1], sys.argv[2]
sys.argv[1:3] = []

def interrupt():
    if inside == "weakref callback":
        class Referent:
            pass
        referent = Referent()
        ref = weakref.ref(referent, lambda _: signal.raise_signal(signal.SIGINT))
        del referent  # collected at once: the signal arrives inside the callback
    else:
        os.kill(os.getpid(), signal.SIGINT)

if where.startswith("import "):
    class Finder:
        def find_spec(self, fullname, path=None, target=None):
            if fullname == where.split()[1]:
                sys.meta_path.remove(self)
                interrupt()
            return None
    sys.meta_path.insert(0, Finder())
else:
    module, name = where.split(":")
    module = importlib.import_module(module)
    original = getattr(module, name)
    def then_interrupt(*args, **kwargs):
        result = original(*args, **kwargs)
        interrupt()
        return result
    setattr(module, name, then_interrupt)

from neuron_moe.__main__ import main
sys.exit(main())
"""


def interrupted_run(args: list[str], where: str, inside: str = "", env: dict | None = None):
    """`neuron-moe ARGS`, SIGINT sent as `where` says: "import NAME" or "MODULE:FUNCTION";
    `inside` "weakref callback": sent from inside one."""
    return subprocess.run(
        [sys.executable, "-c", INTERRUPTING, where, inside, *args],
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def assert_stopped(done, command: str) -> None:
    """Exit 130 and one line, the last, naming the command; no traceback, no 'Exception ignored'."""
    assert done.returncode == 130, done.stderr[-3000:]
    lines = done.stderr.splitlines()  # progress bars, then the one line
    assert lines[-1] == STOPPED.format(command), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]
    assert sum("error" in line for line in lines) == 1, done.stderr[-3000:]
