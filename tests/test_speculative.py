"""Speculative decoding's pieces: the --speculative-config JSON (vLLM's names and defaults, every
refusal one line naming the key), the assistant's fit to the target, prompt lookup (vLLM's rule), and
the rejection sampler: its tokens distributed as the target's (and not without the rejection step),
the greedy check exactly the target's argmax, both static graphs."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma4AssistantConfig

from neuron_moe import cli, cli_parser
from neuron_moe.errors import UserError
from neuron_moe.port import load_port
from neuron_moe.serve.metrics import Metrics
from neuron_moe.spec import DEFAULT_PORT
from neuron_moe.speculative import (
    KEYS,
    MAX_SPECULATIVE_TOKENS,
    SpeculativeConfig,
    check_assistant,
    greedy_verify,
    ngram_propose,
    rejection_sample,
)
from neuron_moe.static import data_dependent_ops

# ---- the config ----


def test_ngram_with_vllms_defaults():
    """vLLM's: one bound given, the other is the same; neither, both 5."""
    issue = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    assert SpeculativeConfig.from_json(issue) == SpeculativeConfig("ngram", 4, None, 4, 4)
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2}') == SpeculativeConfig(
        "ngram", 2, None, 5, 5
    )
    given = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 6}'
    assert SpeculativeConfig.from_json(given) == SpeculativeConfig("ngram", 3, None, 6, 2)
    only_min = SpeculativeConfig.from_json('{"model": "[ngram]", "num_speculative_tokens": 1, "prompt_lookup_min": 7}')
    assert (only_min.method, only_min.prompt_lookup_min, only_min.prompt_lookup_max) == ("ngram", 7, 7)


def test_an_assistant_model_is_method_mtp():
    """vLLM detects Gemma-4's assistant as 'mtp'; k defaults to its n_predict, 1; null is not given."""
    got = SpeculativeConfig.from_json('{"model": "tiny-gemma4-moe-assistant", "num_speculative_tokens": 4}')
    assert got == SpeculativeConfig("mtp", 4, "tiny-gemma4-moe-assistant")
    assert SpeculativeConfig.from_json('{"model": "/a", "method": "mtp", "prompt_lookup_max": null}') == (
        SpeculativeConfig("mtp", 1, "/a")
    )


@pytest.mark.parametrize(
    "text,says",
    [
        ("{", "not valid JSON"),
        ('{"method": "ngram", "num_speculative_tokens": NaN}', "not valid JSON"),
        ("[4]", "expected a JSON object"),
        ('{"model": "m", "num_speculative_tokens": 0}', "num_speculative_tokens must be in 1..16, got 0"),
        ('{"model": "m", "num_speculative_tokens": -1}', "num_speculative_tokens must be in 1..16, got -1"),
        ('{"model": "m", "num_speculative_tokens": 17}', "num_speculative_tokens must be in 1..16, got 17"),
        ('{"model": "m", "num_speculative_tokens": 4.0}', "num_speculative_tokens must be an integer"),
        ('{"model": "m", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
        ('{"model": "m", "num_speculative_tokens": "4"}', "num_speculative_tokens must be an integer"),
        ('{"model": 4, "num_speculative_tokens": 4}', "model must be a string"),
        ('{"model": "", "num_speculative_tokens": 4}', "model must not be empty"),
        ('{"method": ["ngram"], "num_speculative_tokens": 4}', "method must be a string"),
        ('{"method": "eagle", "model": "m", "num_speculative_tokens": 4}', "method 'eagle' is not supported"),
        ('{"method": "mtp", "num_speculative_tokens": 4}', "method 'mtp' needs 'model'"),
        ('{"num_speculative_tokens": 4}', "give 'model' (an assistant) or 'method': 'ngram'"),
        ('{"model": "m", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}', "unknown key"),
        ('{"method": "ngram"}', "num_speculative_tokens is required with method 'ngram'"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "model": "m"}', "model 'm' is not used by method"),
        ('{"model": "m", "num_speculative_tokens": 4, "prompt_lookup_max": 3}', "prompt_lookup_max is a setting"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": "3"}', "prompt_lookup_max must be"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0}', "prompt_lookup_min must be at"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 0}', "prompt_lookup_max must be at"),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
            "prompt_lookup_min (5) must be at most prompt_lookup_max (3)",
        ),
    ],
)
def test_a_bad_config_is_one_line_naming_the_key(text, says):
    with pytest.raises(UserError) as e:
        SpeculativeConfig.from_json(text)
    message = str(e.value)
    assert message.startswith("--speculative-config: ") and says in message and "\n" not in message


_VALUES = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
_VALUES |= st.sampled_from(["ngram", "[ngram]", "mtp", "eagle", ""])


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.dictionaries(st.sampled_from([*KEYS, "quantization"]), _VALUES | st.lists(_VALUES, max_size=2)))
def test_fuzz_any_config_is_taken_or_refused_in_one_line(raw):
    """Whatever the keys and values: a config within the bounds, or one line naming the problem."""
    try:
        config = SpeculativeConfig.from_json(json.dumps(raw))
    except UserError as e:
        assert str(e).startswith("--speculative-config: ") and "\n" not in str(e)
        return
    assert config.method in ("mtp", "ngram") and 1 <= config.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
    if config.method == "ngram":
        assert 1 <= config.prompt_lookup_min <= config.prompt_lookup_max and config.model is None
    else:
        assert config.model and config.prompt_lookup_max is None


