"""Prefix caching (static/prefix.py): the block index alone, the engine step's placement of work on
a runtime that records its calls, and the batching engine over the real graphs, where a request
that takes a held prefix (in place, or copied by the Copy graph) gets the greedy tokens it gets
without prefix caching and from HF eager, and /metrics' counters are the hits made."""

import threading

import pytest
import torch

from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.decoding import SamplingParams
from neuron_moe.serve.metrics import Metrics
from neuron_moe.static.runtime import static_runtime
from neuron_moe.static.cache import KVCache, cache_layout, copy_rows
from neuron_moe.static.prefix import PrefixIndex
from neuron_moe.static.rows import Rows
from neuron_moe.static.sampling import GREEDY

from conftest import random_prompts
from serving import IdTokenizer, Sink, serve_together, tokens_of, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the index ----------------------------------------------------------------------------------------


def test_the_index_takes_whole_blocks_never_the_last_token_and_counts_tokens_as_vllm():
    index = PrefixIndex(rows=3, max_cache_len=96, block=4)
    held = list(range(10, 21))  # 11 tokens: blocks [10..13], [14..17] whole, 3 left over
    index.admit(0, None, 0)
    index.extend(0, held)
    assert index.lookup(held + [99], free=[1, 2]) == (0, 8)
    assert index.lookup(held[:9], free=[1, 2]) == (0, 8)  # 9 tokens: at most 8 taken
    assert index.lookup(held[:8], free=[1, 2]) == (0, 4)  # 8 tokens: the last one is prefilled
    assert index.lookup(held[:5] + [1, 2, 3], free=[1, 2]) == (0, 4)  # diverges inside block 2
    assert index.lookup([10, 11, 12, 99, 14], free=[]) == (None, 0)  # diverges inside block 1
    # the chain: block 2's tokens alone, after another first block, are not held
    assert index.lookup([0, 0, 0, 0, 14, 15, 16, 17, 18], free=[]) == (None, 0)
    assert index.queries == 12 + 9 + 8 + 8 + 5 + 9 and index.hits == 8 + 8 + 4 + 4


def test_the_index_evicts_the_least_recently_used_row_and_forgets_failed_rows():
    index = PrefixIndex(rows=3, max_cache_len=12, block=4)
    for row in (0, 1):
        index.admit(row, None, 0)
        index.extend(row, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    index.park(1)
    assert index.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9], free=[1, 2])[0] == 1  # a free holder first
    assert index.victim([1, 2]) == 2  # an empty row first
    index.park(0)
    assert index.victim([0, 1]) == 1  # then the least recently used
    index.admit(2, 0, 8)  # copied from row 0, which counts as used
    assert index.victim([0, 1]) == 1
    assert index.tokens[2] == [1, 2, 3, 4, 5, 6, 7, 8]
    index.extend(2, [20, 21, 22, 23, 24])  # 13 tokens: the cache's last position written
    assert index.park(2) == 11  # it waits at its last position: what it holds loses that one
    assert index.lookup([1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 9], free=[2])[1] == 8
    assert index.park(0, RuntimeError("device fault")) == 0 and index.tokens[0] == []


def test_a_copy_is_the_source_row_whole_and_leaves_the_other_rows(tiny_port):
    layout = cache_layout(tiny_port.config, 24, whole_rows=True)
    assert {spec.length for spec in layout} == {24}  # sliding layers keep every position too
    state = KVCache(layout, rows=3, dtype=torch.float32)
    for t in state.tensors():
        t.copy_(torch.randn(t.shape))
    before = [t.clone() for t in state.tensors()]
    after = copy_rows(state, torch.tensor([2]), torch.tensor([0]))
    for old, new in zip(before, after):
        assert torch.equal(new[0], old[2]) and torch.equal(new[1:], old[1:])


# ---- the engine step -----------------------------------------------------------------------------------


