"""Integrity-checked publishing of an artifact directory to S3, and pulling it back.

The layout. A publication at s3://bucket/P is its manifest, P/neuron-moe-manifest.json, and the
files it names; each run of `publish` writes its files under a key of its own,
P/runs/<run>/<path> (<run>: UTC time and 32 random bits), and the manifest names each file's key.
A complete publication is never changed, only replaced whole (--overwrite): its manifest by one
conditional PUT, its files removed after no manifest names them.

The design, and why. The manifest is the only object two runs ever both write, and only with a
condition (If-None-Match: * where there is none, If-Match: <the ETag read> where there is one), and
it is also the claim a run holds on P while it uploads (step 3). S3's strong read-after-write
consistency (LIST included) and its atomic conditional PUT are then all that is relied on. Run-unique
keys alone would keep two publishers' files apart, but leave a killed run's objects and open uploads
indistinguishable from a live run's, so nobody could ever safely remove them. A separate claim object
alone (If-None-Match) can be taken over from a dead run only by trusting that the run is dead; if it
is not, it goes on writing the same keys, and its manifest. With the claim in the manifest itself, a
takeover changes the ETag every other run's last write is conditioned on: a run that lost its claim
cannot publish, whatever it still uploads, and what it uploaded is provably garbage.

publish(DIR, "s3://bucket/P"), in order:
  1. Refused, --overwrite or not, where P is inside a publication (a manifest at a parent prefix)
     or holds publications below it (they are named): --overwrite replaces P's own publication and
     nothing else. Refused without --overwrite where P holds a publication, a run in progress (one
     on this host whose process is gone is taken over: it was killed), or objects that belong to no
     publication (an older neuron-moe's unfinished publish, other data).
  2. Every file is checked before anything is written: its size and mtime must not change while
     it is read (a file still being written fails this), a `.pt` (torch.save and torch.jit.save
     write zip archives) must be a complete zip, and with deep=True every member must pass its CRC
     (ZipFile.testzip, which reads it all). The same read gives sha256 and CRC32.
  3. The claim: the manifest is rewritten, conditionally on what step 1 read, to say "run R is
     publishing here" (host, pid, start), keeping the publication it had, which stays readable
     until step 6. A run whose claim was replaced since can never write its manifest (its If-Match
     fails), so from this moment the objects of every other run, finished or not, are garbage:
     removed, and their incomplete multipart uploads aborted (step 7 says why that is safe).
  4. Each file is uploaded with the CRC32 computed in step 2 as S3's full-object checksum (on
     PutObject, and on CompleteMultipartUpload with each part's own CRC32: S3 rejects bytes that do
     not match it) and its sha256 in the object metadata. The upload reads the file as a stream it
     cannot seek, so s3transfer reads every byte once, in order, and keeps each part in memory for
     retries: the CRC32 of exactly what was sent is compared with step 2's (S3 implementations that
     do not check a supplied checksum - moto - would otherwise store a file changed since it was
     hashed, size and mtime kept). Then head_object must report the same length, CRC32 and sha256.
  5. Any failure: this run's objects are removed, its uploads aborted and its claim released
     (the manifest put back as it was, less the claim), best effort; a killed run leaves them to
     the next run's step 3.
  6. The manifest is written, If-Match its claim: only the run that still holds the claim can. (A
     write boto retried after its first try landed fails its condition on that write; the object is
     then byte for byte ours, and is taken as written.)
  7. The sweep of step 3 again, now also removing the replaced publication's files. A sweep lists
     the objects (and uploads) first and reads the manifest after: an object listed was written
     after its run's claim, so a run that the manifest read later does not name (as its
     publication or its claim) lost its claim before that read and can never publish.

pull("s3://bucket/P", DIR): reads the manifest (this layout, or the first, neuron-moe-artifacts/1,
where each file's key is its path under P: both are read) and builds the publication in a private
sibling of DIR (`.DIR.partial-*`): each file downloaded and checked against the manifest's size and
sha256, or, where DIR already holds it with that sha256, linked (or copied) from there. Only when
every file is there is the sibling renamed onto DIR (the old DIR moved aside, then removed): DIR
holds exactly the manifest's files, or - a refused pull - is left as it was. A pull replaces only a
new, an empty or a pulled directory (`.DIR.pulled` beside it names the URI), never one it did not
write. A pull holds a lock on DIR (`.DIR.lock`): a second pull into DIR is refused - or, with stall_s
(serve's shared --artifacts-cache), waits for the first while its bytes keep landing, then verifies
what it left - and the partial siblings a killed pull left are removed.

Credentials, region and endpoint come from boto3's usual sources (AWS_* variables, ~/.aws, an
instance role); AWS_ENDPOINT_URL_S3 points it at another S3 implementation.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
import zipfile
import zlib
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from ..errors import UserError
from ..neuron import artifact
from ..report import atomic_dir, check_output, file_digest, loads_json, run_lock, table

log = logging.getLogger(__name__)

MANIFEST = "neuron-moe-manifest.json"
FORMAT = "neuron-moe-artifacts/2"
FORMAT_V1 = "neuron-moe-artifacts/1"  # each file at P/<path>; read, never written
RUNS = "runs"  # P/runs/<run>/<path>: a run's files
ZIP_SUFFIXES = (".pt",)  # torch.save / torch.jit.save archives
# S3 allows 10,000 parts of at least 5 MiB: 64 MiB parts reach 625 GiB per file. A stream that
# cannot seek is uploaded from memory: up to s3transfer's 10 parts (640 MiB) at once.
MULTIPART_THRESHOLD = 64 * 2**20
MULTIPART_CHUNKSIZE = 64 * 2**20
WAIT_POLL_S = 0.5  # a pull waiting for another's lock tries again this often,
WAIT_LOG_S = 10.0  # and says how far the other has got this often
# answers of a conditional write that lost: the object changed (412), a concurrent conditional
# write to it (409), or it went away (If-Match on a deleted key)
LOST_RACE = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409")


class PublishError(UserError):
    pass


class _LostRace(PublishError):
    """A conditional write of the manifest found it changed: another run's write came first."""


