"""Speculative decoding's pieces: the --speculative-config JSON (vLLM's names and defaults, every
refusal one line naming the key), the assistant's fit to the target and prompt lookup (vLLM's rule).
The verify step's acceptance rule is tested over the verify graph itself (test_speculative_step.py)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma4AssistantConfig

from neuron_moe import cli, cli_parser
from neuron_moe.errors import UserError
from neuron_moe.port import load_port
from neuron_moe.serve.metrics import Metrics
from neuron_moe.spec import DEFAULT_PORT
from neuron_moe.hub import check_assistant
from neuron_moe.speculative import KEYS, MAX_SPECULATIVE_TOKENS, SpeculativeConfig, ngram_propose

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
