"""The step graph (`decoder.Step`): a prefill chunk and the decode step of every row in one call.
Its tokens are the two calls' (prefill, then decode) — in the graph itself, in `generate`, in the
batching engine beside decoding rows, and with prefix caching; and it exports as a static graph
whose every op the XLA check saw lower."""

import pytest
import torch

from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.engine import SamplingParams
from neuron_moe.static import data_dependent_ops, ops_not_lowered
from neuron_moe.static.cache import state_tensors
from neuron_moe.static.decoder import Step, new_cache
from neuron_moe.static.export import decode_inputs, functional, prefill_inputs
from neuron_moe.static.rows import Chunk, generate
from neuron_moe.static.runtime import static_runtime
from neuron_moe.static.sampling import GREEDY

from conftest import random_prompts
from serving import IdTokenizer, serve_together, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# fp32 logits (capped at 30 by the softcap) of the same tokens through GEMMs of other row counts: each
# dot product of 128 to 256 terms may round in another order, a few ulps of 30 per layer
LOGITS_ATOL = 5e-4


@pytest.fixture(scope="module")
def static_model(tiny_port):
    return build_model(tiny_port, tiny_port.static.decode_experts, torch.float32)


class Counted:
    """A runtime whose step graph calls are counted, with the chunks each carried."""

    def __init__(self, runtime):
        self.calls, self.step = [], runtime.step
        runtime.step = self._step

    def _step(self, chunks, *decode):
        self.calls.append([(c.row, c.start, len(c.ids)) for c in chunks])
        return self.step(chunks, *decode)


def test_one_step_call_writes_and_returns_what_the_prefill_then_the_decode_do(tiny_port, static_model):
    """Row 0 decodes at position 20 (its cache from a 20-token prefill) while rows 1 and 2 take chunks:
    a first one (8 tokens at 0) and a later one (5 tokens at 8); row 3 sits free. The tokens are the
    two calls', the logits and the whole cache after within rounding."""
    runtimes = [
        static_runtime(static_model, tiny_port.static, batch=4, prefill_rows=(1, 2), chunk=56, logits=True)
        for _ in range(2)
    ]
    first = random_prompts(2048, [20, 8, 13], seed=4)
    chunks = [Chunk(first[1], 0, 1, GREEDY), Chunk(first[2][8:], 8, 2, GREEDY)]
    ids = torch.tensor([[7], [0], [0], [0]])  # row 0's next input; the others sit as pads
    positions = torch.tensor([[20], [8], [13], [0]])
    sampling = torch.tensor([GREEDY] * 4)
    for runtime in runtimes:  # the same cache before: row 0 holds its prompt, row 2 its first 8 tokens
        runtime.prefill([Chunk(first[0], 0, 0, GREEDY), Chunk(first[2][:8], 0, 2, GREEDY)])
    tokens, logits = runtimes[0].prefill(chunks)
    decoded, decoded_logits = runtimes[0].decode(ids, positions, sampling)
    fused = runtimes[1].step(chunks, ids, positions, sampling)
    assert torch.equal(fused[0], tokens) and torch.equal(fused[2], decoded)
    torch.testing.assert_close(fused[1], logits, atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(fused[3], decoded_logits, atol=LOGITS_ATOL, rtol=0)
    two, one = (state_tensors(r._prefill) for r in runtimes)
    for name in two:
        # K and V after their RMS norms (values of order 1): a few fp32 ulps from the other row counts
        torch.testing.assert_close(one[name], two[name], atol=1e-5, rtol=1e-5, msg=name)


def test_generate_with_the_step_graph_is_generate_with_two_calls_and_hf_eagers(tiny_port, static_model, tiny_eager):
    """An 80-token prompt prefilled in chunks of 8 beside two short ones that decode meanwhile: the
    chunks after the short prompts' prefill go in step calls, and every token is the two-call path's."""
    ids, mask = left_pad(random_prompts(2048, [5, 80, 14], seed=3), 0)
    out = {}
    for fused in (False, True):
        runtime = static_runtime(static_model, tiny_port.static, batch=4, prefill_rows=(1, 4), chunk=8, fused=fused)
        calls = Counted(runtime)
        out[fused] = generate(runtime, ids, mask, 12)[0]
        assert len(calls.calls) == (9 if fused else 0)  # the long prompt's chunks 2..10, each beside 2 rows decoding
    assert torch.equal(out[True], out[False])
    assert out[True].tolist() == greedy(tiny_eager, ids, mask, 12).tokens.tolist()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_served_greedy_with_the_step_graph_is_with_two_calls_and_hf_eagers(
    tiny_port, static_model, tiny_eager, prefix_caching
):
    """Eight requests on four rows, chunks of 8, two of the prompts 61 and 80 tokens and three sharing
    a 45-token prefix (taken from a row that holds it, with prefix caching): the batching engine gives
    every request the same tokens with the step graph as without, and HF eager's; the long prompts'
    chunks run in step calls beside rows decoding."""
    shared = random_prompts(2048, [45], seed=5)[0]
    prompts = random_prompts(2048, [5, 80, 14, 9, 61], seed=33) + [
        shared + t for t in random_prompts(2048, [3, 6, 4], 6)
    ]
    requests = [(p, SamplingParams(n, temperature=0.0)) for p, n in zip(prompts, [9, 12, 6, 11, 8, 10, 7, 12])]
    out = {}
    for fused in (False, True):
        runtime = static_runtime(
            static_model,
            tiny_port.static,
            batch=4,
            prefill_rows=(1, 4),
            chunk=8,
            prefix_caching=prefix_caching,
            fused=fused,
        )
        calls = Counted(runtime)
        engine = Engine(runtime, IdTokenizer(), set())
        try:
            sinks = serve_together(engine, requests)
        finally:
            engine.close()
        assert all(s.error is None for s in sinks)
        out[fused] = [tokens_of(s.steps) for s in sinks]
        long_chunks = [c for call in calls.calls for c in call if c[1] > 0 and c[1] + c[2] > 56]
        assert (len(long_chunks) > 0) == fused  # the long prompts' later chunks beside decoding rows
    assert out[True] == out[False]
    assert out[True] == [greedy(tiny_eager, *left_pad([p], 0), r.max_tokens).tokens[0].tolist() for p, r in requests]


@pytest.mark.slow
def test_the_step_graph_exports_static_with_the_cache_as_state_and_only_ops_the_xla_check_lowered(
    tiny_port, static_model
):
    spec = tiny_port.static
    step = Step(static_model, new_cache(static_model, spec.max_cache_len, spec.batch_size), spec.prefill_experts)
    with torch.no_grad():
        program = functional(torch.export.export(step, prefill_inputs(spec, 8, 2) + decode_inputs(spec), strict=True))
    assert data_dependent_ops(program) == [] and ops_not_lowered(program) == []
    sig = program.graph_signature
    state = {f"cache.{kv}{i}" for i in range(static_model.config.num_hidden_layers) for kv in "kv"}
    assert set(sig.buffers_to_mutate.values()) == state
    nodes = {n.name: n for n in program.graph.nodes}
    assert [tuple(nodes[o].meta["val"].shape) for o in sig.user_outputs] == [(2 + spec.batch_size, 1)]
