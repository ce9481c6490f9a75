"""Plain-text tables, `--json FILE` output, and the project's files: reading its JSON, writing
outputs (atomic for regular files, streamed to others; whole directories renamed into place),
checking output paths before the work, the lock a run holds on its output, and a file's digest."""

from __future__ import annotations

import base64
import errno
import fcntl
import glob
import hashlib
import io
import json
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from .errors import UserError

# errors of a write that are the filesystem's, not ours: reported as one line naming the path
_STORAGE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.EIO,
    errno.EFBIG,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
}


class OutputError(UserError):
    pass


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


def _target(path: Path) -> tuple[Path, os.stat_result | None]:
    """Where a write to `path` lands (a symlink's target, followed) and what is there now."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        return target, os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there yet (a dangling link: its target is made)
        return target, None
    except OSError as e:
        raise OutputError(f"{path}: {e.strerror}") from None


def _file_output(dest: str | Path, seekable: bool) -> tuple[str, Path | None, os.stat_result | None]:
    """How a file output is written: ("stdout" | "stream" | "file", where it lands, what is there
    now). A directory is refused, and a stream (stdout, a FIFO, a device) when written with seeks."""
    if str(dest) == "-":
        kind, target, st = "stdout", None, None
    else:
        target, st = _target(Path(dest))
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{dest} is a directory; give a file name")
        kind = "file" if st is None or stat.S_ISREG(st.st_mode) else "stream"
    if seekable and kind != "file":
        raise OutputError(f"{dest} is not a regular file; this output is written with seeks, so it needs one")
    return kind, target, st


def check_output(dest: str | Path, directory: bool = False, seekable: bool = False) -> None:
    """Fail now, before any work, when `dest` cannot be written: a file output that is a directory
    (or a stream, when `seekable`), a directory output that is a file, a parent on the way that is
    a file, or a folder it goes in that is not writable. '-' is stdout."""
    path = Path(dest)
    if directory:
        target, st = _target(path)
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                raise OutputError(f"{path} exists and is not a directory")
            if not os.access(path, os.W_OK | os.X_OK):
                raise OutputError(f"{path}: directory not writable")
            return
    else:
        kind, target, _ = _file_output(dest, seekable)
        if kind == "stdout":
            return
        if kind == "stream":
            if not os.access(path, os.W_OK):
                raise OutputError(f"{path}: not writable")
            return
    folder = target.parent  # a regular file is written beside itself, then renamed; a directory made there
    while not folder.exists():
        if folder.is_symlink():
            raise OutputError(f"{folder}: a dangling symbolic link on the way to {path}")
        folder = folder.parent
    if not folder.is_dir():
        raise OutputError(f"{folder} is not a directory, so {path} cannot be written")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{folder}: directory not writable, so {path} cannot be written")
    try:  # what the write will do there first (root passes os.access where the filesystem still refuses: /proc)
        fd, probe = tempfile.mkstemp(prefix=".neuron-moe-probe.", dir=folder)
    except OSError as e:
        raise OutputError(f"{path} cannot be written: {folder} takes no new file ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


@contextmanager
def _storage_errors(path: Path):
    """The filesystem's refusals (full, read-only, no permission, a file where a folder should be)
    as one line naming the path."""
    try:
        yield
    except OSError as e:
        if e.errno not in _STORAGE_ERRNOS:
            raise
        raise OutputError(f"cannot write {path}: {e.strerror}") from None


@contextmanager
def atomic_write(path: Path, mode: str = "w", seekable: bool = False):
    """Yield a file to write `path` through; nothing is half-written. '-' is stdout.

    A regular file (or none yet) is written as a temp file in its folder (created if missing),
    then renamed onto it; on any failure the temp file is removed and the old file is untouched.
    A symbolic link is written through: its target is replaced, the link stays. Anything else that
    exists — a FIFO, a terminal, /dev/null, /dev/stdout — is opened and written in place (a stream
    has nothing to replace), unless the writer needs to `seekable` back. A directory is refused.
    A new file gets the mode a plain open() would give it (mkstemp's own is 0600: results
    unreadable by anyone else); a replaced one keeps its mode."""
    kind, target, st = _file_output(path, seekable)
    if kind == "stdout":
        yield sys.stdout.buffer if "b" in mode else sys.stdout
        sys.stdout.flush()
        return
    path = Path(path)
    if kind == "stream":
        with _storage_errors(path), open(path, mode) as f:
            yield f
        return
    with _storage_errors(path):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        if st is not None:
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
        else:
            os.fchmod(fd, 0o666 & ~_umask())
        with _storage_errors(path):
            with os.fdopen(fd, mode) as f:
                yield f
            os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def native_write_errors(path: Path):
    """Writers in Rust (safetensors, tokenizers) report a write the filesystem refused as a plain
    exception whose text ends "(os error N)": made one line naming `path`, as an OSError would be."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found is None or int(found[1]) not in _STORAGE_ERRNOS:
            raise
        raise OutputError(f"cannot write {path}: {os.strerror(int(found[1]))}") from None


class _HeldErrors(io.RawIOBase):
    """A file as a C++ serializer writes it (torch.export.save, torch.save): the first write the
    filesystem refuses (a full disk) is held instead of raised, and later writes are dropped, so the
    serializer finishes normally; `serializer_file` raises it then. (torch's zip writer, given an
    error mid-archive, throws again from its destructor: std::terminate, the process aborts.)"""

    def __init__(self, f):
        self.f, self.error = f, None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.error is None:
            try:
                self.f.write(data)
            except OSError as e:
                self.error = e
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence) if self.error is None else 0

    def tell(self) -> int:
        return self.f.tell()


