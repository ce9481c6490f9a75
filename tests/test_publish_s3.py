"""publish / pull against moto's S3 server on 127.0.0.1 (real HTTP, fake credentials).

What moto 5.2.5 does and does not do, measured (and so what these tests can show):
- it honours IfNoneMatch="*" and IfMatch=<ETag> on PutObject (412 PreconditionFailed; IfMatch on
  a missing key: NoSuchKey), which the claim and the manifest rely on;
- for a multipart upload it computes the full-object CRC32 itself and reports ChecksumType
  FULL_OBJECT, so head_object shows what it stored;
- for a single PUT it stores the supplied CRC32 without checking it (and without the
  x-amz-sdk-checksum-algorithm header, none at all), reports no checksum type, and it never
  rejects a wrong supplied checksum (AWS answers BadDigest). So the tests check that the checksum
  is sent, and that publish itself catches bytes that differ from those it hashed.
Races between two publishers are forced with events in boto's hooks, each publisher its own
client; every wait has a deadline.
"""

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import uuid
import zipfile
import zlib
from pathlib import Path
from types import SimpleNamespace

import boto3
import pytest
import torch
from botocore.config import Config
from botocore.exceptions import ClientError, EndpointConnectionError
from moto.server import ThreadedMotoServer

from neuron_moe import cli
from neuron_moe.errors import UserError
from neuron_moe.publish import s3
from neuron_moe.publish.s3 import MANIFEST, PublishError
from neuron_moe.report import run_lock

from interrupting import assert_stopped, interrupted_run

MiB = 2**20
REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 30  # for a wait on another thread: far longer than any step here takes


@pytest.fixture(scope="module")
def moto_url():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def bucket(moto_url, monkeypatch, tmp_path):
    """A fresh bucket; boto3 (ours and the code's) reaches moto through the environment only."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_url)
    name = f"nm-{uuid.uuid4().hex[:16]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def new_client():
    # no retries, so that an injected failure is final
    return boto3.client("s3", config=Config(retries={"total_max_attempts": 1}))


@pytest.fixture
def client(bucket):
    return new_client()


@pytest.fixture
def small_parts(monkeypatch):
    """Multipart uploads from 5 MiB (S3's least part), so that an 11 MiB file is three parts."""
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 5 * MiB)
    monkeypatch.setattr(s3, "MULTIPART_CHUNKSIZE", 5 * MiB)


def write_artifacts(src: Path, seed: int = 0) -> Path:
    (src / "neff").mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    torch.save({"w": torch.randn(256, 256, generator=gen), "b": torch.randn(256, generator=gen)}, src / "model.pt")
    (src / "neff" / "graph.neff").write_bytes(os.urandom(300_000))
    (src / "config.json").write_text(f'{{"tp_degree": 2, "seed": {seed}}}\n')
    return src


@pytest.fixture
def artifacts(tmp_path):
    return write_artifacts(tmp_path / "artifacts")


def crc32_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def keys(client, bucket, prefix):
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def uploads(client, bucket, prefix):
    """The incomplete multipart uploads under prefix."""
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])]


def manifest(client, bucket, prefix):
    return json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST}")["Body"].read())


def publication_keys(client, bucket, prefix):
    """What a prefix holding one publication and nothing else lists: its manifest and its files."""
    files = manifest(client, bucket, prefix)["files"]
    return sorted([f"{prefix}/{MANIFEST}"] + [f"{prefix}/{f['key']}" for f in files])


def tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def flip_a_byte_keeping_size_and_mtime(path: Path, offset: int) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_round_trip_through_the_cli(bucket, client, artifacts, tmp_path, capsys):
    uri = f"s3://{bucket}/models/tiny/v1"
    assert cli.main(["publish", str(artifacts), uri, "--deep", "--json", str(tmp_path / "pub.json")]) == 0
    report = json.loads((tmp_path / "pub.json").read_text())
    assert report["manifest"] == f"{uri}/{MANIFEST}" and report["replaced_objects"] == 0
    assert {f["path"] for f in report["files"]} == {"model.pt", "neff/graph.neff", "config.json"}
    assert "published 3 files" in capsys.readouterr().out

    local = tree(artifacts)
    published = manifest(client, bucket, "models/tiny/v1")
    assert published["format"] == s3.FORMAT and "pending" not in published and published["run"] == report["run"]
    assert {f["path"]: f["sha256"] for f in published["files"]} == {
        rel: hashlib.sha256(data).hexdigest() for rel, data in local.items()
    }
    for entry in published["files"]:  # each under the run's own key, as the manifest names it
        assert entry["key"] == f"runs/{report['run']}/{entry['path']}"
        data = local[entry["path"]]
        head = client.head_object(Bucket=bucket, Key=f"models/tiny/v1/{entry['key']}", ChecksumMode="ENABLED")
        assert head["ContentLength"] == len(data)
        assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
        assert head["ChecksumCRC32"] == crc32_b64(data) == entry["crc32"]
    assert keys(client, bucket, "models/") == publication_keys(client, bucket, "models/tiny/v1")

    dest = tmp_path / "pulled"
    assert cli.main(["pull", uri, str(dest), "--json", "-"]) == 0
    pulled = json.loads(capsys.readouterr().out)
    assert tree(dest) == local  # byte-identical, and no temp file left beside them
    assert {r["action"] for r in pulled["files"]} == {"downloaded"}
    assert pulled["downloaded_bytes"] == sum(map(len, local.values()))

    # the function `serve --artifacts s3://...` calls: verified files already there are kept
    assert s3.pull(uri, dest) == dest
    again = s3.pull_report(uri, dest, progress=False)
    assert {r["action"] for r in again["files"]} == {"present"} and again["downloaded_bytes"] == 0
    (dest / "config.json").write_text('{"tp_degree": 9, "seed": 0}\n')  # same size, other bytes: replaced
    again = s3.pull_report(uri, dest, progress=False)
    assert {r["path"]: r["action"] for r in again["files"]} == {
        "config.json": "downloaded",
        "model.pt": "present",
        "neff/graph.neff": "present",
    }
    assert tree(dest) == local


