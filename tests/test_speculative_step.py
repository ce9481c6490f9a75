"""Speculative decoding's step over the static graphs: the verify graph (`static/decoder.Verify`), the
cache's slack for the drafts it writes (`static/cache.cache_layout`), the speculative step of `Rows`
(`static/rows.py`) and the batching engine over it (`serve/engine.py`): with prompt lookup, greedy
rows get exactly the tokens they get without speculation, a sampled row's verify columns are the
decode graph's own draws at the same uniforms, and a sampled row's tokens follow the target's
distribution (a chi-square test over 10,240 seeded verify draws, which fails with every draft kept)."""

import numpy as np
import pytest
import torch

from neuron_moe import cli
from neuron_moe.greedy import left_pad
from neuron_moe.model import build_model
from neuron_moe.run_config import Shapes
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.engine import SamplingParams
from neuron_moe.serve.metrics import Metrics
from neuron_moe.speculative import SpeculativeConfig
from neuron_moe.static import data_dependent_ops, ops_not_lowered
from neuron_moe.static.cache import SLIDING, cache_layout
from neuron_moe.static import decoder
from neuron_moe.static.decoder import Decode, Prefill, Verify, new_cache
from neuron_moe.static.export import functional
from neuron_moe.static.rows import Chunk, GraphRuntime, Rows, generate
from neuron_moe.static.runtime import static_runtime
from neuron_moe.static.sampling import GREEDY

from conftest import random_prompts
from test_assistant import random_assistant
from test_sampling import chi_square_p, reference
from serving import IdTokenizer, serve_together, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4
LOOKUP = SpeculativeConfig("ngram", K, prompt_lookup_max=4, prompt_lookup_min=1)
SPEC = ("drafts", "draft_tokens", "accepted_tokens")  # vllm:spec_decode_num_*


@pytest.fixture(scope="module")
def static_model(tiny_port):
    return build_model(tiny_port, tiny_port.static.decode_experts, torch.float32)


