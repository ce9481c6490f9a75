"""`report`'s outputs: `write_json` is atomic and gives the file the mode a plain open() would; a
symlink is written through, a FIFO streamed to, a directory refused; JSON has no NaN; output paths
are checked before the work, and a write the filesystem refuses is one error line."""

import json
import os
import resource
import stat
import tempfile
import threading

import pytest

from neuron_moe import cli
from neuron_moe.report import OutputError, atomic_dir, atomic_write, file_digest, write_json


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


# ---- outputs that are not plain new files -------------------------------------------------------------


def test_a_symlink_is_written_through_not_replaced(tmp_path):
    target = tmp_path / "results" / "r.json"
    target.parent.mkdir()
    target.write_text("old\n")
    target.chmod(0o640)
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    write_json({"a": 1}, str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)  # still the link
    assert json.loads(target.read_text()) == {"a": 1}  # its target holds the new report
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # and keeps its mode
    assert sorted(p.name for p in target.parent.iterdir()) == ["r.json"]


def test_a_fifo_is_streamed_to_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    write_json({"a": 1}, str(fifo))
    reader.join(10)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)  # not turned into a regular file
    assert json.loads(got[0]) == {"a": 1}


def test_a_directory_and_a_seeking_writer_on_a_stream_are_refused(tmp_path, capsys):
    assert cli.main(["ports", "--json", str(tmp_path)]) == 2
    assert_one_error_line(capsys.readouterr().err, f"{tmp_path} is a directory")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="not a regular file; this output is written with seeks"):
        with atomic_write(fifo, "wb", seekable=True):
            pass
    # prep-reader's sidecar is patched after it is written: refused before any work, the FIFO untouched
    assert cli.main(["prep-reader", "--out", str(fifo)]) == 2
    assert_one_error_line(capsys.readouterr().err, "written with seeks")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


# ---- JSON the project writes is JSON (item 4) --------------------------------------------------------


def test_non_finite_numbers_are_written_as_null(tmp_path):
    out = tmp_path / "r.json"
    write_json({"delta": float("nan"), "rows": [float("inf"), -float("inf"), 1.5]}, str(out))
    strict = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert strict == {"delta": None, "rows": [None, None, 1.5]}


# ---- output paths checked before the work, one error line after it (item 10) ---------------------------


def assert_one_error_line(err: str, message: str) -> None:
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "dest,message",
    [
        ("{tmp}/file/r.json", "is not a directory, so"),  # a parent that is a file
        ("{tmp}/file/deeper/r.json", "is not a directory, so"),
        ("{tmp}", "is a directory; give a file name"),
        ("{tmp}/dangling/r.json", "dangling symbolic link"),
    ],
)
def test_bad_json_destinations_fail_before_the_work(tmp_path, capsys, monkeypatch, dest, message):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    ran = []
    monkeypatch.setattr(cli, "cmd_ports", lambda args: ran.append(args) or 0)  # the work
    assert cli.main(["ports", "--json", dest.format(tmp=tmp_path)]) == 2
    assert_one_error_line(capsys.readouterr().err, message)
    assert ran == []


def test_an_out_directory_that_is_a_file_fails_before_the_work(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert cli.main(["eval-reader", "--out", str(tmp_path / "file"), "--quick"]) == 2
    assert_one_error_line(capsys.readouterr().err, "exists and is not a directory")


def test_a_write_the_filesystem_refuses_is_one_line(tmp_path, capsys):
    """A file-size limit (RLIMIT_FSIZE: the write fails with EFBIG, as it would with ENOSPC on a full disk)."""
    out = tmp_path / "r.json"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # Python ignores SIGXFSZ: the write returns EFBIG
    try:
        status = cli.main(["ports", "--json", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert status == 2
    assert_one_error_line(capsys.readouterr().err, f"cannot write {out}: File too large")
    assert list(tmp_path.iterdir()) == []  # no temp file left either


def test_a_port_outside_the_tcp_range_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--port", "99999"])
    assert e.value.code == 2 and "argument --port: must be in [0, 65535], got 99999" in capsys.readouterr().err


def test_a_corrupt_run_file_of_eval_reader_is_named(tmp_path, capsys):
    (tmp_path / "run.json").write_text('{"model": "tiny-gemma4-moe", ')
    assert cli.main(["eval-reader", "--out", str(tmp_path), "--quick", "--selectors", "teal"]) == 2
    assert_one_error_line(capsys.readouterr().err, f"{tmp_path / 'run.json'}: not valid JSON")


def test_a_directory_is_published_whole_or_not_at_all(tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_dir(out) as tmp:
            (tmp / "new.txt").write_text("half")
            raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == ["art"] and (out / "old.txt").read_text() == "old"
    with atomic_dir(out) as tmp:
        assert list(tmp.iterdir()) == [] and tmp.parent == tmp_path
        (tmp / "new.txt").write_text("new")
        assert (out / "old.txt").exists()  # the old one stands until the new one is complete
    assert [p.name for p in tmp_path.iterdir()] == ["art"] and os.listdir(out) == ["new.txt"]


def test_a_published_directory_gets_the_umask_mode_and_sweep_removes_dead_partials(tmp_path, restore_umask):
    os.umask(0o027)
    (tmp_path / ".art.partial-dead").mkdir()
    (tmp_path / ".other.partial-x").mkdir()  # another output's: not ours to remove
    with atomic_dir(tmp_path / "art", sweep=True):
        pass
    assert stat.S_IMODE((tmp_path / "art").stat().st_mode) == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-x", "art"]


def test_what_a_directory_lands_with_has_the_modes_open_and_mkdir_give(tmp_path, restore_umask):
    """Whoever wrote them (safetensors' save_file and mkstemp make 0600 files, mkdtemp 0700
    folders), the files and folders of an atomic_dir land as open() and mkdir() would make them;
    an executable keeps its x bits, under the umask."""
    os.umask(0o027)
    with atomic_dir(tmp_path / "art") as tmp:
        fd, _ = tempfile.mkstemp(dir=tmp)
        os.close(fd)
        tempfile.mkdtemp(dir=tmp)
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        (tmp / "run.sh").chmod(0o700)
    out = tmp_path / "art"
    modes = sorted(stat.S_IMODE(p.stat().st_mode) for p in out.iterdir())
    assert modes == [0o640, 0o750, 0o750]  # the temp file, the temp folder, the script


def test_file_digest_is_size_sha256_and_s3s_crc32(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"hello world")
    d = file_digest(path, chunk=4)  # several reads
    assert d.size == 11 and d.sha256 == "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9"
    assert d.crc32 == "DUoRhQ=="  # base64 of crc32 0x0d4a1185, big-endian, as S3's ChecksumCRC32
