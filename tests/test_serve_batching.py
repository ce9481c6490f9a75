"""Continuous batching (serve/engine.py) over the static graphs on CPU (static/runtime.py):
requests join and leave the batch at different steps, and each gets the tokens it gets alone.
(The same engine over the Neuron artifact's calls: test_serve_neuron.py.)"""

import statistics
import time
import types

import pytest
import torch

from neuron_moe.run_config import Shapes
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.decoding import Output, RequestError, SamplingParams
from neuron_moe.serve.hf_runtime import HFRuntime
from neuron_moe.static.runtime import static_runtime
from neuron_moe.serve.scheduler import Scheduler
from neuron_moe.static.rows import GraphRuntime
from neuron_moe.tokenizer import HFTokenizer

from conftest import random_prompts
from serving import IdTokenizer, Sink, serve_together, tokens_of, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def static_model(tiny_port):
    return build_model(tiny_port, tiny_port.static.decode_experts, torch.float32)


@pytest.fixture(scope="module")
def engine(tiny_port, static_model):
    """4 rows, no EOS: every request runs to its max_tokens (or ends on a stop string)."""
    engine = Engine(static_runtime(static_model, tiny_port.static, batch=4), IdTokenizer(), set())
    yield engine
    engine.close()


PROMPTS = random_prompts(2048, [3, 56, 8, 9, 20, 5, 33, 12, 47, 7], seed=21)  # every bucket (8, 24, 56)
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
    engine = Engine(static_runtime(static_model, tiny_port.static, batch=2), IdTokenizer(), set())
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
    decode, failed = runtime.decode, []

    def failing_once(ids, positions, sampling):
        if not failed and bool((positions > 0).all()):  # the first step of both rows
            failed.append(positions[:, 0].tolist())
            raise RuntimeError("device fault")
        return decode(ids, positions, sampling)

    runtime.decode = failing_once
    engine = Engine(runtime, IdTokenizer(), set())
    try:
        params = SamplingParams(6, temperature=0.0)
        sinks = serve_together(engine, [(PROMPTS[0], params), (PROMPTS[2], params)])
        # each ended with the fault, having had the tokens of the calls before it (the positions it had reached)
        for sink, (prompt, _), at in zip(sinks, [(PROMPTS[0], 0), (PROMPTS[2], 0)], failed[0]):
            assert "device fault" in str(sink.error) and len(sink.steps) == at - len(prompt) + 1
        assert len(list(engine.generate(PROMPTS[0], params))) == 6
    finally:
        engine.close()


def test_limits_are_refused_before_anything_runs_and_the_cache_end_is_length(engine, tiny_eager):
    assert engine.max_context == 97  # max_cache_len 96: a prompt past the largest bucket is chunked
    assert engine.max_tokens_for(96, None) == 1  # a prompt past the largest bucket (56), up to the cache
    with pytest.raises(RequestError, match="the prompt is 97 tokens; this model's context is 97 tokens") as e:
        engine.max_tokens_for(97, None)
    assert e.value.param == "prompt"
    with pytest.raises(RequestError, match="top_k must be at most 256 .*got 257") as e:
        engine.submit(PROMPTS[1], SamplingParams(4, temperature=1.0, top_k=257), Sink(engine))
    assert e.value.param == "top_k"
    with pytest.raises(RequestError, match="exceeds it by 1") as e:
        engine.submit(PROMPTS[1], SamplingParams(97 - 56 + 1, temperature=0.0), Sink(engine))
    assert e.value.param == "max_tokens"
    # no max_tokens: the request runs to the end of the cache, and that is "length"
    budget = engine.max_tokens_for(len(PROMPTS[1]), None)
    steps = list(engine.generate(PROMPTS[1], SamplingParams(budget, temperature=0.0)))
    assert (budget, steps[-1].finish_reason, steps[-1].completion_tokens) == (41, "length", 41)
    assert tokens_of(steps) == greedy(tiny_eager, *left_pad([PROMPTS[1]], 0), budget).tokens[0].tolist()