class Runtime:
    """Two rows, chunks of 8; a prefill's token is 100 + its row, a decode step's 1000 + its position;
    records every call, copies included."""

    batch, pad_id, chunk, prefill_rows, max_cache_len = 2, 0, 8, [1, 2], 64

    def __init__(self):
        self.calls = []

    def prefill(self, chunks):
        self.calls.append(("prefill", [(c.start, len(c.ids), c.row) for c in chunks]))
        return torch.tensor([100 + c.row for c in chunks]), None

    def decode(self, ids, positions, sampling):
        self.calls.append(("decode", positions[:, 0].tolist()))
        return positions[:, 0] + 1000, None

    def copy_row(self, src, dst):
        self.calls.append(("copy", src, dst))


class Work:
    def __init__(self, prompt, n):
        self.prompt, self.n, self.got = prompt, n, []

    def sampling(self):
        return GREEDY

    def next(self, token, logits):
        self.got.append(token)
        return None if len(self.got) == self.n else token

    def end(self, error=None):
        pass


def test_rows_take_a_held_prefix_in_place_or_copied_and_prefill_the_rest():
    runtime = Runtime()
    rows = Rows(runtime, prefix=PrefixIndex(2, runtime.max_cache_len, block=4))
    looked = []
    rows.looked_up = lambda queries, hits: looked.append((queries, hits))
    shared = list(range(10, 30))  # 20 tokens
    waiting = [Work(shared + [1, 2], 3), Work([5, 6, 7], 1)]
    rows.step(lambda: waiting.pop(0) if waiting else None)  # nothing held: both prefilled from 0
    assert runtime.calls[0] == ("prefill", [(0, 8, 0), (0, 3, 1)])  # the second ends with its first token
    while rows.active():
        rows.step()
    # the first ended last: row 0 holds its 22 prompt tokens and the 2 it was fed, and waits after them;
    # row 1, the least recently used, holds the other's 3
    assert rows.positions[:, 0].tolist() == [24, 3] and rows.prefix.tokens[0] == shared + [1, 2, 100, 1022]
    runtime.calls.clear()
    waiting = [Work(shared + [3], 6)]
    rows.step(lambda: waiting.pop() if waiting else None)  # 20 of its 21 tokens are row 0's; row 1 is evicted
    assert runtime.calls[:2] == [("copy", 0, 1), ("prefill", [(20, 1, 1)])]
    runtime.calls.clear()
    waiting = [Work(shared[:13], 2)]
    rows.step(lambda: waiting.pop() if waiting else None)  # row 0 holds its first 12 and is the only free row
    assert runtime.calls[0] == ("prefill", [(12, 1, 0)])
    assert looked == [(22, 0), (3, 0), (21, 20), (13, 12)]


def test_work_sharing_a_prefix_being_prefilled_waits_for_it_and_the_work_behind_it_too():
    """Three prompts sent together, two sharing 20 tokens (5 blocks of 4): the second waits (`held`,
    and the third, behind it, with it) until the first has prefilled them, then copies them and
    prefills its own 2; a prompt sharing less than a block does not wait."""
    runtime = Runtime()
    rows = Rows(runtime, prefix=PrefixIndex(2, runtime.max_cache_len, block=4))
    shared = list(range(10, 30))
    first, second, third = Work(shared + [1, 2], 2), Work(shared + [3, 4], 2), Work([7, 8, 9], 1)
    waiting = [first, second, third]
    take = lambda: waiting.pop(0) if waiting else None  # noqa: E731
    for _ in range(2):  # the first's chunks of 8 at 0 and 8; the second held, the third behind it
        rows.step(take)
        assert rows.held is second and waiting == [third] and rows.slots[1] is None
    rows.step(take)  # its last chunk (16..21) gives its first token
    rows.step(take)  # the second takes the first's 20 in row 1 and prefills 20..21
    assert runtime.calls[:3] == [("prefill", [(0, 8, 0)]), ("prefill", [(8, 8, 0)]), ("prefill", [(16, 6, 0)])]
    # the first ended with its decode (row 0 free): the third, behind the second, goes there beside it
    assert runtime.calls[4:6] == [("copy", 0, 1), ("prefill", [(20, 2, 1), (0, 3, 0)])]
    assert rows.held is None and waiting == []
    while rows.active() or waiting:
        rows.step(take)
    assert first.got == [100, 1022] and second.got == [101, 1022] and third.got == [100]
    runtime.calls.clear()
    waiting = [Work(list(range(40, 60)), 1), Work([40, 41, 42, 5, 6], 1)]  # they share 3 tokens: not a block
    rows.step(take)
    assert rows.held is None and waiting == [] and len(runtime.calls[0][1]) == 2  # both prefilled at once