class _Missing(PublishError):
    """An object the manifest names is not there (`_missing` says why)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


class _BadManifest(PublishError):
    def __init__(self, message: str, etag: str):
        super().__init__(message)
        self.etag = etag


_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")  # S3's rules, and the looser ones of buckets made before 2018


def parse_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket//some/prefix/' -> ('bucket', 'some/prefix'): empty segments dropped, so that
    one prefix has one spelling; '.' and '..' refused (S3 keys are not paths: they would be kept)."""
    if not uri.startswith("s3://") or not uri[5:].partition("/")[0]:
        raise PublishError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = uri[5:].partition("/")
    if bucket in (".", "..") or not _BUCKET.fullmatch(bucket):  # it names a folder in a pull's cache too
        raise PublishError(f"{uri}: {bucket!r} is not an S3 bucket name (letters, digits, '.', '-' and '_')")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise PublishError(f"{uri}: a '.' or '..' segment in the prefix (S3 would keep it as a name)")
    return bucket, "/".join(parts)


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
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None if progress else True
    )


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------- manifest

_SHA256 = re.compile(r"[0-9a-f]{64}")
_RUN = re.compile(r"[0-9A-Za-z][0-9A-Za-z.-]*")


def _relative(value, field: str) -> str:
    # a manifest names files inside DIR and keys inside P: nothing absolute, no '..', no empty or '.' parts
    if (
        not isinstance(value, str)
        or value.startswith("/")
        or "\\" in value
        or any(part in ("", ".", "..") for part in value.split("/"))
    ):
        raise PublishError(f"{field} {value!r} is not a plain relative path")
    return value


def _check_files(files, where: str, v1: bool) -> list[dict]:
    if not isinstance(files, list) or not files:
        raise PublishError(f"{where}: field 'files' must be a non-empty list")
    seen, entries = set(), []
    for i, f in enumerate(files):
        field = f"{where}: files[{i}]"
        if not isinstance(f, dict):
            raise PublishError(f"{field} is not an object")
        path = _relative(f.get("path"), f"{field}.path")
        if path in seen:
            raise PublishError(f"{field}.path {path!r} is listed twice")
        seen.add(path)
        if not isinstance(f.get("size"), int) or isinstance(f["size"], bool) or f["size"] < 0:
            raise PublishError(f"{field}.size {f.get('size')!r} is not a byte count")
        if not isinstance(f.get("sha256"), str) or not _SHA256.fullmatch(f["sha256"]):
            raise PublishError(f"{field}.sha256 {f.get('sha256')!r} is not a sha256 hex digest")
        key = path if v1 else _relative(f.get("key"), f"{field}.key")
        entries.append({**f, "key": key})
    return entries


def _check_manifest(doc, where: str) -> dict:
    """The manifest, checked: {"format", "files"?: [entries, each with its "key" under P],
    "run"?, "created"?, "total_bytes"?, "pending"?: {"run", "host", "pid", "started"}}."""
    if not isinstance(doc, dict) or doc.get("format") not in (FORMAT, FORMAT_V1):
        raise PublishError(f"{where}: not a {FORMAT} (or {FORMAT_V1}) manifest (field 'format')")
    if doc["format"] == FORMAT_V1:
        return {**doc, "files": _check_files(doc.get("files"), where, v1=True)}
    checked = dict(doc)
    if "files" in doc:
        checked["files"] = _check_files(doc["files"], where, v1=False)
    if "run" in doc and (not isinstance(doc["run"], str) or not _RUN.fullmatch(doc["run"])):
        raise PublishError(f"{where}: field 'run' {doc['run']!r} is not a run name")
    pending = doc.get("pending")
    if pending is not None and (
        not isinstance(pending, dict) or not isinstance(pending.get("run"), str) or not _RUN.fullmatch(pending["run"])
    ):
        raise PublishError(f"{where}: field 'pending' {pending!r} does not name a run")
    return checked