def test_the_engine_sets_the_admission_to_its_rows():
    scheduler = Scheduler(None, max_queue=3)
    scheduler.open(types.SimpleNamespace(rows=4))
    assert scheduler.max_running == 4  # its step loop runs the jobs
    with pytest.raises(ValueError, match="runs its 4 rows at once; max_running \\(2\\) does not apply"):
        Scheduler(2, max_queue=3).open(types.SimpleNamespace(rows=4))


class Calls:
    """The runtime's calls in order: ("prefill", [(row, start, length), ...]) and ("decode", rows busy);
    a step call (`GraphRuntime.step`) as its prefill, then its decode."""

    def __init__(self, runtime):
        self.log, self.prefill, self.decode, self.step = [], runtime.prefill, runtime.decode, runtime.step
        runtime.prefill, runtime.decode, runtime.step = self._prefill, self._decode, self._step

    def _step(self, chunks, ids, positions, sampling):
        self.log += [("prefill", [(c.row, c.start, len(c.ids)) for c in chunks]), ("decode", None)]
        return self.step(chunks, ids, positions, sampling)

    def _prefill(self, chunks):
        self.log.append(("prefill", [(c.row, c.start, len(c.ids)) for c in chunks]))
        return self.prefill(chunks)

    def _decode(self, ids, positions, sampling):
        self.log.append(("decode", None))
        return self.decode(ids, positions, sampling)


# 8 prompts, two of them longer than the largest bucket (56): chunked in any case
EIGHT = random_prompts(2048, [5, 80, 14, 33, 9, 61, 22, 40], seed=33)
EIGHT_TOKENS = [9, 12, 6, 11, 8, 10, 7, 12]


@pytest.fixture(scope="module")
def eight_rows(tiny_port, static_model):
    """8 rows, prefill graphs of 1 and 4 prompts, chunks of 8 tokens: every prompt here but the
    first is prefilled in pieces, several of them in each call."""
    runtime = static_runtime(static_model, tiny_port.static, batch=8, prefill_rows=(1, 4), chunk=8)
    calls = Calls(runtime)
    engine = Engine(runtime, IdTokenizer(), set())
    yield engine, calls
    engine.close()


