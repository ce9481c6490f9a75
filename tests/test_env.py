"""`neuron-moe env`: versions, devices, and per path whether this machine supports it and why not; every
command that needs a path refuses with the row's reason, one line, before any work."""

import json
import os

import pytest
from test_nxd_source import INSTALLED, _tree

from neuron_moe import environment, port
from neuron_moe.cli import main
from neuron_moe.errors import UserError
from neuron_moe.neuron import artifact
from neuron_moe.reader.nki import forward as nki_forward

SDK = all(environment.importlib.util.find_spec(m) for m in environment.COMPILE_MODULES)


@pytest.fixture
def plain_cpu(monkeypatch):
    """This machine as a user's shell sees it: no Triton interpreter, no NXD_SRC."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("NXD_SRC", raising=False)


@pytest.mark.skipif(
    SDK or INSTALLED or environment.neuron_devices()["devices"] or environment.gpu()["devices"],
    reason="this machine has the Neuron SDK, NxD, a Neuron device or a GPU",
)
def test_on_this_cpu_machine_every_path_is_unsupported_with_its_reason(plain_cpu, capsys):
    assert main(["env", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in report["paths"]] == list(environment.PATHS)
    assert not any(r["supported"] for r in report["paths"])
    why = {r["path"]: r["why"] for r in report["paths"]}
    assert "needs the Neuron SDK (missing torch_neuronx, neuronx_distributed, neuronxcc)" in why["trace-and-compile"]
    assert "set NXD_SRC to a checkout of aws-neuron/neuronx-distributed" in why["validate --tp-layers nxd"]
    assert "nki 0.2.x (Neuron SDK 2.28), which is not installed" in why["reader --reader-kernel nki"]
    assert "needs a CUDA GPU" in why["reader --reader-kernel triton"]
    assert "and a Neuron device (none" in why["serve --backend neuron"]
    assert report["versions"]["python"] and report["versions"]["torch"] and report["versions"]["nki"] is None
    assert report["neuron"] == {"devices": 0, "cores": None, "source": None} and report["gpu"]["devices"] == []
    # the text report: one row per path, each saying no and why
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    for path in environment.PATHS:
        (line,) = [x for x in text.splitlines() if x.startswith(path + " ")]
        assert line.split()[len(path.split())] == "no" and why[path] in line
    assert "Neuron devices: none" in text and "GPU: none" in text
    # the compile target trace-and-compile builds for and serve requires
    assert report["target"] == artifact.TARGET
    assert (
        "compile target: inf2 (neuronx-cc " in text and "--target inf2; environment NEURON_LOGICAL_NC_CONFIG=1)" in text
    )


@pytest.mark.skipif(INSTALLED, reason="neuronx-distributed is installed here: NXD_SRC is not what is used")
def test_nxd_layers_are_supported_when_nxd_src_is_set(plain_cpu, monkeypatch, tmp_path):
    _tree(tmp_path, version="0.18.0")
    monkeypatch.setenv("NXD_SRC", str(tmp_path))
    supported, why = environment.support(environment.VALIDATE_NXD)
    assert supported and why.startswith(f"neuronx-distributed 0.18.0 (NXD_SRC={tmp_path}; source digest ")
    assert "NxD's CPU mode over gloo (not Neuron" in why


def _not_before_the_refusal(*args, **kwargs):
    raise AssertionError("a port was loaded before the command refused its path")


@pytest.mark.parametrize(
    "argv, path",
    [
        (["trace-and-compile", "--tp", "2", "--out", "{tmp}/art"], environment.TRACE_AND_COMPILE),
        (["validate", "--backend", "tp", "--tp-layers", "nxd"], environment.VALIDATE_NXD),
        (["validate", "--backend", "reader", "--reader-kernel", "nki"], environment.READER_NKI),
        (["validate", "--backend", "reader", "--reader-kernel", "triton"], environment.READER_TRITON),
    ],
)
def test_a_command_that_needs_a_path_refuses_with_the_rows_reason(plain_cpu, argv, path, tmp_path, capsys, monkeypatch):
    supported, why = environment.support(path)
    if supported:
        pytest.skip(f"{path} is supported here: {why}")
    monkeypatch.setattr(port, "load_port", _not_before_the_refusal)  # the commands import it when they run
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert capsys.readouterr().err == f"error: {path} {why}\n"
    assert not (tmp_path / "art").exists()
    with pytest.raises(UserError, match="^" + path):
        environment.require(path)


def test_neuron_ls_devices_and_cores_are_read(tmp_path, monkeypatch):
    tool = tmp_path / "neuron-ls"
    tool.write_text('#!/bin/sh\necho \'[{"neuron_device": 0, "nc_count": 2}, {"neuron_device": 1, "nc_count": 2}]\'\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert environment.neuron_devices() == {"devices": 2, "cores": 4, "source": "neuron-ls"}


def test_nki_outside_the_inf2_target_is_refused_by_name(monkeypatch):
    assert nki_forward.nki_unsupported("0.2.0+g82fdb402") is None  # the SDK 2.28 DLC's nki
    assert "not installed" in nki_forward.nki_unsupported(None)
    why = nki_forward.nki_unsupported("0.5.0")  # the SDK 2.31 DLC's
    assert "targets nki 0.2.x (Neuron SDK 2.28, the last whose NKI supports inf2), not nki 0.5.0" in why
    assert "support Trn2 and Trn3 only" in why and "--reader-kernel reference" in why
    monkeypatch.setattr(nki_forward, "nki_version", lambda: "0.5.0")
    with pytest.raises(UserError, match="^reader kernel 'nki' targets nki 0.2.x"):
        nki_forward.load_kernels()
