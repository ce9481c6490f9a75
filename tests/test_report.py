"""`report.write_json`: atomic, and the file gets the mode a plain open() would give it."""

import json
import os
import stat

import pytest

from neuron_moe.report import write_json


@pytest.fixture
def restore_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_write_json_gives_the_file_the_umask_mode(tmp_path, restore_umask, mask, mode):
    """mkstemp's temp file is 0600 whatever the umask; the renamed result must not stay so."""
    os.umask(mask)
    out = tmp_path / "sub" / "r.json"
    write_json({"a": 1}, str(out))
    assert json.loads(out.read_text()) == {"a": 1}
    assert stat.S_IMODE(out.stat().st_mode) == mode
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]  # no temp file left
