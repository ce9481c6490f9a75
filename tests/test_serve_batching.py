"""Continuous batching (serve/batching.py) over the static graphs on CPU (serve/runtime.py):
requests join and leave the batch at different steps, and each gets the tokens it gets alone.
(The same engine over the Neuron artifact's calls: test_serve_neuron.py.)"""

import types

import pytest
import torch

from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.serve.batching import BatchEngine
from neuron_moe.serve.engine import RequestError, SamplingParams
from neuron_moe.serve.runtime import static_runtime
from neuron_moe.serve.scheduler import Scheduler

from conftest import random_prompts
from serving import IdTokenizer, Sink, serve_together, tokens_of, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def static_model(tiny_port):
    return build_model(tiny_port, tiny_port.static.decode_experts, torch.float32)


@pytest.fixture(scope="module")
def engine(tiny_port, static_model):
    """4 rows, no EOS: every request runs to its max_tokens (or ends on a stop string)."""
    engine = BatchEngine(static_runtime(static_model, tiny_port.static, batch=4), IdTokenizer(), set())
    yield engine
    engine.close()


PROMPTS = random_prompts(2048, [3, 56, 8, 9, 20, 5, 33, 12, 47, 7], seed=21)  # both buckets (8, 56)
MAX_TOKENS = [12, 5, 9, 3, 14, 7, 4, 11, 6, 10]


def test_concurrent_greedy_requests_get_their_tokens_alone_and_hf_eagers(engine, tiny_eager):
    """10 requests on 4 rows: they join as rows free up and leave at their own max_tokens; each
    gets the tokens it gets served alone, which are HF eager's greedy tokens."""
    requests = [(p, SamplingParams(n, temperature=0.0)) for p, n in zip(PROMPTS, MAX_TOKENS)]
    together = serve_together(engine, requests)
    for (prompt, params), sink in zip(requests, together):
        alone = list(engine.generate(prompt, params))
        assert sink.steps == alone and sink.error is None
        reference = greedy(tiny_eager, *left_pad([prompt], 0), params.max_tokens).tokens[0].tolist()
        assert tokens_of(alone) == reference and alone[-1].finish_reason == "length"
    joined = {sink.at[0] for sink in together}
    left = {sink.at[-1] for sink in together}
    assert len(joined) > 3 and len(left) > 3  # requests joined and left at many different steps
    # the rows were never over-filled, and were full: decode step t ran the requests with at[0] < t <= at[-1]
    assert max(sum(s.at[0] < step <= s.at[-1] for s in together) for step in range(engine.steps + 1)) == 4


def test_seeded_sampling_is_the_same_whatever_runs_beside_it(engine):
    sampled = [(PROMPTS[i], SamplingParams(8, temperature=0.9, top_p=0.95, seed=100 + i)) for i in range(3)]
    greedy_rows = [(PROMPTS[i], SamplingParams(MAX_TOKENS[i], temperature=0.0)) for i in range(3, 8)]
    together = serve_together(engine, [*sampled, *greedy_rows])
    for (prompt, params), sink in zip(sampled, together):
        assert sink.steps == list(engine.generate(prompt, params))
    reseeded = list(engine.generate(sampled[0][0], SamplingParams(8, temperature=0.9, top_p=0.95, seed=7)))
    assert reseeded != together[0].steps  # the seed is what decides


def test_a_cancelled_request_frees_its_row_within_one_step(tiny_port, static_model):
    engine = BatchEngine(static_runtime(static_model, tiny_port.static, batch=2), IdTokenizer(), set())
    try:
        long = SamplingParams(40, temperature=0.0)
        first, second, waiting = Sink(engine), Sink(engine), Sink(engine)
        for sink in (first, second, waiting):
            engine.submit(PROMPTS[0], long, sink)
        while len(first.steps) < 5:
            assert not first.ended.wait(0.01)
        assert waiting.steps == []  # both rows are taken
        first.cancelled.set()
        assert first.ended.wait(10) and waiting.ended.wait(30) and second.ended.wait(30)
        cancelled_at = first.at[-1]
        assert waiting.at[0] <= cancelled_at + 1, "the waiting request did not take the freed row at the next step"
        assert len(first.steps) < 40 and first.error is None
        assert waiting.steps == second.steps  # the freed row served the next request as if new
    finally:
        engine.close()


def test_a_consumer_that_stops_reading_frees_its_row(engine):
    steps = engine.generate(PROMPTS[0], SamplingParams(40, temperature=0.0))
    next(steps)
    steps.close()
    closed_at = engine.steps
    wait_for(lambda: engine.slots == [None] * engine.rows, 10, "the row to be freed")
    assert engine.steps <= closed_at + 2  # not the 39 steps the request had left


def test_a_failure_in_one_row_ends_that_request_only(engine):
    requests = [(PROMPTS[i], SamplingParams(MAX_TOKENS[i], temperature=0.0)) for i in range(4)]
    sinks = serve_together(engine, requests, [Sink(engine, fail_at=2 if i == 1 else None) for i in range(4)])
    assert "injected fault" in str(sinks[1].error) and len(sinks[1].steps) == 2
    for i in (0, 2, 3):
        assert sinks[i].error is None and sinks[i].steps == list(engine.generate(*requests[i]))


def test_a_graph_failure_ends_the_requests_it_ran_and_the_engine_goes_on(tiny_port, static_model):
    runtime = static_runtime(static_model, tiny_port.static, batch=2)
    decode, calls = runtime.decode, []

    def failing_once(ids, positions):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return decode(ids, positions)

    runtime.decode = failing_once
    engine = BatchEngine(runtime, IdTokenizer(), set())
    try:
        params = SamplingParams(6, temperature=0.0)
        sinks = serve_together(engine, [(PROMPTS[0], params), (PROMPTS[2], params)])
        assert all("device fault" in str(s.error) and len(s.steps) == 3 for s in sinks)
        assert len(list(engine.generate(PROMPTS[0], params))) == 6
    finally:
        engine.close()


def test_limits_are_refused_before_anything_runs_and_the_cache_end_is_length(engine, tiny_eager):
    assert engine.max_context == 97 and engine.max_prompt == 56  # max_cache_len 96, buckets [8, 56]
    with pytest.raises(RequestError, match="the prompt is 57 tokens; this backend's largest prefill bucket holds 56"):
        engine.max_tokens_for(57, 1)
    with pytest.raises(RequestError, match="exceeds it by 1") as e:
        engine.submit(PROMPTS[1], SamplingParams(97 - 56 + 1, temperature=0.0), Sink(engine))
    assert e.value.param == "max_tokens"
    # no max_tokens: the request runs to the end of the cache, and that is "length"
    budget = engine.max_tokens_for(len(PROMPTS[1]), None)
    steps = list(engine.generate(PROMPTS[1], SamplingParams(budget, temperature=0.0)))
    assert (budget, steps[-1].finish_reason, steps[-1].completion_tokens) == (41, "length", 41)
    assert tokens_of(steps) == greedy(tiny_eager, *left_pad([PROMPTS[1]], 0), budget).tokens[0].tolist()


def test_a_batching_engine_sets_the_admission_to_its_rows():
    scheduler = Scheduler(None, max_queue=3)
    scheduler.open(types.SimpleNamespace(rows=4))
    assert (scheduler.max_running, scheduler.executor) == (4, None)  # its step loop runs the jobs
    with pytest.raises(ValueError, match="runs its 4 rows at once; max_running \\(2\\) does not apply"):
        Scheduler(2, max_queue=3).open(types.SimpleNamespace(rows=4))
