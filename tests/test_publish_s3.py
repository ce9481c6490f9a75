"""publish / pull against moto's S3 server on 127.0.0.1 (real HTTP, fake credentials).

What moto 5.2.5 does and does not do, measured (and so what these tests can show):
- it honours IfNoneMatch="*" on PutObject (412 PreconditionFailed);
- for a multipart upload with a supplied CRC32 it computes the full-object CRC32 itself and
  reports ChecksumType FULL_OBJECT, so head_object catches bytes that differ from the file;
- for a single PUT it stores the supplied CRC32 without checking it and reports no checksum
  type, and it never rejects a wrong supplied checksum (AWS answers BadDigest). The single-PUT
  checks below therefore compare against values computed here, not against moto's arithmetic.
"""

import base64
import hashlib
import json
import os
import uuid
import zipfile
import zlib

import boto3
import pytest
import torch
from botocore.config import Config
from botocore.exceptions import ClientError, EndpointConnectionError
from moto.server import ThreadedMotoServer

from neuron_moe import cli
from neuron_moe.errors import UserError
from neuron_moe.report import run_lock
from neuron_moe.publish import s3
from neuron_moe.publish.s3 import MANIFEST, PublishError

MiB = 2**20


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


@pytest.fixture
def client(bucket):
    # no retries, so that an injected failure is final
    return boto3.client("s3", config=Config(retries={"total_max_attempts": 1}))


@pytest.fixture
def artifacts(tmp_path):
    src = tmp_path / "artifacts"
    (src / "neff").mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    torch.save({"w": torch.randn(256, 256, generator=gen), "b": torch.randn(256, generator=gen)}, src / "model.pt")
    (src / "neff" / "graph.neff").write_bytes(os.urandom(300_000))
    (src / "config.json").write_text('{"tp_degree": 2}\n')
    return src


def crc32_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def keys(client, bucket, prefix):
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_round_trip_through_the_cli(bucket, client, artifacts, tmp_path, capsys):
    uri = f"s3://{bucket}/models/tiny/v1"
    assert cli.main(["publish", str(artifacts), uri, "--deep", "--json", str(tmp_path / "pub.json")]) == 0
    report = json.loads((tmp_path / "pub.json").read_text())
    assert report["manifest"] == f"{uri}/{MANIFEST}" and report["replaced_objects"] == 0
    assert {f["path"] for f in report["files"]} == {"model.pt", "neff/graph.neff", "config.json"}
    assert "published 3 files" in capsys.readouterr().out

    local = tree(artifacts)
    for rel, data in local.items():
        head = client.head_object(Bucket=bucket, Key=f"models/tiny/v1/{rel}", ChecksumMode="ENABLED")
        assert head["ContentLength"] == len(data)
        assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
        assert head["ChecksumCRC32"] == crc32_b64(data)
    manifest = json.loads(client.get_object(Bucket=bucket, Key=f"models/tiny/v1/{MANIFEST}")["Body"].read())
    assert {f["path"]: f["sha256"] for f in manifest["files"]} == {
        rel: hashlib.sha256(data).hexdigest() for rel, data in local.items()}

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
    (dest / "config.json").write_text('{"tp_degree": 9}\n')  # same size, other bytes: replaced
    again = s3.pull_report(uri, dest, progress=False)
    assert {r["path"]: r["action"] for r in again["files"]} == {
        "config.json": "downloaded", "model.pt": "present", "neff/graph.neff": "present"}
    assert tree(dest) == local


def test_multipart_upload_gets_a_full_object_crc32(bucket, client, tmp_path, monkeypatch):
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 5 * MiB)
    monkeypatch.setattr(s3, "MULTIPART_CHUNKSIZE", 5 * MiB)
    src = tmp_path / "big"
    src.mkdir()
    data = os.urandom(11 * MiB)
    (src / "weights.bin").write_bytes(data)
    s3.publish(src, f"s3://{bucket}/mp", progress=False, client=client)
    head = client.head_object(Bucket=bucket, Key="mp/weights.bin", ChecksumMode="ENABLED")
    assert head["ETag"].endswith('-3"')  # three parts were sent
    assert head["ChecksumType"] == "FULL_OBJECT" and head["ChecksumCRC32"] == crc32_b64(data)


