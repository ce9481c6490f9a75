"""Integrity-checked publishing of an artifact directory to S3, and pulling it back.

publish(DIR, "s3://bucket/prefix"):
  1. A used prefix (any object under it) is refused unless overwrite=True. With overwrite the old
     manifest is deleted first, so from that moment `pull` refuses the prefix instead of mixing
     old and new files; then the other old objects.
  2. Every file is checked before anything is sent or deleted: its size and mtime must not change
     while it is read (a file still being written fails this), a `.pt` (torch.save and
     torch.jit.save write zip archives) must be a complete zip, and with deep=True every member
     must pass its CRC (ZipFile.testzip, which reads it all). The same read gives sha256 and CRC32.
  3. Each file is uploaded with its CRC32 as S3's full-object checksum (S3 rejects a body that does
     not match it, also for multipart uploads) and its sha256 in the object metadata; then
     head_object must report the same length, CRC32 and sha256, and the file's size and mtime
     must still be those it was hashed with.
  4. The manifest is written last and only once: put_object(IfNoneMatch="*") fails if any writer
     created it in the meantime. A prefix without a manifest is not a publication.

pull("s3://bucket/prefix", DIR): reads the manifest, checks that every file can land in DIR (no
file where a folder must go, no folder where a file must), downloads each file to a temp name in
its final folder, checks its size and sha256 against the manifest and only then renames it into
place. A file already in DIR with the manifest's sha256 is kept; a failed file leaves nothing
behind. A pull holds a lock on DIR (`.DIR.lock` beside it): a second pull into DIR is refused, and
the temp files a killed pull left (hidden `.part` names, which `publish` would refuse) are removed.

Credentials, region and endpoint come from boto3's usual sources (AWS_* variables, ~/.aws, an
instance role); AWS_ENDPOINT_URL_S3 points it at another S3 implementation.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import zipfile
import zlib
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from ..errors import UserError
from ..report import check_output, file_digest, run_lock, table

MANIFEST = "neuron-moe-manifest.json"
FORMAT = "neuron-moe-artifacts/1"
ZIP_SUFFIXES = (".pt",)  # torch.save / torch.jit.save archives
# S3 allows 10,000 parts of at least 5 MiB: 64 MiB parts reach 625 GiB per file.
MULTIPART_THRESHOLD = 64 * 2**20
MULTIPART_CHUNKSIZE = 64 * 2**20
PART = ".part"  # suffix of a download in progress


class PublishError(UserError):
    pass


def parse_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/some/prefix/' -> ('bucket', 'some/prefix')."""
    if not uri.startswith("s3://") or not uri[5:].partition("/")[0]:
        raise PublishError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.strip("/")


def _key(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


def _uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


# boto3 and botocore (the publish extra) are imported where they are used, never at the top: the
# server imports this module, and needs them only for an s3:// URI.
def _client():
    try:
        import boto3
    except ImportError:
        raise PublishError("S3 needs boto3: pip install 'neuron-moe[publish]'") from None
    return boto3.client("s3")


def _transfer_config():
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNKSIZE)


