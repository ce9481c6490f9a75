import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch

from neuron_moe import cli, cli_parser
from neuron_moe.cli_parser import DEFAULT_THREADS
from neuron_moe.errors import UserError, restore_ctrl_c, take_ctrl_c
from neuron_moe.eval import seq_match
from neuron_moe.greedy import Generation
from neuron_moe.spec import NAIVE, QUANTIZATIONS, Placement


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

    def make(port, backend, checkpoint, speculative=None):
        inner = make_eager(port, backend, checkpoint, speculative)

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
    assert cli.main(["validate", "--backend", "traced", "--quantized-layers", "attention"]) == 2
    assert "--quantized-layers names the linears --quantization puts in a format" in capsys.readouterr().err
    assert cli.main(["serve", "--backend", "neuron", "--quantization", "int8", "--port", "0"]) == 2  # before binding
    assert "runs a compiled artifact in the format it was built with" in capsys.readouterr().err
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
    """A NaN logit makes max|Δlogit| and the cosine NaN, and comparisons with NaN are false: the check must
    fail on them explicitly, or matching tokens alone would pass (SEQ_MATCH True, exit 0)."""
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
    """More new tokens than the context holds is refused up front, not run (allocating logits) until
    something breaks."""
    assert cli.main(["validate", "--max-new-tokens", "1000000"]) == 2  # within the parser's bound, past the port's
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
    assert "--threads: must be in [1, " in capsys.readouterr().err


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
        (["serve", "--max-queue", "-1"], "argument --max-queue: must be in [0, 2147483647], got -1"),
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
        (["build-corpus", "--out", "o", "--scale", "0"], "argument --scale: must be in (0, 1000], got 0"),
        (["validate", "--recovery-rank", "-2"], "argument --recovery-rank: must be in [0, 262144], got -2"),
        (
            ["trace-and-compile", "--tp", "2", "--dry-run", "--out", "o", "--batch-size", "2000"],
            "argument --batch-size: must be in [1, 1024], got 2000",
        ),
    ],
)
def test_numeric_options_out_of_range_are_refused_by_name(argv, message, capsys):
    """One check for every numeric option (cli_parser.number): NaN, inf, a negative reserve or timeout are
    refused at the command line, naming the option (a NaN reserve would otherwise print 'FITS: nan', exit 0)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--header-timeout", "--body-timeout"])
def test_a_clients_deadline_under_a_second_is_refused(flag, capsys):
    """serve's deadlines for a client's headers and body: under 1 s (1e-300 cut every client at once)
    refused by name, the floor said; 1 s taken. Parsed alone: a regression must not start a server."""
    with pytest.raises(SystemExit) as e:
        cli_parser.parser().parse_args(["serve", flag, "1e-300"])
    assert e.value.code == 2 and f"argument {flag}: must be at least 1, got 1e-300" in capsys.readouterr().err
    args = cli_parser.parser().parse_args(["serve", flag, "1"])
    assert getattr(args, flag.removeprefix("--").replace("-", "_")) == 1.0


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
                assert set(action.choices) <= set(QUANTIZATIONS) and "none" in action.choices, name


# ---- every integer option bounded -------------------------------------------------------------------------


def subcommands() -> dict[str, argparse.ArgumentParser]:
    return next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def takes_integers(kind) -> bool:
    try:
        return type(kind("1")) is int
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False


def integer_options() -> list[tuple[list[str], str]]:
    """(the least argv a command parses, flag) for every integer option of every command, those of a
    command's own subcommands (`deploy k8s`) included."""
    found = []

    def walk(least: list[str], sub: argparse.ArgumentParser) -> None:
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        for a in sub._actions:
            if a not in nested and (a.required or (not a.option_strings and a.nargs != 0)):
                least = [*least, *a.option_strings[:1], str(a.choices[0]) if a.choices else "x"]
        found.extend((least, a.option_strings[0]) for a in sub._actions if a.option_strings and takes_integers(a.type))
        for a in nested:
            for name, child in a.choices.items():
                walk([*least, name], child)

    for name, sub in subcommands().items():
        walk([name], sub)
    return found