def test_k_is_at_most_16():
    assert SpeculativeConfig.from_json(f'{{"model": "m", "num_speculative_tokens": {MAX_SPECULATIVE_TOKENS}}}')


# ---- the assistant against the target ----


def _assistant(tmp_path, vocab: int, backbone: int):
    text = dict(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        enable_moe_block=False,
    )
    Gemma4AssistantConfig(text_config=text, backbone_hidden_size=backbone).save_pretrained(tmp_path)
    return SpeculativeConfig("mtp", 4, str(tmp_path))


def test_an_assistant_that_fits_the_target_is_taken(tmp_path):
    target = load_port(DEFAULT_PORT).config
    assert check_assistant(_assistant(tmp_path, target.vocab_size, target.hidden_size), target) == tmp_path
    assert check_assistant(SpeculativeConfig("ngram", 4, None, 4, 4), target) is None


@pytest.mark.parametrize(
    "vocab,backbone,says",
    [(1000, None, "vocab_size 1000 does not fit the target's 2048"), (None, 64, "backbone_hidden_size 64 does not")],
)
def test_an_assistant_that_does_not_fit_is_refused(tmp_path, vocab, backbone, says):
    target = load_port(DEFAULT_PORT).config
    config = _assistant(tmp_path, vocab or target.vocab_size, backbone or target.hidden_size)
    with pytest.raises(UserError, match=f"--speculative-config: .*{says}"):
        check_assistant(config, target)


def test_a_missing_or_foreign_assistant_is_refused(tmp_path):
    target = load_port(DEFAULT_PORT).config
    with pytest.raises(UserError, match="--speculative-config: .*no-such-assistant"):
        check_assistant(SpeculativeConfig("mtp", 4, "no-such-assistant"), target)
    with pytest.raises(UserError, match="--speculative-config: .*no config.json"):
        check_assistant(SpeculativeConfig("mtp", 4, str(tmp_path)), target)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4_text"}))
    with pytest.raises(UserError, match="not a Gemma-4 assistant"):
        check_assistant(SpeculativeConfig("mtp", 4, str(tmp_path)), target)


def test_the_built_in_assistant_fits_the_tiny_port():
    target = load_port(DEFAULT_PORT).config
    directory = check_assistant(SpeculativeConfig("mtp", 4, "tiny-gemma4-moe-assistant"), target)
    assert (directory / "config.json").is_file()


# ---- prompt lookup ----


def _lookup_reference(context, k, low, high):
    """vLLM's rule written out: n from the longest down, the earliest earlier occurrence of the last n."""
    for n in range(high, low - 1, -1):
        if n >= len(context):
            continue
        suffix = context[-n:]
        for start in range(len(context) - n):
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


@pytest.mark.parametrize(
    "context,k,low,high,draft",
    [
        ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),  # vLLM's docstring example: to the context's end
        ([1, 2, 9, 1, 2, 8, 1, 2], 1, 2, 2, [9]),  # two occurrences: the earliest
        ([5, 1, 2, 7, 3, 1, 2, 6, 3, 1, 2], 2, 2, 3, [6, 3]),  # the longest n first, then earliest
        ([7, 7, 7, 7], 4, 1, 3, [7]),  # an occurrence overlapping the suffix
        ([1, 2, 3, 4, 5], 3, 1, 4, []),  # nothing recurs
        ([1, 2, 1], 3, 2, 4, []),  # only a 1-gram recurs
        ([1, 2, 1], 3, 1, 4, [2, 1]),
        ([3], 2, 1, 2, []),
        ([], 2, 1, 2, []),
        ([1, 2, 1, 2], 0, 1, 2, []),
        ([256, 0, 5, 1], 2, 1, 2, []),  # the suffix's bytes inside two other tokens': not an occurrence
        ([256, 0, 1, 7, 1], 2, 1, 2, [7, 1]),  # past such a place, the first occurrence at a token
    ],
)
def test_prompt_lookup_cases(context, k, low, high, draft):
    assert ngram_propose(context, k, low, high) == draft