def _get_manifest(client, bucket: str, prefix: str) -> tuple[dict | None, str | None]:
    """(the checked manifest at prefix, its ETag), or (None, None) where there is none; a manifest
    that is not one raises _BadManifest (with its ETag: --overwrite replaces it)."""
    from botocore.exceptions import ClientError

    key = _key(prefix, MANIFEST)
    where = _uri(bucket, key)
    with _s3_errors(f"reading {where}"):
        try:
            answer = client.get_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if _error_code(e) in ("NoSuchKey", "404"):
                return None, None
            raise
        body = answer["Body"].read()
    try:
        return _check_manifest(loads_json(body), where), answer["ETag"]
    except (ValueError, UnicodeDecodeError, PublishError) as e:  # JSONDecodeError is a ValueError
        raise _BadManifest(
            str(e) if isinstance(e, PublishError) else f"{where}: not JSON ({e})", answer["ETag"]
        ) from None


def _encode(doc: dict) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()


def _put_manifest(client, bucket: str, prefix: str, doc: dict, etag: str | None, lost: str) -> str:
    """Write the manifest if it is still what was read (ETag `etag`; None: there was none); its new
    ETag. `lost`: the error when it is not."""
    from botocore.exceptions import ClientError

    key, body = _key(prefix, MANIFEST), _encode(doc)
    condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
    with _s3_errors(f"writing {_uri(bucket, key)}"):
        try:
            return client.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json", **condition)[
                "ETag"
            ]
        except ClientError as e:
            if _error_code(e) not in LOST_RACE:
                raise
            # boto retries a write whose answer was lost; if the first try landed, the retry's
            # condition fails on our own write: what is there is then ours (it names our run)
            try:
                now = client.get_object(Bucket=bucket, Key=key)
                if now["Body"].read() == body:
                    return now["ETag"]
            except ClientError:
                pass
            raise _LostRace(lost) from e


def _publication(doc: dict | None) -> dict:
    """The publication a manifest holds (its files and where they came from), without a claim."""
    return {k: v for k, v in (doc or {}).items() if k in ("files", "run", "created", "total_bytes")}


# ---------------------------------------------------------------------------------------- publish


def _local_files(src: Path) -> list[tuple[str, Path]]:
    if not src.is_dir():
        raise PublishError(f"{src}: not a directory")
    files = []
    for rel, path in artifact.regular_files(src):  # a FIFO or a device refused by name; links followed
        if any(part.startswith(".") for part in rel.split("/")):
            # temp files of writes in progress (ours, torch's, safetensors') are hidden names
            raise PublishError(f"{path}: a hidden file (a write in progress?); remove it or wait for the writer")
        if path.name == MANIFEST:  # anywhere: below P, that name marks a publication
            raise PublishError(f"{path}: {MANIFEST} is the name publish gives its manifest; rename the file")
        files.append((rel, path))
    if not files:
        raise PublishError(f"{src}: no files to publish")
    return files


def _check_zip(path: Path, deep: bool) -> None:
    if not zipfile.is_zipfile(path):
        raise PublishError(
            f"{path}: not a complete zip archive (torch.save / torch.jit.save write one): "
            "truncated, or still being written"
        )
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
        raise PublishError(
            f"{path}: changed while it was read ({before[0]} -> {after[0]} bytes): is it still being written?"
        )
    return {"path": rel, "size": size, "sha256": sha256, "crc32": crc32}, after


def _check_artifact(src: Path, entries: list[dict]) -> None:
    """A directory that is a trace-and-compile artifact (its manifest.json has a format and files)
    is published only as its manifest describes it: every file there with its size and sha256, none
    else (the sha256 are those just computed: the bytes that will be sent)."""
    path = src / artifact.MANIFEST
    if not path.is_file():
        return
    try:
        raw = loads_json(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return  # not JSON (or nested past any manifest): not a trace-and-compile manifest
    if not isinstance(raw, dict) or not isinstance(raw.get("format"), int) or not isinstance(raw.get("files"), dict):
        return  # another tool's manifest.json
    manifest = artifact.check_manifest(raw, path)
    artifact.check_files(
        src, manifest["files"], {e["path"]: (e["size"], e["sha256"]) for e in entries if e["path"] != artifact.MANIFEST}
    )
    artifact.check_weights(src, manifest)


def _list_keys(client, bucket: str, prefix: str) -> list[str]:
    keys = []
    with _s3_errors(f"listing {_uri(bucket, prefix)}"):
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "")
        for page in pages:
            keys += [obj["Key"] for obj in page.get("Contents", [])]
    return keys