def test_greedy_beside_seven_others_with_batched_and_chunked_prefill_is_hf_eagers(eight_rows, tiny_eager):
    engine, calls = eight_rows
    requests = [(p, SamplingParams(n, temperature=0.0)) for p, n in zip(EIGHT, EIGHT_TOKENS)]
    calls.log.clear()
    together = serve_together(engine, requests)
    log = list(calls.log)
    for (prompt, params), sink in zip(requests, together):
        reference = greedy(tiny_eager, *left_pad([prompt], 0), params.max_tokens).tokens[0].tolist()
        assert sink.error is None and tokens_of(sink.steps) == reference, len(prompt)
        assert list(engine.generate(prompt, params)) == sink.steps  # and alone
    prefills = [chunks for kind, chunks in log if kind == "prefill"]
    assert max(len(c) for c in prefills) == 4  # several prompts per call
    assert sum(len(c) for c in prefills) == sum(-(-len(p) // 8) for p in EIGHT)  # every chunk once
    # the 80-token prompt's ten chunks (starts 0, 8, ..., 72) run with decode steps of the rows
    # already generating between them
    long = [
        i
        for i, (kind, chunks) in enumerate(log)
        if kind == "prefill"
        for row, start, n in chunks
        if start + n == 80 or (start > 0 and start % 8 == 0 and start < 72 and n == 8)
    ]
    assert len(long) >= 9 and sum(kind == "decode" for kind, _ in log[long[0] : long[-1]]) >= 5


def test_chunked_prefill_is_the_unchunked_prefill(tiny_port, static_model, tiny_eager):
    """The same prompts prefilled whole (chunk 56) and in pieces of 8: the same greedy tokens."""
    prompts = random_prompts(2048, [56, 41, 17], seed=8)
    out = {}
    for chunk in (56, 8):
        engine = Engine(
            static_runtime(static_model, tiny_port.static, batch=4, prefill_rows=(1, 4), chunk=chunk),
            IdTokenizer(),
            set(),
        )
        try:
            out[chunk] = [
                s.steps for s in serve_together(engine, [(p, SamplingParams(10, temperature=0.0)) for p in prompts])
            ]
        finally:
            engine.close()
    assert out[8] == out[56]
    assert [tokens_of(s) for s in out[8]] == [
        greedy(tiny_eager, *left_pad([p], 0), 10).tokens[0].tolist() for p in prompts
    ]


def test_seeded_sampled_requests_are_the_same_alone_and_beside_seven_others(eight_rows):
    engine, _ = eight_rows
    sampled = [
        (EIGHT[i], SamplingParams(10, temperature=0.8, top_p=0.9, top_k=40 * (i % 2), seed=50 + i)) for i in range(4)
    ]
    greedy_rows = [(EIGHT[i], SamplingParams(EIGHT_TOKENS[i], temperature=0.0)) for i in range(4, 8)]
    together = serve_together(engine, [*sampled, *greedy_rows])
    for (prompt, params), sink in zip(sampled, together):
        assert sink.error is None and sink.steps == list(engine.generate(prompt, params))
    assert len({tuple(tokens_of(s.steps)) for s in together[:4]}) == 4


def test_the_graphs_sample_what_the_host_samples_for_the_same_seed(eight_rows, tiny_eager):
    """In the graphs and on the host (the engine over HF eager, `hf_runtime.HFRuntime`):
    the same sampler, the same seeded draws, so the same tokens — where the graphs' cap does not
    bite (a nucleus within their 256 candidates: top-p 0.6 here; the trained model's nucleus at
    top-p 0.9 after a random prompt is wider, and is then cut: tests/test_sampling.py)."""
    engine, _ = eight_rows
    settings = [(1.0, 1.0, 0), (0.7, 0.6, 0), (1.2, 1.0, 30), (0.9, 0.8, 100)]
    with Engine(HFRuntime(tiny_eager), IdTokenizer(), set()) as alone:
        for i, (temperature, top_p, top_k) in enumerate(settings):
            params = SamplingParams(12, temperature=temperature, top_p=top_p, top_k=top_k, seed=900 + i)
            assert tokens_of(engine.generate(EIGHT[2], params)) == tokens_of(alone.generate(EIGHT[2], params)), i


# ---- the step's host work beside its graph calls, over stand-in graphs -----------------------------

TEXT = (
    "Café owners in Zürich charged 4,50 € for a crème brûlée 🍮, and the crew wrote down every word the "
    "islanders taught them about the winds, the tides 🌊 and the long winters of the far north."
)


class StandIn:
    """Graph calls that take `step_s` (a sleep, which releases the GIL as a graph's ops do) and
    answer with the token that follows the row's input in a fixed stream: after token t at position
    p, corpus[(t + p + 1) % len(corpus)], so a request's tokens follow from its prompt alone, whatever
    its row. Each call is recorded: (graph, entry, exit, the sinks of the decode's generating rows)."""

    def __init__(self, corpus: list[int], step_s: float = 0.0):
        self.corpus, self.step_s = torch.tensor(corpus), step_s
        self.calls, self.engine = [], None

    def runtime(self, batch: int) -> GraphRuntime:
        return GraphRuntime(self._prefill, self._decode, Shapes(batch, 512, (8, 56), (1, 4), 56))

    def stream(self, prompt: list[int], n: int) -> list[int]:
        """The first n tokens a request for `prompt` gets."""
        tokens, token = [], prompt[-1]
        for position in range(len(prompt) - 1, len(prompt) - 1 + n):
            token = int(self._follow(torch.tensor(token), position))
            tokens.append(token)
        return tokens

    def _follow(self, token, position):
        return self.corpus[(token + position + 1) % len(self.corpus)]

    def _prefill(self, ids, mask, positions, row_ids, sampling):
        start = time.perf_counter()
        return self._end("prefill", start, self._follow(ids[:, -1], positions[:, -1]), None)

    def _decode(self, ids, positions, sampling):
        start, rows = time.perf_counter(), self.engine.batch
        running = [rows.slots[r].sink for r in rows.generating()]
        return self._end("decode", start, self._follow(ids[:, 0], positions[:, 0]), running)

    def _end(self, graph, start, tokens, running):
        if self.step_s:
            time.sleep(max(0.0, start + self.step_s - time.perf_counter()))
        self.calls.append((graph, start, time.perf_counter(), running))
        return (tokens[:, None],)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_port):
    return HFTokenizer(tiny_port.checkpoint)


def stand_in_engine(tokenizer, batch: int, step_s: float = 0.0, eos_ids=()):
    stand_in = StandIn(tokenizer.encode(TEXT, add_special_tokens=False), step_s)
    stand_in.engine = Engine(stand_in.runtime(batch), tokenizer, set(eos_ids))
    return stand_in


def test_stop_strings_eos_and_max_tokens_end_each_request_as_alone_a_stop_string_a_step_late_at_most(tiny_tokenizer):
    """Each Step as the request's Output makes it alone (texts, held-back text, finish reasons); a
    request that EOS or max_tokens ends leaves the decode batch at once, one that a stop string ends
    (seen by the text thread) decodes one token past it at most, and its row serves the next."""
    corpus = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    probe = StandIn(corpus)
    prompts = [corpus[5 * i : 5 * i + n] for i, n in enumerate([4, 9, 30, 60, 12, 7, 20, 15, 3, 41])]
    streams = [probe.stream(p, 40) for p in prompts]
    eos = {streams[1][20]}
    requests = []
    for i, (prompt, stream) in enumerate(zip(prompts, streams)):
        text = tiny_tokenizer.decode(stream)
        stops = (text[len(text) // 2 : len(text) // 2 + 1 + i % 3],) if i % 3 else ()
        requests.append((prompt, SamplingParams(40 - i, temperature=0.0, stop=stops)))
    want = []
    for (prompt, params), stream in zip(requests, streams):
        output = Output(tiny_tokenizer, frozenset(eos), params)
        want.append([output.next(token) for token in stream[: len(stream)]])
        want[-1] = want[-1][: next(i for i, s in enumerate(want[-1]) if s.finish_reason) + 1]
    by_stop_string = [
        i for i, w in enumerate(want) if w[-1].finish_reason == "stop" and streams[i][len(w) - 1] not in eos
    ]
    by_eos = [i for i, w in enumerate(want) if streams[i][len(w) - 1] in eos]
    assert len(by_stop_string) >= 3 and by_eos and any(w[-1].finish_reason == "length" for w in want)

    stand_in = stand_in_engine(tiny_tokenizer, 4, eos_ids=eos)
    try:
        sinks = serve_together(stand_in.engine, requests)
    finally:
        stand_in.engine.close()
    for i, (sink, steps) in enumerate(zip(sinks, want)):
        assert sink.error is None and sink.steps == steps, i
        decoded = sum(sink in running for graph, *_, running in stand_in.calls if graph == "decode")
        assert decoded in ((len(steps) - 1, len(steps)) if i in by_stop_string else (len(steps) - 1,)), i


def test_a_steps_text_is_made_during_the_next_graph_call(tiny_tokenizer):
    """8 streaming requests over 5 ms stand-in graph calls: every Step is sent from the text thread,
    after the call that chose its token, most of them while the step loop is in the next call. (What
    the host adds between two calls is timed by bench/engine_overhead.py, not here.)"""
    stand_in = stand_in_engine(tiny_tokenizer, 8, step_s=0.005)
    corpus = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    requests = [
        (
            corpus[3 * i : 3 * i + 10 + 4 * i],
            SamplingParams(60, temperature=0.8 * (i % 2), seed=i, stop=("###", "\n\n")),
        )
        for i in range(8)
    ]
    try:
        sinks = serve_together(stand_in.engine, requests)
    finally:
        stand_in.engine.close()
    assert all(s.error is None and len(s.steps) == 60 for s in sinks)
    assert {thread for s in sinks for thread in s.threads} == {"batch-text"}
    calls = stand_in.calls
    inside = []
    for sink in sinks:
        decodes = [i for i, (graph, *_, running) in enumerate(calls) if graph == "decode" and sink in running]
        for i, put in zip(decodes, sink.times[1:]):  # its first Step is the prefill's
            assert put > calls[i][2]
            inside.append(i + 1 < len(calls) and calls[i + 1][1] <= put <= calls[i + 1][2])
    assert sum(inside) > 0.5 * len(inside), f"{sum(inside)} of {len(inside)} Steps sent during the next call"


class SlowLastSink(Sink):
    """A sink whose last Step takes 50 ms to send (a slow client connection, as it were)."""

    def put(self, step):
        if step.finish_reason:
            time.sleep(0.05)
        super().put(step)


def test_a_graph_failure_after_a_requests_last_step_leaves_it_its_answer(tiny_tokenizer):
    """A request that a stop string ended is still in the next decode call while its last Step goes
    out; that call fails: the request keeps its answer (no error after its end), the other request in
    the call ends with the error."""
    stand_in = stand_in_engine(tiny_tokenizer, 2)
    corpus = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    prompts = [corpus[:6], corpus[10:20]]
    stream = stand_in.stream(prompts[0], 30)
    text = tiny_tokenizer.decode(stream)
    stopped = SamplingParams(30, temperature=0.0, stop=(text[len(text) // 3 : len(text) // 3 + 2],))
    output = Output(tiny_tokenizer, frozenset(), stopped)
    want = [output.next(token) for token in stream]
    want = want[: next(i for i, s in enumerate(want) if s.finish_reason) + 1]
    assert want[-1].finish_reason == "stop" and len(want) >= 3
    runtime, calls = stand_in.engine.runtime, []

    def failing(*inputs):  # the decode call after the one whose token the stop string ended
        calls.append(len(calls) + 1)
        if len(calls) == len(want):
            raise RuntimeError("device fault")
        return decode(*inputs)

    (decode,) = runtime._decode.values()  # the stand-in's one decode graph
    runtime._decode[None] = failing
    engine = stand_in.engine
    try:
        sinks = serve_together(
            engine,
            [(prompts[0], stopped), (prompts[1], SamplingParams(30, temperature=0.0))],
            [SlowLastSink(engine), Sink(engine)],
        )
    finally:
        engine.close()
    assert sinks[0].steps == want and sinks[0].error is None
    assert "device fault" in str(sinks[1].error) and len(sinks[1].steps) == len(want)


class SlowSink(Sink):
    """A sink whose every Step takes 0.5 ms to send: 4 ms of text-side work a step over 8 rows."""

    def put(self, step):
        time.sleep(0.0005)
        super().put(step)


def test_the_text_side_does_not_lengthen_a_slow_graph_call(tiny_tokenizer):
    """8 streaming requests whose Steps take 4 ms a step to send, over 5 ms stand-in graph calls: in
    series with the calls that work would put ≥ 4 ms between two decode calls; beside them the gap
    is the engine's own (~0.1 ms, bench/engine_overhead.py), so its median stays under 2 ms."""
    stand_in = stand_in_engine(tiny_tokenizer, 8, step_s=0.005)
    corpus = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    requests = [(corpus[3 * i : 3 * i + 12], SamplingParams(40, temperature=0.0)) for i in range(8)]
    try:
        sinks = serve_together(stand_in.engine, requests, [SlowSink(stand_in.engine) for _ in requests])
    finally:
        stand_in.engine.close()
    assert all(s.error is None and len(s.steps) == 40 for s in sinks)
    calls = stand_in.calls
    gaps = [b[1] - a[2] for a, b in zip(calls, calls[1:]) if a[0] == b[0] == "decode" and len(a[3]) == 8]
    assert len(gaps) > 30 and statistics.median(gaps) < 2e-3, f"median {1e3 * statistics.median(gaps):.3f} ms"
