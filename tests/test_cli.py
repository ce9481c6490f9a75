import argparse
import json
import subprocess
import sys

import pytest
import torch

from neuron_moe import cli
from neuron_moe.cli_parser import DEFAULT_THREADS
from neuron_moe.errors import UserError
from neuron_moe.eval import seq_match
from neuron_moe.greedy import Generation
from neuron_moe.spec import NAIVE, Placement


def test_validate_passes_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r" / "validate.json"
    assert cli.main(["validate", "--max-new-tokens", "12", "--prompt", "x = 1 +", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["all_match"] and report["backend"] == "dense_masked"
    assert len(report["prompts"]) == len(seq_match.DEFAULT_PROMPTS) + 1
    for row in report["prompts"]:
        assert row["seq_match"] and row["first_divergence"] is None
        assert row["max_abs_dlogit_step0"] <= 1e-5 and row["min_cosine"] > 0.999999
    printed = capsys.readouterr().out
    assert "SEQ_MATCH" in printed and "PASS: 5/5 prompts match" in printed
    # the shown texts end at the model's EOS: the reversed list, not the next made-up question after it
    row = next(r for r in report["prompts"] if r["prompt"].startswith("Q: Reverse: "))
    words = row["prompt"].removeprefix("Q: Reverse: ").removesuffix("\nA:").split()
    assert row["reference_text"] == row["backend_text"] == " " + " ".join(reversed(words))


def test_validate_fails_with_exit_1_and_reports_divergence(monkeypatch, capsys):
    make_eager = seq_match.generator

    def make(port, backend, checkpoint):
        inner = make_eager(port, backend, checkpoint)

        def generate(ids, mask, n):
            gen = inner(ids, mask, n)
            gen.tokens[0, 3:] = (gen.tokens[0, 3:] + 1) % port.config.vocab_size  # corrupt row 0 from step 3
            return gen

        return generate

    monkeypatch.setattr(seq_match, "generator", make)
    assert cli.main(["validate", "--backend", "eager", "--max-new-tokens", "6", "--json", "-"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["all_match"]
    assert report["prompts"][0]["first_divergence"] == 3
    assert all(r["seq_match"] for r in report["prompts"][1:])


def test_info_json_to_stdout(capsys):
    assert cli.main(["info", "--model", "gemma4-26b-a4b", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["geometry"]["num_experts"] == 128
    assert "per_token" not in report


def test_info_per_token_table(capsys):
    assert cli.main(["info", "--model", "gemma4-26b-a4b", "--per-token"]) == 0
    out = capsys.readouterr().out
    dense = next(line for line in out.splitlines() if line.startswith("dense_masked "))
    selective = next(line for line in out.splitlines() if line.startswith("selective "))
    assert "1522.5" in dense and "95.2" in selective and selective.rstrip().endswith("16x")


def test_user_errors_are_one_line_and_exit_2(capsys):
    assert cli.main(["info", "--model", "no-such-port"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown port 'no-such-port'") and "Traceback" not in err
    assert cli.main(["validate", "--model", "gemma4-26b-a4b"]) == 2
    assert "pass --checkpoint DIR" in capsys.readouterr().err
    assert cli.main(["validate", "--backend", "eager", "--quantization", "int8", "--expert-layout", "channel"]) == 2
    assert "--expert-layout applies to the TP backends (tp) only" in capsys.readouterr().err
    assert cli.main(["validate", "--backend", "traced", "--quantization", "int8"]) == 2
    assert "--quantization int8 applies to --backend dense_masked, eager" in capsys.readouterr().err
    assert cli.main(["serve", "--backend", "static", "--quantization", "int8", "--port", "0"]) == 2  # before binding
    assert "not --backend static" in capsys.readouterr().err
    assert cli.main(["plan", "--instance", "inf2.48xlarge", "--tp", "8", "--budget", "10"]) == 2
    assert "--budget configure the reader: pass --reader" in capsys.readouterr().err
    # the seed bug is the expert layout's router scatter: the channel layout has none to get wrong
    with pytest.raises(UserError, match="runs the 'expert' expert layout only, not 'channel'"):
        Placement(expert_layout="channel", scatter=NAIVE).layout(None)


@pytest.mark.parametrize(
    "command", [[], ["info"], ["validate"], ["ports"], ["eval-tasks"], ["train-tiny"], ["build-corpus"]]
)
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(command + ["--help"])
    assert exit_.value.code == 0
    assert "--json" in capsys.readouterr().out or not command


def test_every_command_has_a_handler():
    """cli_parser.py declares the commands and cli.COMMANDS runs them: the two agree."""
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(cli.COMMANDS)


def test_a_non_finite_logit_fails_the_comparison_whatever_the_tokens(capsys):
    """Issue 26, item 4: NaN logits gave max|Δlogit| nan, cosine nan and SEQ_MATCH True (exit 0)."""
    tokens = torch.tensor([[5, 6, 7], [5, 6, 7]])
    logits = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    poisoned = logits.clone()
    poisoned[1, 1, 3] = float("nan")
    rows = seq_match.compare(Generation(tokens, logits), Generation(tokens.clone(), poisoned), ["a", "b"])
    assert [r["seq_match"] for r in rows] == [True, False]
    assert [r["finite_logits"] for r in rows] == [True, False]
    rows = seq_match.compare(Generation(tokens, poisoned), Generation(tokens.clone(), logits), ["a", "b"])
    assert [r["seq_match"] for r in rows] == [True, False]  # the reference's NaN fails it too


def test_validate_refuses_more_new_tokens_than_the_context_holds(capsys):
    """Issue 26, item 9: 10^9 new tokens ran (and allocated logits) until something broke."""
    assert cli.main(["validate", "--max-new-tokens", "1000000000"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context of 512 tokens" in err and err.count("\n") == 1


def test_every_command_takes_threads_and_applies_it(monkeypatch, capsys):
    """--threads on every command (default: $OMP_NUM_THREADS, else the measured DEFAULT_THREADS), set on
    torch before the command runs."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    subcommands = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in subcommands.items():
        (threads,) = [a for a in sub._actions if "--threads" in a.option_strings]
        assert threads.default == DEFAULT_THREADS == 1, name
    assert set(subcommands) == set(cli.COMMANDS)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cli.parser().parse_args(["ports"]).threads == 3
    before = torch.get_num_threads()
    try:
        assert cli.main(["ports", "--threads", "2"]) == 0 and torch.get_num_threads() == 2
        assert cli.main(["ports"]) == 0 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SystemExit):
        cli.main(["ports", "--threads", "0"])
    assert "--threads: must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["plan", "--instance", "inf2.48xlarge", "--tp", "8", "--runtime-reserve-gib", "nan"],
            "argument --runtime-reserve-gib: must be a finite number, got nan",
        ),
        (
            ["plan", "--instance", "inf2.48xlarge", "--tp", "8", "--runtime-reserve-gib", "-1"],
            "argument --runtime-reserve-gib: must be at least 0, got -1",
        ),
        (
            ["plan", "--instance", "inf2.48xlarge", "--tp", "8", "--reader", "--budget", "inf"],
            "argument --budget: must be a finite number, got inf",
        ),
        (
            ["plan", "--instance", "inf2.48xlarge", "--tp", "8", "--reader", "--scan", "0"],
            "argument --scan: must be in [1, 128], got 0",
        ),
        (["serve", "--drain-timeout", "nan"], "argument --drain-timeout: must be a finite number, got nan"),
        (["serve", "--drain-timeout", "-1"], "argument --drain-timeout: must be at least 0, got -1"),
        (["serve", "--max-queue", "-1"], "argument --max-queue: must be at least 0, got -1"),
        (["serve", "--batch-size", "1.5"], "argument --batch-size: expected an integer, got '1.5'"),
        (
            ["prep-reader", "--out", "s.safetensors", "--seed", str(2**64)],
            f"argument --seed: must be in [0, {2**64 - 1}], got {2**64}",
        ),
        (["prep-reader", "--out", "s.safetensors", "--seed", "-1"], "argument --seed: must be in [0, "),
        (
            ["train-tiny", "--corpus", "c", "--out", "o", "--lr", "nan"],
            "argument --lr: must be a finite number, got nan",
        ),
        (
            ["train-tiny", "--corpus", "c", "--out", "o", "--task-share", "1.5"],
            "argument --task-share: must be in (0, 1], got 1.5",
        ),
        (["build-corpus", "--out", "o", "--scale", "0"], "argument --scale: must be more than 0, got 0"),
        (["validate", "--recovery-rank", "-2"], "argument --recovery-rank: must be at least 0, got -2"),
    ],
)
def test_numeric_options_out_of_range_are_refused_by_name(argv, message, capsys):
    """One check for every numeric option (cli_parser.number): NaN, inf, a negative reserve or timeout are
    refused at the command line, naming the option (a NaN reserve used to print 'FITS: nan' and exit 0)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def test_the_parser_and_the_entry_point_import_no_torch():
    """`neuron-moe --help` and a wrong flag answer at once: building the parser (and importing the entry
    point, which imports a command's modules only when it runs) loads neither torch nor transformers."""
    code = (
        "import sys, neuron_moe.cli_parser as p, neuron_moe.cli; p.parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'boto3', 'uvicorn') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "argv,gone",
    [
        (["validate", "--reader-backend", "triton"], "--reader-backend"),
        (["validate", "--reader-weights", "int8"], "--reader-weights"),
        (["validate", "--backend", "tp8"], "invalid choice: 'tp8'"),
        (["validate", "--backend", "tp8-naive-scatter"], "invalid choice: 'tp8-naive-scatter'"),
        (["validate", "--backend", "tp8-int4"], "invalid choice: 'tp8-int4'"),
        (["validate", "--backend", "int4"], "invalid choice: 'int4'"),
        (["validate", "--rank", "4"], "--rank"),
        (["plan", "--instance", "inf2.xlarge", "--tp", "1", "--batch", "4"], "--batch"),
        (["plan", "--instance", "inf2.xlarge", "--tp", "1", "--seq", "64"], "--seq"),
        (["plan", "--instance", "inf2.xlarge", "--tp", "1", "--reader-budget", "10"], "--reader-budget"),
        (["plan", "--instance", "inf2.xlarge", "--tp", "1", "--dtype", "bf16"], "invalid choice: 'bf16'"),
        (["reads", "--dtype", "int8"], "--dtype"),
        (["trace-and-compile", "--tp", "1", "--out", "o", "--dtype", "fp32"], "invalid choice: 'fp32'"),
        (["trace-and-compile", "--tp", "2", "--out", "o", "--dtype", "int4"], "invalid choice: 'int4'"),
        (["reads", "--budget", "25", "--dtype", "int4"], "--dtype"),
    ],
)
def test_old_option_names_are_refused(argv, gone, capsys):
    """One name per option, the same in every command: the old names (and any prefix of an option) do not parse."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and gone in capsys.readouterr().err


def test_every_command_that_takes_them_offers_the_same_dtype_and_quantization_words():
    subcommands = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in subcommands.items():
        for action in sub._actions:
            if "--dtype" in action.option_strings:
                assert set(action.choices) <= {"bfloat16", "float32"}, name
            if "--quantization" in action.option_strings:
                assert set(action.choices) <= {"none", "int8", "int4"} and "none" in action.choices, name
