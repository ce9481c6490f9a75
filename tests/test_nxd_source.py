"""Where NxD comes from for `--tp-layers nxd` (`parallel/nxd_source.py`), without NxD: a source tree
named by NXD_SRC (its root or its src/), what is refused, the stand-ins (only for absent packages,
never a real one, loud about any name they lack), and the CLI's refusals before any work."""

import os
import sys

import pytest

from neuron_moe.cli import main
from neuron_moe.errors import UserError
from neuron_moe.parallel import nxd_source
from neuron_moe.parallel.trace import run_ranks

INSTALLED = nxd_source.importlib.util.find_spec(nxd_source.PACKAGE) is not None


def _tree(root, version="9.8.7"):
    """A minimal neuronx-distributed source tree: what `locate` looks for."""
    package = root / "src" / "neuronx_distributed"
    (package / "parallel_layers").mkdir(parents=True)
    (package / "parallel_layers" / "layers.py").write_text("X = 1\n")
    (package / "_version.py").write_text(f'__version__ = "{version}"\n')
    return package


@pytest.mark.skipif(INSTALLED, reason="neuronx-distributed is installed here: it is used whatever NXD_SRC says")
@pytest.mark.parametrize("named", ["root", "src"])
def test_nxd_src_names_the_root_or_its_src(tmp_path, monkeypatch, named):
    package = _tree(tmp_path)
    monkeypatch.setenv("NXD_SRC", str(tmp_path if named == "root" else tmp_path / "src"))
    source = nxd_source.locate()
    assert (source.origin, source.package, source.version) == ("NXD_SRC", package, "9.8.7")
    assert source.commit is None and len(source.digest) == 16  # no git, not a known release: named by digest
    assert f"source digest {source.digest}, not a known release" in source.describe()
    (package / "parallel_layers" / "layers.py").write_text("X = 2\n")
    assert nxd_source.locate().digest != source.digest  # the digest names the contents


@pytest.mark.skipif(INSTALLED, reason="neuronx-distributed is installed here")
def test_without_nxd_it_is_missing_and_a_bad_tree_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("NXD_SRC", raising=False)
    assert nxd_source.locate() is None
    with pytest.raises(UserError, match="needs neuronx-distributed: install it .* or set NXD_SRC"):
        nxd_source.require()
    monkeypatch.setenv("NXD_SRC", str(tmp_path))
    with pytest.raises(UserError, match=f"NXD_SRC={tmp_path}: no neuronx-distributed source there"):
        nxd_source.locate()


def _activated(rank, source, fake_dir):
    """In a forked process: activate, then report what each Neuron package name resolves to."""
    stood_in = nxd_source.activate(source)
    import torch_neuronx
    import torch_xla.core.xla_model as xm

    try:
        xm.xla_device()
    except AttributeError as e:
        missing = str(e)
    return {
        "stood_in": stood_in,
        "real_file": torch_neuronx.__file__,
        "real_is_stand_in": hasattr(torch_neuronx, "__neuron_moe_stand_in__"),
        "reduce_sum": xm.REDUCE_SUM,
        "missing": missing,
        "cpu_mode": os.environ["NXD_CPU_MODE"],
        "bare": sys.modules["neuronx_distributed"].__path__,
    }


@pytest.mark.skipif(INSTALLED, reason="neuronx-distributed is installed here")
def test_stand_ins_only_for_absent_packages_never_a_real_one(tmp_path, monkeypatch):
    package = _tree(tmp_path / "nxd")
    fake = tmp_path / "site"
    (fake / "torch_neuronx").mkdir(parents=True)
    (fake / "torch_neuronx" / "__init__.py").write_text("REAL = True\n")  # an installed torch_neuronx
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.setenv("NXD_SRC", str(tmp_path / "nxd"))
    source = nxd_source.locate()
    assert "torch_neuronx" not in nxd_source.stand_in_packages()
    (got,) = run_ranks(1, _activated, source, fake)  # activate changes the process: a forked one
    assert "torch_neuronx" not in got["stood_in"] and "torch_xla" in got["stood_in"]
    assert got["real_file"] == str(fake / "torch_neuronx" / "__init__.py") and not got["real_is_stand_in"]
    assert got["reduce_sum"] == "sum" and got["cpu_mode"] == "1"
    assert "torch_xla.core.xla_model.xla_device: torch_xla.core.xla_model is a neuron-moe stand-in" in got["missing"]
    assert got["bare"] == [str(package)]
    assert "torch_xla" not in sys.modules and "NXD_CPU_MODE" not in os.environ  # this process untouched


def test_device_kernels_stood_in_for_refuse_to_run():
    kernel = nxd_source._kernel_decorator("ops.nki_jit")(experimental_flags="x")(
        test_device_kernels_stood_in_for_refuse_to_run
    )
    for call in (lambda: kernel(1), lambda: kernel[(1,)]):
        with pytest.raises(RuntimeError, match="a Neuron device kernel, stood in for on CPU"):
            call()
    with pytest.raises(NotImplementedError, match="context parallelism 1"):
        nxd_source.CollectivesConfig(replica_groups=[[0, 1]])
    assert nxd_source.CollectivesConfig(replica_groups=[[0], [1]]).rank_src_tgt_pairs == {0: [], 1: []}


@pytest.mark.skipif(INSTALLED, reason="neuronx-distributed is installed here")
def test_cli_refuses_nxd_layers_without_nxd_in_one_line(monkeypatch, capsys):
    monkeypatch.delenv("NXD_SRC", raising=False)
    assert main(["validate", "--backend", "tp", "--tp-layers", "nxd"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "set NXD_SRC to a checkout" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "dense_masked", "--tp-layers", "nxd"], "--tp-layers applies to the TP backends"),
        (["--backend", "reader", "--tp", "2"], "--tp applies to the TP backends"),
        (["--backend", "tp", "--tp-layers", "nxd", "--dtype", "bfloat16"], "runs float32 only, not bfloat16"),
        (["--backend", "tp", "--tp", "24"], "TP 24 (channel expert layout): 8 attention heads do not split"),
    ],
)
def test_cli_refuses_tp_options_that_do_not_apply(argv, message, capsys, tmp_path, monkeypatch):
    _tree(tmp_path)  # an NxD to be found (refused before it is imported)
    monkeypatch.setenv("NXD_SRC", str(tmp_path))
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
