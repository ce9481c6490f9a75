"""The logits-processing variant graphs (static/decoder.py `ProcessingDecode`, `ProcessingPrefill`;
static/sampling.py `process`) against a host reference sampler written from each request's own
token lists (`sampling.process_host`, which `--backend hf`'s runtime matches with `process` itself):
penalties, logit_bias, min_p, bans and a bitmask token for token over more than 1,000 steps, greedy
and seeded, a request alone and beside 7 others; a row that asks nothing gets the plain decode
graph's very token in the variant; logprobs (the chosen token's and the top 20) and the prompt's
logprobs are log_softmax of HF eager's logits; the variants export with no data-dependent op."""

import math
from collections import deque

import pytest
import torch

from neuron_moe.model import build_model
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.decoding import Output, SamplingParams
from neuron_moe.serve.hf_runtime import HFRuntime
from neuron_moe.static.runtime import static_runtime
from neuron_moe.static import data_dependent_ops, ops_not_lowered
from neuron_moe.static.decoder import Decode, ProcessingDecode, ProcessingPrefill, new_cache, new_counts
from neuron_moe.static.export import export, graph_inputs
from neuron_moe.static.rows import Rows
from neuron_moe.static.sampling import (
    BIAS_WIDTH,
    NOTHING,
    Processing,
    greedy_sampling,
    mask_words,
    neutral_inputs,
    pick,
    process,
    process_host,
)

from conftest import random_prompts
from serving import IdTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 2048
# fp32 logprobs of one model run twice: the same ops on the same inputs, but a different batch (rows
# beside it) may take other kernels; log_softmax of logits within ~1e-6 of each other, with margin
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def static_model(tiny_port):
    return build_model(tiny_port, tiny_port.static.decode_experts, torch.float32)


class Recorded:
    """An Output in a row of the static graphs (the work `Rows` runs), keeping each step's raw logits,
    sampling row and token, and its Steps."""

    def __init__(self, prompt: list[int], params: SamplingParams, banned=(), allowed=None):
        self.prompt, self.output = prompt, Output(IdTokenizer(), frozenset(), params, prompt)
        self.bans, self.mask = banned, allowed
        self.output.banned = lambda: self.bans  # stand-ins for the host-fields and grammar helpers' methods
        self.output.allowed = lambda: self.mask
        self.logits, self.rows, self.tokens, self.steps = [], [], [], []

    @property
    def asks(self) -> bool:
        return self.output.asks or bool(self.bans) or self.mask is not None

    def sampling(self):
        row = self.output.sampling()
        self.rows.append(row)
        return row

    def processing(self):
        return self.output.processing()

    def prompt_scores(self, *scores):
        self.output.prompt_scores(*scores)

    def next(self, token, logits, scores=None):
        self.tokens.append(token)
        self.logits.append(logits)
        step = self.output.next(token, scores)
        self.steps.append(step)
        return None if step.finish_reason else token

    def end(self, error=None):
        if error is not None:
            raise error


def run(runtime, works) -> None:
    rows, waiting = Rows(runtime), deque(works)
    while waiting or rows.active():
        rows.step(lambda: waiting.popleft() if waiting else None)


def reference_tokens(work: Recorded, candidates: int) -> list[int]:
    """The host reference sampler's token at each step from the graph's own raw logits, the
    request's settings and its own history: `process_host`, then `pick`."""
    out = []
    for logits, row in zip(work.logits, work.rows):
        processed = process_host(logits, row[0], work.output.params.processing, work.prompt, out, work.bans, work.mask)
        finite = torch.isfinite(logits.sum())[None]
        out.append(int(pick(processed[None], torch.tensor([row]), candidates, finite)[0, 0]))
    return out


SETTINGS = [
    Processing(repetition_penalty=1.3),
    Processing(presence_penalty=1.5, frequency_penalty=0.4),
    Processing(presence_penalty=-0.5, frequency_penalty=-0.2, repetition_penalty=0.8),
    Processing(min_p=0.1),
    Processing(logit_bias=((7, 5.0), (100, -100.0), (33, 2.5))),
    Processing(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.2, min_p=0.05, logprobs=3),
]


