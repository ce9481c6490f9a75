"""The static graphs compiled by torch.compile (static/inductor.py), as `serve --backend static` runs
them by default: the same tokens as the modules (greedy and seeded sampling, a prompt prefilled in
chunks, rows joining and leaving), one shared KV cache, no compile after the first call of each
shape, inductor's cache where it was put; and the commands' compile flags, refused by name where
they cannot work. The compiling tests share one runtime of the smallest shapes (batch 2, one
bucket, one prompt per prefill, a decode graph over the first 16 positions and one over all 96,
and the step graph: four graphs, each compiled once), and one more with prefix caching whose
logits-processing variants and copy graph are compiled (three graphs) and checked against the modules'."""

import dataclasses
import math
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
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.decoding import SamplingParams
from neuron_moe.static import inductor
from neuron_moe.static.rows import Chunk
from neuron_moe.static.runtime import static_runtime
from neuron_moe.static.sampling import BIAS_WIDTH, GREEDY, mask_words, neutral_inputs, sampling_row

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
    sampling = torch.tensor([GREEDY] * 2)
    for start in runtime.decode_starts:  # each decode length's graph
        runtime.decode(torch.full((2, 1), 5), torch.full((2, 1), start), sampling)
    runtime.step([Chunk([5] * 8, 0, 0, GREEDY)], torch.full((2, 1), 5), torch.zeros(2, 1, dtype=torch.long), sampling)


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
    engine = Engine(runtime, IdTokenizer(), set())
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
    assert len(lines) == 4, lines  # a progress line per compile, no more


def test_inductor_keeps_what_it_compiled_in_the_cache_directory(compiled):
    _, cache, lines = compiled
    assert any((cache / "fxgraph").rglob("*")), sorted(p.name for p in cache.iterdir())
    assert lines[0].startswith("compiled the prefill graph (1 rows x 8 tokens) in ")
    assert lines[1].startswith("compiled the decode 16 graph (2 rows x 1 tokens) in ")
    assert lines[2].startswith("compiled the decode 96 graph (2 rows x 1 tokens) in ")
    assert lines[3].startswith("compiled the step graph (1 rows x 8 tokens) in ")


def test_the_progress_line_of_a_graph_whose_first_input_is_one_dimensional(monkeypatch):
    """The draft graph's first input is the rows' last ids [B] (the copy graph's a row [1]): its line
    names no shape, where it once raised (compiling stood in for by the module itself: the line is
    what is checked)."""
    monkeypatch.setattr(inductor.torch, "compile", lambda module, **_: module)
    module = torch.nn.Identity()
    module.model = torch.nn.Module()
    module.model.model = torch.nn.Module()
    lines = []
    inductor.CompiledGraph(module, "draft", lines.append)(torch.zeros(3, dtype=torch.long))
    assert len(lines) == 1 and lines[0].startswith("compiled the draft graph in "), lines


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


# ---- the logits-processing variants and the copy graph, compiled ----------------------------------------

# fp32 logprobs of the same model compiled and not: inductor's fused kernels sum in another order,
# logits within ~1e-6 of each other; log_softmax of them, with margin (as test_logits_processing.py)
LOGPROB_ATOL = 1e-4
# the KV state after the same calls: K and V come out of the projections (and rotary, norms) in fp32,
# where the two orders of summation differ by a few ulps of values of order 1
STATE_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def variants(compiled, small_spec, model):
    """(a runtime with prefix caching whose variants and copy graph are compiled, into the module's
    compile cache, its progress lines; the same of the modules)."""
    lines = []
    runtime = static_runtime(model, small_spec, 2, compile=True, progress=lines.append, prefix_caching=True)
    return runtime, lines, static_runtime(model, small_spec, 2, prefix_caching=True)


def variant_calls(runtime, steps: int = 4) -> list:
    """Two chunks of a prompt prefilled in row 0 by the logits-processing prefill (the second attends to
    the first and keeps its counts), row 0 copied into row 1 (the copy graph), then `steps` steps of the
    logits-processing decode of both rows, each fed its own last token: row 0 greedy under penalties and
    min_p, row 1 sampled under a bias, a ban and a bitmask -> every call's outputs."""
    prompt = PROMPTS[0]
    outputs = [
        runtime.prefill_processing([Chunk(prompt[s : s + 8], s, 0, GREEDY, prompt[s + 1 : s + 9])]) for s in (0, 8)
    ]
    runtime.copy_row(0, 1)
    vocab = runtime.vocab
    ids, positions = torch.tensor([[prompt[16]], [prompt[16]]]), torch.full((2, 1), 16)
    process, bias_ids, bias, mask = neutral_inputs(2, vocab)
    process[0] = torch.tensor([0.5, 0.3, 1.2, 0.05, 0.0, 1.0, 0.0])  # penalties, min_p; fed a prompt token
    process[1] = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    bias_ids[1, :2], bias[1, :2] = torch.tensor([7, 100]), torch.tensor([3.0, -math.inf])
    mask[1] = torch.randint(-(2**31), 2**31 - 1, (mask.shape[1],), generator=torch.Generator().manual_seed(3))
    for step in range(steps):
        sampling = torch.tensor([GREEDY, sampling_row(0.9, 40, 0.95, (0.37 * (step + 1)) % 1)])
        out = runtime.decode_processing(ids, positions, sampling, process, bias_ids, bias, mask)
        outputs.append(out)
        ids, positions = out[0][:, None].clone(), positions + 1
        process[:, 4:] = torch.tensor([0.0, 0.0, 1.0])  # the rows are fed their output tokens now
    return outputs