def test_head_object_check_catches_bytes_that_differ_from_the_hashed_file(bucket, client, tmp_path, monkeypatch):
    # The file changes after it was hashed, keeping its size and mtime (so the stat check cannot
    # see it): AWS would reject the upload (BadDigest); moto stores it, and head_object's CRC32 -
    # which moto computes itself for multipart uploads - must give it away.
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 5 * MiB)
    monkeypatch.setattr(s3, "MULTIPART_CHUNKSIZE", 5 * MiB)
    src = tmp_path / "big"
    src.mkdir()
    path = src / "weights.bin"
    path.write_bytes(os.urandom(6 * MiB))

    def flip_a_byte(**_):
        st = path.stat()
        with open(path, "r+b") as f:
            f.seek(123)
            byte = f.read(1)
            f.seek(123)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    client.meta.events.register("before-call.s3.CreateMultipartUpload", flip_a_byte)
    with pytest.raises(PublishError, match=r"mp/weights.bin does not match .*weights.bin after upload: crc32"):
        s3.publish(src, f"s3://{bucket}/mp", progress=False, client=client)
    assert keys(client, bucket, "mp/") == ["mp/weights.bin"]  # no manifest


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
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
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


def test_a_file_changing_during_its_upload_leaves_no_manifest(bucket, client, artifacts):
    target = artifacts / "neff" / "graph.neff"

    def append(request, **_):
        if request.url.endswith("/graph.neff"):
            with open(target, "ab") as f:
                f.write(b"more")

    client.meta.events.register("before-send.s3.PutObject", append)
    with pytest.raises(PublishError, match=r"graph\.neff: changed while it was uploaded; no manifest"):
        s3.publish(artifacts, f"s3://{bucket}/v1", progress=False, client=client)
    assert f"v1/{MANIFEST}" not in keys(client, bucket, "v1/")


def test_failure_mid_upload_leaves_no_manifest_and_needs_overwrite(bucket, client, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 5 * MiB)
    monkeypatch.setattr(s3, "MULTIPART_CHUNKSIZE", 5 * MiB)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a-small.bin").write_bytes(os.urandom(1000))
    (src / "b-big.bin").write_bytes(os.urandom(11 * MiB))
    uri = f"s3://{bucket}/v1"

    def drop_part_2(request, **_):
        if "partNumber=2" in request.url:
            raise EndpointConnectionError(endpoint_url=request.url)

    client.meta.events.register("before-send.s3.UploadPart", drop_part_2)
    with pytest.raises(PublishError, match=rf"uploading .*b-big\.bin to {uri}/b-big\.bin failed, no manifest"):
        s3.publish(src, uri, progress=False, client=client)
    assert keys(client, bucket, "v1/") == ["v1/a-small.bin"]  # it did fail mid-way, and wrote no manifest

    assert cli.main(["pull", uri, str(tmp_path / "dest")]) == 2
    assert f"no manifest at {uri}/{MANIFEST}" in capsys.readouterr().err
    assert cli.main(["publish", str(src), uri]) == 2
    assert "objects but no manifest (an unfinished publish)" in capsys.readouterr().err

    client.meta.events.unregister("before-send.s3.UploadPart", drop_part_2)
    report = s3.publish(src, uri, overwrite=True, progress=False, client=client)
    assert report["replaced_objects"] == 1
    assert tree(s3.pull(uri, tmp_path / "dest")) == tree(src)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_corrupted_object_is_caught_on_pull_and_nothing_lands(bucket, client, artifacts, tmp_path, damage):
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    good = (artifacts / "neff" / "graph.neff").read_bytes()
    bad = bytes([good[0] ^ 1]) + good[1:] if damage == "flipped byte" else good[:-10]
    client.put_object(Bucket=bucket, Key="v1/neff/graph.neff", Body=bad)  # rot at rest, after publishing

    dest = tmp_path / "dest"
    (dest / "neff").mkdir(parents=True)
    (dest / "neff" / "graph.neff").write_bytes(b"an older version")
    with pytest.raises(PublishError, match=rf"{uri}/neff/graph\.neff does not match its manifest entry"):
        s3.pull(uri, dest)
    assert (dest / "neff" / "graph.neff").read_bytes() == b"an older version"  # not replaced
    assert not [p for p in dest.rglob(".*")]  # no temp file left
    # the files before it in the manifest landed whole and verified
    assert tree(dest) == dict(tree(artifacts), **{"neff/graph.neff": b"an older version"})