def params(i: int, max_tokens: int, sampled: bool) -> SamplingParams:
    kind = i % 3 if sampled else 0  # greedy; temperature alone; top-k (within the candidate width)
    temperature, top_k = [(0.0, 0), (0.9, 0), (1.1, 40)][kind]
    return SamplingParams(max_tokens, temperature, 1.0, top_k, seed=1000 + i, processing=SETTINGS[i % len(SETTINGS)])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_penalties_bias_and_min_p_are_the_host_reference_samplers_over_1000_steps(tiny_port, static_model, sampled):
    """One request at a time (alone in the batch), then eight at once: every token of every request,
    over more than 1,000 steps each way, is the host reference's from the same logits."""
    spec = tiny_port.static
    runtime = static_runtime(static_model, spec, batch=8, prefill_rows=(1, 4), chunk=8, logits=True)
    prompts = random_prompts(VOCAB, [1, 2, 9, 17, 5, 30, 3, 12] * 2, seed=31)
    max_tokens = spec.max_cache_len + 1 - max(len(p) for p in prompts)  # as long as the cache allows
    for alone in (True, False):
        works = [Recorded(p, params(i, max_tokens, sampled)) for i, p in enumerate(prompts)]
        if alone:
            for work in works:
                run(runtime, [work])
        else:
            run(runtime, works)
        assert sum(len(w.tokens) for w in works) >= 1000
        for work in works:
            assert work.tokens == reference_tokens(work, runtime.candidates), work.output.params.processing
        assert any(len(set(w.tokens)) > 1 for w in works)  # not one token over and over