def test_the_checksum_goes_with_the_upload_for_the_server_to_verify(bucket, client, tmp_path, small_parts):
    """AWS checks a supplied checksum against the bytes it receives (BadDigest): a single PUT carries
    the file's CRC32, a multipart upload its full-object CRC32 on CompleteMultipartUpload (and each
    part its own); head_object then reports it."""
    src = tmp_path / "src"
    src.mkdir()
    small, big = os.urandom(1000), os.urandom(11 * MiB)
    (src / "big.bin").write_bytes(big)
    (src / "small.bin").write_bytes(small)
    sent = []

    def record(request, **_):
        sent.append((request.method, request.url, dict(request.headers)))

    client.meta.events.register("before-send.s3.PutObject", record)
    client.meta.events.register("before-send.s3.UploadPart", record)
    client.meta.events.register("before-send.s3.CompleteMultipartUpload", record)
    report = s3.publish(src, f"s3://{bucket}/mp", progress=False, client=client)
    key = {f["path"]: f["key"] for f in report["files"]}

    def headers(method, suffix):
        found = [h for m, url, h in sent if m == method and url.split("?")[0].endswith(suffix)]
        assert found, f"no {method} of {suffix}"
        return found

    [put] = headers("PUT", key["small.bin"])
    assert put["x-amz-checksum-crc32"] == crc32_b64(small).encode()
    assert put["x-amz-sdk-checksum-algorithm"] == b"CRC32"
    [complete] = headers("POST", key["big.bin"])
    assert complete["x-amz-checksum-crc32"] == crc32_b64(big).encode()
    assert complete["x-amz-checksum-type"] == b"FULL_OBJECT"
    parts = {
        int(re.search(r"partNumber=(\d+)", url)[1]): h["x-amz-checksum-crc32"]
        for m, url, h in sent
        if m == "PUT" and "partNumber=" in url
    }  # sent in parallel: any order
    assert parts == {1 + i // (5 * MiB): crc32_b64(big[i : i + 5 * MiB]).encode() for i in range(0, len(big), 5 * MiB)}
    head = client.head_object(Bucket=bucket, Key=key["big.bin"], ChecksumMode="ENABLED")
    assert head["ETag"].endswith('-3"')  # three parts were sent
    assert head["ChecksumType"] == "FULL_OBJECT" and head["ChecksumCRC32"] == crc32_b64(big)


@pytest.mark.parametrize("size", [300_000, 6 * MiB], ids=["single PUT", "multipart"])
def test_a_file_changed_after_its_check_is_never_reported_published(
    bucket, client, tmp_path, monkeypatch, small_parts, size
):
    """The file changes after it was hashed, keeping its size and mtime (so no stat can see it). AWS
    would reject the upload (BadDigest); moto stores what it is sent, and for a single PUT echoes
    back the CRC32 it was given: publish must see it itself."""
    src = tmp_path / "src"
    src.mkdir()
    path = src / "weights.bin"
    path.write_bytes(os.urandom(size))
    digest = s3.file_digest

    def digest_then_change(p, bar=None):
        result = digest(p, bar)
        flip_a_byte_keeping_size_and_mtime(p, size - 7)
        return result

    monkeypatch.setattr(s3, "file_digest", digest_then_change)
    uri = f"s3://{bucket}/v1"
    with pytest.raises(
        PublishError,
        match=r"weights\.bin: changed between its check and its upload, its size and "
        r"mtime kept .* no manifest was written",
    ):
        s3.publish(src, uri, progress=False, client=client)
    with pytest.raises(PublishError, match=r"holds no publication yet: the last publish there failed"):
        s3.read_manifest(uri, client)
    assert keys(client, bucket, "v1/") == [f"v1/{MANIFEST}"] and uploads(client, bucket, "v1/") == []
    monkeypatch.setattr(s3, "file_digest", digest)
    s3.publish(src, uri, progress=False, client=client)  # the failed run released its claim: no --overwrite
    assert tree(s3.pull(uri, tmp_path / "dest")) == tree(src)


def test_head_object_must_report_what_was_hashed(bucket, client, artifacts):
    """Bytes that reach the server otherwise than sent (here: another writer, between the upload and
    its check) are caught by comparing head_object's CRC32 with the local one."""
    other = boto3.client("s3")

    def someone_else_writes(params, **_):
        if params["Key"].endswith("/config.json"):
            other.put_object(
                Bucket=params["Bucket"],
                Key=params["Key"],
                Body=b'{"tp_degree": 2, "seed": 9}\n',
                ChecksumAlgorithm="CRC32",
            )

    client.meta.events.register("before-parameter-build.s3.HeadObject", someone_else_writes)
    with pytest.raises(PublishError, match=r"config\.json does not match .*config\.json after upload: crc32"):
        s3.publish(artifacts, f"s3://{bucket}/v1", progress=False, client=client)
    assert keys(client, bucket, "v1/") == [f"v1/{MANIFEST}"]


def test_truncated_pt_is_refused_before_anything_is_sent(bucket, client, artifacts):
    pt = artifacts / "model.pt"
    pt.write_bytes(pt.read_bytes()[: pt.stat().st_size // 2])
    with pytest.raises(PublishError, match=r"model\.pt: not a complete zip archive"):
        s3.publish(artifacts, f"s3://{bucket}/v1", progress=False, client=client)
    assert keys(client, bucket, "") == []


def test_deep_check_finds_a_corrupt_member_the_quick_check_lets_through(bucket, client, artifacts):
    pt = artifacts / "model.pt"
    with zipfile.ZipFile(pt) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)  # the 256x256 tensor's storage
    raw = bytearray(pt.read_bytes())
    name_len, extra_len = (
        int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    raw[info.header_offset + 30 + name_len + extra_len + 1000] ^= 0xFF  # inside the member's data
    pt.write_bytes(bytes(raw))

    with pytest.raises(PublishError, match=rf"model\.pt: member '{info.filename}' fails its CRC check"):
        s3.publish(artifacts, f"s3://{bucket}/deep", deep=True, progress=False, client=client)
    assert keys(client, bucket, "") == []
    s3.publish(artifacts, f"s3://{bucket}/quick", progress=False, client=client)  # the zip's directory is intact


def test_a_file_growing_while_read_is_refused(bucket, client, artifacts, monkeypatch):
    digest = s3.file_digest

    def digest_while_a_writer_appends(path, bar=None):
        result = digest(path, bar)
        if path.name == "graph.neff":
            with open(path, "ab") as f:
                f.write(b"more")
        return result

    monkeypatch.setattr(s3, "file_digest", digest_while_a_writer_appends)
    with pytest.raises(PublishError, match=r"graph\.neff: changed while it was read \(300000 -> 300004 bytes\)"):
        s3.publish(artifacts, f"s3://{bucket}/v1", progress=False, client=client)
    assert keys(client, bucket, "") == []


def test_a_file_changing_during_its_upload_leaves_no_publication(bucket, client, artifacts):
    target = artifacts / "neff" / "graph.neff"

    def append(request, **_):
        if request.url.endswith("/graph.neff"):
            with open(target, "ab") as f:
                f.write(b"more")

    client.meta.events.register("before-send.s3.PutObject", append)
    with pytest.raises(PublishError, match=r"graph\.neff: changed while it was uploaded; no manifest"):
        s3.publish(artifacts, f"s3://{bucket}/v1", progress=False, client=client)
    assert keys(client, bucket, "v1/") == [f"v1/{MANIFEST}"]  # the claim, released; the files removed
    assert "files" not in manifest(client, bucket, "v1") and "pending" not in manifest(client, bucket, "v1")


def test_failure_mid_upload_removes_the_run_and_a_rerun_needs_no_overwrite(
    bucket, client, tmp_path, small_parts, capsys
):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a-small.bin").write_bytes(os.urandom(1000))
    (src / "b-big.bin").write_bytes(os.urandom(11 * MiB))
    uri = f"s3://{bucket}/v1"
    small_uploaded = []

    def drop_part_2(request, **_):
        if "partNumber=2" in request.url:
            raise EndpointConnectionError(endpoint_url=request.url)

    def note(request, **_):
        small_uploaded.append(request.url.endswith("/a-small.bin"))

    client.meta.events.register("before-send.s3.UploadPart", drop_part_2)
    client.meta.events.register("before-send.s3.PutObject", note)
    with pytest.raises(PublishError, match=rf"uploading .*b-big\.bin to {uri}/runs/.*/b-big\.bin failed, no manifest"):
        s3.publish(src, uri, progress=False, client=client)
    assert any(small_uploaded)  # it did fail mid-way, after one file
    assert keys(client, bucket, "v1/") == [f"v1/{MANIFEST}"] and uploads(client, bucket, "v1/") == []

    assert cli.main(["pull", uri, str(tmp_path / "dest")]) == 2
    assert f"{uri} holds no publication yet: the last publish there failed" in capsys.readouterr().err
    client.meta.events.unregister("before-send.s3.UploadPart", drop_part_2)
    report = s3.publish(src, uri, progress=False, client=client)
    assert report["replaced_objects"] == 0 and report["aborted_uploads"] == 0
    assert tree(s3.pull(uri, tmp_path / "dest")) == tree(src)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_refused_pull_leaves_the_destination_as_it_was(bucket, client, artifacts, tmp_path, damage):
    """A pulled directory, then a new publication there with an object rotten at rest: the pull is
    refused by the object's name and the directory is byte for byte the first pull's, with nothing
    beside it."""
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    dest = s3.pull(uri, tmp_path / "dest")
    before, siblings = tree(dest), sorted(p.name for p in tmp_path.iterdir())

    (artifacts / "config.json").write_text('{"tp_degree": 4, "seed": 0}\n')
    (artifacts / "extra.bin").write_bytes(os.urandom(1000))
    report = s3.publish(artifacts, uri, overwrite=True, progress=False, client=client)
    key = next(f["key"] for f in report["files"] if f["path"] == "extra.bin")  # one to download
    good = (artifacts / "extra.bin").read_bytes()
    bad = bytes([good[0] ^ 1]) + good[1:] if damage == "flipped byte" else good[:-10]
    client.put_object(Bucket=bucket, Key=key, Body=bad)  # rot at rest, after publishing

    with pytest.raises(PublishError, match=rf"{key} does not match its manifest entry"):
        s3.pull(uri, dest)
    assert tree(dest) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == siblings  # no partial directory left


def test_second_publish_is_refused_and_overwrite_replaces_it(bucket, client, artifacts, tmp_path, capsys):
    uri = f"s3://{bucket}/v1"
    first = s3.publish(artifacts, uri, progress=False, client=client)
    assert cli.main(["publish", str(artifacts), uri]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {uri} already holds a publication (3 files, created ")
    assert err.rstrip().endswith("pass --overwrite to replace it") and err.count("\n") == 1

    (artifacts / "neff" / "graph.neff").unlink()
    (artifacts / "config.json").write_text('{"tp_degree": 8}\n')
    report = s3.publish(artifacts, uri, overwrite=True, progress=False, client=client)
    assert report["replaced_objects"] == 3 and report["run"] != first["run"]  # the first run's files
    assert keys(client, bucket, "v1/") == publication_keys(client, bucket, "v1")
    assert tree(s3.pull(uri, tmp_path / "dest")) == tree(artifacts)


def test_conditional_writes_hold_on_this_server(client, bucket):
    """What the claim and the manifest rely on: moto's conditional PutObject."""
    etag = client.put_object(Bucket=bucket, Key="probe", Body=b"1", IfNoneMatch="*")["ETag"]
    with pytest.raises(ClientError, match="PreconditionFailed"):
        client.put_object(Bucket=bucket, Key="probe", Body=b"2", IfNoneMatch="*")
    newer = client.put_object(Bucket=bucket, Key="probe", Body=b"2", IfMatch=etag)["ETag"]
    with pytest.raises(ClientError, match="PreconditionFailed"):
        client.put_object(Bucket=bucket, Key="probe", Body=b"3", IfMatch=etag)
    assert client.get_object(Bucket=bucket, Key="probe")["ETag"] == newer


# ------------------------------------------------------------------------- who may write a prefix


def test_a_prefix_above_publications_is_refused_by_name_and_overwrite_never_deletes_them(
    bucket, client, artifacts, tmp_path, capsys
):
    for version in ("v1", "v2"):
        s3.publish(artifacts, f"s3://{bucket}/p/{version}", progress=False, client=client)
    before = keys(client, bucket, "p/")
    for overwrite in (["--overwrite"], []):
        assert cli.main(["publish", str(artifacts), f"s3://{bucket}/p", *overwrite]) == 2
        assert keys(client, bucket, "p/") == before
        assert capsys.readouterr().err == (
            f"error: s3://{bucket}/p holds publications below it: s3://{bucket}/p/v1, s3://{bucket}/p/v2; publish "
            "to a prefix of its own (--overwrite replaces only the publication at the prefix itself)\n"
        )
    assert cli.main(["publish", str(artifacts), f"s3://{bucket}/p/v1/sub", "--overwrite"]) == 2
    assert f"s3://{bucket}/p/v1/sub is inside the publication s3://{bucket}/p/v1;" in capsys.readouterr().err
    assert keys(client, bucket, "p/") == before

    # one prefix, one spelling: '//' and a trailing '/' name p/v1 itself, which --overwrite replaces
    (artifacts / "config.json").write_text('{"tp_degree": 4}\n')
    report = s3.publish(artifacts, f"s3://{bucket}//p//v1/", overwrite=True, progress=False, client=client)
    assert report["uri"] == f"s3://{bucket}/p/v1" and report["replaced_objects"] == 3
    assert keys(client, bucket, "p/") == sorted(
        publication_keys(client, bucket, "p/v1") + publication_keys(client, bucket, "p/v2")
    )
    assert tree(s3.pull(f"s3://{bucket}/p/v1", tmp_path / "v1")) == tree(artifacts)
    assert s3.pull_report(f"s3://{bucket}/p/v2", tmp_path / "v2", progress=False, client=client)["files"]
    with pytest.raises(PublishError, match=r"p/\.\./v1: a '\.' or '\.\.' segment in the prefix"):
        s3.parse_uri(f"s3://{bucket}/p/../v1")


def _publisher(name, src, uri, results, hooks, overwrite=False):
    """A thread publishing src to uri with its own client, `hooks` {event: handler} on it; its
    report or PublishError lands in results[name]."""
    client = new_client()
    for event, handler in hooks.items():
        client.meta.events.register(event, handler)

    def run():
        try:
            results[name] = s3.publish(src, uri, overwrite=overwrite, progress=False, client=client)
        except PublishError as e:
            results[name] = e

    return threading.Thread(target=run, name=name)


def test_two_publishers_racing_to_one_prefix_never_break_the_winner(bucket, client, tmp_path):
    """Both find the prefix empty; a barrier holds each at its first write until both are there;
    then the first runs to its end before the second goes on."""
    a, b = write_artifacts(tmp_path / "a", seed=1), write_artifacts(tmp_path / "b", seed=2)
    uri = f"s3://{bucket}/v1"
    barrier, first_done, results = threading.Barrier(2, timeout=DEADLINE_S), threading.Event(), {}

    def first_write(second: bool):
        wrote = []

        def hook(params, **_):
            if not wrote:
                wrote.append(params["Key"])
                barrier.wait()
                if second and not first_done.wait(DEADLINE_S):
                    raise RuntimeError("the first publisher never finished")

        return hook

    threads = [
        _publisher(
            name,
            src,
            uri,
            results,
            {f"before-parameter-build.s3.{op}": hook for op in ("PutObject", "CreateMultipartUpload")},
        )
        for name, src, hook in (("a", a, first_write(False)), ("b", b, first_write(True)))
    ]
    threads[0].start()
    threads[1].start()
    threads[0].join(DEADLINE_S)
    first_done.set()
    threads[1].join(DEADLINE_S)
    assert tree(s3.pull(uri, tmp_path / "dest")) == tree(a)  # the winner's publication, whole
    assert keys(client, bucket, "v1/") == publication_keys(client, bucket, "v1")
    assert isinstance(results["a"], dict), results["a"]
    assert isinstance(results["b"], PublishError)
    assert (
        f"{uri} changed while this publish checked its files (another publish claimed it); nothing was "
        "written" in str(results["b"])
    )


def test_an_overwrite_that_takes_over_a_running_publish_leaves_only_its_own(bucket, client, tmp_path):
    """A is held after its first file; B (--overwrite) publishes from start to end meanwhile; then A
    goes on. A's later files must neither land in B's publication nor stay behind."""
    a, b = write_artifacts(tmp_path / "a", seed=1), write_artifacts(tmp_path / "b", seed=2)
    uri = f"s3://{bucket}/v1"
    paused, resume, results, data_puts = threading.Event(), threading.Event(), {}, []

    def hold_before_the_second_file(params, **_):
        if params["Key"].endswith(MANIFEST):
            return
        data_puts.append(params["Key"])
        if len(data_puts) == 2:
            paused.set()
            if not resume.wait(DEADLINE_S):
                raise RuntimeError("B never finished")

    thread = _publisher("a", a, uri, results, {"before-parameter-build.s3.PutObject": hold_before_the_second_file})
    thread.start()
    try:
        assert paused.wait(DEADLINE_S)
        report = s3.publish(b, uri, overwrite=True, progress=False, client=new_client())
    finally:
        resume.set()
        thread.join(DEADLINE_S)
    assert tree(s3.pull(uri, tmp_path / "dest")) == tree(b)
    assert keys(client, bucket, "v1/") == publication_keys(client, bucket, "v1")
    assert uploads(client, bucket, "v1/") == []
    assert report["replaced_objects"] == 1  # A's first file
    assert isinstance(results["a"], PublishError)
    assert f"another publish took {uri} over while this one ran (--overwrite); this run's files were removed" in str(
        results["a"]
    )


def test_a_manifest_write_whose_first_try_landed_is_not_taken_for_a_lost_race(bucket, client, artifacts, tmp_path):
    """boto retries a PUT whose answer was lost; the retry's condition then fails on the first try's
    own write. Here each manifest write (the claim, then the manifest) reaches S3 once before it is sent."""
    other = boto3.client("s3")
    landed = []

    def first_try_lands(request, **_):
        if request.url.split("?")[0].endswith(MANIFEST):
            condition = {k: v for k, v in request.headers.items() if k.lower() in ("if-match", "if-none-match")}
            [(name, value)] = condition.items()
            value = value.decode() if isinstance(value, bytes) else value
            body = request.body
            if not isinstance(body, bytes):  # a stream: read it, and put it back for the request itself
                position = body.tell()
                body, _ = body.read(), body.seek(position)
            other.put_object(
                Bucket=bucket,
                Key=f"v1/{MANIFEST}",
                Body=body,
                **({"IfMatch": value} if name.lower() == "if-match" else {"IfNoneMatch": value}),
            )
            landed.append(name.lower())

    client.meta.events.register("before-send.s3.PutObject", first_try_lands)
    uri = f"s3://{bucket}/v1"
    report = s3.publish(artifacts, uri, progress=False, client=client)
    assert landed == ["if-none-match", "if-match"]
    assert keys(client, bucket, "v1/") == publication_keys(client, bucket, "v1")  # its files were kept
    assert manifest(client, bucket, "v1")["run"] == report["run"]
    assert tree(s3.pull(uri, tmp_path / "dest")) == tree(artifacts)


def test_a_run_in_progress_is_refused_by_name_and_overwrite_takes_it_over(bucket, client, artifacts, tmp_path, capsys):
    run = "20250101T000000Z-0badf00d"
    claim = {
        "format": s3.FORMAT,
        "pending": {"run": run, "host": "another-host", "pid": 4242, "started": "2025-01-01T00:00:00+00:00"},
    }
    client.put_object(Bucket=bucket, Key=f"v1/{MANIFEST}", Body=json.dumps(claim).encode())
    client.put_object(Bucket=bucket, Key=f"v1/runs/{run}/model.pt", Body=b"half of it")
    uri = f"s3://{bucket}/v1"
    assert cli.main(["publish", str(artifacts), uri]) == 2
    assert (
        f"error: {uri} is being published by run {run} (host another-host, pid 4242, since "
        "2025-01-01T00:00:00+00:00); wait for it, or if it was killed, pass --overwrite"
    ) in capsys.readouterr().err
    with pytest.raises(PublishError, match=rf"{uri} holds no publication yet: run {run} .* has not finished"):
        s3.pull(uri, tmp_path / "dest")
    report = s3.publish(artifacts, uri, overwrite=True, progress=False, client=client)
    assert report["replaced_objects"] == 1
    assert keys(client, bucket, "v1/") == publication_keys(client, bucket, "v1")


KILLED_AFTER_ITS_FIRST_PART = """
import os, signal, sys
import boto3
from neuron_moe.publish import s3
s3.MULTIPART_THRESHOLD = s3.MULTIPART_CHUNKSIZE = 5 * 2**20
client = boto3.client("s3")
client.meta.events.register("after-call.s3.UploadPart", lambda **_: os.kill(os.getpid(), signal.SIGKILL))
s3.publish(sys.argv[1], sys.argv[2], progress=False, client=client)
"""


@pytest.mark.parametrize("overwrite", [False, True], ids=["rerun", "rerun --overwrite"])
def test_the_run_after_a_killed_publish_aborts_its_open_upload(bucket, client, tmp_path, small_parts, overwrite):
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(11 * MiB))
    uri = f"s3://{bucket}/v1"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_ITS_FIRST_PART, str(src), uri],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-3000:]
    left_open = uploads(client, bucket, "v1/")
    assert len(left_open) == 1  # S3 keeps (and bills) its parts until someone aborts it

    # the killed run's claim names this host and a pid that is gone: a rerun takes it over
    report = s3.publish(src, uri, overwrite=overwrite, progress=False, client=client)
    assert uploads(client, bucket, "v1/") == [] and report["aborted_uploads"] == 1
    assert keys(client, bucket, "v1/") == publication_keys(client, bucket, "v1")
    assert tree(s3.pull(uri, tmp_path / "dest")) == tree(src)


def test_credentials_that_may_not_list_uploads_still_publish(bucket, client, artifacts, caplog):
    """A policy without s3:ListBucketMultipartUploads: publish works, and says what it cannot do."""

    def access_denied(**_):
        return SimpleNamespace(status_code=403), {
            "Error": {"Code": "AccessDenied", "Message": "Access Denied"},
            "ResponseMetadata": {"HTTPStatusCode": 403},
        }

    client.meta.events.register("before-call.s3.ListMultipartUploads", access_denied)
    s3.publish(artifacts, f"s3://{bucket}/v1", progress=False, client=client)
    assert keys(client, bucket, "v1/") == publication_keys(client, bucket, "v1")
    assert "a killed run's open uploads are not aborted" in caplog.text


def test_a_publication_in_the_first_layout_is_read_and_replaced_whole(bucket, client, artifacts, tmp_path):
    """neuron-moe-artifacts/1 put each file at P/<path>: pull reads it, --overwrite replaces it."""
    files = tree(artifacts)
    for rel, data in files.items():
        client.put_object(Bucket=bucket, Key=f"old/{rel}", Body=data)
    first = {
        "format": s3.FORMAT_V1,
        "created": "2025-01-01T00:00:00+00:00",
        "total_bytes": sum(map(len, files.values())),
        "files": [
            {"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "crc32": crc32_b64(data)}
            for rel, data in files.items()
        ],
    }
    client.put_object(Bucket=bucket, Key=f"old/{MANIFEST}", Body=json.dumps(first).encode())
    uri = f"s3://{bucket}/old"
    assert tree(s3.pull(uri, tmp_path / "first")) == files
    with pytest.raises(PublishError, match=rf"{uri} already holds a publication \(3 files, created 2025-01-01"):
        s3.publish(artifacts, uri, progress=False, client=client)

    (artifacts / "config.json").write_text('{"tp_degree": 4}\n')
    report = s3.publish(artifacts, uri, overwrite=True, progress=False, client=client)
    assert report["replaced_objects"] == 3  # the first layout's files
    assert keys(client, bucket, "old/") == publication_keys(client, bucket, "old")
    assert tree(s3.pull(uri, tmp_path / "second")) == tree(artifacts)


def test_objects_of_no_publication_need_overwrite(bucket, client, artifacts, capsys):
    client.put_object(Bucket=bucket, Key="v1/notes.txt", Body=b"someone's")
    uri = f"s3://{bucket}/v1"
    assert cli.main(["publish", str(artifacts), uri]) == 2
    assert (
        f"error: {uri} holds 1 objects that belong to no publication (the first: {uri}/notes.txt)"
        in capsys.readouterr().err
    )
    assert s3.publish(artifacts, uri, overwrite=True, progress=False, client=client)["replaced_objects"] == 1
    assert keys(client, bucket, "v1/") == publication_keys(client, bucket, "v1")


# ----------------------------------------------------------------------------------------- pull


def test_pulled_files_get_the_mode_open_would_give(bucket, client, artifacts, tmp_path, umask_027):
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    dest = s3.pull(uri, tmp_path / "dest")
    modes = {p.relative_to(dest).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in dest.rglob("*")}
    assert modes == {"config.json": 0o640, "model.pt": 0o640, "neff": 0o750, "neff/graph.neff": 0o640}


def _waiting_logged(caplog) -> bool:
    return any("waiting for the pull by pid" in r.getMessage() for r in caplog.records)


def test_a_second_server_on_a_shared_cache_waits_for_the_first_pull(
    bucket, client, tiny_port, tmp_path, monkeypatch, caplog, one_torch_thread
):
    """Two servers, one --artifacts s3://... and one --artifacts-cache: the second waits for the
    first's pull (saying how far it got), then loads from the cache after verifying it."""
    from neuron_moe.checkpoint import save_checkpoint
    from neuron_moe.model import build_model
    from neuron_moe.serve.server import plan_load, s3_cache_dir

    model = build_model(tiny_port)
    published = save_checkpoint(model, tmp_path / "published")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (published / name).write_bytes((tiny_port.checkpoint / name).read_bytes())
    uri = f"s3://{bucket}/tiny"
    s3.publish(published, uri, progress=False, client=client)
    cache = tmp_path / "cache"
    monkeypatch.setattr(s3, "WAIT_POLL_S", 0.05, raising=False)
    fetched = []
    fetch = s3._fetch
    monkeypatch.setattr(s3, "_fetch", lambda *a: (fetched.append(threading.current_thread().name), fetch(*a))[1])

    go, held = threading.Event(), threading.Event()
    slow = new_client()

    def hold_the_first_download(params, **_):
        if not params["Key"].endswith(MANIFEST):
            held.set()
            if not go.wait(DEADLINE_S):
                raise RuntimeError("never let go")

    slow.meta.events.register("before-parameter-build.s3.GetObject", hold_the_first_download)
    results = {}

    def first_server():
        results["first"] = s3.pull_report(uri, s3_cache_dir(uri, cache), progress=False, client=slow)

    def second_server():
        try:
            _, load = plan_load(cli.serve_config(["serve", "--artifacts", uri, "--artifacts-cache", str(cache)]))
            results["second"] = load()
        except Exception as e:  # what the server would exit with
            results["second"] = e

    first, second = (
        threading.Thread(target=first_server, name="first"),
        threading.Thread(target=second_server, name="second"),
    )
    caplog.set_level("INFO", logger="neuron_moe.publish.s3")
    first.start()
    try:
        assert held.wait(DEADLINE_S)
        second.start()
        deadline = threading.Event()
        for _ in range(int(DEADLINE_S / 0.05)):
            if _waiting_logged(caplog) or not second.is_alive():
                break
            deadline.wait(0.05)
        assert _waiting_logged(caplog), results.get("second")
    finally:
        go.set()
        first.join(DEADLINE_S)
        if second.ident is not None:
            second.join(DEADLINE_S)
    engine = results["second"]
    assert not isinstance(engine, Exception), engine
    assert {r["action"] for r in results["first"]["files"]} == {"downloaded"}
    assert set(fetched) == {"first"}  # the second downloaded nothing: it verified the first's files
    assert torch.equal(engine.runtime.model.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_republished_checkpoint_served_from_a_used_cache_is_the_new_one(
    bucket, client, tiny_port, tmp_path, one_torch_thread
):
    """A sharded checkpoint (index + shards) served through --artifacts s3://... and a cache, then
    re-published --overwrite as one model.safetensors of other weights: the next server loads the
    new weights (the old index, which the loader would prefer, is gone from the cache)."""
    from neuron_moe.checkpoint import save_checkpoint
    from neuron_moe.model import build_model
    from neuron_moe.serve.server import plan_load

    from conftest import reseeded

    def publish(seed, shard_bytes, overwrite):
        model = build_model(reseeded(tiny_port, seed))
        out = save_checkpoint(model, tmp_path / f"published-{seed}", shard_bytes=shard_bytes)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).write_bytes((tiny_port.checkpoint / name).read_bytes())
        s3.publish(out, uri, overwrite=overwrite, progress=False, client=client)
        return model, sorted(p.name for p in out.iterdir())

    def serve():
        config = cli.serve_config(["serve", "--artifacts", uri, "--artifacts-cache", str(tmp_path / "cache")])
        return plan_load(config)[1]().runtime.model.model.embed_tokens.weight

    uri = f"s3://{bucket}/tiny"
    first, files = publish(1, 2 * MiB, overwrite=False)
    assert "model.safetensors.index.json" in files and len([f for f in files if f.startswith("model-")]) >= 2
    assert torch.equal(serve(), first.model.embed_tokens.weight)
    second, files = publish(2, None, overwrite=True)
    assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    assert not torch.equal(second.model.embed_tokens.weight, first.model.embed_tokens.weight)
    assert torch.equal(serve(), second.model.embed_tokens.weight)


def test_a_pull_waiting_on_a_stuck_one_gives_up(bucket, client, artifacts, tmp_path, monkeypatch):
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    monkeypatch.setattr(s3, "WAIT_POLL_S", 0.05)
    dest = tmp_path / "pulled"
    total = sum(map(len, tree(artifacts).values()))
    stuck = re.escape(
        f"{dest}: the pull by pid {os.getpid()} has landed nothing for 0.3 s (0.0 of {total / MiB:.1f} "
        "MiB there, waited 0 s)"
    )
    with run_lock(dest, "pull"), pytest.raises(PublishError, match=stuck + r": is it stuck\?"):  # held; nothing lands
        s3.pull_report(uri, dest, progress=False, client=client, stall_s=0.3)
    assert not dest.exists()


def test_pull_refuses_a_manifest_that_points_outside_dir(bucket, client, tmp_path):
    manifest = {"format": s3.FORMAT, "files": [{"path": "../escaped", "size": 1, "sha256": "0" * 64}]}
    client.put_object(Bucket=bucket, Key=f"v1/{MANIFEST}", Body=json.dumps(manifest).encode())
    with pytest.raises(PublishError, match=r"files\[0\]\.path '\.\./escaped' is not a plain relative path"):
        s3.pull(f"s3://{bucket}/v1", tmp_path / "dest")
    manifest["files"][0].update(path="model.pt", key="../../elsewhere/model.pt")  # an object outside the prefix
    client.put_object(Bucket=bucket, Key=f"v1/{MANIFEST}", Body=json.dumps(manifest).encode())
    with pytest.raises(PublishError, match=r"files\[0\]\.key '\.\./\.\./elsewhere/model\.pt' is not a plain relative"):
        s3.pull(f"s3://{bucket}/v1", tmp_path / "dest")
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "dest").exists()


def test_bad_input_errors_name_the_problem(bucket, client, artifacts, tmp_path):
    with pytest.raises(PublishError, match=r"not an S3 URI: 'bucket/prefix'"):
        s3.publish(artifacts, "bucket/prefix", progress=False, client=client)
    with pytest.raises(PublishError, match=r"listing s3://nm-no-such-bucket/v1: .*NoSuchBucket"):
        s3.publish(artifacts, "s3://nm-no-such-bucket/v1", progress=False, client=client)
    (artifacts / ".model.pt.tmp123").write_bytes(b"half")
    with pytest.raises(PublishError, match=r"\.model\.pt\.tmp123: a hidden file"):
        s3.publish(artifacts, f"s3://{bucket}/v1", progress=False, client=client)
    with pytest.raises(PublishError, match=r"empty: no files to publish"):
        (tmp_path / "empty").mkdir()
        s3.publish(tmp_path / "empty", f"s3://{bucket}/v1", progress=False, client=client)


def test_a_killed_pulls_leftovers_are_removed_by_the_next_pull(bucket, client, artifacts, tmp_path):
    """A killed pull leaves its private sibling of DIR (`.DIR.partial-*`, files half downloaded in
    it); the next pull, holding the lock, removes it, and DIR holds exactly the publication."""
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    dest = tmp_path / "pulled"
    partial = tmp_path / ".pulled.partial-k2j4h1x0"
    (partial / "neff").mkdir(parents=True)
    (partial / "neff" / "graph.neff.a8d0b1c2").write_bytes(b"half a download")
    s3.pull_report(uri, dest, progress=False, client=client)
    assert not partial.exists() and tree(dest) == tree(artifacts)
    assert s3.publish(dest, f"s3://{bucket}/v2", progress=False, client=client)["files"]
    assert not (tmp_path / ".pulled.lock").exists()  # the lock went with its pull


def test_a_second_pull_into_the_same_dir_is_refused_while_one_runs(bucket, client, artifacts, tmp_path):
    """A live pull's temp files are not leftovers: a second pull into DIR is refused, not let delete them."""
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    dest = tmp_path / "pulled"
    with run_lock(dest, "pull"):  # as a running pull holds it
        with pytest.raises(UserError, match=r"pulled is being written by another pull \(pid \d+\)"):
            s3.pull_report(uri, dest, progress=False, client=client)
    s3.pull_report(uri, dest, progress=False, client=client)
    assert tree(dest) == tree(artifacts)


@pytest.mark.parametrize("clash", ["file where a folder goes", "folder where a file goes", "unrelated file"])
def test_a_directory_no_pull_wrote_is_refused_before_downloading(bucket, client, artifacts, tmp_path, capsys, clash):
    """A pull replaces its directory whole: one that a pull did not write is refused, and kept."""
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    dest = tmp_path / "pulled"
    dest.mkdir()
    if clash == "file where a folder goes":
        (dest / "neff").write_text("x")
    elif clash == "folder where a file goes":
        (dest / "model.pt").mkdir()
    else:
        (dest / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(dest) for p in dest.rglob("*"))
    assert cli.main(["pull", uri, str(dest)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {dest} holds files that no pull wrote; a pull replaces its directory whole with the "
        "publication, so it writes only a new, an empty or a pulled one: remove it, or choose another\n"
    )
    assert sorted(p.relative_to(dest) for p in dest.rglob("*")) == before  # nothing was downloaded


def test_a_mount_point_is_refused_as_a_pull_destination(bucket, client, artifacts, tmp_path, monkeypatch):
    """A pull replaces DIR whole, which a mount point (a container's volume) cannot be."""
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    dest = tmp_path / "volume"
    dest.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == dest)
    with pytest.raises(PublishError, match=rf"{dest} is a mount point; .* pull into a folder inside it"):
        s3.pull_report(uri, dest, progress=False, client=client)
    s3.pull_report(uri, dest / "v1", progress=False, client=client)
    assert tree(dest / "v1") == tree(artifacts)


def test_a_republication_with_other_files_pulled_into_a_used_directory_leaves_only_its_files(
    bucket, client, artifacts, tmp_path
):
    """DIR holds exactly the manifest's files: those of the publication it replaced are gone."""
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    dest = s3.pull(uri, tmp_path / "dest")
    (artifacts / "neff" / "graph.neff").unlink()
    (artifacts / "neff").rmdir()
    (artifacts / "weights.bin").write_bytes(os.urandom(5000))
    s3.publish(artifacts, uri, overwrite=True, progress=False, client=client)
    report = s3.pull_report(uri, dest, progress=False, client=client)
    assert tree(dest) == tree(artifacts) and not (dest / "neff").exists()
    assert {r["path"]: r["action"] for r in report["files"]} == {
        "config.json": "present",
        "model.pt": "present",
        "weights.bin": "downloaded",
    }


def test_publish_with_a_bad_json_path_fails_before_uploading(bucket, client, artifacts, tmp_path, capsys):
    """`publish --json <dir>` is refused before any upload, not after uploading everything."""
    uri = f"s3://{bucket}/v1"
    assert cli.main(["publish", str(artifacts), uri, "--json", str(tmp_path)]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err
    assert keys(client, bucket, "v1") == []


@pytest.mark.parametrize("command", ["publish", "pull"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    assert "--json" in capsys.readouterr().out


# ------------------------------------------------------------------- a trace-and-compile artifact


@pytest.fixture
def dry_run_artifact(tmp_path, tiny_port, one_torch_thread):
    from neuron_moe.neuron import compile as compile_

    out = tmp_path / "art"
    compile_.trace_and_compile(tiny_port, compile_.Build.at(tp=1, out=out, dtype="float32", dry_run=True, export=False))
    return out


def test_publish_refuses_an_artifact_that_its_own_manifest_does_not_describe(bucket, client, dry_run_artifact, capsys):
    """A weight file changed after trace-and-compile (its manifest.json says other bytes): nothing
    is uploaded, and the file is named; a file the manifest does not list, the same."""
    weights = dry_run_artifact / "weights" / "tp0_sharded_checkpoint.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-100] + bytes([good[-100] ^ 0xFF]) + good[-99:])
    uri = f"s3://{bucket}/art"
    assert cli.main(["publish", str(dry_run_artifact), uri]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {weights}: sha256 ") and "the file changed after trace-and-compile" in err, err
    assert keys(client, bucket, "") == []

    weights.write_bytes(good)
    (dry_run_artifact / "notes.txt").write_text("added later")
    assert cli.main(["publish", str(dry_run_artifact), uri]) == 2
    assert capsys.readouterr().err.startswith(f"error: {dry_run_artifact}/notes.txt: not in the artifact's manifest")
    assert keys(client, bucket, "") == []
    (dry_run_artifact / "notes.txt").unlink()
    assert cli.main(["publish", str(dry_run_artifact), uri]) == 0


def test_verify_reads_a_publication_from_s3_and_refuses_a_rotten_object(
    bucket, client, dry_run_artifact, tmp_path, capsys
):
    uri = f"s3://{bucket}/art"
    report = s3.publish(dry_run_artifact, uri, progress=False, client=client)
    assert cli.main(["verify", uri, "--model", "tiny-gemma4-moe"]) == 0
    assert f"{uri}: {len(report['files']) - 1} files" in capsys.readouterr().out
    assert not (tmp_path / "art-pulled").exists()

    key = next(f["key"] for f in report["files"] if f["path"] == "shard_plan.json")
    client.put_object(Bucket=bucket, Key=key, Body=b"{}")  # rot at rest
    assert cli.main(["verify", uri]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: s3://{bucket}/{key} does not match its manifest entry") and err.count("\n") == 1

    # a publication that is not an artifact
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.bin").write_bytes(b"a")
    s3.publish(tmp_path / "plain", f"s3://{bucket}/plain", progress=False, client=client)
    assert cli.main(["verify", f"s3://{bucket}/plain"]) == 2
    assert f"error: s3://{bucket}/plain: no manifest.json" in capsys.readouterr().err


INTERRUPTED_AFTER_ITS_FIRST_PART = """
import os, signal, sys
import boto3
from neuron_moe import cli
from neuron_moe.publish import s3
s3.MULTIPART_THRESHOLD = s3.MULTIPART_CHUNKSIZE = 5 * 2**20
client, sent = boto3.client, []
def interrupt_once(**_):  # one Ctrl-C, as a user presses it
    if not sent:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGINT)
def interrupting_client(*args, **kwargs):
    made = client(*args, **kwargs)
    made.meta.events.register("after-call.s3.UploadPart", interrupt_once)
    return made
boto3.client = interrupting_client
sys.exit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_during_publish_is_one_line_and_its_clean_up_holds(bucket, client, tmp_path):
    """SIGINT while s3transfer's threads upload: one line, exit 130; this run's objects removed, its
    open upload aborted, its claim released (a rerun needs no --overwrite)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(16 * MiB))
    uri = f"s3://{bucket}/v1"
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_AFTER_ITS_FIRST_PART, "publish", str(src), uri],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr) == (130, "error: interrupted (Ctrl-C): neuron-moe publish stopped\n"), (
        done.stderr[-3000:]
    )
    assert keys(client, bucket, "v1/") == [f"v1/{MANIFEST}"] and uploads(client, bucket, "v1/") == []
    assert "pending" not in manifest(client, bucket, "v1")
    s3.publish(src, uri, progress=False, client=client)
    assert tree(s3.pull(uri, tmp_path / "dest")) == tree(src)


@pytest.mark.parametrize(
    "where",
    ["import torch", "neuron_moe.publish.s3:file_digest", "neuron_moe.report:_give_new_modes"],
    ids=["start-up", "after a download", "before the rename"],
)
def test_ctrl_c_during_pull_is_one_line_and_leaves_nothing(bucket, client, tmp_path, where):
    """SIGINT at the start, mid-download, or with every file in and DIR's `.DIR.pulled` mark written
    but DIR not yet renamed into place: one line, exit 130, nothing beside DIR; a DIR an earlier pull
    wrote keeps its files and its mark (naming the earlier publication)."""
    for version in ("v1", "v2"):
        s3.publish(
            write_artifacts(tmp_path / version, seed=len(version)),
            f"s3://{bucket}/{version}",
            progress=False,
            client=client,
        )
    out = tmp_path / "out"
    out.mkdir()
    done = interrupted_run(["pull", f"s3://{bucket}/v1", str(out / "dest")], where)
    assert_stopped(done, "pull")
    assert list(out.iterdir()) == []

    s3.pull(f"s3://{bucket}/v1", out / "dest")
    done = interrupted_run(["pull", f"s3://{bucket}/v2", str(out / "dest")], where)
    assert_stopped(done, "pull")
    assert sorted(p.name for p in out.iterdir()) == [".dest.pulled", "dest"]
    assert tree(out / "dest") == tree(tmp_path / "v1")
    assert (out / ".dest.pulled").read_text() == f"s3://{bucket}/v1\n"


def put_publication(client, bucket: str, prefix: str, objects: dict[str, bytes], text: str | None = None, **extra):
    """A publication written by hand: each object under runs/r1/, and a manifest naming them (its
    text `text` where given, else the manifest of these objects with `extra` fields)."""
    files = []
    for path, data in objects.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/runs/r1/{path}", Body=data)
        digest = hashlib.sha256(data).hexdigest()
        files.append({"path": path, "key": f"runs/r1/{path}", "size": len(data), "sha256": digest})
    body = text if text is not None else json.dumps({"format": s3.FORMAT, "run": "r1", "files": files, **extra})
    client.put_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST}", Body=body.encode())
    return f"s3://{bucket}/{prefix}"


DEEP = "[" * 200_000 + "]" * 200_000


@pytest.mark.parametrize(
    "text,named",
    [
        (DEEP, "not JSON (nested deeper than 64 levels)"),
        (json.dumps({"format": s3.FORMAT, "total_bytes": float("nan")}), "not JSON (NaN is not a JSON number)"),
    ],
    ids=["nested 200,000 deep", "NaN"],
)
def test_a_publication_manifest_that_is_not_strict_json_is_one_line(bucket, client, tmp_path, capsys, text, named):
    uri = put_publication(client, bucket, "v1", {"a.bin": b"a"}, text=text)
    for argv in (["pull", uri, str(tmp_path / "dest")], ["verify", uri]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"error: {uri}/{MANIFEST}: {named}\n", err
    assert not (tmp_path / "dest").exists()


def test_an_artifact_manifest_nested_too_deep_in_a_publication_is_one_line(bucket, client, capsys):
    uri = put_publication(client, bucket, "v1", {"manifest.json": DEEP.encode()})
    assert cli.main(["verify", uri]) == 2
    assert capsys.readouterr().err == f"error: {uri}/manifest.json: not valid JSON: nested deeper than 64 levels\n"


def test_an_object_the_manifest_names_that_was_never_there_is_named_so(bucket, client, tmp_path, capsys):
    """Not "replaced during this pull": the manifest is the one the pull read, and it names an object
    S3 does not hold."""
    uri = put_publication(client, bucket, "v1", {"a.bin": b"a"})
    doc = manifest(client, bucket, "v1")
    doc["files"][0]["key"] = "runs/r1/no-such-object"
    client.put_object(Bucket=bucket, Key=f"v1/{MANIFEST}", Body=json.dumps(doc).encode())
    missing = f"s3://{bucket}/v1/runs/r1/no-such-object: no such object, though the publication's manifest names it"
    for argv in (["pull", uri, str(tmp_path / "dest")], ["verify", uri]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {missing}: the publication is damaged") and err.count("\n") == 1, err
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("uri", ["s3://../x", "s3://./x", "s3://a b/x"])
def test_a_bucket_that_is_not_a_name_is_refused(tmp_path, capsys, uri):
    """'..' as a bucket would be a folder of the pull's cache (serve --artifacts-cache, deploy k8s)."""
    assert cli.main(["pull", uri, str(tmp_path / "dest")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {uri}: ") and not (tmp_path / "dest").exists()


def test_a_linked_folder_is_published_with_its_files(bucket, client, artifacts, tmp_path):
    """A symbolic link to a folder is followed (its files are published, as a link to a file is),
    not skipped; a FIFO is refused by name."""
    shutil.move(artifacts / "neff", tmp_path / "neff-elsewhere")
    (artifacts / "neff").symlink_to(tmp_path / "neff-elsewhere", target_is_directory=True)
    uri = f"s3://{bucket}/v1"
    report = s3.publish(artifacts, uri, progress=False, client=client)
    assert "neff/graph.neff" in {f["path"] for f in report["files"]}
    pulled = tree(s3.pull(uri, tmp_path / "dest"))
    assert set(pulled) == {"model.pt", "config.json", "neff/graph.neff"}
    assert pulled["neff/graph.neff"] == (tmp_path / "neff-elsewhere" / "graph.neff").read_bytes()
    os.mkfifo(artifacts / "pipe")
    with pytest.raises(UserError, match=r"pipe: not a regular file"):
        s3.publish(artifacts, f"s3://{bucket}/v2", progress=False, client=client)


def test_verify_catches_a_published_manifest_changed_or_out_of_contract(bucket, client, dry_run_artifact, capsys):
    """The publication records manifest.json's digest as it does the others': a changed one is caught
    by its sha256; one rewritten with its digest too, by its fields. publish refuses the latter."""
    uri = f"s3://{bucket}/art"
    report = s3.publish(dry_run_artifact, uri, progress=False, client=client)
    key = next(f["key"] for f in report["files"] if f["path"] == "manifest.json")
    tampered = json.loads((dry_run_artifact / "manifest.json").read_text())
    tampered["tp"] = 4
    body = json.dumps(tampered).encode()
    client.put_object(Bucket=bucket, Key=key, Body=body)
    assert cli.main(["verify", uri]) == 2
    assert capsys.readouterr().err.startswith(f"error: s3://{bucket}/{key} does not match its manifest entry")

    doc = manifest(client, bucket, "art")
    entry = next(f for f in doc["files"] if f["path"] == "manifest.json")
    entry.update(size=len(body), sha256=hashlib.sha256(body).hexdigest())
    client.put_object(Bucket=bucket, Key=f"art/{MANIFEST}", Body=json.dumps(doc).encode())
    assert cli.main(["verify", uri]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {uri}/manifest.json: 'tp' 4 with weights true takes 4 rank shard(s)"), err

    (dry_run_artifact / "manifest.json").write_bytes(body)
    assert cli.main(["publish", str(dry_run_artifact), f"s3://{bucket}/again"]) == 2
    assert "manifest.json: 'tp' 4 with weights true takes 4 rank shard(s)" in capsys.readouterr().err