def test_second_publish_is_refused_and_overwrite_replaces_everything(bucket, client, artifacts, tmp_path, capsys):
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    assert cli.main(["publish", str(artifacts), uri]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {uri} already holds a publication, 4 objects; pass --overwrite")
    assert err.count("\n") == 1

    (artifacts / "neff" / "graph.neff").unlink()
    (artifacts / "config.json").write_text('{"tp_degree": 8}\n')
    report = s3.publish(artifacts, uri, overwrite=True, progress=False, client=client)
    assert report["replaced_objects"] == 4
    assert keys(client, bucket, "v1/") == sorted([f"v1/{MANIFEST}", "v1/config.json", "v1/model.pt"])
    assert tree(s3.pull(uri, tmp_path / "dest")) == tree(artifacts)


def test_manifest_is_written_only_once(bucket, client, artifacts):
    # moto honours IfNoneMatch (the race below relies on it, so check that first)
    client.put_object(Bucket=bucket, Key="probe", Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError, match="PreconditionFailed"):
        client.put_object(Bucket=bucket, Key="probe", Body=b"2", IfNoneMatch="*")

    other = boto3.client("s3")

    def another_writer_finishes_first(request, **_):
        if request.url.endswith("/v1/config.json"):
            other.put_object(Bucket=bucket, Key=f"v1/{MANIFEST}", Body=b'{"theirs": true}')

    client.meta.events.register("before-send.s3.PutObject", another_writer_finishes_first)
    with pytest.raises(PublishError, match=rf"v1/{MANIFEST} was created by another writer"):
        s3.publish(artifacts, f"s3://{bucket}/v1", progress=False, client=client)
    assert client.get_object(Bucket=bucket, Key=f"v1/{MANIFEST}")["Body"].read() == b'{"theirs": true}'


def test_pull_refuses_a_manifest_that_points_outside_dir(bucket, client, tmp_path):
    manifest = {"format": s3.FORMAT, "files": [{"path": "../escaped", "size": 1, "sha256": "0" * 64}]}
    client.put_object(Bucket=bucket, Key=f"v1/{MANIFEST}", Body=json.dumps(manifest).encode())
    with pytest.raises(PublishError, match=r"files\[0\]\.path '\.\./escaped' is not a plain relative path"):
        s3.pull(f"s3://{bucket}/v1", tmp_path / "dest")
    assert not (tmp_path / "escaped").exists()


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
    """Issue 26, item 11: a killed pull left hidden `.part` files (ours, and boto's beside them), and
    `publish` of that directory then refused it for its hidden files."""
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    dest = tmp_path / "pulled"
    (dest / "neff").mkdir(parents=True)
    leftovers = [dest / ".model.pt.k2j4h1x0.part", dest / "neff" / ".graph.neff.a8d0.part.1A2b3C4d"]
    for part in leftovers:
        part.write_bytes(b"half a download")
    (dest / ".mine").write_text("not a download: kept")
    s3.pull_report(uri, dest, progress=False, client=client)
    assert not any(p.exists() for p in leftovers)
    assert (dest / ".mine").exists() and tree(dest) == {**tree(artifacts), ".mine": b"not a download: kept"}
    (dest / ".mine").unlink()
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


@pytest.mark.parametrize("clash", ["file where a folder goes", "folder where a file goes"])
def test_a_pull_that_cannot_land_fails_before_downloading(bucket, client, artifacts, tmp_path, capsys, clash):
    """Issue 26, item 10: a file/folder conflict in DIR was a raw traceback, after part of the download."""
    uri = f"s3://{bucket}/v1"
    s3.publish(artifacts, uri, progress=False, client=client)
    dest = tmp_path / "pulled"
    dest.mkdir()
    if clash == "file where a folder goes":
        (dest / "neff").write_text("x")
        message = "neff is a file, where the manifest's neff/graph.neff needs a folder"
    else:
        (dest / "model.pt").mkdir()
        message = "model.pt is a folder, where the manifest has the file model.pt"
    assert cli.main(["pull", uri, str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (dest / "config.json").exists()  # nothing was downloaded


def test_publish_with_a_bad_json_path_fails_before_uploading(bucket, client, artifacts, tmp_path, capsys):
    """Issue 26, item 10: `publish --json <dir>` uploaded everything, then died writing the report."""
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