def _list_uploads(client, bucket: str, prefix: str) -> list[dict]:
    """The incomplete multipart uploads under prefix: [{"Key", "UploadId", ...}]; none where the
    credentials may not list them (s3:ListBucketMultipartUploads), with a warning."""
    from botocore.exceptions import ClientError

    uploads = []
    with _s3_errors(f"listing the multipart uploads under {_uri(bucket, prefix)}"):
        try:
            pages = client.get_paginator("list_multipart_uploads").paginate(
                Bucket=bucket, Prefix=f"{prefix}/" if prefix else ""
            )
            for page in pages:
                uploads += page.get("Uploads", [])
        except ClientError as e:
            if _error_code(e) not in ("AccessDenied", "403"):
                raise
            log.warning(
                "may not list the multipart uploads under %s (%s): a killed run's open uploads are "
                "not aborted (a lifecycle rule, AbortIncompleteMultipartUpload, does it)",
                _uri(bucket, prefix),
                _error_code(e),
            )
    return uploads


def _delete(client, bucket: str, keys: list[str]) -> None:
    for i in range(0, len(keys), 1000):  # delete_objects takes at most 1000 keys
        with _s3_errors(f"deleting objects under {_uri(bucket, keys[i].rpartition('/')[0])}"):
            answer = client.delete_objects(
                Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            )
        if answer.get("Errors"):
            err = answer["Errors"][0]
            raise PublishError(f"deleting {_uri(bucket, err['Key'])}: {err.get('Code')} {err.get('Message')}")


def _abort(client, bucket: str, uploads: list[dict]) -> None:
    from botocore.exceptions import ClientError

    for upload in uploads:
        with _s3_errors(f"aborting the multipart upload to {_uri(bucket, upload['Key'])}"):
            try:
                client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            except ClientError as e:
                if _error_code(e) != "NoSuchUpload":  # completed or aborted by someone else meanwhile
                    raise


def _run_of(prefix: str, key: str) -> str | None:
    """The run whose object `key` is (P/runs/<run>/...), or None."""
    parts = key[len(prefix) + 1 if prefix else 0 :].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == RUNS else None


def _named(prefix: str, doc: dict | None) -> set[str]:
    return {_key(prefix, f["key"]) for f in (doc or {}).get("files") or []}


def _nested(prefix: str, keys: list[str], named: set[str]) -> list[str]:
    """The prefixes below `prefix` that hold a manifest of their own: other publications."""
    own, tail = _key(prefix, MANIFEST), "/" + MANIFEST
    return sorted(k[: -len(tail)] for k in keys if k.endswith(tail) and k != own and k not in named)


def _below(key: str, prefixes: list[str]) -> bool:
    return any(key.startswith(p + "/") for p in prefixes)


def _refuse_nesting(client, bucket: str, prefix: str, keys: list[str], named: set[str]) -> None:
    """A publication neither sits inside another nor holds one: its prefix is its own."""
    from botocore.exceptions import ClientError

    nested = _nested(prefix, keys, named)
    if nested:
        raise PublishError(
            f"{_uri(bucket, prefix)} holds publications below it: "
            f"{', '.join(_uri(bucket, n) for n in nested)}; publish to a prefix of its own "
            "(--overwrite replaces only the publication at the prefix itself)"
        )
    parts = prefix.split("/") if prefix else []
    for parent in ("/".join(parts[:i]) for i in range(len(parts))):
        key = _key(parent, MANIFEST)
        with _s3_errors(f"checking {_uri(bucket, key)}"):
            try:
                client.head_object(Bucket=bucket, Key=key)
            except ClientError as e:
                if _error_code(e) in ("404", "NoSuchKey", "403", "AccessDenied"):
                    continue  # none, or not ours to see (a policy that grants only our prefix)
                raise
        raise PublishError(
            f"{_uri(bucket, prefix)} is inside the publication {_uri(bucket, parent)}; publish to a prefix of its own"
        )


def _pid_alive(pid) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        return True  # someone else's process, or a pid we cannot judge: alive as far as we know
    return True


def _killed(pending: dict) -> bool:
    """A claim's run is known to be gone: it ran on this host and its process no longer exists."""
    return pending.get("host") == socket.gethostname() and not _pid_alive(pending.get("pid"))


def _refuse_unless_ours(bucket: str, prefix: str, keys: list[str], doc: dict | None) -> None:
    """Without --overwrite: refuse a prefix that holds a publication, a live run, or others' objects."""
    where = _uri(bucket, prefix)
    if doc and doc.get("files"):
        raise PublishError(
            f"{where} already holds a publication ({len(doc['files'])} files, created "
            f"{doc.get('created', '?')}); pass --overwrite to replace it"
        )
    pending = (doc or {}).get("pending")
    if pending and not _killed(pending):
        raise PublishError(
            f"{where} is being published by run {pending['run']} (host {pending.get('host')}, pid "
            f"{pending.get('pid')}, since {pending.get('started')}); wait for it, or if it was "
            "killed, pass --overwrite to take over (that run then fails instead of publishing)"
        )
    own, named = _key(prefix, MANIFEST), _named(prefix, doc)
    strays = [k for k in keys if k != own and k not in named and _run_of(prefix, k) is None]
    if strays:
        raise PublishError(
            f"{where} holds {len(strays)} objects that belong to no publication "
            f"(the first: {_uri(bucket, strays[0])}): an unfinished publish of an older neuron-moe, "
            "or other data; pass --overwrite to delete them"
        )