@contextmanager
def _s3_errors(what: str):
    """Turn boto's errors (network, credentials, S3 answers) into one line that says what failed."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, ClientError, Boto3Error) as e:
        raise PublishError(f"{what}: {e}") from e


def _error_code(e: Exception) -> str | None:
    return getattr(e, "response", {}).get("Error", {}).get("Code")


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None if progress else True)


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


# ---------------------------------------------------------------------------------------- publish

def _local_files(src: Path) -> list[tuple[str, Path]]:
    if not src.is_dir():
        raise PublishError(f"{src}: not a directory")
    files = []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if any(part.startswith(".") for part in rel.parts):
            # temp files of writes in progress (ours, torch's, safetensors') are hidden names
            raise PublishError(f"{path}: a hidden file (a write in progress?); remove it or wait for the writer")
        if path.is_dir():
            continue
        if not path.is_file():
            raise PublishError(f"{path}: not a regular file")
        if rel.as_posix() == MANIFEST:
            raise PublishError(f"{path}: {MANIFEST} is the name publish gives its manifest; rename the file")
        files.append((rel.as_posix(), path))
    if not files:
        raise PublishError(f"{src}: no files to publish")
    return files


def _check_zip(path: Path, deep: bool) -> None:
    if not zipfile.is_zipfile(path):
        raise PublishError(f"{path}: not a complete zip archive (torch.save / torch.jit.save write one): "
                           "truncated, or still being written")
    if not deep:
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        raise PublishError(f"{path}: unreadable zip archive ({e})") from e
    if bad is not None:
        raise PublishError(f"{path}: member {bad!r} fails its CRC check (corrupt archive)")


def _check_file(rel: str, path: Path, deep: bool, bar: tqdm) -> tuple[dict, tuple[int, int]]:
    before = _stamp(path)
    if path.name.endswith(ZIP_SUFFIXES):
        _check_zip(path, deep)
    size, sha256, crc32 = file_digest(path, bar)
    after = _stamp(path)
    if before != after or size != after[0]:
        raise PublishError(f"{path}: changed while it was read ({before[0]} -> {after[0]} bytes): "
                           "is it still being written?")
    return {"path": rel, "size": size, "sha256": sha256, "crc32": crc32}, after


def _list_keys(client, bucket: str, prefix: str) -> list[str]:
    keys = []
    with _s3_errors(f"listing {_uri(bucket, prefix)}"):
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "")
        for page in pages:
            keys += [obj["Key"] for obj in page.get("Contents", [])]
    return keys


def _delete(client, bucket: str, prefix: str, keys: list[str]) -> None:
    manifest = _key(prefix, MANIFEST)
    rest = [k for k in keys if k != manifest]
    if manifest in keys:  # first: the prefix stops being a publication before any file changes
        with _s3_errors(f"deleting {_uri(bucket, manifest)}"):
            client.delete_object(Bucket=bucket, Key=manifest)
    for i in range(0, len(rest), 1000):  # delete_objects takes at most 1000 keys
        with _s3_errors(f"deleting objects under {_uri(bucket, prefix)}"):
            answer = client.delete_objects(
                Bucket=bucket, Delete={"Objects": [{"Key": k} for k in rest[i:i + 1000]], "Quiet": True})
        if answer.get("Errors"):
            err = answer["Errors"][0]
            raise PublishError(f"deleting {_uri(bucket, err['Key'])}: {err.get('Code')} {err.get('Message')}")


def _verify_object(client, bucket: str, key: str, path: Path, entry: dict) -> None:
    where = _uri(bucket, key)
    with _s3_errors(f"checking {where}"):
        head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    got = {"size": head.get("ContentLength"), "crc32": head.get("ChecksumCRC32"),
           "sha256": head.get("Metadata", {}).get("sha256")}
    bad = [f"{name} {got[name]!r} != {entry[name]!r}" for name in got if got[name] != entry[name]]
    # S3 names the type for multipart uploads; a single PUT's CRC32 covers the whole object by
    # definition (moto 5.2 leaves the type out there). A COMPOSITE CRC would not equal ours anyway.
    if head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        bad.append(f"checksum type {head['ChecksumType']!r} != 'FULL_OBJECT'")
    if bad:
        raise PublishError(f"{where} does not match {path} after upload: {'; '.join(bad)}")


def _put_manifest(client, bucket: str, prefix: str, manifest: dict) -> str:
    from botocore.exceptions import ClientError

    key = _key(prefix, MANIFEST)
    body = (json.dumps(manifest, indent=2) + "\n").encode()
    with _s3_errors(f"writing {_uri(bucket, key)}"):
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json", IfNoneMatch="*")
        except ClientError as e:
            if _error_code(e) in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise PublishError(f"{_uri(bucket, key)} was created by another writer during this publish; "
                                   "this one did not replace it") from e
            raise
    return key


def publish(src_dir: Path, uri: str, *, overwrite: bool = False, deep: bool = False,
            progress: bool = True, client=None) -> dict:
    """Publish every file under src_dir to uri (s3://bucket/prefix); returns the report."""
    start = time.monotonic()
    src = Path(src_dir)
    bucket, prefix = parse_uri(uri)
    files = _local_files(src)
    client = client or _client()

    existing = _list_keys(client, bucket, prefix)
    if existing and not overwrite:
        what = ("a publication" if _key(prefix, MANIFEST) in existing
                else "objects but no manifest (an unfinished publish)")
        raise PublishError(f"{_uri(bucket, prefix)} already holds {what}, {len(existing)} objects; "
                           "pass --overwrite to replace them")

    total = sum(path.stat().st_size for _, path in files)
    entries, stamps = [], []
    with _bar(total, "checking", progress) as bar:
        for rel, path in files:
            entry, stamp = _check_file(rel, path, deep, bar)
            entries.append(entry)
            stamps.append(stamp)

    if existing:
        _delete(client, bucket, prefix, existing)

    config = _transfer_config()
    with _bar(total, "uploading", progress) as bar:
        for (rel, path), entry, stamp in zip(files, entries, stamps):
            key = _key(prefix, rel)
            with _s3_errors(f"uploading {path} to {_uri(bucket, key)} failed, no manifest was written "
                            "(re-run with --overwrite)"):
                client.upload_file(str(path), bucket, key, Config=config, Callback=bar.update, ExtraArgs={
                    "ChecksumAlgorithm": "CRC32", "ChecksumCRC32": entry["crc32"],
                    "Metadata": {"sha256": entry["sha256"]}})
            if _stamp(path) != stamp:
                raise PublishError(f"{path}: changed while it was uploaded; no manifest was written "
                                   "(re-run with --overwrite once it is complete)")
            _verify_object(client, bucket, key, path, entry)

    total = sum(e["size"] for e in entries)  # as hashed, not as first stat'ed
    manifest = {"format": FORMAT, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "total_bytes": total, "files": entries}
    manifest_key = _put_manifest(client, bucket, prefix, manifest)
    return {"uri": _uri(bucket, prefix), "manifest": _uri(bucket, manifest_key),
            "files": [dict(e, key=_key(prefix, e["path"])) for e in entries],
            "total_bytes": total, "replaced_objects": len(existing),
            "seconds": round(time.monotonic() - start, 3)}


# ------------------------------------------------------------------------------------------- pull

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _check_manifest(manifest, where: str) -> list[dict]:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PublishError(f"{where}: not a {FORMAT} manifest (field 'format')")
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        raise PublishError(f"{where}: field 'files' must be a non-empty list")
    seen = set()
    for i, f in enumerate(files):
        field = f"{where}: files[{i}]"
        if not isinstance(f, dict):
            raise PublishError(f"{field} is not an object")
        path = f.get("path")
        # a manifest names files inside DIR: nothing absolute, no '..', no empty or '.' parts
        if (not isinstance(path, str) or path.startswith("/") or "\\" in path
                or any(part in ("", ".", "..") for part in path.split("/"))):
            raise PublishError(f"{field}.path {path!r} is not a plain relative path")
        if path in seen:
            raise PublishError(f"{field}.path {path!r} is listed twice")
        seen.add(path)
        if not isinstance(f.get("size"), int) or isinstance(f["size"], bool) or f["size"] < 0:
            raise PublishError(f"{field}.size {f.get('size')!r} is not a byte count")
        if not isinstance(f.get("sha256"), str) or not _SHA256.fullmatch(f["sha256"]):
            raise PublishError(f"{field}.sha256 {f.get('sha256')!r} is not a sha256 hex digest")
    return files


def read_manifest(uri: str, client=None) -> list[dict]:
    """The files of the publication at uri, as its manifest lists them (checked)."""
    from botocore.exceptions import ClientError

    bucket, prefix = parse_uri(uri)
    client = client or _client()
    where = _uri(bucket, _key(prefix, MANIFEST))
    with _s3_errors(f"reading {where}"):
        try:
            body = client.get_object(Bucket=bucket, Key=_key(prefix, MANIFEST))["Body"].read()
        except ClientError as e:
            if _error_code(e) in ("NoSuchKey", "404"):
                raise PublishError(f"no manifest at {where}: nothing was published there, "
                                   "or a publish did not finish") from e
            raise
    try:
        manifest = json.loads(body)
    except ValueError as e:
        raise PublishError(f"{where}: not JSON ({e})") from e
    return _check_manifest(manifest, where)


def _fetch(client, bucket: str, key: str, target: Path, entry: dict, config, bar: tqdm) -> None:
    """Download to a temp file beside target, verify, fsync, rename; on any failure remove the temp."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=PART, dir=target.parent)
    os.close(fd)
    try:
        with _disk_errors(target), _s3_errors(f"downloading {_uri(bucket, key)} to {target}"):
            client.download_file(bucket, key, tmp, Config=config, Callback=bar.update)
        size, sha256, _ = file_digest(Path(tmp), bar)
        if size != entry["size"] or sha256 != entry["sha256"]:
            raise PublishError(f"{_uri(bucket, key)} does not match its manifest entry: {size} bytes, "
                               f"sha256 {sha256} (expected {entry['size']} bytes, sha256 {entry['sha256']}); "
                               f"{target} was not written")
        with _disk_errors(target):
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def pull_report(uri: str, dest_dir: Path, *, progress: bool = True, client=None) -> dict:
    """pull(), returning the report (one row per file: downloaded, or already present)."""
    start = time.monotonic()
    bucket, prefix = parse_uri(uri)
    client = client or _client()
    files = read_manifest(uri, client)
    dest = Path(dest_dir)
    check_output(dest, directory=True)
    _check_landing(dest, files)
    with run_lock(dest, "pull"):
        with _disk_errors(dest):
            dest.mkdir(parents=True, exist_ok=True)
            for part in _leftovers(dest):  # a dead pull's: a live one would hold the lock
                part.unlink()
        rows, fetched = _pull_files(client, bucket, prefix, files, dest, progress)
    return {"uri": _uri(bucket, prefix), "dest": str(dest), "files": rows,
            "total_bytes": sum(f["size"] for f in files), "downloaded_bytes": fetched,
            "seconds": round(time.monotonic() - start, 3)}


def _pull_files(client, bucket: str, prefix: str, files: list[dict], dest: Path, progress: bool):
    config = _transfer_config()
    rows, fetched = [], 0
    # every byte is counted twice: downloaded, then read again for its sha256
    with _bar(2 * sum(f["size"] for f in files), "download + verify", progress) as bar:
        for entry in files:
            target = dest / entry["path"]
            if target.is_file() and target.stat().st_size == entry["size"]:
                if file_digest(target, bar).sha256 == entry["sha256"]:
                    bar.update(entry["size"])
                    rows.append({**entry, "action": "present"})
                    continue
                bar.total += entry["size"]  # read for nothing: it differs
            _fetch(client, bucket, _key(prefix, entry["path"]), target, entry, config, bar)
            fetched += entry["size"]
            rows.append({**entry, "action": "downloaded"})
    return rows, fetched


def _check_landing(dest: Path, files: list[dict]) -> None:
    """Before any download: every file of the manifest can land in dest."""
    for entry in files:
        target = dest / entry["path"]
        for folder in reversed(target.parents):
            if folder in dest.parents or folder == dest:
                continue
            if folder.exists() and not folder.is_dir():
                raise PublishError(f"{folder} is a file, where the manifest's {entry['path']} needs a folder")
        if target.is_dir():
            raise PublishError(f"{target} is a folder, where the manifest has the file {entry['path']}")


def _leftovers(dest: Path) -> list[Path]:
    """Temp files of an interrupted pull: ours (`.NAME.*.part`) and boto's beside them (`.part.XXXXXXXX`)."""
    return [p for p in dest.rglob(".*" + PART + "*")
            if p.is_file() and (p.name.endswith(PART) or PART + "." in p.name)]


@contextmanager
def _disk_errors(where: Path):
    """A full disk, a read-only or forbidden folder: one line naming the place."""
    try:
        yield
    except OSError as e:
        raise PublishError(f"writing {where}: {e.strerror or e}") from None


def pull(uri: str, dest_dir: Path) -> Path:
    """Download the publication at uri into dest_dir, every file verified; returns dest_dir."""
    pull_report(uri, dest_dir)
    return Path(dest_dir)


def render_publish(report: dict) -> str:
    return (table(report["files"], [("path", "file"), ("size", "bytes"), ("sha256", "sha256"), ("crc32", "CRC32")])
            + f"\n\npublished {len(report['files'])} files ({report['total_bytes']} bytes) to {report['uri']}, "
              f"each verified with head_object; manifest {report['manifest']}")


def render_pull(report: dict) -> str:
    return (table(report["files"], [("path", "file"), ("size", "bytes"), ("sha256", "sha256"), ("action", "")])
            + f"\n\n{report['dest']}: {len(report['files'])} files verified against the manifest of {report['uri']} "
              f"({report['downloaded_bytes']} of {report['total_bytes']} bytes downloaded)")
