"""The static graphs compiled by torch.compile (static/inductor.py), as `serve --backend static` runs
them by default: the same tokens as the modules (greedy and seeded sampling, a prompt prefilled in
chunks, rows joining and leaving), one shared KV cache, no compile after the first call of each
shape, inductor's cache where it was put; and the commands' compile flags, refused by name where
they cannot work. The compiling tests share one runtime of the smallest shapes (batch 2, one
bucket, one prompt per prefill, a decode graph over the first 16 positions and one over all 96:
three graphs, each compiled once)."""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import cpp_builder
from torch._inductor.exc import InvalidCxxCompiler

from neuron_moe import cli
from neuron_moe.model import build_model
from neuron_moe.serve import server
from neuron_moe.serve.batching import BatchEngine
from neuron_moe.serve.engine import SamplingParams
from neuron_moe.static import inductor
from neuron_moe.static.rows import Chunk
from neuron_moe.static.runtime import static_runtime
from neuron_moe.static.sampling import GREEDY

from conftest import random_prompts
from serving import IdTokenizer, serve_together, tokens_of

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# a prompt of 20 tokens is prefilled in three chunks of the one bucket (8, 8, 4)
PROMPTS = random_prompts(2048, [20, 5, 9, 3], seed=5)
REQUESTS = [
    (PROMPTS[0], SamplingParams(10, temperature=0.0)),
    (PROMPTS[1], SamplingParams(8, temperature=0.0)),
    (PROMPTS[2], SamplingParams(9, temperature=0.9, top_p=0.95, seed=7)),
    (PROMPTS[3], SamplingParams(6, temperature=1.0, top_k=20, seed=8)),
]


@pytest.fixture(scope="module")
def small_spec(tiny_port):
    return dataclasses.replace(tiny_port.static, buckets=(8,), prefill_rows=(1,), prefill_chunk=8, decode_lengths=(16,))


@pytest.fixture(scope="module")
def model(tiny_port):
    return build_model(tiny_port, tiny_port.static.decode_experts, torch.float32)


def warm(runtime):
    """Every shape of the runtime called once (what serve's warm-up does): the compiled graphs compile."""
    runtime.prefill([Chunk([5] * 8, 0, 0, GREEDY)])
    for start in runtime.decode_starts:  # each decode length's graph
        runtime.decode(torch.full((2, 1), 5), torch.full((2, 1), start), torch.tensor([GREEDY] * 2))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, small_spec, model):
    """(runtime, the compile cache directory, the progress lines): compiled into a cache of its own."""
    cache = tmp_path_factory.mktemp("inductor")
    lines = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(inductor.CACHE_ENV, "")  # put back after the module's tests
        inductor.use_cache_dir(cache)
        runtime = static_runtime(model, small_spec, 2, compile=True, progress=lines.append)
        torch.set_num_threads(1)
        warm(runtime)
        yield runtime, cache, lines


def run(runtime) -> list[list[int]]:
    engine = BatchEngine(runtime, IdTokenizer(), set())
    try:
        return [tokens_of(sink.steps) for sink in serve_together(engine, REQUESTS)]
    finally:
        engine.close()


def test_the_compiled_graphs_give_the_modules_tokens_over_one_shared_cache(compiled, small_spec, model):
    """Greedy and seeded sampled requests, 4 on 2 rows, one prefilled in chunks: the compiled graphs give
    the modules' tokens, the steps running the decode graph over 16 positions while every row is below
    16 and the one over all 96 otherwise. The compiled prefill and decode graphs write the one KV cache
    in place (the tensors the graphs were built over): a decode that read a copy would attend to zeros
    after the prefill."""
    runtime, _, _ = compiled
    cache = runtime._decode[16].module.cache
    assert runtime._prefill.module.cache is cache and runtime._decode[96].module.cache is cache
    before = [t.data_ptr() for t in cache.tensors()]
    ran, choose = [], runtime.decode_length
    runtime.decode_length = lambda positions: ran.append(choose(positions)) or ran[-1]
    try:
        got = run(runtime)
    finally:
        del runtime.decode_length
    assert set(ran) == {16, 96}
    assert [t.data_ptr() for t in cache.tensors()] == before and all(t.abs().sum() > 0 for t in cache.tensors())
    want = run(static_runtime(model, small_spec, 2))
    assert got == want and [len(t) for t in got] == [p.max_tokens for _, p in REQUESTS]


def test_no_graph_compiles_again_after_the_first_call_of_its_shape(compiled):
    """Dynamo compiled each graph once (in the warm-up); whole requests through the engine add none."""
    runtime, _, lines = compiled
    graphs, frames = counters["stats"]["unique_graphs"], dict(counters["frames"])
    run(runtime)
    assert counters["stats"]["unique_graphs"] == graphs and dict(counters["frames"]) == frames
    assert runtime._prefill.shapes == {((1, 8), (1, 8), (1, 8), (1,), (1, 4))}
    assert runtime._decode[16].shapes == runtime._decode[96].shapes == {((2, 1), (2, 1), (2, 4))}
    assert len(lines) == 3, lines  # a progress line per compile, no more