def test_every_integer_option_of_every_command_refuses_2_to_the_64_by_name(capsys):
    """A typo of 20 digits is one argparse error naming the option, whatever the command: never a
    traceback (an overflow in torch), a segfault (a thread pool of 10^5 threads) or a report of
    22-digit byte counts."""
    options = integer_options()
    assert {"--threads", "--hidden", "--intermediate", "--max-new-tokens", "--seq-len", "--steps"} <= {
        flag for _, flag in options
    }
    for least, flag in options:
        for value in (str(2**64), "99999999999999999999"):
            with pytest.raises(SystemExit) as e:
                cli.parser().parse_args([*least, flag, value])
            err = capsys.readouterr().err
            assert e.value.code == 2 and re.search(f"argument {flag}(/--[a-z-]+)?: must be", err), (least, flag, err)
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["plan", "--instance", "inf2.48xlarge", "--tp", "8", "--buckets", f"8,{2**64}"])
    assert "argument --buckets: a length is at most" in capsys.readouterr().err


def test_reads_refuses_an_absurd_explicit_geometry_by_name(capsys):
    for flag in ("--hidden", "--intermediate"):
        argv = ["reads", "--hidden", "128", "--experts", "8", "--top-k", "2", "--intermediate", "64"]
        argv[argv.index(flag) + 1] = "99999999999999999999"
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        out, err = capsys.readouterr()
        assert e.value.code == 2 and f"argument {flag}: must be in [1, " in err and not out


def test_the_parsers_bounds_are_the_ports_and_configs():
    """cli_parser holds no torch import, so it keeps its own copy of these bounds: the same numbers."""
    from neuron_moe import cli_parser
    from neuron_moe.config import SIZES
    from neuron_moe.port import MAX_BATCH

    assert cli_parser.MAX_ROWS == MAX_BATCH
    assert cli_parser.MAX_TOKENS == SIZES["max_position_embeddings"][1]
    sizes = ("hidden_size", "num_experts", "top_k_experts", "moe_intermediate_size")
    assert list(cli_parser.GEOMETRY_BOUNDS.values()) == [SIZES[k][1] for k in sizes]


