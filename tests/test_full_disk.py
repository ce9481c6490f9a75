"""The commands that write, on a filesystem that is full: one `error:` line naming what could not
be written, exit 2, nothing left behind in the output's folder. The filesystem is a small tmpfs
mounted in a mount namespace of the command's own (`unshare -m`; `-rm` maps an unprivileged user to
root in a user namespace for it), so nothing outside the command sees it."""

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the command, then what it left on the tmpfs (listed before the namespace, and the mount, go away)
MOUNT_AND_RUN = (
    'mount -t tmpfs -o size="$SIZE" tmpfs "$MNT" || exit 99; {FILL} "$@"; rc=$?; rm -f "$MNT/filler"; '
    'echo "left on the disk:"; cd "$MNT" && find . -mindepth 1; exit $rc'
)
FILL = 'dd if=/dev/zero of="$MNT/filler" bs=4k >/dev/null 2>&1;'


def _unshare() -> list[str]:
    return ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]


@pytest.fixture(scope="module")
def namespace():
    """The unshare command line, once it is known to work here."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a small tmpfs of the test's own")
    probe = subprocess.run([*_unshare(), "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses a mount namespace to this user: {probe.stderr.strip()}")
    return _unshare()


def run_on_full_disk(namespace, tmp_path, args, size="256k", fill=False, env=None):
    """`neuron-moe ARGS` with $MNT (tmp_path/mnt, which ARGS may name) a tmpfs of `size`, all of it
    taken first when `fill`."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = MOUNT_AND_RUN.replace("{FILL}", FILL if fill else "")
    done = subprocess.run(
        [*namespace, "sh", "-c", script, "sh", sys.executable, "-m", "neuron_moe", *args],
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "SIZE": size,
            "MNT": str(mnt),
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return done, mnt


def assert_one_error(done, named: str, left: tuple[str, ...] = ()):
    """One error line, on a line of its own (not after a progress bar), naming `named`, exit 2, and
    nothing but `left` on the disk."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert sorted(done.stdout.split("left on the disk:\n")[-1].split()) == sorted(f"./{p}" for p in left)
    assert done.stderr.count("error:") == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if "error:" in line]
    assert line.startswith("error: ") and named in line and "No space left on device" in line, line


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """Fortune files of random words, enough for the tiny port's 2048-token tokenizer."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(3000)]
    out = tmp_path_factory.mktemp("fortunes")
    for i in range(3):
        docs = [" ".join(rng.choice(words) for _ in range(30)) + "." for _ in range(150)]
        (out / f"f{i}").write_text("\n%\n".join(docs) + "\n%\n")
    return out


@pytest.mark.parametrize("fill,named", [(False, ".pt2"), (True, ".art.lock")], ids=["filling up", "full"])
def test_trace_and_compile_on_a_full_disk(namespace, tmp_path, fill, named):
    """torch's archive writer, refused a write mid-archive, throws from its destructor: the process
    must not abort (exit 134) but say which file could not be written. A disk full from the start
    refuses the lock its pid: the lock goes too."""
    done, mnt = run_on_full_disk(
        namespace,
        tmp_path,
        ["trace-and-compile", "--dry-run", "--tp", "1", "--dtype", "float32", "--out", str(tmp_path / "mnt" / "art")],
        fill=fill,
    )
    assert_one_error(done, named)


@pytest.mark.parametrize(
    "args,named",
    [
        (["prep-reader", "--out", "{mnt}/reader.safetensors"], "reader.safetensors"),
        (["prep-reader", "--tp", "2", "--out", "{mnt}/reader"], "reader/"),  # not the folder it made
        (["eval-reader", "--quick", "--out", "{mnt}/eval"], "eval/"),  # nor eval-reader's
    ],
    ids=["prep-reader", "prep-reader --tp", "eval-reader"],
)
def test_reader_commands_on_a_full_disk(namespace, tmp_path, args, named):
    mnt = tmp_path / "mnt"
    done, _ = run_on_full_disk(namespace, tmp_path, [a.replace("{mnt}", str(mnt)) for a in args])
    assert_one_error(done, named)


def test_corpus_and_training_on_a_full_disk(namespace, tmp_path, text_dir):
    """build-corpus's JSON lines; train-tiny's checkpoint (safetensors writes from Rust)."""
    done, _ = run_on_full_disk(
        namespace,
        tmp_path,
        ["build-corpus", "--text-dir", str(text_dir), "--scale", "0.02", "--out", str(tmp_path / "mnt" / "corpus")],
        size="64k",
    )
    assert_one_error(done, "corpus/", left=("corpus",))  # its folder, empty
    corpus = tmp_path / "corpus"
    assert (
        subprocess.run(
            [
                sys.executable,
                "-m",
                "neuron_moe",
                "build-corpus",
                "--text-dir",
                str(text_dir),
                "--scale",
                "0.02",
                "--out",
                str(corpus),
            ],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    shutil.rmtree(tmp_path / "mnt")
    done, _ = run_on_full_disk(
        namespace,
        tmp_path,
        [
            "train-tiny",
            "--corpus",
            str(corpus),
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--out",
            str(tmp_path / "mnt" / "model"),
        ],
    )
    assert_one_error(done, "model")


def test_a_report_on_a_full_disk(namespace, tmp_path):
    """Every command's --json is written by one function (report.write_json); info's stands for all."""
    mnt = tmp_path / "mnt"
    done, _ = run_on_full_disk(namespace, tmp_path, ["info", "--json", str(mnt / "report.json")], fill=True)
    assert_one_error(done, "report.json")


def test_a_pull_onto_a_full_disk(namespace, tmp_path):
    """pull's downloads (s3transfer's writes) into its private sibling of DIR: refused, one line,
    and nothing left beside DIR. moto's S3 server on 127.0.0.1, reached from the namespace (its
    network is this one's)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
            "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
        }
        client = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL_S3"],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket="full")
        src = tmp_path / "src"
        src.mkdir()
        (src / "weights.bin").write_bytes(os.urandom(1 << 20))
        from neuron_moe.publish import s3

        s3.publish(src, "s3://full/v1", progress=False, client=client)
        done, mnt = run_on_full_disk(
            namespace, tmp_path, ["pull", "s3://full/v1", str(tmp_path / "mnt" / "dest")], env=env
        )
        assert_one_error(done, "dest")
        shutil.rmtree(mnt)  # and on a disk full from the start: its lock refused its pid, and goes
        done, mnt = run_on_full_disk(
            namespace, tmp_path, ["pull", "s3://full/v1", str(tmp_path / "mnt" / "dest")], env=env, fill=True
        )
        assert_one_error(done, ".dest.lock")
    finally:
        server.stop()


def test_serve_with_its_compile_cache_on_a_full_disk(namespace, tmp_path):
    """`serve --backend static` compiles its graphs into --compile-cache as it warms up: a full disk
    there stops the server with one error line naming the cache (not torch's traceback), exit 2, and
    nothing left on the disk but the cache's folders (no temp file of a refused write)."""
    cache = tmp_path / "mnt" / "cache"
    done, _ = run_on_full_disk(
        namespace, tmp_path, ["serve", "--backend", "static", "--port", "0", "--compile-cache", str(cache)], fill=True
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.splitlines()[-1]
    assert last.startswith(
        f"error: the model failed to load: compiling the prefill graph into the compile cache {cache}"
    )
    assert "No space left on device" in last, last
    left = done.stdout.split("left on the disk:\n")[-1].split()
    assert all(p == "./cache" or p.startswith("./cache/") for p in left), left
    assert not [p for p in left if p.endswith(".tmp")], left