def _sweep(client, bucket: str, prefix: str, strays: bool, refuse_nested: bool) -> tuple[int, int]:
    """Remove what no manifest can ever name again (the module docstring, step 7): the objects and
    multipart uploads of runs the manifest does not name, listed before it is read; with `strays`,
    also the objects outside runs/ that it does not name. Returns (objects removed, uploads aborted)."""
    keys, uploads = _list_keys(client, bucket, prefix), _list_uploads(client, bucket, prefix)
    try:
        doc, _ = _get_manifest(client, bucket, prefix)
    except _BadManifest:
        doc = None
    if doc is None:  # someone removed it, or wrote another: nothing is known to be garbage
        return 0, 0
    own, named = _key(prefix, MANIFEST), _named(prefix, doc)
    nested = _nested(prefix, keys, named)
    if refuse_nested:  # again, now that the claim is in place: the check before it may have raced
        _refuse_nesting(client, bucket, prefix, keys, named)
    live = {doc.get("run"), (doc.get("pending") or {}).get("run")} - {None}

    def garbage(key: str) -> bool:
        if key == own or key in named or _below(key, nested):
            return False
        run = _run_of(prefix, key)
        return strays if run is None else run not in live

    dead = [k for k in keys if garbage(k)]
    stale = [u for u in uploads if garbage(u["Key"])]
    _delete(client, bucket, dead)
    _abort(client, bucket, stale)
    return len(dead), len(stale)


class _SentBytes:
    """A file as s3transfer reads it to send it: a stream it cannot seek, so it reads each byte
    once and in order (keeping each part in memory for a retry); the CRC32 of what it sent."""

    def __init__(self, f):
        self.f, self.size, self.crc = f, 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def read(self, n: int = -1) -> bytes:
        block = self.f.read(n)
        self.size += len(block)
        self.crc = zlib.crc32(block, self.crc)
        return block

    def crc32(self) -> str:
        return base64.b64encode(self.crc.to_bytes(4, "big")).decode()


def _upload(client, bucket: str, key: str, path: Path, entry: dict, stamp, config, bar: tqdm) -> None:
    with _s3_errors(f"uploading {path} to {_uri(bucket, key)} failed, no manifest was written"), open(path, "rb") as f:
        sent = _SentBytes(f)
        client.upload_fileobj(
            sent,
            bucket,
            key,
            Config=config,
            Callback=bar.update,
            ExtraArgs={
                "ChecksumAlgorithm": "CRC32",
                "ChecksumCRC32": entry["crc32"],
                "Metadata": {"sha256": entry["sha256"]},
            },
        )
    if _stamp(path) != stamp:
        raise PublishError(
            f"{path}: changed while it was uploaded; no manifest was written (publish again once it is complete)"
        )
    if (sent.size, sent.crc32()) != (entry["size"], entry["crc32"]):
        raise PublishError(
            f"{path}: changed between its check and its upload, its size and mtime kept "
            f"({entry['size']} bytes, CRC32 {entry['crc32']} when checked; {sent.size} bytes, "
            f"CRC32 {sent.crc32()} as sent); no manifest was written"
        )
    _verify_object(client, bucket, key, path, entry)


def _verify_object(client, bucket: str, key: str, path: Path, entry: dict) -> None:
    where = _uri(bucket, key)
    with _s3_errors(f"checking {where}"):
        head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    got = {
        "size": head.get("ContentLength"),
        "crc32": head.get("ChecksumCRC32"),
        "sha256": head.get("Metadata", {}).get("sha256"),
    }
    bad = [f"{name} {got[name]!r} != {entry[name]!r}" for name in got if got[name] != entry[name]]
    # S3 names the type for multipart uploads; a single PUT's CRC32 covers the whole object by
    # definition (moto 5.2 leaves the type out there). A COMPOSITE CRC would not equal ours anyway.
    if head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        bad.append(f"checksum type {head['ChecksumType']!r} != 'FULL_OBJECT'")
    if bad:
        raise PublishError(f"{where} does not match {path} after upload: {'; '.join(bad)}")


def _abandon(client, bucket: str, prefix: str, run: str, claim: dict, claim_etag: str) -> None:
    """After a failure: this run's objects removed, its uploads aborted, its claim released (the
    manifest put back as it was before the claim, unless another run has taken P over since). Best
    effort: the failure that got here is what the user must see; a killed run leaves this to the
    next run on P."""
    try:
        doc, _ = _get_manifest(client, bucket, prefix)
        if doc is not None and doc.get("run") == run:  # interrupted after its manifest landed: published
            return
        mine = _key(prefix, f"{RUNS}/{run}")
        _delete(client, bucket, _list_keys(client, bucket, mine))
        _abort(client, bucket, _list_uploads(client, bucket, mine))
        released = {k: v for k, v in claim.items() if k != "pending"}
        with suppress(_LostRace):  # another run holds P now: no claim of ours to release
            _put_manifest(client, bucket, prefix, released, claim_etag, "")
    except (PublishError, OSError) as e:
        log.warning("cleaning up after the failed publish to %s: %s", _uri(bucket, prefix), e)