def test_threads_are_bounded_by_what_the_machine_runs(monkeypatch, capsys):
    """--threads 100000 would crash a thread pool (exit 139), a 20-digit one overflow torch: both refused by name."""
    before = torch.get_num_threads()
    try:
        for value in ("99999999999999999999", "100000"):
            with pytest.raises(SystemExit) as e:
                cli.main(["ports", "--threads", value])
            err = capsys.readouterr().err
            assert e.value.code == 2 and "argument --threads: must be in [1, " in err and f"got {value}" in err
        assert torch.get_num_threads() == before  # refused before torch was told anything
        from neuron_moe.cli_parser import THREADS_PER_CPU, max_threads

        assert max_threads() == THREADS_PER_CPU * len(os.sched_getaffinity(0))
        with pytest.raises(SystemExit):
            cli.main(["ports", "--threads", str(max_threads() + 1)])
        assert f"argument --threads: must be in [1, {max_threads()}], got" in capsys.readouterr().err
        monkeypatch.setenv("OMP_NUM_THREADS", "100000")
        assert cli.main(["ports"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: $OMP_NUM_THREADS=100000 is more torch threads") and err.count("\n") == 1
        assert cli.main(["ports", "--threads", "1"]) == 0  # the flag wins over the variable
    finally:
        torch.set_num_threads(before)


# ---- smaller things a user meets ------------------------------------------------------------------------------


def test_reads_without_flags_reads_at_the_ports_reader_recovery_rank(capsys):
    """The tiny port's [reader] table sets recovery_rank 0; the reader's own default (32) is past what its
    budget allows there."""
    assert cli.main(["reads", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recovery_rank"] == 0 and report["budget_percent"] == 17.8, report
    assert cli.main(["reads", "--recovery-rank", "32"]) == 2  # a flag still overrides the port
    assert "below what the reader reads before any exact channel" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [(["reads", "--json"], "--json"), (["prep-reader", "--out"], "--out")])
def test_an_output_the_filesystem_refuses_is_named_by_its_flag_before_any_work(argv, flag, capsys):
    """/proc takes no new file (even for root, whom os.access lets through): the error names the flag
    and the path given, not the temp file a write would have made."""
    assert cli.main([*argv, "/proc/neuron-moe-test"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: /proc/neuron-moe-test cannot be written") or err.startswith(
        f"error: {flag}: /proc: directory not writable"
    ), err
    assert "/proc/.neuron-moe-test" not in err and err.count("\n") == 1


def test_model_given_a_directory_says_it_is_one(tmp_path, monkeypatch, capsys):
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    for model in (str(tmp_path / "ckpt"), "ckpt", "ckpt/"):
        assert cli.main(["info", "--model", model]) == 2
        err = capsys.readouterr().err
        assert "ckpt is a directory, not a port file" in err and "--checkpoint" in err, err
    (tmp_path / "tiny-gemma4-moe").mkdir()  # a folder named as a built-in port does not hide the port
    assert cli.main(["info"]) == 0


def test_ctrl_c_during_trace_and_compiles_ranks_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the rank shards are built: the partial output is removed on the way out (as on any
    failure) and the user reads one line, no traceback."""
    from neuron_moe.neuron import compile as nc

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(nc.cpu, "shard_checkpoint", interrupted)
    out = tmp_path / "art"
    assert cli.main(["trace-and-compile", "--tp", "2", "--dry-run", "--out", str(out)]) == 130
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: interrupted (Ctrl-C): neuron-moe trace-and-compile stopped"
    assert not [line for line in err if "Traceback" in line or "KeyboardInterrupt" in line]
    assert not out.exists() and not list(tmp_path.glob(".art.partial-*"))


class _Finalized:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)


class _Referent:
    pass


def _finalizer():
    _Finalized()  # collected at once: the signal arrives inside its __del__


def _weakref_callback():
    referent = _Referent()
    ref = weakref.ref(referent, lambda _: signal.raise_signal(signal.SIGINT))
    del referent  # collected at once: the signal arrives inside the callback
    return ref


@pytest.mark.parametrize("callback", [_finalizer, _weakref_callback], ids=["__del__", "weakref callback"])
def test_ctrl_c_inside_a_callback_is_not_lost(callback):
    """Python prints an exception raised in `__del__` or a weakref callback and carries on: a Ctrl-C
    landing in one (the garbage collector runs them anywhere; a real Ctrl-C during trace-and-compile's
    export lands in `regex`'s finalizers and torch's weakref callbacks) would be lost and the command
    run on. The CLI's hook sends it again once out of the callback."""
    previous = take_ctrl_c()
    try:
        with pytest.raises(KeyboardInterrupt):
            callback()
            time.sleep(60)  # cut short by the signal sent again
    finally:
        restore_ctrl_c(previous)


def test_a_real_ctrl_c_during_trace_and_compile_is_one_line_and_exit_130(tmp_path):
    """SIGINT to the process while it exports the rank graphs: exit 130, one line, nothing written."""
    import signal
    import time

    out = tmp_path / "art"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "neuron_moe", "trace-and-compile", "--tp", "2", "--dry-run", "--out", str(out)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, env=env)
    seen = b""
    while b"export:" not in seen:  # tqdm's bar: the rank module is built, its graphs are being exported
        chunk = proc.stderr.read1(4096)
        assert chunk, seen.decode(errors="replace")
        seen += chunk
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[1]
    err = (seen + rest).decode(errors="replace")
    assert proc.returncode == 130, err
    assert err.rstrip().splitlines()[-1] == "error: interrupted (Ctrl-C): neuron-moe trace-and-compile stopped"
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".art.partial-*"))
