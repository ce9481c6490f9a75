"""Reads accounting: bytes per token and layer from first principles (32-byte sectors, bf16, the
sidecar layout), the budget -> k solver, resident memory, and `neuron-moe reads`."""

import json

import pytest

import trained_like
from neuron_moe import cli
from neuron_moe.formats import FORMATS
from neuron_moe.reader.accounting import (
    SECTOR,
    BudgetError,
    breakdown,
    channel_bytes,
    expert_read_bytes,
    full_bytes,
    reads,
    resident,
    row_sectors,
    solve_k,
)
from neuron_moe.reader.geometry import Geometry
from neuron_moe.spec import Reader
from neuron_moe.reader.hadamard import random_signs
from neuron_moe.reader.prep import prep_layer

QWEN3_30B = Geometry(hidden=2048, experts=128, top_k=8, intermediate=768)
GEMMA4_26B = Geometry(hidden=2816, experts=128, top_k=8, intermediate=704)


def test_qwen3_reads_by_hand():
    """Every number derived on paper for hidden 2048, 128 experts, top-8, intermediate 768."""
    full = 8 * 3 * 768 * 2048 * 2  # eight whole experts in bf16
    assert full_bytes(QWEN3_30B) == full == 75_497_472
    parts = reads(QWEN3_30B, Reader().resolved(), k=755)
    # 16 blocks x 80 scanned coordinates x one strip of 1536 base-3 codes (1600 padded rows / 5 = 320 B = 10
    # sectors), + scales [16, 1536] bf16
    assert parts["sketch"] == 8 * (16 * 80 * 320 + 16 * 1536 * 2)
    assert parts["norms"] == 8 * 768 * 2
    assert parts["exact"] == 755 * 3 * 2048 * 2  # gate row + up row + down row
    assert parts["recovery"] == 2048 * 32 * 2 + (6144 - 755) * 32 * 2  # U once, b_j for the unchosen
    assert solve_k(QWEN3_30B, Reader().resolved(), 17.8) == 755


def test_qwen3_at_17_8_percent_reproduces_the_papers_breakdown():
    """5 ternary codes per byte, strips padded to whole sectors: sketch 4.9, exact 12.3, recovery 0.6;
    resident ≈ 7 % sketch, ≈ 0.5 % recovery (80/128 x 1.6/16 x 2/3 = 4.17 % of codes, + scales)."""
    b = breakdown(QWEN3_30B, Reader().resolved(), 17.8)
    share = {name: part["percent"] for name, part in b["reads"].items()}
    assert share["sketch"] == pytest.approx(4.86, abs=0.005)
    assert share["exact"] == pytest.approx(12.29, abs=0.005)
    assert share["recovery"] == pytest.approx(0.63, abs=0.005)
    assert b["total_percent"] <= 17.8
    assert b["k"] == 755
    assert round(b["resident"]["sketch"]["percent"]) == 7
    assert round(b["resident"]["recovery"]["percent"], 1) == 0.5


ODD = Geometry(hidden=200, experts=16, top_k=4, intermediate=40)  # hidden not whole blocks, rows not whole sectors


WHOLE_BLOCKS = Geometry(hidden=128, experts=16, top_k=4, intermediate=64)


@pytest.mark.parametrize("geo", [QWEN3_30B, GEMMA4_26B, ODD, WHOLE_BLOCKS])
@pytest.mark.parametrize(
    "settings",
    [Reader().resolved(), Reader(scan=128, recovery_rank=0).resolved(), Reader(scan=40, recovery_rank=8).resolved()],
)
def test_k_is_the_most_that_fits(geo, settings):
    limit = lambda budget: budget / 100 * full_bytes(geo)  # noqa: E731
    for budget in (15.0, 17.8, 30.0, 60.0, 99.9):
        try:
            k = solve_k(geo, settings, budget)
        except BudgetError:
            assert sum(reads(geo, settings, 0).values()) > limit(budget)
            continue
        assert sum(reads(geo, settings, k).values()) <= limit(budget) < sum(reads(geo, settings, k + 1).values())
    assert solve_k(geo, settings, 100) == geo.channels
    assert sum(reads(geo, settings, geo.channels).values()) == full_bytes(geo)


def test_rows_that_are_not_whole_sectors_cost_one_more():
    assert row_sectors(64) == 2 and row_sectors(400) == 14  # 400 B: 12.5 sectors, may straddle 14
    assert reads(ODD, Reader().resolved(), 1)["exact"] - reads(ODD, Reader().resolved(), 0)["exact"] == 3 * 14 * 32


@pytest.mark.parametrize(
    "budget,message",
    [
        (0, r"budget must be in \(0, 100\]"),
        (-3, r"budget must be in \(0, 100\]"),
        (100.5, r"budget must be in"),
        (
            5.0,
            r"budget 5.0% is below what the reader reads before any exact channel "
            r"\(5.57%: sketch 4.86%, norms 0.02%, recovery 0.69%",
        ),
    ],
)
def test_budgets_out_of_range_are_refused(budget, message):
    with pytest.raises(BudgetError, match=message):
        solve_k(QWEN3_30B, Reader().resolved(), budget)