def test_bans_and_a_bitmask_rule_tokens_out_as_the_host_does(tiny_port, static_model):
    """The stand-ins of the host-fields and grammar helpers' inputs: a banned list (the greedy
    token's own, found first) and a bitmask allowing every third token; never chosen, and the
    tokens the host reference's, beside a row that asks nothing (which gets its plain tokens)."""
    spec = tiny_port.static
    runtime = static_runtime(static_model, spec, batch=4, logits=True)
    prompt = random_prompts(VOCAB, [6], seed=3)[0]
    plain = Recorded(prompt, SamplingParams(20, 0.0))
    run(runtime, [plain])
    banned = tuple(sorted(set(plain.tokens)))[:BIAS_WIDTH]
    mask = torch.zeros(mask_words(VOCAB), dtype=torch.int32)
    allowed = set(range(0, VOCAB, 3))
    for t in allowed:
        mask[t // 32] |= torch.tensor(1 << (t % 32) if t % 32 < 31 else -(1 << 31), dtype=torch.int32)
    works = [
        Recorded(prompt, SamplingParams(20, 0.0), banned=banned),
        Recorded(prompt, SamplingParams(20, 0.8, seed=5), allowed=mask),
        Recorded(prompt, SamplingParams(20, 0.0)),
    ]
    run(runtime, works)
    assert not set(works[0].tokens) & set(banned)
    assert set(works[1].tokens) <= allowed
    assert works[2].tokens == plain.tokens
    for work in works:
        assert work.tokens == reference_tokens(work, runtime.candidates)


def test_a_row_that_asks_nothing_gets_the_plain_decode_token_in_the_variant(tiny_port, static_model):
    """The variant with neutral inputs is bit for bit the plain decode graph: the same tokens, greedy
    and sampled, and the same logits, over 12 steps of 2 rows fed the same inputs."""
    spec = tiny_port.static
    cache, counts = new_cache(static_model, spec.max_cache_len, 2), new_counts(static_model, 2)
    plain, variant = (
        Decode(static_model, cache, spec.decode_experts, True),
        ProcessingDecode(static_model, cache, counts, spec.decode_experts, True),
    )
    ids = torch.tensor([[2], [2]])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for position in range(12):
            sampling = greedy_sampling(2)
            sampling[1] = torch.tensor([0.9, 0.0, 1.0, float(torch.rand((), generator=gen))])
            positions = torch.full((2, 1), position)
            token, logits = plain(ids, positions, sampling)
            outputs = variant(ids, positions, sampling, *neutral_inputs(2, VOCAB))
            assert torch.equal(outputs[0], token) and torch.equal(outputs[5], logits)
            ids = token


def test_process_is_the_host_reference_on_random_logits():
    """`process` on random rows (every setting at once, ties and -inf bias included) is
    `process_host` bit for bit."""
    gen = torch.Generator().manual_seed(7)
    rows, vocab = 64, 300
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[:, :10] = 0.0  # ties at zero, where the repetition penalty's two branches meet
    process_row, bias_ids, bias, mask = neutral_inputs(rows, vocab)
    output_counts, prompt_seen = torch.zeros(rows, vocab), torch.zeros(rows, vocab)
    temperature = torch.rand(rows, generator=gen) * 1.5
    temperature[::4] = 0.0
    cases = []
    for r in range(rows):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 20, (), generator=gen)),), generator=gen).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 30, (), generator=gen)),), generator=gen).tolist()
        entries = torch.randperm(vocab, generator=gen)[:8].tolist()
        settings = Processing(
            presence_penalty=float(torch.rand((), generator=gen) * 4 - 2),
            frequency_penalty=float(torch.rand((), generator=gen) * 4 - 2),
            repetition_penalty=float(torch.rand((), generator=gen) * 2 + 0.2),
            min_p=float(torch.rand((), generator=gen) * 0.3) if r % 2 else 0.0,
            logit_bias=tuple((t, float(torch.randint(-100, 101, (), generator=gen))) for t in entries[:6]),
        )
        banned = tuple(entries[6:])
        word = int(torch.randint(0, mask.shape[1], (), generator=gen))
        mask[r, word] = int(torch.randint(-(2**31), 2**31 - 1, (), generator=gen))
        process_row[r, :4] = torch.tensor(settings.values())
        entries = [*settings.logit_bias, *((t, -math.inf) for t in banned)]
        bias_ids[r, : len(entries)] = torch.tensor([t for t, _ in entries])
        bias[r, : len(entries)] = torch.tensor([v for _, v in entries])
        for t in output:
            output_counts[r, t] += 1
        prompt_seen[r, prompt] = 1
        cases.append((prompt, output, settings, banned, mask[r].clone()))
    got = process(logits, temperature, process_row, bias_ids, bias, mask, output_counts, prompt_seen)
    for r, (prompt, output, settings, banned, words) in enumerate(cases):
        want = process_host(logits[r], float(temperature[r]), settings, prompt, output, banned, words)
        assert torch.equal(got[r], want), r


