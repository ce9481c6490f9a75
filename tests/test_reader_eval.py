"""eval-reader: selectors inside the trained model at read budgets. The full budget is the full model,
top-k reads its plan on every token, thresholds are calibrated on data disjoint from the evaluation
and their reads are measured, unreachable budgets are reported, and a rerun skips finished cells."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from neuron_moe import cli
from neuron_moe.eval import reader_eval as R
from neuron_moe.eval import reader_report
from neuron_moe.experts.selector_experts import attach_selector, moe_layers
from neuron_moe.reader import selectors as S
from neuron_moe.model import build_model, prep_port
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.prep import model_expert_weights, write_sidecar
from neuron_moe.reader.sidecar import Sidecar
from neuron_moe.tokenizer import load_tokenizer

from conftest import reseeded


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The two corpus files eval-reader reads, with a few short documents each."""
    out = tmp_path_factory.mktemp("corpus")
    for name, words in (("calib.jsonl", "calibration"), ("eval_text.jsonl", "evaluation")):
        rows = [
            {"kind": "text", "text": f"A short {words} text, number {i}. The capital of Peru is Lima."}
            for i in range(3)
        ]
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.fixture(scope="module")
def sidecar(tiny_port, tmp_path_factory):
    return Sidecar(prep_port(tiny_port, tmp_path_factory.mktemp("sc") / "sidecar.safetensors"))


def test_the_sidecar_from_a_held_model_is_the_port_models(tiny_port, tmp_path):
    """eval-reader preps from the fp32 model it already holds (a random-weights port is not built
    again): byte for byte the sidecar prep_port makes from the model it builds in the port's dtype."""
    port = dataclasses.replace(reseeded(tiny_port, 7), dtype=torch.bfloat16)
    held = build_model(port, "eager", torch.float32)
    built = prep_port(port, tmp_path / "built.safetensors").read_bytes()
    assert prep_port(port, tmp_path / "held.safetensors", model=held).read_bytes() == built
    # teeth: the held fp32 weights prepped as they are (not in the port's bf16) give other bytes
    c = port.config
    raw = write_sidecar(
        tmp_path / "raw.safetensors",
        model_expert_weights(held),
        Geometry.from_config(c),
        layers=c.num_hidden_layers,
        progress=False,
    )
    assert raw.read_bytes() != built


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


@pytest.mark.parametrize("name", list(S.SELECTORS))
def test_full_budget_is_the_full_model(tiny_port, tiny_eager, sidecar, name):
    """Every selector at 100 % inside the model = HF eager to fp32 summation order (2e-6 of the
    largest logit, as in test_dense_masked; 1.2e-5 apart with 1 torch thread); at 60 % it is not."""
    from neuron_moe.model import build_model

    ids = torch.tensor([load_tokenizer(tiny_port).encode("Q: Reverse: red fox owl sun\nA: sun owl fox red")])
    want = logits(tiny_eager, ids)
    model = build_model(tiny_port, "eager", torch.float32)
    layers = moe_layers(model, sidecar if name == "reader" else None, 0 if name == "reader" else None)
    attach_selector(model, name, layers, [S.top_k(name, layer, 100.0) for layer in layers])
    assert float((logits(model, ids) - want).abs().max()) <= 2e-6 * float(want.abs().max())
    attach_selector(model, name, layers, [S.top_k(name, layer, 60.0) for layer in layers])
    assert float((logits(model, ids) - want).abs().max()) > 1e-3  # teeth


def test_calibration_never_sees_the_evaluation(tiny_port, corpus):
    settings = R.Settings(per_task=50, corpus=str(corpus))  # the calibration split build-corpus writes
    raw = {i.prompt for i in R.T.eval_items(50, seed=4321)}
    evaluation = {i.prompt for i in R.evaluation_items(settings)}
    assert raw & evaluation  # the fact task draws both splits from the same held-out countries ...
    assert not {i.prompt for i in R.calibration_items(settings)} & evaluation  # ... so calibration drops those
    tok = load_tokenizer(tiny_port)
    calib = {tuple(s.ids) for s in R.sequences(tok, settings, 512, "calibration")}
    evals = {tuple(s.ids) for s in R.sequences(tok, settings, 512, "evaluation")}
    assert not calib & evals and len(calib) > 100
    assert {s.source for s in R.sequences(tok, settings, 512, "calibration")} >= {"text", "series"}


