"""tools/xla_ops.py: the XLA op allow-list written from the XLA check's JSON (which needs torch-xla, so
the results here are made by hand in the check's format): exactly the ops it recorded, read back by
the package as its allow-list; nothing written from a result with a failed run or without the ops."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_moe import static
from neuron_moe.errors import UserError
from tools import xla_ops

ROOT = Path(__file__).resolve().parents[1]
OPS = ["aten.add.Tensor", "aten.index_copy.default", "<built-in function getitem>"]


def result(**changes) -> dict:
    """An XLA check result in the format bench.xla_check writes, every run passed."""
    out = {
        "code": "bench 1234567",
        "environment": {"torch": "2.9.0+cu128", "torch_xla": "2.9.0"},
        "runs": [{"run": "exported, dense_masked prefill", "passed": True}, {"run": "serving", "passed": True}],
        "exported_graphs": ["dense_masked/selective decode", "serving decode"],
        "exported_ops": OPS[::-1],
    }
    return out | changes


def test_the_recorded_ops_become_the_list_the_package_reads(tmp_path, monkeypatch):
    out = tmp_path / "xla_lowered_ops.txt"
    (tmp_path / "r.json").write_text(json.dumps(result()))
    assert xla_ops.main([str(tmp_path / "r.json"), "--out", str(out)]) == 0
    text = out.read_text()
    assert [line for line in text.splitlines() if not line.startswith("#")] == sorted(OPS)
    header = "".join(line for line in text.splitlines() if line.startswith("#"))
    assert "dense_masked/selective decode, serving decode" in header and "bench 1234567" in header
    assert "torch-xla 2.9.0" in header and str(tmp_path / "r.json") in header
    monkeypatch.setattr(static, "XLA_LOWERED_OPS_FILE", out)
    assert static.xla_lowered_ops() == frozenset(OPS)


def test_several_results_make_the_list_of_their_ops_together_each_vouching_for_its_own(tmp_path):
    """A run of the check alone (`--only new`) beside the full check's result: the union of their ops,
    both named in the header; a failed run in either refuses the whole list."""
    out = tmp_path / "xla_lowered_ops.txt"
    (tmp_path / "full.json").write_text(json.dumps(result()))
    new = result(runs=[{"run": "new", "passed": True}], exported_graphs=["new verify"], exported_ops=["aten.ne.Tensor"])
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert xla_ops.main([str(tmp_path / "full.json"), str(tmp_path / "new.json"), "--out", str(out)]) == 0
    text = out.read_text()
    assert xla_ops.ops_of(text) == sorted([*OPS, "aten.ne.Tensor"])
    assert f"{tmp_path / 'full.json'}, {tmp_path / 'new.json'}" in text and "new verify" in text
    new["runs"] = [{"run": "new", "passed": False}]
    (tmp_path / "new.json").write_text(json.dumps(new))
    with pytest.raises(UserError, match=r"new.json: not every run lowered cleanly \(failed: new\)"):
        xla_ops.main([str(tmp_path / "full.json"), str(tmp_path / "new.json"), "--out", str(out)])
    assert xla_ops.ops_of(out.read_text()) == sorted([*OPS, "aten.ne.Tensor"])


def test_the_committed_list_is_what_the_tool_would_write_from_its_ops():
    """The committed allow-list round-trips: its ops, recorded as a result's, come back unchanged."""
    committed = static.XLA_LOWERED_OPS_FILE.read_text()
    ops = xla_ops.ops_of(committed)
    assert xla_ops.ops_of(xla_ops.allow_list(result(exported_ops=ops), "r.json")) == ops == sorted(ops)
    assert frozenset(ops) == static.xla_lowered_ops()


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            {"runs": [{"run": "exported, dense_masked prefill", "passed": True}, {"run": "serving", "passed": False}]},
            r"not every run lowered cleanly \(failed: serving\)",
        ),
        ({"runs": []}, "no runs: not a result of the XLA check"),
        ({"exported_ops": []}, "no exported_ops / exported_graphs recorded"),
    ],
)
def test_a_result_that_cannot_vouch_for_its_ops_is_refused(changes, message):
    with pytest.raises(UserError, match=message):
        xla_ops.allow_list(result(**changes), "r.json")


def test_the_command_writes_nothing_from_a_failed_run_and_says_why(tmp_path):
    out = tmp_path / "xla_lowered_ops.txt"
    out.write_text("# before\naten.add.Tensor\n")
    bad = result(runs=[{"run": "serving", "passed": False}])
    (tmp_path / "r.json").write_text(json.dumps(bad))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tools.xla_ops", str(tmp_path / "r.json"), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'r.json'}: not every run lowered cleanly "
        "(failed: serving), so its ops are not known to lower"
    ]
    assert out.read_text() == "# before\naten.add.Tensor\n"
    (tmp_path / "r.json").write_text(json.dumps(result()))
    done = subprocess.run(
        [sys.executable, "-m", "tools.xla_ops", str(tmp_path / "r.json"), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (f"wrote {out}: 3 ops; added <built-in function getitem>, aten.index_copy.default")