def test_resident_bytes_are_the_sidecar_tensors():
    """The accounting's resident memory is what prep actually produces, tensor by tensor."""
    ex = trained_like.experts(num_experts=3, inter=40, hidden=200, seed=0)
    out = prep_layer(ex.gate_up_proj, ex.down_proj, random_signs(256, 0), rank=8)
    nbytes = {name: t.numel() * t.element_size() for name, t in out.items()}
    held = resident(Geometry(hidden=200, experts=3, top_k=1, intermediate=40), Reader(recovery_rank=8).resolved())
    assert held == {
        "sketch": nbytes["codes"] + nbytes["scales"],
        "norms": nbytes["down_norms"],
        "recovery": nbytes["basis"] + nbytes["coeffs"],
    }


def test_reads_cli_for_gemma4_and_explicit_geometry(capsys):
    assert cli.main(["reads", "--model", "gemma4-26b-a4b"]) == 0
    printed = capsys.readouterr().out
    assert "gemma4-26b-a4b (hidden 2816, 128 experts, top-8, intermediate 704)" in printed
    assert "k = 703 exact channels of 5632" in printed and "resident" in printed
    args = ["reads", "--hidden", "2048", "--experts", "128", "--top-k", "8", "--intermediate", "768", "--json", "-"]
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["k"] == 755 and report["geometry"]["hidden"] == 2048
    assert cli.main(args[:-2] + ["--scan", "128", "--recovery-rank", "0", "--json", "-"]) == 0
    full_scan = json.loads(capsys.readouterr().out)
    assert full_scan["reads"]["recovery"]["bytes"] == 0
    assert full_scan["reads"]["sketch"]["bytes"] == 8 * (16 * 128 * 320 + 16 * 1536 * 2)  # every strip


def test_each_format_is_charged_its_tensors_by_hand():
    """Gemma-4 26B's expert (gate_up [1408, 2816], down [2816, 704]) read whole and one exact channel
    (three rows of 2816), in each format: bf16; int8 with an fp32 scale per output channel (and the
    one-rank reader's scale pair); int4 packed two a byte with a bf16 scale per 32 inputs, every
    tensor here a whole number of sectors but int4's channel row (1584 bytes: 49.5 sectors, 51)."""
    assert expert_read_bytes(GEMMA4_26B, "none") == 3 * 704 * 2816 * 2
    assert expert_read_bytes(GEMMA4_26B, "int8") == 3 * 704 * 2816 + (1408 + 2816) * 4
    assert expert_read_bytes(GEMMA4_26B, "int4") == 3 * 704 * 2816 // 2 + (1408 * 88 + 2816 * 22) * 2
    assert channel_bytes(GEMMA4_26B, "none") == 3 * 2816 * 2
    assert channel_bytes(GEMMA4_26B, "int8") == 3 * 2816 + SECTOR
    assert channel_bytes(GEMMA4_26B, "int4") == 3 * 51 * SECTOR


@pytest.mark.parametrize("quantization", list(FORMATS))
def test_a_whole_expert_is_its_formats_bytes_to_the_sector(quantization):
    """Every registered format, asked for its bytes: an expert read whole costs the format's bytes of
    gate_up and down (`Format.nbytes`), each of its tensors rounded up to whole sectors (one more
    where a tensor need not start on a boundary), and the full read is top_k of them."""
    fmt, H, inter = FORMATS[quantization], GEMMA4_26B.hidden, GEMMA4_26B.intermediate
    whole = expert_read_bytes(GEMMA4_26B, quantization)
    assert 0 <= whole - fmt.nbytes((2 * inter, H)) - fmt.nbytes((H, inter)) < 2 * len(fmt.tensors) * 2 * SECTOR
    settings = Reader(quantization=quantization).resolved()
    assert breakdown(GEMMA4_26B, settings, 100)["full_bytes"] == 8 * whole


def test_reads_names_a_formats_bits_a_weight(capsys):
    args = ["reads", "--model", "gemma4-26b-a4b", "--quantization", "int4", "--budget", "25"]
    assert cli.main(args) == 0
    assert "int4 exact rows at 4.50 bits a weight, scales beside them (accounted only)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--hidden", "2048"], "needs all four of --hidden --experts --top-k --intermediate"),
        (
            ["--hidden", "2048", "--experts", "4", "--top-k", "8", "--intermediate", "64"],
            "--top-k 8 is more than --experts 4",
        ),
        (["--tp", "2", "--quantization", "int4"], "one token a step (not with --quantization int4)"),
        (["--tp", "2", "--quantization", "int8"], "one token a step (not with --quantization int8)"),
        (["--tp", "2", "--batch-size", "4"], "one token a step (not with --batch-size)"),
    ],
)
def test_reads_cli_errors(capsys, args, message):
    assert cli.main(["reads", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--budget", "0"], "argument --budget: must be in (0, 100], got 0"),
        (["--budget", "nan"], "argument --budget: must be a finite number, got nan"),
        (["--scan", "129"], "argument --scan: must be in [1, 128], got 129"),
        (["--recovery-rank", "-1"], "argument --recovery-rank: must be in [0, 262144], got -1"),
        (["--batch-size", "4", "--step-budget", "nan"], "argument --step-budget: must be a finite number, got nan"),
        (["--batch-size", "4", "--step-budget", "0"], "argument --step-budget: must be more than 0, got 0"),
        (["--batch-size", "4", "--step-budget", "-2"], "argument --step-budget: must be more than 0, got -2"),
    ],
)
def test_reads_numbers_out_of_range_are_argument_errors(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["reads", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