@contextmanager
def serializer_file(path: Path):
    """Yield a binary file for a C++ serializer to write `path` through; a refused write (full,
    read-only) is raised once it is done, as one line naming `path`, not an aborted process."""
    with _storage_errors(path):
        with open(path, "wb") as raw:
            held = _HeldErrors(raw)
            yield held
            if held.error is None:
                raw.flush()
        if held.error is not None:
            raise held.error


def _umask() -> int:
    # /proc says it without changing it: os.umask(0) would, for a moment, for every thread
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0)
        os.umask(umask)
        return umask


def _give_new_modes(root: Path) -> None:
    """Every file and folder under root (root included) the mode open()/mkdir() would have given
    it, whatever the writer did (safetensors and mkdtemp make theirs owner-only)."""
    umask = _umask()
    os.chmod(root, 0o777 & ~umask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~umask)
        for name in files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):  # a symbolic link has no mode of its own
                os.chmod(path, (0o777 if st.st_mode & stat.S_IXUSR else 0o666) & ~umask)


@contextmanager
def atomic_dir(out: Path, *, sweep: bool = False):
    """Yield an empty hidden sibling of `out` (`.NAME.partial-*`) to build a directory in; when the
    block ends it is renamed onto `out`, an old `out` moved aside first and removed after. On any
    failure it is removed and `out` is untouched. What lands has the modes open() and mkdir() give
    under the umask, whoever wrote it (an artifact built by one user is read by a server running as
    another). `sweep`: the caller holds `out`'s `run_lock`, so the partial siblings it finds are dead
    runs' leftovers: they are removed first."""
    out = Path(out).absolute()
    prefix = f".{out.name}.partial-"
    with _storage_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        if sweep:
            for stale in out.parent.glob(glob.escape(prefix) + "*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    try:
        yield tmp
        with _storage_errors(out):
            _give_new_modes(tmp)  # mkdtemp's 0700 would become the published directory's mode
            old = None
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=prefix + "old-", dir=out.parent))
                os.rename(out, old / "x")
            try:
                os.rename(tmp, out)
            except BaseException:
                if old is not None:
                    os.rename(old / "x", out)
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def made_dir(path: Path, keep=None):
    """Yield `path`, a directory (made, parents too, if missing) that a run writes files into one
    by one. One this block made is removed again when the block fails (a full disk, Ctrl-C), unless
    `keep()` says it holds work a rerun reuses; one that was there stays as it is."""
    path = Path(path)
    made = not path.exists()
    with _storage_errors(path):
        path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except BaseException:
        if made and not (keep is not None and keep()):
            shutil.rmtree(path, ignore_errors=True)
        raise


class FileDigest(NamedTuple):
    size: int
    sha256: str  # hex
    crc32: str  # base64 of the big-endian 4 bytes, as S3 reports a CRC32 checksum


def file_digest(path: Path, progress=None, chunk: int = 8 * 2**20) -> FileDigest:
    """Size, sha256 and CRC32 of a file in one read; `progress` (a tqdm bar) is advanced by the bytes."""
    sha, crc, size = hashlib.sha256(), 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
            crc = zlib.crc32(block, crc)
            size += len(block)
            if progress is not None:
                progress.update(len(block))
    return FileDigest(size, sha.hexdigest(), base64.b64encode(crc.to_bytes(4, "big")).decode())


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """JSON text; a non-finite float (NaN, ±inf) is written as null, since JSON has no such number
    (Python's json would write a bare NaN, which no strict parser reads)."""
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def write_json(obj: Any, dest: str) -> None:
    """`obj` as JSON to `dest` ('-': stdout), through `atomic_write`."""
    with atomic_write(dest) as f:
        f.write(dumps(obj, indent=2, sort_keys=False) + "\n")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


MAX_JSON_DEPTH = 64  # arrays and objects within each other; what this project writes nests at most 5


def loads_json(text: str | bytes):
    """JSON text parsed strictly: NaN and Infinity refused (they are not JSON), and so is nesting
    deeper than MAX_JSON_DEPTH, a ValueError like any other malformed text (Python's parser would
    raise RecursionError, or hand back a structure that later recursion trips on)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    todo = [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
            todo += [(child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)]
    return value


def read_json_object(path: Path, error: type[Exception], missing: str) -> dict:
    """A JSON file that must hold an object; `error(message)` names the file and the problem.
    Parsed by `loads_json`: NaN, Infinity and too deep a nesting refused."""
    if not path.is_file():
        raise error(missing)
    try:
        raw = loads_json(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise error(f"{path}: not valid JSON: {e}") from None
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object")
    return raw


@contextmanager
def run_lock(path: Path, what: str, wait=None):
    """Hold the lock of `path` (a file `.NAME.lock` beside it) while a run writes `path`, so that
    a second run on the same output is refused instead of deleting the first's work; leftovers
    found while holding it are a dead run's. flock: the kernel drops it when its holder dies.
    `wait(holder_pid)`: called instead of refusing, while another run holds the lock, before each
    new try; it sleeps a little, and raises to give up."""
    path = Path(path).absolute()
    lock = path.parent / f".{path.name}.lock"
    with _storage_errors(lock):
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                if wait is None:
                    raise OutputError(
                        f"{path} is being written by another {what} (pid {holder}); "
                        "wait for it to finish, or choose another output"
                    ) from None
                wait(holder)
                continue
            try:
                if os.path.samestat(os.fstat(fd), os.stat(lock)):
                    break  # else its holder removed it as it let go, between our open and our flock: again
            except FileNotFoundError:
                pass
            os.close(fd)
    try:
        with _storage_errors(lock):  # a full disk refuses the pid: the lock goes as it would after the run
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.unlink(lock)  # while still holding it: whoever opens the path next gets a fresh file
        os.close(fd)