def state(runtime) -> list[torch.Tensor]:
    graph = runtime._prefill_processing
    graph = getattr(graph, "module", graph)
    return [*graph.cache.tensors(), *graph.counts.tensors()]


def test_the_compiled_variants_and_copy_give_the_modules_outputs_and_state(variants):
    """The logits-processing prefill and decode and the copy graph, compiled, against the modules over
    the same calls: the same tokens, ranks and top ids, logprobs within fp32's reordering, the same
    token counts, and a KV state as close; the compiled graphs wrote the very tensors they were built
    over (one state with the prefill and decode graphs)."""
    runtime, lines, modules = variants
    compiled_state = state(runtime)
    assert runtime._copy.module.cache is runtime._decode[96].module.cache is runtime._prefill_processing.module.cache
    before = [t.data_ptr() for t in compiled_state]
    got, want = variant_calls(runtime), variant_calls(modules)
    for g, w in zip(got[:2], want[:2]):  # the prefill's scores: (logprob, rank, top ids, top logprobs) per chunk
        (g,), (w,) = g, w
        torch.testing.assert_close(g[0], w[0], atol=LOGPROB_ATOL, rtol=0)
        assert torch.equal(g[1], w[1]) and torch.equal(g[2], w[2])
        torch.testing.assert_close(g[3], w[3], atol=LOGPROB_ATOL, rtol=0)
    for (g_tokens, g_scores, _), (w_tokens, w_scores, _) in zip(got[2:], want[2:]):
        assert torch.equal(g_tokens, w_tokens) and (g_tokens >= 0).all()
        torch.testing.assert_close(g_scores[0], w_scores[0], atol=LOGPROB_ATOL, rtol=0)
        assert torch.equal(g_scores[1], w_scores[1]) and torch.equal(g_scores[2], w_scores[2])
        torch.testing.assert_close(g_scores[3], w_scores[3], atol=LOGPROB_ATOL, rtol=0)
    assert [t.data_ptr() for t in compiled_state] == before
    *kv, output_counts, prompt_seen = compiled_state
    *want_kv, want_output, want_prompt = state(modules)
    assert torch.equal(output_counts, want_output) and torch.equal(prompt_seen, want_prompt)
    assert output_counts.sum(-1).tolist() == [3, 3] and prompt_seen[0].sum() > 0  # the steps after the first
    for g, w in zip(kv, want_kv):
        torch.testing.assert_close(g, w, **STATE_TOLERANCE)
        assert torch.equal(g[0, :, :16], g[1, :, :16]) and g[1, :, :16].abs().sum() > 0  # the copy: row 0's prompt


def test_the_variants_and_copy_compile_once_per_shape(variants):
    """Each compiled once at its first call, told through `progress`; the same calls again compile nothing."""
    runtime, lines, _ = variants
    saved = [t.clone() for t in state(runtime)]  # left as found: the test beside it compares the state
    variant_calls(runtime)
    graphs, frames = counters["stats"]["unique_graphs"], dict(counters["frames"])
    variant_calls(runtime, steps=6)
    for t, before in zip(state(runtime), saved):
        t.copy_(before)
    assert counters["stats"]["unique_graphs"] == graphs and dict(counters["frames"]) == frames
    assert runtime._prefill_processing.shapes == {((1, 8), (1, 8), (1, 8), (1,), (1, 8))}
    words, width = mask_words(runtime.vocab), BIAS_WIDTH
    shapes = {((2, 1), (2, 1), (2, 4), (2, 7), (2, width), (2, width), (2, words))}
    assert runtime._decode_processing[96].shapes == shapes
    assert runtime._copy.shapes == {((1,), (1,))}
    assert [line.split(" in ")[0] for line in lines] == [
        "compiled the logits-processing prefill graph (1 rows x 8 tokens)",
        "compiled the copy graph",
        "compiled the logits-processing decode 96 graph (2 rows x 1 tokens)",
    ]
