"""The reader over int8 experts: exact rows read as int8 with their scales (reader/int8.py), the
accounting in the int8 byte layout, SEQ_MATCH at budget 100 against one-rank `int8`, and the
sidecar made from the bf16 weights or from the dequantised int8."""

import json

import pytest
import torch

from neuron_moe import cli
from neuron_moe.errors import UserError
from neuron_moe.eval.seq_match import DEFAULT_PROMPTS, compare
from neuron_moe.experts.channel_reader import attach_reader
from neuron_moe.experts.int8 import int8_experts, int8_forward
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.reader import accounting as A
from neuron_moe.reader import reference
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.hadamard import random_signs
from neuron_moe.reader.prep import model_expert_weights, prep_layer, write_sidecar
from neuron_moe.reader.sidecar import LayerSidecar, SidecarError
from neuron_moe.tokenizer import load_tokenizer

from conftest import reseeded

QWEN3_30B = Geometry(hidden=2048, experts=128, top_k=8, intermediate=768)
GEMMA4_26B = Geometry(hidden=2816, experts=128, top_k=8, intermediate=704)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader-int8") / "tiny.safetensors"
    assert cli.main(["prep-reader", "--out", str(path)]) == 0
    return path


def test_int8_reads_by_hand():
    """Qwen3-30B-A3B: a channel is three int8 rows of 2048 B and its 8-byte scale pair (one sector);
    an expert whole is its int8 gate_up and down and their fp32 scales; each routed expert's down
    scale (2048 fp32) is read whatever is chosen."""
    settings = A.Reader(quantization="int8").resolved()
    assert A.channel_bytes(QWEN3_30B, "int8") == 3 * 2048 + 32
    assert A.expert_read_bytes(QWEN3_30B, "int8") == 2 * 768 * 2048 + 768 * 2048 + 2 * 768 * 4 + 2048 * 4
    parts = A.reads(QWEN3_30B, settings, k=300)
    bf16 = A.reads(QWEN3_30B, A.Reader().resolved(), k=300)
    assert parts["sketch"] == bf16["sketch"] and parts["norms"] == bf16["norms"]  # the sidecar is bf16 either way
    assert parts["recovery"] == bf16["recovery"]
    assert parts["exact"] == 300 * (3 * 2048 + 32) + 8 * 2048 * 4
    assert A.reads(QWEN3_30B, settings, QWEN3_30B.channels) == {
        "sketch": 0,
        "norms": 0,
        "recovery": 0,
        "exact": 8 * A.expert_read_bytes(QWEN3_30B, "int8"),
    }


@pytest.mark.parametrize("geo", [QWEN3_30B, GEMMA4_26B])
def test_int8_at_17_8_percent_the_sketch_is_twice_its_bf16_share(geo):
    """The same sketch against half the full read: ≈ 9.5-9.7 % of the int8 experts' read (4.8-4.9 % of
    bf16's), so 17.8 % buys about half the exact bytes, ~1.1x the channels of bf16's 12.3 %."""
    b8, b16 = (
        A.breakdown(geo, A.Reader(quantization="int8").resolved(), 17.8),
        A.breakdown(geo, A.Reader().resolved(), 17.8),
    )
    assert b8["reads"]["sketch"]["percent"] == pytest.approx(2 * b16["reads"]["sketch"]["percent"], rel=0.01)
    assert b8["total_percent"] <= 17.8 and b8["full_bytes"] == geo.top_k * A.expert_read_bytes(geo, "int8")
    k = A.solve_k(geo, A.Reader(quantization="int8").resolved(), 17.8)
    assert (
        sum(A.reads(geo, A.Reader(quantization="int8").resolved(), k).values())
        <= 0.178 * b8["full_bytes"]
        < sum(A.reads(geo, A.Reader(quantization="int8").resolved(), k + 1).values())
    )
    # equal bytes: the bf16 reader's 17.8 % buys the int8 reader nearly twice the channels
    equal = A.solve_k(geo, A.Reader(quantization="int8").resolved(), 17.8, full=A.full_bytes(geo))
    assert 1.8 * b16["k"] < equal < 2.1 * b16["k"]