def test_answer_positions_are_the_answer(tiny_port):
    """Scored positions predict exactly the answer's tokens and EOS."""
    tok = load_tokenizer(tiny_port)
    item = R.T.eval_items(1, tasks=("reverse",))[0]
    seq = R.item_sequence(tok, item)
    predicted = seq.ids[seq.start + 1 :]
    assert predicted[-1] == tok.eos_token_id and tok.decode(predicted[:-1]) == item.answer


def test_quick_run_end_to_end_and_resume(tiny_port, corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    argv = [
        "eval-reader",
        "--quick",
        "--items",
        "1",
        "--selectors",
        "teal,cats",
        "--budgets",
        "30",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    cells = {(c["selector"], c["rule"]): c for c in report["cells"]}
    assert cells["cats", "topk"]["status"] == cells["cats", "threshold"]["status"] == "not reachable"
    assert "below its fixed reads" in cells["cats", "topk"]["reason"]  # CATS reads the whole gate first: 33 %
    top, thr = cells["teal", "topk"], cells["teal", "threshold"]
    assert top["within_one_sector"] and top["max_read_deviation_bytes"] == 0  # the plan, on every token and layer
    assert 30 - 0.6 < top["target_reads"] <= 30  # within one TEAL step (4 strips of 256 B = 0.52 %) below
    assert top["reads"]["p5"] == pytest.approx(top["reads"]["p95"]) == pytest.approx(top["target_reads"])
    assert thr["within_one_sector"] is None and thr["reads"]["p95"] - thr["reads"]["p5"] > 1  # measured, varies
    assert thr["target_reads"] == top["target_reads"]
    for c in (top, thr):
        assert c["positions"] == sum(s["positions"] for s in c["by_source"].values())
        assert set(c["by_source"]) == {"fact", "kv", "reverse", "text"}
        assert (
            sum(b["tokens"] for b in c["reads_by_answer_position"])
            == c["positions"] - c["by_source"]["text"]["positions"]
        )
        assert c["kl_mean"] > 0 and 0 < c["top1"] <= 1 and c["accuracy"]["items"] == 3
    printed = capsys.readouterr().out
    assert "not reachable" in printed and "teal" in printed
    assert "| teal | topk | 30 |" in (out / "report.md").read_text()
    for png in ("reads_vs_quality.png", "retention.png", "retention_by_position.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"

    def no_recompute(*a, **k):
        raise AssertionError("a finished cell was run again")

    monkeypatch.setattr(R.Run, "cell", no_recompute)
    assert cli.main(argv) == 0  # resumed: every cell read back from OUT/cells
    assert json.loads((tmp_path / "r.json").read_text())["cells"] == report["cells"]
    other = argv[: argv.index("--items") + 1] + ["2"] + argv[argv.index("--items") + 2 :]
    assert cli.main(other) == 2  # another item count into the same OUT is refused
    assert "holds cells of another run (different per_task)" in capsys.readouterr().err


def test_the_readers_defaults_reach_the_default_budgets(tmp_path, capsys):
    """Plain `reader` at eval-reader's default budgets (12.8, 17.8) on the default model: the port's recovery
    rank (0: a rank-32 map alone reads 12.5 % here) makes both reachable, so the reader is in the table and
    the plots; a selector that cannot reach a budget is named in a note, with its reason."""
    out = tmp_path / "defaults"
    argv = [
        "eval-reader",
        "--quick",
        "--items",
        "1",
        "--selectors",
        "reader,cats",
        "--rules",
        "topk",
        "--out",
        str(out),
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert cli.main(argv) == 0
    cells = {(c["selector"], c["budget"]): c for c in json.loads((tmp_path / "r.json").read_text())["cells"]}
    for budget in (12.8, 17.8):
        reader = cells["reader", budget]
        assert reader["status"] == "ok" and budget - 0.6 < reader["target_reads"] <= budget
        assert cells["cats", budget]["status"] == "not reachable"
    printed, md = capsys.readouterr().out, (out / "report.md").read_text()
    for text in (printed, md):
        assert "cats at 12.8 %: not reachable, so absent from the plots: budget 12.8% is below its fixed reads" in text
        assert "reader at" not in text  # reachable: no note
    assert "| reader | topk | 12.8 |" in md and "| reader | topk | 17.8 |" in md


def test_the_reader_at_tp(tmp_path, capsys):
    """The per-rank quota reads its plan on every rank and token; the global top-k over the ranks has the
    same total k and reads unevenly; a budget below a rank's floor is not reachable, with that floor; the
    split variant takes the one-rank reader's k over the ranks."""
    out = tmp_path / "tp"
    argv = [
        "eval-reader",
        "--quick",
        "--items",
        "1",
        "--budgets",
        "40",
        "--rules",
        "topk",
        "--out",
        str(out),
        "--selectors",
        "reader-r0,reader-r0-tp2,reader-r0-tp2-global,reader-r0-tp8,reader-r0-tp8-split",
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert cli.main(argv) == 0
    cells = {c["selector"]: c for c in json.loads((tmp_path / "r.json").read_text())["cells"]}
    one, quota, glob = cells["reader-r0"], cells["reader-r0-tp2"], cells["reader-r0-tp2-global"]
    assert quota["max_read_deviation_bytes"] == 0 and 40 - 1 < quota["target_reads"] <= 40
    assert quota["k_per_rank"] == glob["k_per_rank"] == 36 and glob["max_read_deviation_bytes"] > 0
    assert quota["kl_mean"] != glob["kl_mean"] and one["kl_mean"] > 0
    assert cells["reader-r0-tp8"]["status"] == "not reachable"
    assert "per rank at TP 8" in cells["reader-r0-tp8"]["reason"] and "43.23%" in cells["reader-r0-tp8"]["reason"]
    split = cells["reader-r0-tp8-split"]
    assert split["status"] == "ok" and split["k_per_rank"] == 87 // 8 and split["target_reads"] > 43.23
    assert "| reader-r0-tp2 | topk | 40 |" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--selectors", "teal,deja-vu"], "unknown selector 'deja-vu'"),
        (["--selectors", "teal-r4"], "unknown selector 'teal-r4'"),
        (["--rules", "topk,median"], "--rules: expected a comma-separated subset of topk, threshold"),
        (["--budgets", "0,17.8"], r"each budget must be in \(0, 100\] percent"),
        (["--budgets", "150"], r"each budget must be in \(0, 100\] percent"),
        (["--budgets", "a"], "expected comma-separated percentages"),
        (["--corpus", "/nonexistent"], "/nonexistent/eval_text.jsonl: missing; build the corpus first"),
        (["--selectors", "reader-r64"], r"reader-r64: recovery rank 64 above the sidecar's \(32\)"),
        (["--selectors", "reader-tp3"], "reader-tp3: TP degree 3 is not one of"),
        (["--selectors", "teal-tp2"], "unknown selector 'teal-tp2'"),
        (["--selectors", "reader-tp2"], r"is a top-k rule per rank: pass --rules topk"),
    ],
)
def test_bad_input_is_one_error_line(flags, message, tmp_path, capsys):
    assert cli.main(["eval-reader", "--quick", "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err.split("\r")[-1]  # after any progress bar (the reader's sidecar prep)
    assert err.startswith("error: ") or err.split("\n", 1)[1].startswith("error: "), err
    assert err.count("error: ") == 1 and "Traceback" not in err
    assert re.search(message, err), err


def test_the_results_page_is_written_from_the_run_beside_it(tmp_path):
    """bench/results/reader-eval.md is the report writer's page for the report.json and layers.json in
    bench/results/reader-eval/: regenerated, it is byte for byte the committed page, so the page cannot
    describe another run than the one its files hold."""
    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    page = tmp_path / "reader-eval.md"
    assert reader_report.main([str(results / "reader-eval"), str(page)]) == 0
    assert page.read_text() == (results / "reader-eval.md").read_text()
    report = json.loads((results / "reader-eval" / "report.json").read_text())
    assert report["settings"]["weights_sha256"][:16] in page.read_text()
    assert reader_report.main([str(tmp_path / "missing")]) == 2