def repetitive(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts that repeat a piece of themselves, so that prompt lookup finds drafts."""
    return [p + p[1 : 1 + n // 2] for p, n in zip(random_prompts(2048, lengths, seed), lengths)]


def test_the_cache_has_the_slack_a_verify_step_writes_past_a_row(tiny_port):
    config, spec = tiny_port.config, tiny_port.static
    plain, slack = cache_layout(config, spec.max_cache_len), cache_layout(config, spec.max_cache_len, slack=16)
    for a, b in zip(plain, slack):
        assert b.length == a.length + 16
        assert a.length == (config.sliding_window if a.kind == SLIDING else spec.max_cache_len)


@pytest.mark.parametrize("hidden", [False, True], ids=["prompt lookup", "for an assistant"])
def test_the_verify_graph_exports_static_with_only_ops_the_xla_check_lowered(tiny_port, static_model, hidden):
    """The verify graph as the runtime builds it (with the hidden state an assistant reads, or without)
    exports with no data-dependent op and only ops on the allow-list (bench/results/xla-check-new.md)."""
    spec, rows, q = tiny_port.static, tiny_port.static.batch_size, K + 1
    cache = new_cache(static_model, spec.max_cache_len, rows, slack=K + 1)
    verify = Verify(static_model, cache, spec.decode_experts, hidden=hidden)
    inputs = (
        torch.zeros(rows, q, dtype=torch.long),
        torch.arange(q).expand(rows, q).contiguous(),
        torch.tensor([GREEDY] * rows),
        torch.full((rows,), K, dtype=torch.long),
        torch.zeros(rows, q),
    )
    with torch.no_grad():
        program = functional(torch.export.export(verify, inputs, strict=True))
    assert data_dependent_ops(program) == [] and ops_not_lowered(program) == []


def _graphs(model, spec, rows, slack):
    cache = new_cache(model, spec.max_cache_len, rows, slack=slack)
    return (
        Prefill(model, cache, spec.prefill_experts, logits=True),
        Decode(model, cache, spec.decode_experts, logits=True),
        Verify(model, cache, spec.decode_experts, logits=True),
    )


def _prefill(prefill, prompts, sampling):
    """Each prompt prefilled into its own row, whole -> the first tokens [B]."""
    runtime = GraphRuntime(prefill, None, Shapes(batch_size=len(prompts), buckets=(8, 56), prefill_rows=(1,)))
    chunks = [Chunk(p, 0, row, tuple(s)) for row, (p, s) in enumerate(zip(prompts, sampling.tolist()))]
    return runtime.prefill(chunks)[0]


@torch.no_grad()
def test_verify_columns_are_the_decode_graphs_tokens_step_by_step(tiny_port, static_model):
    """Three rows, one past the sliding window (16) and one sampled: the decode graph run q steps on
    its own tokens (at the sampled row's uniforms) against one verify call fed the same tokens as
    drafts — all of them to rows 0 and 2, a wrong one at column 2 to row 1. Every column each row's
    drafts reach is the decode graph's token (and logits); the rows accept k, 1 and k drafts."""
    spec = tiny_port.static
    prompts = random_prompts(2048, [5, 40, 9], seed=4)
    sampling = torch.tensor([GREEDY, GREEDY, (0.8, 0.0, 1.0, 0.0)])
    uniforms = torch.rand(3, K + 1)
    prefill, decode, _ = _graphs(static_model, spec, 3, slack=K)
    fed = _prefill(prefill, prompts, sampling)
    start = torch.tensor([[len(p)] for p in prompts])
    tokens, logits, ids = [], [], fed[:, None]
    for i in range(K + 1):
        step = torch.cat([sampling[:, :3], uniforms[:, i : i + 1]], dim=1)
        token, step_logits = decode(ids, start + i, step)
        tokens.append(token[:, 0])
        logits.append(step_logits)
        ids = token
    tokens, logits = torch.stack(tokens, 1), torch.stack(logits, 1)

    prefill, _, verify = _graphs(static_model, spec, 3, slack=K)
    assert torch.equal(_prefill(prefill, prompts, sampling), fed)
    drafts = tokens[:, :K].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % 2048
    ids = torch.cat([fed[:, None], drafts], dim=1)
    got, accepted, got_logits = verify(ids, start + torch.arange(K + 1), sampling, torch.full((3,), K), uniforms)
    assert accepted.tolist() == [K, 1, K]
    for row, n in enumerate([K + 1, 2, K + 1]):
        assert torch.equal(got[row, :n], tokens[row, :n])
        torch.testing.assert_close(got_logits[row, :n], logits[row, :n], rtol=0, atol=1e-4)


@torch.no_grad()
def test_a_row_with_fewer_drafts_accepts_none_of_its_pads(tiny_port, static_model):
    """A row's columns after its drafts are pads: never accepted, even where the pad is the token."""
    spec = tiny_port.static
    prompts = random_prompts(2048, [6, 7], seed=5)
    prefill, decode, verify = _graphs(static_model, spec, 2, slack=K)
    fed = _prefill(prefill, prompts, torch.tensor([GREEDY, GREEDY]))
    start = torch.tensor([[len(p)] for p in prompts])
    first = decode(fed[:, None], start, torch.tensor([GREEDY, GREEDY]))[0][:, 0]
    ids = torch.cat([fed[:, None], first[:, None].expand(2, K)], dim=1)  # every draft the token after fed
    got, accepted, _ = verify(
        ids, start + torch.arange(K + 1), torch.tensor([GREEDY, GREEDY]), torch.tensor([0, 1]), torch.zeros(2, K + 1)
    )
    assert accepted.tolist() == [0, 1] and torch.equal(got[:, 0], first)


# ---- sampled rows: the verify graph's tokens follow the target's distribution ----

ROWS, CALLS = 64, 160  # 10,240 draws of one verify step
SAMPLED = (1.0, 8, 1.0)  # temperature 1, top-k 8, top-p 1: a support of 8 tokens


@torch.no_grad()
def _sampled_draws(tiny_port, static_model):
    """ROWS rows prefilled with one fixed prompt, sampled (SAMPLED); the decode graph's logits at the
    fed token and after the draft d (its most likely next token) processed as `pick` does, p0 and p1;
    then CALLS verify calls of the fed token and d in every row, each at its own seeded uniforms (each
    call rewrites the same two positions with the same KV). -> (the first token each draw emits [N],
    the second where it emits two [M], p0, p1): what a row's context continues with, the drafts it
    keeps then the target's token after them."""
    spec = tiny_port.static
    prompt = random_prompts(2048, [12], seed=57)[0]
    sampling = torch.tensor([(*SAMPLED, 0.0)] * ROWS)
    prefill, decode, verify = _graphs(static_model, spec, ROWS, slack=1)
    fed = _prefill(prefill, [prompt] * ROWS, sampling)
    start = torch.full((ROWS, 1), len(prompt))
    p0 = reference(decode(fed[:, None], start, sampling)[1][0], *SAMPLED)
    draft = int(p0.argmax())
    p1 = reference(decode(torch.full((ROWS, 1), draft), start + 1, sampling)[1][0], *SAMPLED)
    ids = torch.stack([fed, torch.full((ROWS,), draft)], dim=1)
    generator, first, second = torch.Generator().manual_seed(57), [], []
    for _ in range(CALLS):
        uniforms = torch.rand(ROWS, 2, generator=generator)
        tokens, accepted, _ = verify(
            ids, start + torch.arange(2), sampling, torch.ones(ROWS, dtype=torch.long), uniforms
        )
        kept = accepted == 1
        first.append(torch.where(kept, ids[:, 1], tokens[:, 0]))
        second.append(tokens[kept, 1])
    return torch.cat(first).numpy(), torch.cat(second).numpy(), p0, p1


def test_a_sampled_rows_tokens_follow_the_targets_distribution(tiny_port, static_model):
    """The verify graph with one drafted token d (the coupled rejection sampling of
    `speculative.accepted_drafts`): the first token over 10,240 draws follows the target's processed
    distribution there, and the second, over the draws that kept d, the target's after d (Pearson's
    chi-square test, p > 0.01; seeded, so it cannot flake)."""
    first, second, p0, p1 = _sampled_draws(tiny_port, static_model)
    for tokens, p in ((first, p0), (second, p1)):
        counts = np.bincount(tokens, minlength=len(p))
        assert not counts[p == 0].any(), "a token outside the top 8 was drawn"
        assert chi_square_p(counts, len(tokens) * p) > 0.01
    assert len(second) >= 1000  # enough draws kept d to test the token after it


def test_keeping_every_draft_fails_the_same_test(tiny_port, static_model, monkeypatch):
    """The same draws with the rejection step removed (every draft kept): d is always the first
    token, and the test fails."""
    monkeypatch.setattr(decoder, "accepted_drafts", lambda fed_and_drafts, tokens, drafted: drafted)
    first, second, p0, _ = _sampled_draws(tiny_port, static_model)
    assert len(second) == len(first) == ROWS * CALLS
    assert chi_square_p(np.bincount(first, minlength=len(p0)), len(first) * p0) < 1e-6


def _recording(runtime):
    """The runtime, its verify calls recorded: (drafted [B], accepted [B])."""
    calls, inner = [], runtime.verify

    def verify(*inputs):
        out = inner(*inputs)
        calls.append((inputs[3].tolist(), out[1].tolist()))
        return out

    runtime.verify = verify
    return calls


@torch.no_grad()
def test_greedy_generation_with_speculation_is_without(tiny_port, static_model):
    """Rows well past the sliding window and one up to the cache's last position (the global layers'
    slack): the same tokens and logits with prompt lookup as without, the rows of a call accepting
    different counts."""
    spec = tiny_port.static
    prompts = repetitive([6, 30, 12, 20], seed=11)
    ids, mask = left_pad(prompts, 0)
    n = spec.max_cache_len + 1 - ids.shape[1]
    plain = generate(static_runtime(static_model, spec, batch=2, logits=True), ids, mask, n)
    runtime = static_runtime(static_model, spec, batch=2, logits=True, speculative=LOOKUP)
    calls = _recording(runtime)
    got = generate(runtime, ids, mask, n)
    assert torch.equal(got[0], plain[0])
    torch.testing.assert_close(got[1], plain[1], rtol=0, atol=1e-4)
    taken = [a for drafted, accepted in calls for d, a in zip(drafted, accepted) if d]
    assert sum(taken) > 0  # drafts were taken
    assert any(len({a for d, a in zip(*call) if d}) > 1 for call in calls)  # rows accepting different counts


@torch.no_grad()
def test_greedy_generation_with_an_assistants_drafts_is_without(tiny_port, static_model):
    """The assistant's drafts (a random one here: drafts mostly rejected, so every row's rejected
    slots are read around, past the window, by the verify graph and by the draft's window + 1): the
    same tokens as without speculation; each row drafts from its second speculative step on."""
    spec = tiny_port.static
    prompts = random_prompts(2048, [6, 30, 12, 20], seed=13)
    ids, mask = left_pad(prompts, 0)
    n = spec.max_cache_len + 1 - ids.shape[1]
    plain = generate(static_runtime(static_model, spec, batch=2, logits=True), ids, mask, n)
    config = SpeculativeConfig("mtp", K, model="random")
    runtime = static_runtime(
        static_model, spec, batch=2, logits=True, speculative=config, assistant=random_assistant(tiny_port.config)
    )
    calls = _recording(runtime)
    got = generate(runtime, ids, mask, n)
    assert torch.equal(got[0], plain[0])
    torch.testing.assert_close(got[1], plain[1], rtol=0, atol=1e-4)
    assert sum(d == K for drafted, _ in calls for d in drafted) > len(calls)


class Runtime:
    """One row; a prefill gives 7, and the verify graph's column i the token after its input there
    (input + 1): prompt lookup's drafts 8, 9, 10, 11 after 7 are all accepted."""

    batch, pad_id, chunk, prefill_rows, speculative = 1, 0, 8, [1], LOOKUP

    def __init__(self):
        self.calls = []

    def prefill(self, chunks):
        return torch.tensor([7 for _ in chunks]), None

    def verify(self, ids, positions, sampling, drafted, uniforms):
        self.calls.append((ids.tolist(), positions.tolist(), drafted.tolist()))
        tokens = ids + 1
        accepted = ((ids[:, 1:] == tokens[:, :-1]).long().cumprod(-1) * (torch.arange(K) < drafted[:, None])).sum(-1)
        return tokens, accepted, None, None


class Work:
    def __init__(self, prompt, stop, n=50):
        self.prompt, self.stop, self.n, self.got, self.ended = prompt, stop, n, [], False

    def sampling(self):
        return GREEDY

    def next(self, token, logits):
        self.got.append(token)
        return None if token == self.stop or len(self.got) == self.n else token

    def end(self, error=None):
        self.ended = True


def test_a_stop_token_among_the_accepted_drafts_ends_the_work_there():
    """Four drafts accepted and a bonus token, and the work stops at the second: it takes two, the
    rest are dropped, and its row serves the next work from position 0; a work whose max_tokens ends
    it mid-way takes exactly that many."""
    runtime, first, second = Runtime(), Work([7, 8, 9, 10, 11, 3], stop=9), Work([7, 8, 9, 10, 11, 3], stop=-1, n=4)
    rows, waiting = Rows(runtime), [first, second]
    while waiting or rows.active():
        rows.step(lambda: waiting.pop(0) if waiting else None)
    assert first.got == [7, 8, 9] and first.ended
    assert second.got == [7, 8, 9, 10] and second.ended
    assert runtime.calls == [([[7, 8, 9, 10, 11]], [[6, 7, 8, 9, 10]], [4])] * 2


def _serve(engine, requests):
    """Each request's tokens (its texts, spelled by IdTokenizer)."""
    try:
        return [tokens_of(sink.steps) for sink in serve_together(engine, requests)]
    finally:
        engine.close()


def test_served_greedy_texts_with_speculation_are_those_without(tiny_port, static_model):
    """64 requests over 8 rows (EOS on, prefix caching on as serve has it, one request to the cache's
    last position): each request's text is the same with prompt lookup as without; and where a stop
    token from the middle of its answer is asked, that answer up to the stop."""
    spec = tiny_port.static
    prompts = repetitive([5 + (7 * i) % 40 for i in range(63)], seed=12)
    prompts[32:48] = [prompts[0][:17] + p for p in prompts[32:48]]  # a block held by another row
    prompts.append(prompts[-1][:40] * 2)  # 80 tokens, then to the cache's last position
    budget = [8 + i % 9 for i in range(63)] + [spec.max_cache_len + 1 - 80]

    def served(speculative, stops):
        runtime = static_runtime(static_model, spec, batch=8, prefix_caching=True, speculative=speculative)
        calls = _recording(runtime) if speculative else []
        engine = Engine(runtime, IdTokenizer(), {1})
        engine.metrics = Metrics("m")
        params = [SamplingParams(n, temperature=0.0, stop_token_ids=s) for n, s in zip(budget, stops)]
        return _serve(engine, list(zip(prompts, params))), calls, engine.metrics.registry

    expected, _, _ = served(None, [()] * 64)
    got, calls, registry = served(LOOKUP, [()] * 64)
    assert got == expected
    # /metrics: each verify call's rows that had drafts, their drafts, and those accepted
    rows = [(d, a) for drafted, accepted in calls for d, a in zip(drafted, accepted) if d]
    counted = [registry.get_sample_value(f"vllm:spec_decode_num_{name}_total", {"model_name": "m"}) for name in SPEC]
    assert counted == [len(rows), sum(d for d, _ in rows), sum(a for _, a in rows)] and counted[2] > 0
    stops = [(a[len(a) // 2],) if i % 2 == 0 and a else () for i, a in enumerate(expected)]
    got, _, _ = served(LOOKUP, stops)
    assert got == [a[: a.index(s[0])] if s else a for a, s in zip(expected, stops)]


@pytest.mark.parametrize("command", ["validate", "serve"])
def test_speculation_outside_the_static_graphs_is_one_error_line(command, capsys):
    given = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    assert cli.main([command, "--backend", "eager", *given] + (["--port", "0"] if command == "serve" else [])) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --speculative-config runs in --backend static's graphs, not --backend eager"