@torch.no_grad()
def test_the_int8_reader_at_every_channel_is_the_int8_experts(tiny_port):
    """reference.forward with int8 rows, every channel exact: `int8_forward`'s output up to where
    each dequantises (the row vs after the matmul)."""
    experts = build_model(tiny_port).model.layers[1].experts
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 128, generator=gen)
    index = torch.rand(12, 16, generator=gen).argsort(-1)[:, :4]
    weights = torch.softmax(torch.randn(12, 4, generator=gen), -1)
    want = int8_forward(experts, x, index, weights)
    signs = random_signs(128, 0)
    side = LayerSidecar.from_tensors(prep_layer(experts.gate_up_proj.data, experts.down_proj.data, signs), signs)
    got = reference.forward(
        x,
        index,
        weights,
        experts.gate_up_proj,
        experts.down_proj.mT,
        side,
        k=256,
        scan=80,
        rank=32,
        act_fn=experts.act_fn,
        int8=int8_experts(experts),
    )
    assert float((got - want).abs().max() / want.abs().max()) < 2e-6
    bf16 = reference.forward(
        x,
        index,
        weights,
        experts.gate_up_proj,
        experts.down_proj.mT,
        side,
        k=256,
        scan=80,
        rank=32,
        act_fn=experts.act_fn,
    )
    assert float((bf16 - want).abs().max() / want.abs().max()) > 1e-4  # teeth: the int8 numbers, not the weights


def generate(model, tokenizer, n=24):
    ids, mask = left_pad([tokenizer.encode(p) for p in DEFAULT_PROMPTS], tokenizer.pad_token_id)
    return greedy(model, ids, mask, n)


def test_seq_match_at_budget_100_against_one_rank_int8(tiny_port, sidecar):
    tokenizer = load_tokenizer(tiny_port, None)
    want = generate(build_model(tiny_port, "dense_masked", quantization="int8"), tokenizer)
    model = build_model(tiny_port)
    assert attach_reader(model, sidecar, budget=100, quantization="int8") == 4 * 64
    rows = compare(want, generate(model, tokenizer), list(DEFAULT_PROMPTS))
    assert all(r["seq_match"] for r in rows), rows
    # int8 on both sides, summed in another order (measured 1e-5 on logits up to ~25)
    assert all(r["max_abs_dlogit_step0"] == 0 and r["min_cosine"] > 0.99999 for r in rows), rows
    sparse = build_model(tiny_port)
    attach_reader(sparse, sidecar, budget=60, rank=0, quantization="int8")
    assert not all(
        r["seq_match"] and r["min_cosine"] > 0.99999
        for r in compare(want, generate(sparse, tokenizer), list(DEFAULT_PROMPTS))
    )  # teeth


def test_validate_reader_int8_cli(sidecar, capsys):
    args = [
        "validate",
        "--backend",
        "reader",
        "--quantization",
        "int8",
        "--budget",
        "100",
        "--sidecar",
        str(sidecar),
        "--max-new-tokens",
        "8",
        "--json",
        "-",
    ]
    assert cli.main(args) == 0  # against HF eager fp32: int8 at 100 % keeps the greedy tokens
    report = json.loads(capsys.readouterr().out)
    assert report["all_match"] and report["backend_options"]["quantization"] == "int8"
    assert cli.main(["validate", "--backend", "eager", "--quantization", "int8", "--budget", "60"]) == 2
    assert "--budget apply to --backend reader only" in capsys.readouterr().err