def publish(
    src_dir: Path, uri: str, *, overwrite: bool = False, deep: bool = False, progress: bool = True, client=None
) -> dict:
    """Publish every file under src_dir to uri (s3://bucket/prefix); returns the report."""
    start = time.monotonic()
    src = Path(src_dir)
    bucket, prefix = parse_uri(uri)
    where = _uri(bucket, prefix)
    files = _local_files(src)
    client = client or _client()

    keys = _list_keys(client, bucket, prefix)
    try:
        doc, etag = _get_manifest(client, bucket, prefix)
    except _BadManifest as e:
        if not overwrite:
            raise PublishError(f"{e}; pass --overwrite to replace it") from None
        doc, etag = None, e.etag
    _refuse_nesting(client, bucket, prefix, keys, _named(prefix, doc))
    if not overwrite:
        _refuse_unless_ours(bucket, prefix, keys, doc)

    total = sum(path.stat().st_size for _, path in files)
    entries, stamps = [], []
    with _bar(total, "checking", progress) as bar:
        for rel, path in files:
            entry, stamp = _check_file(rel, path, deep, bar)
            entries.append(entry)
            stamps.append(stamp)
    _check_artifact(src, entries)

    run = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(4)}"
    claim = {
        "format": FORMAT,
        **_publication(doc),
        "pending": {"run": run, "host": socket.gethostname(), "pid": os.getpid(), "started": _now()},
    }
    claim_etag = _put_manifest(
        client,
        bucket,
        prefix,
        claim,
        etag,
        f"{where} changed while this publish checked its files (another publish claimed "
        "it); nothing was written: run it again to see what the prefix holds",
    )
    try:
        removed, aborted = _sweep(client, bucket, prefix, strays=overwrite, refuse_nested=True)
        config = _transfer_config()
        for entry in entries:
            entry["key"] = f"{RUNS}/{run}/{entry['path']}"
        with _bar(sum(e["size"] for e in entries), "uploading", progress) as bar:
            for (_, path), entry, stamp in zip(files, entries, stamps):
                _upload(client, bucket, _key(prefix, entry["key"]), path, entry, stamp, config, bar)
        total = sum(e["size"] for e in entries)  # as hashed, not as first stat'ed
        manifest = {"format": FORMAT, "created": _now(), "run": run, "total_bytes": total, "files": entries}
        _put_manifest(
            client,
            bucket,
            prefix,
            manifest,
            claim_etag,
            f"another publish took {where} over while this one ran (--overwrite); this run's files "
            "were removed, its manifest not written",
        )
    except BaseException:
        _abandon(client, bucket, prefix, run, claim, claim_etag)
        raise
    swept = _sweep(client, bucket, prefix, strays=overwrite, refuse_nested=False)  # the replaced publication's
    return {
        "uri": where,
        "manifest": _uri(bucket, _key(prefix, MANIFEST)),
        "run": run,
        "files": [dict(e, key=_key(prefix, e["key"])) for e in entries],
        "total_bytes": total,
        "replaced_objects": removed + swept[0],
        "aborted_uploads": aborted + swept[1],
        "seconds": round(time.monotonic() - start, 3),
    }


# ------------------------------------------------------------------------------------------- pull


def read_manifest(uri: str, client=None) -> list[dict]:
    """The files of the publication at uri, as its manifest lists them (checked), each with its
    object's "key" under the prefix."""
    bucket, prefix = parse_uri(uri)
    where = _uri(bucket, _key(prefix, MANIFEST))
    doc, _ = _get_manifest(client or _client(), bucket, prefix)
    if doc is None:
        raise PublishError(f"no manifest at {where}: nothing was published there, or a publish did not finish")
    if not doc.get("files"):
        pending = doc.get("pending")
        raise PublishError(
            f"{_uri(bucket, prefix)} holds no publication yet: "
            + (
                f"run {pending['run']} (host {pending.get('host')}, pid {pending.get('pid')}) started publishing there "
                f"at {pending.get('started')} and has not finished (or was killed)"
                if pending
                else "the last publish there failed"
            )
        )
    return doc["files"]


