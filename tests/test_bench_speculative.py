"""bench/speculative.py: a run's summary from canned measurements (the speed-up against no speculation in
the same repeat, the texts compared, the acceptance per draft position), and the bench end to end on the
tiny port's graphs as modules: its JSON has the runs' required keys and the machine, its page the table,
and a bad flag is one error line."""

import json

import pytest

from bench import speculative as s

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def measured(tokens, seconds, steps, row_steps, verified=(), decode=(), verify=()):
    calls = {name: [] for name in s.CALLS}
    calls["decode"], calls["verify"] = list(decode), list(verify)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "steps": steps,
        "row_steps": row_steps,
        "calls": calls,
        "verified": list(verified),
    }


def test_summary_is_the_median_of_the_repeats_against_none_in_the_same_repeat():
    texts = [[5, 6, 7, 8], [9, 9, 9, 9]]  # 8 output tokens, 6 of them from decode or verify steps
    base = [measured(texts, 2.0, 3, 6, decode=[0.5] * 3), measured(texts, 4.0, 3, 6, decode=[1.0] * 3)]
    # three verify steps: rows drafted 4, 4 and 2 tokens, accepted 2, 0 and 2
    spec = [
        measured(texts, 1.0, 2, 3, [(4, 2), (4, 0), (2, 2)], verify=[0.25, 0.25]),
        measured(texts, 1.0, 2, 3, [(4, 2), (4, 0), (2, 2)], verify=[0.25, 0.25]),
    ]
    run = s.summary("ngram", "repeats", 2, spec, base, k=4)
    assert list(run)[: len(s.KEYS)] == list(s.KEYS)
    assert (run["method"], run["workload"], run["batch_size"]) == ("ngram", "repeats", 2)
    assert run["tokens_per_step"] == 6 / 3
    assert run["tok_s"] == 8.0 and run["speedup_repeats"] == [2.0, 4.0] and run["speedup"] == 3.0
    assert run["identical"] is True
    assert run["acceptance_per_position"] == [2 / 3, 2 / 3, 0.0, 0.0]
    assert (run["verify_call_ms"], run["decode_call_ms"]) == (250.0, None)
    assert run["host_ms_per_step"] == 1e3 * (1.0 - 0.5) / 2
    other = [measured([[5, 6, 7, 8], [9, 9, 9, 1]], 1.0, 2, 3)] * 2
    assert s.summary("ngram", "repeats", 2, other, base, k=4)["identical"] is False


def test_bench_end_to_end_writes_the_runs_the_machine_and_the_page(tmp_path, capsys):
    out = tmp_path / "speculative.json"
    argv = ["--no-compile", "--batch-sizes", "1,2", "--prompts", "2", "--max-tokens", "6", "--repeats", "1"]
    argv += ["--methods", "none,ngram", "--workloads", "repeats,code", "--json", str(out)]
    assert s.main(argv) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [(r["method"], r["workload"], r["batch_size"]) for r in runs] == [
        (m, w, b) for b in (1, 2) for w in ("repeats", "code") for m in ("none", "ngram")
    ]
    for r in runs:
        assert set(s.KEYS) <= set(r) and r["tok_s"] > 0 and r["identical"] is True, r
        assert r["speedup"] == 1.0 if r["method"] == "none" else r["speedup"] > 0
    assert report["machine"]["cores"] and report["machine"]["load_average"] and report["machine"]["torch_threads"] == 1
    assert len(report["workloads"]["repeats"]["prompts"]) == 2
    page = out.with_suffix(".md").read_text()
    assert "| ngram | repeats | 1 |" in page and "| ngram | repeats | 2 |" in page and "What bounds" in page
    assert "ngram" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--methods", "ngram"], "--methods"),
        (["--workloads", "poetry"], "--workloads"),
        (["--batch-sizes", "1,x"], "--batch-sizes"),
        (["--ngram", '{"model": "x", "num_speculative_tokens": 2}'], "--ngram"),
        (["--assistant", "/no/such/assistant"], "--assistant"),
    ],
)
def test_a_bad_flag_is_one_error_line(flags, named, capsys):
    assert s.main(["--no-compile", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and len(err.strip().splitlines()) == 1