def test_prompt_lookup_is_vllms_rule_on_random_contexts():
    rng = random.Random(0)
    for _ in range(500):
        context = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        low = rng.randrange(1, 5)
        high = rng.randrange(low, 7)
        k = rng.randrange(1, 6)
        assert ngram_propose(context, k, low, high) == _lookup_reference(context, k, low, high), (context, low, high)


def test_prompt_lookup_on_a_long_context():
    """A 512-token context whose last 4 tokens recur once, early: found, the tokens after them."""
    context = list(np.random.default_rng(1).integers(100, 1000, 512))
    context[100:104] = context[-4:]
    assert ngram_propose(context, 5, 2, 4) == context[104:109]


# ---- the rejection sampler ----

DRAWS = 20_000
VOCAB = 12
K = 3


def _chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `tokens` against `probs` [V]: its p-value (the regularised upper
    gamma function; scipy is not a dependency). Bins expected under 5 are merged; a token of
    probability 0 drawn at all gives 0."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    probs = probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def _distributions(generator: torch.Generator, rows: int) -> torch.Tensor:
    """`rows` model-like distributions over VOCAB (softmax of scaled normal logits), one token of each
    at probability 0 (so that drawing it would show)."""
    logits = torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64) * 1.5
    logits[:, -1] = -torch.inf
    return logits.softmax(-1).float()


def _verify_draws(seed: int, draft: str, rejection: bool):
    """DRAWS verify steps of one fixed context (the target's p at each of K + 1 positions, the
    drafter's q): (tokens, accepted, p). `draft`: 'model' (q a model-like distribution, the drafts drawn
    from it) or 'lookup' (fixed drafts, each the target's most likely token, q one-hot). Without
    `rejection` every draft of p > 0 is kept (uniform_accept 0): the sampler with its rejection step
    removed."""
    g = torch.Generator().manual_seed(seed)
    p = _distributions(g, K + 1)
    if draft == "model":
        q = _distributions(g, K)
        tokens = torch.multinomial(q, DRAWS, replacement=True, generator=g).T  # [DRAWS, K]
        draft_probs = q.expand(DRAWS, K, VOCAB)
    else:
        tokens = p[:K].argmax(-1).expand(DRAWS, K)  # lookup proposes what the context makes likely
        draft_probs = None
    u_accept = torch.rand(DRAWS, K, generator=g) * rejection
    u_sample = torch.rand(DRAWS, K + 1, generator=g)
    out, accepted = rejection_sample(p.expand(DRAWS, K + 1, VOCAB), tokens, draft_probs, u_accept, u_sample)
    return out, accepted, p


def _p_values(out, accepted, p) -> list[float]:
    """The chi-square p-value of each position's token among the rows that reach it (every earlier
    draft accepted), against the target's p there: each is the target's next-token distribution."""
    return [_chi_square_p(out[accepted >= i, i], p[i]) for i in range(K + 1) if (accepted >= i).sum() >= 500]


@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_the_speculative_tokens_are_distributed_as_the_targets(draft):
    out, accepted, p = _verify_draws(seed=57, draft=draft, rejection=True)
    values = _p_values(out, accepted, p)
    assert len(values) >= 2, "too few rows reach the second position to test it"
    assert min(values) > 0.01, values
    assert int(accepted.min()) >= 0 and int(accepted.max()) <= K


@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_without_the_rejection_step_the_same_test_fails(draft):
    out, accepted, p = _verify_draws(seed=57, draft=draft, rejection=False)
    assert (accepted == K).all()  # every draft kept: the drafter's distribution, not the target's
    assert _p_values(out, accepted, p)[0] < 1e-6


def test_the_kept_tokens_are_the_accepted_drafts_then_one_draw():
    """Hand-made rows: p = q accepts everything (the bonus from p at k); a draft of target probability
    0 is rejected and replaced by a draw from max(0, p - q); a drafter probability 0 rejects too."""
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])[None].repeat(3, 1, 1)
    q = p[:, :2].clone()
    drafts = torch.tensor([[1, 2], [2, 2], [1, 2]])
    q[2, 0] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # row 2's draft 1 has drafter probability 0
    u = torch.full((3, 2), 0.5)
    tokens, accepted = rejection_sample(p, drafts, q, u, torch.full((3, 3), 0.99))
    assert accepted.tolist() == [2, 0, 0]
    assert tokens[0].tolist() == [1, 2, 3]
    assert tokens[1, 0] == 1  # p - q: [0.5, 0.5, -0.5, 0] -> only 0 and 1; u 0.99 -> 1
    assert tokens[2, 0] == 1  # p - q: [-0.5, 0.5, 0, 0] -> 1


