"""Ctrl-C during trace-and-compile and prep-reader --tp: one line, exit 130, and their clean-up
done (no partial build beside --out, no lock, no folder the run made). SIGINT is sent by the process
to itself at fixed points of the work (`interrupting.py`), start-up included, so the tests do not
depend on timing."""

import pytest

from interrupting import assert_stopped, interrupted_run

TRACE = ["trace-and-compile", "--dry-run", "--tp", "1", "--dtype", "float32"]


@pytest.mark.parametrize(
    "where,inside",
    [
        ("import torch", ""),  # start-up: the command line parsed, torch importing
        ("neuron_moe.neuron.compile:checked", ""),  # after the first key's export
        ("neuron_moe.neuron.compile:checked", "weakref callback"),  # where Python would print it and run on
    ],
    ids=["start-up", "after an export", "in a weakref callback"],
)
def test_ctrl_c_during_trace_and_compile_is_one_line_and_leaves_nothing(tmp_path, where, inside):
    out = tmp_path / "art"
    done = interrupted_run([*TRACE, "--out", str(out)], where, inside)
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