def test_logprobs_and_prompt_logprobs_are_hf_eagers_log_softmax(tiny_port, static_model, tiny_eager):
    """The chosen tokens' logprobs and the top 20 from the variant decode, and each prompt token's
    (echo) from the variant prefill in chunks, are log_softmax of HF eager's fp32 logits over the
    prompt and the tokens generated, within LOGPROB_ATOL; the top ids are eager's top ids."""
    spec = tiny_port.static
    runtime = static_runtime(static_model, spec, batch=4, prefill_rows=(1, 4), chunk=8)
    prompts = random_prompts(VOCAB, [19, 1, 7], seed=12)
    works = [
        Recorded(p, SamplingParams(10, 0.0, processing=Processing(logprobs=20, prompt_logprobs=20))) for p in prompts
    ]
    run(runtime, works)
    for work in works:
        steps = work.steps
        tokens = [s.logprobs.token for s in steps]
        assert tokens == work.tokens
        with torch.no_grad():
            eager = tiny_eager(input_ids=torch.tensor([work.prompt + tokens[:-1]])).logits[0].float()
        logp = eager.log_softmax(-1)
        n = len(work.prompt)
        expected = [logp[n - 1 + i, t] for i, t in enumerate(tokens)]
        got = torch.tensor([s.logprobs.logprob for s in steps])
        torch.testing.assert_close(got, torch.stack(expected), atol=LOGPROB_ATOL, rtol=0)
        for i, step in enumerate(steps):
            top_ids, top = zip(*step.logprobs.top)
            ref_top, ref_ids = logp[n - 1 + i].topk(20)
            torch.testing.assert_close(torch.tensor(top), ref_top, atol=LOGPROB_ATOL, rtol=0)
            gap = ref_top[:-1] - ref_top[1:]
            assert all(a == b or gap[min(j, 18)] < LOGPROB_ATOL for j, (a, b) in enumerate(zip(top_ids, ref_ids)))
        prompt_scores = steps[0].prompt_logprobs
        assert len(prompt_scores) == n and prompt_scores[0] is None
        for i, entry in enumerate(prompt_scores[1:]):
            assert entry.token == work.prompt[i + 1]
            assert abs(entry.logprob - float(logp[i, work.prompt[i + 1]])) < LOGPROB_ATOL
            assert abs(entry.top[0][1] - float(logp[i].max())) < LOGPROB_ATOL


def test_the_host_path_honours_the_same_fields_as_the_graphs(tiny_port, static_model, tiny_eager):
    """`--backend hf`'s runtime (`hf_runtime.HFRuntime`: HF eager's logits, processed and sampled on
    the host with the graphs' functions) gives what the static graphs give for the same greedy
    requests with penalties, bias and min_p, and the same logprobs within LOGPROB_ATOL."""
    spec = tiny_port.static
    runtime = static_runtime(static_model, spec, batch=4)
    prompts = random_prompts(VOCAB, [5, 11, 1], seed=44)
    host = Engine(HFRuntime(tiny_eager), IdTokenizer(), set())
    for i, prompt in enumerate(prompts):
        settings = SETTINGS[(i * 2 + 1) % len(SETTINGS)]
        settings = Processing(**{**settings.__dict__, "logprobs": 2, "prompt_logprobs": 2})
        p = SamplingParams(24, 0.0, processing=settings)
        work = Recorded(prompt, p)
        run(runtime, [work])
        steps = list(host.generate(prompt, p))
        assert [s.logprobs.token for s in steps] == work.tokens
        got = torch.tensor([s.logprobs.logprob for s in steps])
        want = torch.tensor([s.logprobs.logprob for s in work.steps])
        torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
        host_prompt, graph_prompt = steps[0].prompt_logprobs, work.steps[0].prompt_logprobs
        assert [e and e.token for e in host_prompt] == [e and e.token for e in graph_prompt]
    host.close()


def test_a_request_that_asks_nothing_is_not_a_processing_request():
    assert not NOTHING.asks and not Output(IdTokenizer(), frozenset(), SamplingParams(4)).asks
    assert Processing(logprobs=0).asks and Processing(min_p=0.1).asks


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_the_variants_export_with_no_data_dependent_op(tiny_port, static_model, kind):
    """torch.export (strict) of each variant: no data-dependent op, every op one the XLA check saw
    lower (bench/xla_check.py runs both variants), the KV cache and the token counts mutated state,
    the declared inputs and outputs only (`export.checked`)."""
    spec = tiny_port.static
    cache, counts = (
        new_cache(static_model, spec.max_cache_len, spec.batch_size),
        new_counts(static_model, spec.batch_size),
    )
    if kind == "decode":
        graph, bucket = ProcessingDecode(static_model, cache, counts, spec.decode_experts), None
    else:
        graph, bucket = ProcessingPrefill(static_model, cache, counts, spec.prefill_experts), spec.buckets[0]
    program = export(graph, graph_inputs(graph, spec, bucket), kind)
    assert data_dependent_ops(program) == [] and ops_not_lowered(program) == []
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    assert {"counts.output", "counts.prompt"} <= mutated
