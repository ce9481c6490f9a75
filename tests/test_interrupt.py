"""Ctrl-C during trace-and-compile: one line, exit 130, and its clean-up done (no partial build
beside --out, no lock). SIGINT is sent by the process to itself at a fixed point of the work (after
the first key's export), so the test does not depend on timing."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

INTERRUPTED_AFTER_THE_FIRST_EXPORT = """
import os, signal, sys
from neuron_moe import cli
from neuron_moe.neuron import compile as compile_
checked = compile_.checked
def check_then_interrupt(*args):
    checked(*args)
    os.kill(os.getpid(), signal.SIGINT)
compile_.checked = check_then_interrupt
sys.exit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_during_trace_and_compile_is_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "art"
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_AFTER_THE_FIRST_EXPORT]
        + ["trace-and-compile", "--dry-run", "--tp", "1", "--dtype", "float32", "--out", str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 130, done.stderr[-3000:]
    lines = done.stderr.splitlines()  # progress bars, then the one line
    assert lines[-1] == "error: interrupted (Ctrl-C): neuron-moe trace-and-compile stopped", done.stderr[-3000:]
    assert "Traceback" not in done.stderr and sum("error" in line for line in lines) == 1
    assert list(tmp_path.iterdir()) == []  # no --out, no .art.partial-*, no .art.lock