def test_greedy_verify_is_the_targets_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, K + 1, VOCAB, generator=g)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :K].clone()
    for row, wrong_at in enumerate([0, 1, 2, None, 1]):
        if wrong_at is not None:
            drafts[row, wrong_at] = (drafts[row, wrong_at] + 1) % VOCAB
    tokens, accepted = greedy_verify(logits, drafts)
    assert torch.equal(tokens, argmax)
    assert accepted.tolist() == [0, 1, 2, K, 1]


class _Verify(torch.nn.Module):
    def forward(self, target_probs, draft_tokens, draft_probs, uniform_accept, uniform_sample, logits):
        sampled = rejection_sample(target_probs, draft_tokens, draft_probs, uniform_accept, uniform_sample)
        lookup = rejection_sample(target_probs, draft_tokens, None, uniform_accept, uniform_sample)
        return *sampled, *lookup, *greedy_verify(logits, draft_tokens)


def test_the_verify_functions_export_as_static_graphs():
    rows = 2
    probs = torch.full((rows, K + 1, VOCAB), 1 / VOCAB)
    inputs = (
        probs,
        torch.zeros(rows, K, dtype=torch.long),
        probs[:, :K],
        torch.rand(rows, K),
        torch.rand(rows, K + 1),
        torch.randn(rows, K + 1, VOCAB),
    )
    program = torch.export.export(_Verify(), inputs)
    assert data_dependent_ops(program) == []
    eager = _Verify()(*inputs)
    for a, b in zip(program.module()(*inputs), eager, strict=True):
        assert torch.equal(a, b)


# ---- the flag ----

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
COMMANDS = {
    "validate": ["validate"],
    "serve": ["serve", "--backend", "static"],
    "trace-and-compile": ["trace-and-compile", "--tp", "2", "--dry-run", "--out", "OUT"],
    "deploy k8s": ["deploy", "k8s", "--instance", "inf2.xlarge", "--artifacts", "s3://b/p", "--out", "OUT"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_flag_on_each_command_refuses_a_bad_config_in_one_line(command, tmp_path, capsys):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in COMMANDS[command]]
    assert cli.main([*argv, "--speculative-config", '{"model": "m", "num_speculative_tokens": 17}']) == 2
    err = capsys.readouterr().err
    assert err == "error: --speculative-config: num_speculative_tokens must be in 1..16, got 17\n"
    assert not (tmp_path / "out").exists()  # refused before any work


@pytest.mark.parametrize("command", ["validate", "serve", "trace-and-compile"])
def test_the_run_configuration_holds_the_parsed_config(command, tmp_path):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in COMMANDS[command]]
    args = cli_parser.parser().parse_args([*argv, "--speculative-config", NGRAM])
    assert cli.run_config(args).speculative == SpeculativeConfig("ngram", 4, None, 4, 4)
    assert cli.run_config(cli_parser.parser().parse_args(argv)).speculative is None


def test_deploy_refuses_the_config_an_artifact_carries(tmp_path, capsys):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in COMMANDS["deploy k8s"]]
    assert cli.main([*argv, "--speculative-config", NGRAM]) == 2
    assert capsys.readouterr().err == (
        "error: --speculative-config: deploy k8s takes none; an artifact speculates as it was built "
        "(trace-and-compile --speculative-config writes its verify key and the config into its manifest)\n"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_help_names_the_flag(command, capsys):
    with pytest.raises(SystemExit):
        cli_parser.parser().parse_args([*COMMANDS[command][: 2 if command == "deploy k8s" else 1], "--help"])
    assert "--speculative-config JSON" in capsys.readouterr().out


# ---- /metrics ----


def test_metrics_count_the_drafts_as_vllm():
    """Per row: a draft, its tokens, the accepted ones and each accepted position; a row without drafts
    is no draft."""
    metrics = Metrics("tiny")
    metrics.spec_decoded([4, 4, 0], [2, 4, 0])
    metrics.spec_decoded([3], [0])
    text = metrics.render().decode()
    expected = {
        "vllm:spec_decode_num_drafts_total": 3,
        "vllm:spec_decode_num_draft_tokens_total": 11,
        "vllm:spec_decode_num_accepted_tokens_total": 6,
    }
    for name, value in expected.items():
        assert f'{name}{{model_name="tiny"}} {value:.1f}' in text
    for position, value in enumerate([2, 2, 1, 1]):
        line = f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{position}"}}'
        assert f"{line} {value:.1f}" in text
    assert 'position="4"' not in text