# ---- over the real graphs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def static_model(tiny_port):
    return build_model(tiny_port, tiny_port.static.decode_experts, torch.float32)


def engines(tiny_port, static_model):
    """Two rows, chunks of 8, prefill graphs of 1 and 2: with prefix caching and without."""
    for caching in (True, False):
        runtime = static_runtime(
            static_model, tiny_port.static, batch=2, prefill_rows=(1, 2), chunk=8, prefix_caching=caching
        )
        yield caching, Engine(runtime, IdTokenizer(), set())


SHARED = random_prompts(2048, [45], seed=5)[0]  # longer than the sliding window (16): 2 whole blocks and 13
TAILS = random_prompts(2048, [6, 4, 9], seed=6)


def test_greedy_tokens_with_prefix_caching_are_those_without_it_and_the_hits_are_counted(
    tiny_port, static_model, tiny_eager
):
    """In order, on two rows: a prompt of the shared prefix and a tail (nothing held: row 0); another
    tail (32 tokens of row 0, copied into row 1, the least recently used); the prefix cut inside a
    block (16: copied into row 0, the last token prefilled); a follow-up whose prompt is the second's
    prompt and output (48 tokens of row 1, taken in place, 3 of them generated ones); then, while a
    request with a new prefix runs in one row, a prompt sharing that prefix goes into the other (32,
    copied from the busy row). Every output equals HF eager's greedy one and the engine's without."""
    first, second = SHARED + TAILS[0][1:], SHARED + TAILS[1][1:]
    sequential = [(first, 8), (second, 12), (SHARED[:17], 4)]
    expected_hits, copies = [0, 32, 16, 48, 0, 32], 3
    out, counted = {}, {}
    for caching, engine in engines(tiny_port, static_model):
        engine.metrics = Metrics("m")
        try:
            got = []
            for prompt, n in sequential:
                (sink,) = serve_together(engine, [(prompt, SamplingParams(n, temperature=0.0))])
                got.append((prompt, tokens_of(sink.steps)))
            follow = got[1][0] + got[1][1] + TAILS[2][1:]  # the second's prompt, output and 8 more tokens
            (sink,) = serve_together(engine, [(follow, SamplingParams(5, temperature=0.0))])
            got.append((follow, tokens_of(sink.steps)))
            fresh = random_prompts(2048, [44], seed=7)[0]
            long, beside = fresh + TAILS[2][1:], fresh[:40]
            running = Sink(engine)
            engine.submit(long, SamplingParams(30, temperature=0.0), running)
            wait_for(lambda: running.steps, what="the long request's first token")
            (sink,) = serve_together(engine, [(beside, SamplingParams(6, temperature=0.0))])
            assert running.ended.wait(60)
            got += [(long, tokens_of(running.steps)), (beside, tokens_of(sink.steps))]
            registry = engine.metrics.registry
            names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "neuron_moe:copy_calls_total")
            counted[caching] = [registry.get_sample_value(name, {"model_name": "m"}) for name in names]
        finally:
            engine.close()
        out[caching] = got
    assert out[True] == out[False]
    for prompt, tokens in out[True]:
        assert tokens == greedy(tiny_eager, *left_pad([prompt], 0), len(tokens)).tokens[0].tolist(), len(prompt)
    queries = sum(len(prompt) for prompt, _ in out[True])
    assert counted[True] == [queries, sum(expected_hits), copies]
    assert counted[False] == [0, 0, 0]