def test_a_sidecar_of_the_dequantised_int8_is_accepted_for_int8_only(tiny_port, sidecar, tmp_path):
    model = build_model(tiny_port)
    dq = write_sidecar(
        tmp_path / "dq.safetensors",
        [int8_experts(layer.experts).dequantized() for layer in model.model.layers],
        Geometry(hidden=128, experts=16, intermediate=64),
        layers=4,
        progress=False,
    )
    assert dq.read_bytes() != sidecar.read_bytes()
    attach_reader(build_model(tiny_port), dq, budget=60, rank=0, quantization="int8")
    with pytest.raises(SidecarError, match="made from other expert weights"):
        attach_reader(build_model(tiny_port), dq, budget=60, rank=0)  # bf16 reads the weights themselves
    with pytest.raises(SidecarError, match="made from other expert weights"):
        attach_reader(build_model(reseeded(tiny_port, 99)), sidecar, budget=60, quantization="int8")
    with pytest.raises(UserError, match="int8 experts runs on the reference kernel only"):
        attach_reader(build_model(tiny_port), sidecar, budget=60, quantization="int8", kernel="triton")
    assert sum(1 for _ in model_expert_weights(model)) == 4


def test_reads_cli_int8(capsys):
    assert cli.main(["reads", "--model", "gemma4-26b-a4b", "--quantization", "int8", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quantization"] == "int8" and report["total_percent"] <= 17.8
    assert report["percent_of_bf16_full"] == pytest.approx(
        17.8 * report["full_bytes"] / A.full_bytes(GEMMA4_26B), abs=0.01
    )
    assert report["reads"]["sketch"]["percent"] == pytest.approx(9.54, abs=0.01)


def test_eval_reader_int8_selectors(tiny_port, sidecar):
    """eval-reader's `reader[-rN]-int8[dq]`: budgets stay a share of the bf16 read (equal bytes); at
    the int8 experts' whole read the selector is the int8 experts."""
    from neuron_moe.experts.selector_experts import moe_layers
    from neuron_moe.reader import selectors as S
    from neuron_moe.reader.sidecar import Sidecar

    from neuron_moe.spec import SelectorSpec, SpecError, parse_selector

    assert parse_selector("reader-r16-int8dq", S.SELECTORS) == SelectorSpec(
        "reader-r16-int8dq", "reader", 16, quantization="int8", dequantised=True
    )
    assert parse_selector("reader-int8", S.SELECTORS) == SelectorSpec("reader-int8", "reader", quantization="int8")
    assert parse_selector("teal", S.SELECTORS) == SelectorSpec("teal", "teal")
    for bad in ("teal-int8", "reader-int4", "reader-r-int8", "oracle-r3"):
        with pytest.raises(SpecError, match="unknown selector"):
            parse_selector(bad, S.SELECTORS)
    with pytest.raises(SpecError, match="runs at one rank"):
        parse_selector("reader-tp2-int8", S.SELECTORS)
    model = build_model(tiny_port)
    layer = moe_layers(model, Sidecar(sidecar), 0, int8=True)[1]
    bf16 = moe_layers(model, Sidecar(sidecar), 0)[1]
    geo, settings = layer.geo, layer.settings
    whole = 100 * A.full_reads(geo, settings) / A.full_bytes(geo)  # 52.08 % on this geometry
    assert S.plan("reader", geo, settings, whole)["channel"] == geo.channels
    assert S.plan("reader", geo, settings, whole - 0.1)["channel"] < geo.channels
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(10, 128, generator=gen)
    index = torch.rand(10, 16, generator=gen).argsort(-1)[:, :4]
    weights = torch.softmax(torch.randn(10, 4, generator=gen), -1)
    got = S.run("reader", layer, x, index, weights, S.top_k("reader", layer, whole))
    with torch.no_grad():
        want = int8_forward(model.model.layers[1].experts, x, index, weights)
    assert float((got.out - want).abs().max() / want.abs().max()) < 2e-6
    assert torch.all(got.reads == A.full_reads(geo, settings))
    # equal bytes at 17.8 %: int8 rows buy the reader ~1.7x the channels on this geometry (30 -> 51)
    k8, k16 = S.plan("reader", geo, settings, 17.8)["channel"], S.plan("reader", geo, bf16.settings, 17.8)["channel"]
    assert 1.5 * k16 < k8 < 2 * k16
    assert S.charged("reader", geo, settings, {"channel": k8}) <= 0.178 * A.full_bytes(geo)
