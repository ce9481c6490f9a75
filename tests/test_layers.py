"""The layering of docs/architecture.md, held: no module imports a layer above its own, and no
modules import each other in a cycle — imports inside functions included — and a function
imports only what a user may not have installed (tests/layers.py)."""

import shutil

import pytest

import layers as L


def test_no_module_imports_a_layer_above_its_own():
    assert L.upward(L.imports()) == []


def test_no_import_cycle():
    assert L.cycles(L.imports()) == []


def test_imports_inside_functions_are_only_for_optional_packages():
    assert L.needless_local_imports() == []


def test_every_module_has_a_layer():
    for name in L.modules():
        L.layer_of(name)  # raises for a module in no layer


@pytest.fixture
def package(tmp_path):
    copy = tmp_path / "neuron_moe"
    shutil.copytree(L.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors", "*.json"))
    return copy


def test_the_check_sees_an_upward_import_inside_a_function(package):
    with open(package / "reader" / "hadamard.py", "a") as f:
        f.write("\n\ndef _upward():\n    from ..serve import app  # noqa: F401\n")
    found = L.upward(L.imports(package))
    assert len(found) == 1 and found[0].startswith("reader.hadamard (definitions) imports serve.app (surfaces)")
    assert found[0].endswith("inside a function")


def test_the_check_sees_a_cycle_within_a_layer(package):
    with open(package / "static" / "cache.py", "a") as f:
        f.write("\nfrom . import decoder  # noqa: E402,F401\n")  # decoder imports cache
    assert L.cycles(L.imports(package)) == [["static.cache", "static.decoder"]]
    assert L.upward(L.imports(package)) == []


def test_a_module_in_no_layer_is_named(package):
    (package / "stray.py").write_text("")
    with pytest.raises(KeyError, match="neuron_moe.stray is in no layer"):
        [L.layer_of(name) for name in L.modules(package)]


def test_the_check_tells_a_needless_local_import_from_an_optional_one(package):
    with open(package / "reader" / "hadamard.py", "a") as f:
        f.write(
            "\n\ndef _lazy():\n    import boto3  # noqa: F401\n    from ..reader.triton import forward  # noqa: F401\n"
            "    from ..errors import UserError  # noqa: F401\n    import json  # noqa: F401\n"
        )
    lines = {line.split(": ", 1)[1] for line in L.needless_local_imports(package) if line.startswith("reader.hadamard")}
    assert lines == {"neuron_moe.errors inside a function", "json inside a function"}