def test_inductor_keeps_what_it_compiled_in_the_cache_directory(compiled):
    _, cache, lines = compiled
    assert any((cache / "fxgraph").rglob("*")), sorted(p.name for p in cache.iterdir())
    assert lines[0].startswith("compiled the prefill graph (1 rows x 8 tokens) in ")
    assert lines[1].startswith("compiled the decode 16 graph (2 rows x 1 tokens) in ")
    assert lines[2].startswith("compiled the decode 96 graph (2 rows x 1 tokens) in ")


@pytest.fixture
def no_compiler(monkeypatch):
    """Inductor's own compiler lookup finds none (as on a machine without g++)."""

    def missing():
        raise InvalidCxxCompiler()

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)


@pytest.mark.parametrize("argv", [["serve", "--backend", "static", "--port", "0"], ["validate", "--backend", "static"]])
def test_without_a_cpp_compiler_the_compiled_graphs_are_refused_by_name(no_compiler, argv, capsys):
    assert inductor.cpp_compiler() is None
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: compiling the static graphs"), err
    assert "needs a C++ compiler" in err and "pass --no-compile" in err


def test_no_compile_runs_the_modules_without_a_compiler(no_compiler, monkeypatch, tmp_path):
    monkeypatch.setenv(inductor.CACHE_ENV, str(tmp_path / "unused"))
    assert server.check_compile(cli.serve_config(["serve", "--backend", "static", "--no-compile"])) is False
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--no-compile"], "--no-compile applies to --backend static's graphs; --backend eager runs"),
        (["serve", "--compile-cache", "x"], "--compile-cache applies to --backend static's graphs; --backend eager"),
        (["serve", "--backend", "static", "--no-compile", "--compile-cache", "x"], "with --no-compile none are"),
        (["serve", "--backend", "static", "--compile-cache", "{file}"], "--compile-cache {file}: cannot create it"),
        (["validate", "--no-compile"], "--no-compile applies to --backend static (its graphs on CPU), not --backend"),
        (["validate", "--backend", "static", "--no-compile", "--compile-cache", "x"], "--backend static --no-compile"),
        (["validate", "--backend", "traced", "--compile-cache", "x"], "--backend traced compiles none"),
    ],
)
def test_the_compile_flags_are_refused_where_they_cannot_apply(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(inductor.CACHE_ENV, str(tmp_path / "cache"))  # a compile cache set is put back
    (tmp_path / "file").write_text("not a directory")
    argv = [a.format(file=tmp_path / "file" / "below") for a in argv] + (["--port", "0"] if argv[0] == "serve" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(file=tmp_path / "file" / "below") in err, err


def test_the_compiled_graphs_order_of_layer_types_is_not_the_hash_seeds(small_spec, model):
    """transformers' decoder iterates a set of layer-type strings, whose order follows the process's
    hash seed: a graph traced over it would get another compile-cache key at every other restart.
    The compiled graph's view holds them sorted; the model keeps its own."""
    graph = static_runtime(model, small_spec, 2, compile=True)._decode[96]
    assert graph.module.model.model.unique_layer_types == ["full_attention", "sliding_attention"]
    assert isinstance(model.model.unique_layer_types, set)


FROM_A_CACHE = """
import dataclasses, sys
import torch
from neuron_moe.model import build_model
from neuron_moe.port import load_port
from neuron_moe.static import inductor
from neuron_moe.static.rows import Chunk
from neuron_moe.static.runtime import static_runtime
from neuron_moe.static.sampling import GREEDY
inductor.use_cache_dir(sys.argv[1])
port = load_port("tiny-gemma4-moe")
spec = dataclasses.replace(port.static, buckets=(8,), prefill_rows=(1,), prefill_chunk=8)
model = build_model(port, port.static.decode_experts, torch.float32)
compiled = static_runtime(model, spec, 2, compile=True, progress=print)
torch.set_num_threads(1)
modules = static_runtime(model, spec, 2)
got, want = (r.prefill([Chunk([5] * 8, 0, 0, GREEDY)])[0] for r in (compiled, modules))
print("same tokens" if torch.equal(got, want) else f"other tokens: {got} != {want}")
"""


def test_a_kernel_cut_short_in_the_compile_cache_is_built_again(compiled, tmp_path):
    """A compiled kernel of the cache truncated (a disk that filled up, a copy stopped midway), in a
    new process: one warning line naming it, the kernel built again from its source where the graph
    loads from the cache, and the graph gives the modules' tokens (not a loader's traceback, or a
    crash mapping it)."""
    _, cache, _ = compiled
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    kernel = max(copy.rglob("*.main.so"), key=lambda p: p.stat().st_size)  # a graph's kernels
    kernel.write_bytes(kernel.read_bytes()[:4096])
    done = subprocess.run(
        [sys.executable, "-c", FROM_A_CACHE, str(copy)],
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [warning] = [line for line in done.stderr.splitlines() if "cut short" in line]
    assert str(kernel.relative_to(copy)) in warning and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "(from the compile cache)" in done.stdout and done.stdout.rstrip().endswith("same tokens"), done.stdout
    assert inductor._whole_elf(kernel)  # built again