def test_n_generations_of_one_prompt_share_its_prefill(tiny_port, static_model, tiny_eager):
    """A request's n=3 generations of a 50-token prompt, sent together on two rows: with prefix
    caching the first is prefilled (7 chunks of 8), the others wait for it, then copy its 48 tokens
    (3 whole blocks) and prefill 2; without, each is prefilled whole. The same greedy tokens."""
    prompt = SHARED + TAILS[0][1:]
    names = ("vllm:prefix_cache_hits_total", "neuron_moe:copy_calls_total", "neuron_moe:prefill_rows_total")
    out, counted = {}, {}
    for caching, engine in engines(tiny_port, static_model):
        engine.metrics = Metrics("m")
        try:
            sinks = serve_together(engine, [(prompt, SamplingParams(6, temperature=0.0))] * 3)
            out[caching] = [tokens_of(sink.steps) for sink in sinks]
            registry = engine.metrics.registry
            counted[caching] = [registry.get_sample_value(name, {"model_name": "m"}) for name in names]
        finally:
            engine.close()
    want = greedy(tiny_eager, *left_pad([prompt], 0), 6).tokens[0].tolist()
    assert out[True] == out[False] == [want] * 3
    assert counted[True] == [2 * 48, 2, 7 + 1 + 1]
    assert counted[False] == [0, 0, 3 * 7]


def test_a_request_waiting_for_a_prefix_ends_when_its_client_leaves_or_the_engine_closes(tiny_port, static_model):
    """Two requests of one 50-token prompt sent together: the second waits for the first's prefill
    (its 3 blocks are held by no row) and is ended when its client leaves, or when the engine closes."""
    params = SamplingParams(30, temperature=0.0)
    caching, engine = next(engines(tiny_port, static_model))
    runtime, gate = engine.batch.runtime, threading.Event()
    prefill = runtime.prefill
    runtime.prefill = lambda chunks: gate.wait() and prefill(chunks)  # each round's first chunk waits for the test
    assert caching
    try:
        for prompt, leaving in zip(random_prompts(2048, [50, 50], seed=11), (True, False)):
            gate.clear()
            first, second = Sink(engine), Sink(engine)
            with engine._wake:  # admitted together: the second waits for the first's prefill
                engine.submit(prompt, params, first)
                engine.submit(prompt, params, second)
            wait_for(lambda: engine.batch.held is not None, what="the second request to wait")
            if leaving:
                second.cancelled.set()
                gate.set()
                assert second.ended.wait(10) and second.steps == [] and second.error is None
                assert engine.batch.held is None and first.ended.wait(60) and len(first.steps) == 30
    finally:
        with engine._wake:  # closed before the loop's next step: the first ends running, the second waiting
            engine._closed = True
        gate.set()
        engine.close()
    assert second.ended.is_set() and second.steps == [] and first.ended.is_set() and len(first.steps) < 30


def test_a_request_that_asks_for_logits_processing_takes_no_prefix(tiny_port, static_model):
    """A repetition penalty counts the prompt's tokens in the variant prefill, and prompt logprobs score
    each of them: such a request prefills its whole prompt (vLLM skips the prefix cache for prompt
    logprobs too), is not counted as a query, and gets the tokens and logprobs it gets without caching."""
    from neuron_moe.static.sampling import Processing

    first, second = SHARED + TAILS[0][1:], SHARED + TAILS[1][1:]
    asking = SamplingParams(8, temperature=0.0, processing=Processing(repetition_penalty=1.3, logprobs=2))
    out, counted = {}, {}
    for caching, engine in engines(tiny_port, static_model):
        engine.metrics = Metrics("m")
        try:
            (plain,) = serve_together(engine, [(first, SamplingParams(8, temperature=0.0))])
            (asked,) = serve_together(engine, [(second, asking)])
            out[caching] = [plain.steps, asked.steps]
            registry = engine.metrics.registry
            counted[caching] = [
                registry.get_sample_value(n, {"model_name": "m"})
                for n in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
            ]
        finally:
            engine.close()
    # the same tokens; the logprobs as close as fp32 attention over a longer (masked) sliding ring allows
    assert [tokens_of(steps) for steps in out[True]] == [tokens_of(steps) for steps in out[False]]
    with_, without = ([s.logprobs.logprob for s in steps[1]] for steps in (out[True], out[False]))
    assert torch.allclose(torch.tensor(with_), torch.tensor(without), atol=1e-4)
    assert counted[True] == [len(first), 0]  # the plain request's lookup only
