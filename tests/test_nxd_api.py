"""parallel/nxd.py uses only NxD names and keywords listed in NXD_API (which tools/check_nxd_api.py
verifies against the NxD source), passes keywords only, and without the SDK fails with one clear
error. The SDK itself cannot be installed here, so nothing in this file runs NxD."""

import ast
import inspect

import pytest

from neuron_moe.errors import UserError
from neuron_moe.parallel import cpu, nxd


def _nxd_calls():
    """(name, keywords or None, positional count, line) for every _nxd("…") / _bound(obj, "…")
    in nxd.py; keywords are those of the call applied to the result (None: used as a value)."""
    tree = ast.parse(inspect.getsource(nxd))
    splats = {}  # helper functions whose returned dict(...) is splatted as keywords
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for ret in (n for n in ast.walk(fn) if isinstance(n, ast.Return)):
                if isinstance(ret.value, ast.Call) and getattr(ret.value.func, "id", "") == "dict":
                    splats[fn.name] = [k.arg for k in ret.value.keywords]
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") in ("_nxd", "_bound")
            and isinstance(node.args[-1], ast.Constant)
        ):
            outer = parents.get(node)
            if isinstance(outer, ast.Call) and outer.func is node:
                keywords = []
                for k in outer.keywords:
                    keywords += [k.arg] if k.arg else splats[k.value.func.id]
                found.append((node.args[-1].value, keywords, len(outer.args), node.lineno))
            else:
                found.append((node.args[-1].value, None, 0, node.lineno))
    return found


def test_every_nxd_name_and_keyword_is_in_the_verified_table():
    calls = _nxd_calls()
    assert len(calls) >= len(nxd.NXD_API)
    for name, keywords, positional, line in calls:
        assert name in nxd.NXD_API, f"nxd.py:{line} uses {name}, which is not in NXD_API"
        path, allowed = nxd.NXD_API[name]
        assert path.startswith("src/neuronx_distributed/")
        assert positional == 0, f"nxd.py:{line}: {name} called with positional arguments"
        if keywords is not None:
            assert allowed is not None and set(keywords) <= set(allowed), (line, name, keywords)
    unused = set(nxd.NXD_API) - {c[0] for c in calls}
    assert not unused, f"NXD_API lists names nxd.py does not use: {sorted(unused)}"


def test_initialize_model_parallel_is_called_with_keywords():
    """The trap: its third positional parameter is context_parallel_size."""
    (call,) = [c for c in _nxd_calls() if c[0].endswith("initialize_model_parallel")]
    assert call[2] == 0 and "context_parallel_size" in call[1] and "expert_model_parallel_size" in call[1]


def test_same_surface_as_the_cpu_backend():
    for name in (
        "ColumnParallelLinear",
        "RowParallelLinear",
        "ExpertFusedColumnParallelLinear",
        "ExpertFusedRowParallelLinear",
        "ParallelEmbedding",
        "SPMDRank",
        "scatter_to_process_group_spmd",
        "scatter_to_tensor_model_parallel_region",
        "reduce_from_tensor_model_parallel_region",
    ):
        assert (
            inspect.signature(getattr(nxd, name)).parameters.keys()
            == inspect.signature(getattr(cpu, name)).parameters.keys()
        ), name


@pytest.mark.skipif(nxd.sdk_available(), reason="the Neuron SDK is installed")
def test_without_the_sdk_every_entry_point_is_one_clear_error():
    assert not nxd.sdk_available()
    for build in (
        lambda: nxd.ColumnParallelLinear(8, 8, tp=2),
        lambda: nxd.SPMDRank(2),
        lambda: nxd.ExpertFusedColumnParallelLinear(4, 8, 8, tp=2, stride=2),
        lambda: nxd.initialize_model_parallel(2),
        lambda: nxd.trace_keys({}, dict, 2, "/tmp/x"),
    ):
        with pytest.raises(nxd.NeuronSDKMissing, match="needs the Neuron SDK .* not on PyPI") as e:
            build()
        assert isinstance(e.value, UserError) and "\n" not in str(e.value)


def test_names_outside_the_table_are_refused():
    with pytest.raises(KeyError, match="not in NXD_API"):
        nxd._nxd("neuronx_distributed.parallel_layers.layers.ExpertFusedLinear")