def read_files(uri: str, keep: tuple[str, ...] = (), *, progress: bool = True, client=None):
    """Every file of the publication at uri read from S3, nothing written, each checked against the
    manifest's size and sha256: ({path: (size, sha256)}, {path: bytes} of the paths in `keep`)."""
    from botocore.exceptions import ClientError

    bucket, prefix = parse_uri(uri)
    client = client or _client()
    files = read_manifest(uri, client)
    found, kept = {}, {}
    with _bar(sum(f["size"] for f in files), "reading", progress) as bar:
        for entry in files:
            where = _uri(bucket, _key(prefix, entry["key"]))
            sha, size, chunks = hashlib.sha256(), 0, []
            with _s3_errors(f"reading {where}"):
                try:
                    body = client.get_object(Bucket=bucket, Key=_key(prefix, entry["key"]))["Body"]
                except ClientError as e:
                    if _error_code(e) in ("404", "NoSuchKey"):
                        raise _missing(client, bucket, prefix, _key(prefix, entry["key"]), files) from None
                    raise
                for block in body.iter_chunks(8 * 2**20):
                    sha.update(block)
                    size += len(block)
                    bar.update(len(block))
                    if entry["path"] in keep:
                        chunks.append(block)
            if (size, sha.hexdigest()) != (entry["size"], entry["sha256"]):
                raise PublishError(
                    f"{where} does not match its manifest entry: {size} bytes, sha256 {sha.hexdigest()} "
                    f"(expected {entry['size']} bytes, sha256 {entry['sha256']})"
                )
            found[entry["path"]] = (size, entry["sha256"])
            if entry["path"] in keep:
                kept[entry["path"]] = b"".join(chunks)
    return found, kept


def _missing(client, bucket: str, prefix: str, key: str, files: list[dict]) -> PublishError:
    """The error for an object that the manifest read at the start names and S3 does not hold: the
    publication was replaced since (its manifest names other files now), or it never held it (a key
    no publish wrote, or an object removed by hand)."""
    try:
        now = (_get_manifest(client, bucket, prefix)[0] or {}).get("files")
    except PublishError:
        now = None
    if now == files:
        return PublishError(
            f"{_uri(bucket, key)}: no such object, though the publication's manifest names it: the "
            "publication is damaged (an object removed, or a manifest publish did not write); publish it again"
        )
    return PublishError(
        f"{_uri(bucket, key)} is gone: the publication was replaced during this pull (publish --overwrite); pull again"
    )


def _fetch(client, bucket: str, key: str, target: Path, entry: dict, config, bar: tqdm) -> None:
    """Download into the pull's private directory and verify; a file that does not match raises
    (and the whole directory goes)."""
    from botocore.exceptions import ClientError

    with _disk_errors(target):
        target.parent.mkdir(parents=True, exist_ok=True)
    with _disk_errors(target), _s3_errors(f"downloading {_uri(bucket, key)} to {target}"):
        try:
            client.download_file(bucket, key, str(target), Config=config, Callback=bar.update)
        except ClientError as e:
            if _error_code(e) in ("404", "NoSuchKey"):
                raise _Missing(key) from e
            raise
    size, sha256, _ = file_digest(target, bar)
    if size != entry["size"] or sha256 != entry["sha256"]:
        raise PublishError(
            f"{_uri(bucket, key)} does not match its manifest entry: {size} bytes, "
            f"sha256 {sha256} (expected {entry['size']} bytes, sha256 {entry['sha256']}); "
            "nothing was written"
        )


def _pulled_mark(dest: Path) -> Path:
    """The file beside a directory a pull wrote (`.NAME.pulled`: the URI it came from): only such a
    directory, or an empty one, is ever replaced by a pull."""
    return dest.parent / f".{dest.name}.pulled"


def _restore(path: Path, text: str | None) -> None:
    """`path` as it was: holding `text`, or absent (None)."""
    if text is None:
        path.unlink(missing_ok=True)
    elif not path.is_file() or path.read_text() != text:
        path.write_text(text)


def pull_report(uri: str, dest_dir: Path, *, progress: bool = True, client=None, stall_s: float | None = None) -> dict:
    """pull(), returning the report (one row per file: downloaded, or already present).
    `stall_s`: where another pull holds DIR, wait for it instead of refusing, for as long as bytes
    keep landing; give up after stall_s seconds in which none did."""
    start = time.monotonic()
    bucket, prefix = parse_uri(uri)
    client = client or _client()
    files = read_manifest(uri, client)
    dest = Path(dest_dir).absolute()
    check_output(dest, directory=True)
    wait = None if stall_s is None else _waiter(dest, sum(f["size"] for f in files), stall_s)
    if os.path.ismount(dest):  # it could be neither renamed aside nor replaced
        raise PublishError(
            f"{dest} is a mount point; a pull replaces its directory whole: pull into a folder inside it"
        )
    with run_lock(dest, "pull", wait=wait):
        if dest.is_dir() and any(dest.iterdir()) and not _pulled_mark(dest).is_file():
            raise PublishError(
                f"{dest} holds files that no pull wrote; a pull replaces its directory whole with the "
                "publication, so it writes only a new, an empty or a pulled one: remove it, or choose another"
            )
        mark = _pulled_mark(dest)
        before = mark.read_text() if mark.is_file() else None
        try:
            with atomic_dir(dest, sweep=True) as tmp:  # sweep: holding the lock, partial siblings are dead pulls'
                rows, fetched = _pull_files(client, bucket, prefix, files, dest, tmp, progress)
                with _disk_errors(dest):  # before the rename: what it replaces was new, empty or pulled
                    mark.write_text(_uri(bucket, prefix) + "\n")
        except BaseException:  # DIR untouched (a full disk, Ctrl-C): so is its mark
            _restore(mark, before)
            raise
    return {
        "uri": _uri(bucket, prefix),
        "dest": str(dest),
        "files": rows,
        "total_bytes": sum(f["size"] for f in files),
        "downloaded_bytes": fetched,
        "seconds": round(time.monotonic() - start, 3),
    }


