"""Ctrl-C during trace-and-compile and prep-reader --tp: one line, exit 130, and their clean-up
done (no partial build beside --out, no lock, no folder the run made). SIGINT is sent by the process
to itself at fixed points of the work (`interrupting.py`), start-up included, so the tests do not
depend on timing. And a signal during serve's warm-up stops it."""

import os
import signal
import subprocess
import sys

import pytest

from interrupting import REPO, assert_stopped, interrupted_run

TRACE = ["trace-and-compile", "--dry-run", "--tp", "1", "--dtype", "float32"]
TRACE_TP2_INT4 = ["trace-and-compile", "--dry-run", "--tp", "2", "--quantization", "int4"]


@pytest.mark.parametrize(
    "args,where,inside",
    [
        (TRACE, "import torch", ""),  # start-up: the command line parsed, torch importing
        (TRACE, "neuron_moe.neuron.compile:checked", ""),  # after the first key's export
        # where Python would print it as 'Exception ignored' and run on, the artifact written
        (TRACE_TP2_INT4, "neuron_moe.neuron.compile:checked", "weakref callback"),
    ],
    ids=["start-up", "after an export", "in a weakref callback"],
)
def test_ctrl_c_during_trace_and_compile_is_one_line_and_leaves_nothing(tmp_path, args, where, inside):
    out = tmp_path / "art"
    done = interrupted_run([*args, "--out", str(out)], where, inside)
    assert_stopped(done, "trace-and-compile")
    assert list(tmp_path.iterdir()) == []  # no --out, no .art.partial-*, no .art.lock


@pytest.mark.parametrize(
    "where",
    ["import torch", "neuron_moe.reader.prep:prep_layer", "neuron_moe.reader.shard:stream_layers"],
    ids=["start-up", "after a layer's prep", "after the first shard"],
)
def test_ctrl_c_during_prep_reader_tp_is_one_line_and_leaves_nothing(tmp_path, where):
    done = interrupted_run(["prep-reader", "--tp", "2", "--out", str(tmp_path / "reader")], where)
    assert_stopped(done, "prep-reader")
    assert list(tmp_path.iterdir()) == []  # not the folder it made, nor a file in it


@pytest.mark.parametrize(
    "signum,when",
    [
        (signal.SIGTERM, "Application startup complete"),  # the model loading, its warm-up not begun
        (signal.SIGTERM, "warm-up 1/"),  # the first graph compiling
        (signal.SIGINT, "warm-up 1/"),
    ],
    ids=["SIGTERM at start-up", "SIGTERM in the warm-up", "SIGINT in the warm-up"],
)
def test_a_signal_during_serves_warm_up_stops_it(tmp_path, signum, when):
    """`serve --backend static` told to exit while it warms up (minutes of compiling, a graph at a
    time) stops the warm-up and exits 0, as a drained server does: it does not compile on, turn
    ready, and only then exit. The log line the signal waits for is read first, so where the signal
    lands does not depend on timing; the warm-up takes minutes, the stop a moment."""
    argv = [sys.executable, "-m", "neuron_moe", "serve", "--backend", "static", "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*argv, "--compile-cache", str(tmp_path / "cache")], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if when in line:
                break
        proc.send_signal(signum)
        log = "".join(seen) + proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, log[-3000:]
    assert "its warm-up was stopped" in log and "model ready" not in log and "warmed up in" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
