"""`--checkpoint ORG/NAME`: a Hugging Face Hub repository, fetched through huggingface_hub into its
cache, against a hub of our own on 127.0.0.1 (tests/fake_hub.py; no network). The commands run
as a user runs them, in a child process, so that the library reads HF_ENDPOINT, HF_HOME, HF_TOKEN
and HF_HUB_OFFLINE from the environment as it does at import."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from neuron_moe import hub
from neuron_moe.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from neuron_moe.model import build_model
from neuron_moe.port import load_port

from conftest import reseeded
from fake_hub import FakeHub, Repo

REPO = Path(__file__).resolve().parents[1]
NEEDED = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
# what the tiny checkpoint's repository holds beside what we read: none of it may be fetched
EXTRA = {
    "README.md": b"# tiny\n",
    ".gitattributes": b"*.safetensors filter=lfs\n",
    "original/consolidated.safetensors": b"not ours",
    "pytorch_model.bin": b"not ours",
}


def neuron_moe(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "neuron_moe", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **env},
    )


def test_a_repo_id_is_fetched_once_then_served_from_the_cache_offline(tmp_path, tiny_port):
    """validate --checkpoint ORG/NAME downloads the four files we read (private repo: HF_TOKEN sent),
    loads and passes; with HF_HUB_OFFLINE=1 the warm cache serves it without a request; a cold cache
    offline is one error line naming the repository and the variable."""
    with FakeHub({"org/tiny": Repo.from_dir(tiny_port.checkpoint, extra=EXTRA, token="hf_secret")}) as fake:
        env = {"HF_ENDPOINT": fake.url, "HF_HOME": str(tmp_path / "home"), "HF_TOKEN": "hf_secret"}
        run = neuron_moe(
            env, "validate", "--checkpoint", "org/tiny", "--backend", "eager", "--max-new-tokens", "2", "--json", "-"
        )
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["all_match"]
        assert fake.fetched() == sorted(NEEDED) and "train_log.json" not in fake.fetched()
        assert {auth for _, _, auth in fake.requests} == {"Bearer hf_secret"}
        assert "checkpoint org/tiny@main: from http://127.0.0.1" in run.stderr and "Fetching 4 files" in run.stderr
        snapshot = next((tmp_path / "home" / "hub" / "models--org--tiny" / "snapshots").iterdir())
        assert sorted(p.name for p in snapshot.iterdir()) == sorted(NEEDED)

        before = len(fake.requests)
        warm = neuron_moe({**env, "HF_HUB_OFFLINE": "1"}, "info", "--checkpoint", "org/tiny", "--json", "-")
        assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout)["model"] == "tiny-gemma4-moe" and len(fake.requests) == before

        cold = neuron_moe(
            {**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "cold")}, "info", "--checkpoint", "org/tiny"
        )
        assert cold.returncode == 2 and len(fake.requests) == before
        assert cold.stderr.count("\n") == 1 and "Traceback" not in cold.stderr
        assert cold.stderr.startswith("error: checkpoint org/tiny@main: not in the Hugging Face cache ")
        assert "HF_HUB_OFFLINE=1 forbids downloading it" in cold.stderr


@pytest.fixture
def fake_hub(tmp_path, monkeypatch, tiny_port):
    """A hub with two revisions of the tiny model (main: its weights; v2: other weights), huggingface_hub
    pointed at it in this process, with an empty cache."""
    other = save_checkpoint(build_model(reseeded(tiny_port, 77)), tmp_path / "v2")
    for name in NEEDED[2:]:
        (other / name).write_bytes((tiny_port.checkpoint / name).read_bytes())
    main = Repo.from_dir(tiny_port.checkpoint).revisions["main"]
    v2 = Repo.from_dir(other).revisions["main"]
    with FakeHub({"org/tiny": Repo({"main": main, "v2": v2})}) as fake:
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield fake, other


def test_revision_picks_the_weights(fake_hub, tiny_port):
    _, other = fake_hub
    path = hub.local_checkpoint("org/tiny", "v2", tiny_port)
    embedding = load_checkpoint(path).model.embed_tokens.weight
    assert torch.equal(embedding, load_checkpoint(other).model.embed_tokens.weight)
    main = hub.local_checkpoint("org/tiny", None, tiny_port)
    assert torch.equal(
        load_checkpoint(main).model.embed_tokens.weight, load_checkpoint(tiny_port.checkpoint).model.embed_tokens.weight
    )
    assert main != path


@pytest.mark.parametrize(
    "spec,revision,message",
    [
        ("org/absent", None, "checkpoint org/absent@main: no such repository on http://127.0.0.1"),
        ("org/tiny", "v9", "checkpoint org/tiny@v9: no revision 'v9' (a branch, tag or commit) in org/tiny"),
    ],
)
def test_what_the_hub_refuses_is_named(fake_hub, tiny_port, spec, revision, message):
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hub.resolve(spec, revision)


def test_a_downloaded_checkpoint_gets_the_same_checks(fake_hub):
    """The Hub's files are checked as a local directory is: another model's checkpoint is refused."""
    with pytest.raises(CheckpointError, match="not the model of port 'gemma4-26b-a4b'"):
        hub.local_checkpoint("org/tiny", None, load_port("gemma4-26b-a4b"))


def test_a_path_is_never_taken_for_a_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert hub.resolve("org/tiny") == Path("org/tiny")  # it exists: a directory, not the Hub
    for spec in ("./org/x", "/abs/x", "a/b/c", "../x", "org/..", "x"):
        assert not hub.is_repo_id(spec), spec
    with pytest.raises(CheckpointError, match="--revision main applies to a Hub repository id"):
        hub.resolve(str(tmp_path), "main")