def _waiter(dest: Path, total: int, stall_s: float):
    """run_lock's `wait` for a pull into dest: how far the holder has got, every WAIT_LOG_S; gives up
    when nothing landed for stall_s (hashing the files it found there lands nothing: allow for that)."""
    started = last_change = time.monotonic()
    seen, next_log = -1, started

    def wait(holder: str) -> None:
        nonlocal seen, last_change, next_log
        now = time.monotonic()
        landed = _bytes_in(dest)
        if landed != seen:
            seen, last_change = landed, now
        elif now - last_change > stall_s:
            raise PublishError(
                f"{dest}: the pull by pid {holder} has landed nothing for {stall_s:g} s "
                f"({_amount(landed, total)} there, waited {now - started:.0f} s): "
                "is it stuck? Stop it, or pull into another directory"
            )
        if now >= next_log:
            log.info(
                "waiting for the pull by pid %s into %s: %s there (%.0f s)",
                holder,
                dest,
                _amount(landed, total),
                now - started,
            )
            next_log = now + WAIT_LOG_S
        time.sleep(WAIT_POLL_S)

    return wait


def _amount(part: int, total: int) -> str:
    unit, name = (2**30, "GiB") if total >= 2**30 else (2**20, "MiB")
    return f"{part / unit:.1f} of {total / unit:.1f} {name}"


def _bytes_in(dest: Path) -> int:
    """The bytes a pull into dest has landed: in its private sibling directories (`atomic_dir`'s)."""
    total = 0
    for partial in dest.parent.glob(glob.escape(f".{dest.name}.partial-") + "*"):
        for folder, _, names in os.walk(partial):
            for name in names:
                with suppress(FileNotFoundError):  # renamed or removed while we looked
                    total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _pull_files(client, bucket: str, prefix: str, files: list[dict], dest: Path, tmp: Path, progress: bool):
    """Every file of the manifest into tmp, verified: a file of dest with the manifest's sha256 is
    linked (or copied) over, any other downloaded."""
    config = _transfer_config()
    rows, fetched = [], 0
    # every byte is counted twice: downloaded, then read again for its sha256
    with _bar(2 * sum(f["size"] for f in files), "download + verify", progress) as bar:
        for entry in files:
            old, target = dest / entry["path"], tmp / entry["path"]
            row = {k: v for k, v in entry.items() if k != "key"}
            if old.is_file() and not old.is_symlink() and old.stat().st_size == entry["size"]:
                if file_digest(old, bar).sha256 == entry["sha256"]:
                    bar.update(entry["size"])
                    with _disk_errors(target):
                        target.parent.mkdir(parents=True, exist_ok=True)
                        try:
                            os.link(old, target)
                        except OSError:  # a filesystem without hard links
                            shutil.copyfile(old, target)
                    rows.append({**row, "action": "present"})
                    continue
                bar.total += entry["size"]  # read for nothing: it differs
            try:
                _fetch(client, bucket, _key(prefix, entry["key"]), target, entry, config, bar)
            except _Missing as e:
                raise _missing(client, bucket, prefix, e.key, files) from None
            fetched += entry["size"]
            rows.append({**row, "action": "downloaded"})
    return rows, fetched


@contextmanager
def _disk_errors(where: Path):
    """A full disk, a read-only or forbidden folder: one line naming the place."""
    try:
        yield
    except OSError as e:
        raise PublishError(f"writing {where}: {e.strerror or e}") from None


def pull(uri: str, dest_dir: Path, *, stall_s: float | None = None) -> Path:
    """Download the publication at uri into dest_dir, every file verified; returns dest_dir.
    `stall_s`: as pull_report's (wait for another pull into dest_dir)."""
    pull_report(uri, dest_dir, stall_s=stall_s)
    return Path(dest_dir)


def render_publish(report: dict) -> str:
    return (
        table(report["files"], [("path", "file"), ("size", "bytes"), ("sha256", "sha256"), ("crc32", "CRC32")])
        + f"\n\npublished {len(report['files'])} files ({report['total_bytes']} bytes) to {report['uri']}, "
        f"each sent with its CRC32 and verified with head_object; manifest {report['manifest']} "
        f"(run {report['run']})"
    )


def render_pull(report: dict) -> str:
    return (
        table(report["files"], [("path", "file"), ("size", "bytes"), ("sha256", "sha256"), ("action", "")])
        + f"\n\n{report['dest']}: {len(report['files'])} files verified against the manifest of {report['uri']} "
        f"({report['downloaded_bytes']} of {report['total_bytes']} bytes downloaded)"
    )
