"""The inf2 memory planner's counts: the expert layout's bytes as whole experts per rank hold them, and info.py's."""

import json

import pytest
import torch

from neuron_moe import cli, spec
from neuron_moe.formats import FORMATS
from neuron_moe.errors import UserError
from neuron_moe.formats.int4 import DEFAULT_GROUP, SCALE_BYTES
from neuron_moe.info import parameter_counts
from neuron_moe.neuron.plan import (
    CHIP_HBM_BW,
    COMPILE_ANCHOR_GRAPH_BYTES,
    COMPILE_HOST_MULTIPLE,
    CORE_HBM,
    GB,
    HOST_GRAPHS_RESERVE,
    HOST_LOAD_COPIES,
    HOST_PROCESS_RESERVE,
    INSTANCES,
    SHAPE_STEP,
    GiB,
    plan,
    port_plan,
    render_plan,
)
from neuron_moe.parallel import cpu
from neuron_moe.parallel.model import rank_model
from neuron_moe.port import load_port
from neuron_moe.run_config import RunConfig
from neuron_moe.spec import LAYER_GROUPS, Reader

from conftest import port_text_elsewhere


WEIGHT_GROUPS = ("embeddings", "norms_and_scalars", "attention", "dense_mlp", "router", "experts", "lm_head")


@pytest.fixture(scope="module")
def big():
    return load_port("gemma4-26b-a4b").config


def test_bf16_at_tp8_fits_inf2_24xlarge(big):
    r = plan(big, "inf2.24xlarge", 8, "none", batch=1, seq=4096)
    assert r["fits"], r["reason"]
    assert abs(r["experts_all_ranks_bytes"] / GB - 45.68) < 0.01  # ≈45.7 GB of bf16 experts
    assert r["per_rank_bytes"]["experts"] * 8 == r["experts_all_ranks_bytes"]


def test_int8_at_tp2_does_not_fit_inf2_8xlarge_once_lm_head_graph_and_runtime_count(big):
    r = plan(big, "inf2.8xlarge", 2, "int8", batch=1, seq=4096)
    per_rank = r["per_rank_bytes"]
    assert 11.4 <= per_rank["experts"] / GB < 11.5  # ≈11.4 GB of experts on each rank
    # ≈22.9 GB in all: the channel layout's down scales, [E, 1, H] per layer (43 MB), are on both ranks
    assert 22.9 <= r["experts_all_ranks_bytes"] / GB < 23.0
    whole = plan(big, "inf2.8xlarge", 2, "int8", batch=1, seq=4096, expert_layout="expert")
    assert 22.8 <= whole["experts_all_ranks_bytes"] / GB < 22.9  # bf16 experts ≈22.8 GB: down scales [H]
    assert r["experts_all_ranks_bytes"] - whole["experts_all_ranks_bytes"] == 2 * 30 * (128 - 1) * 2816 * 4
    assert not whole["fits"]
    assert not r["fits"] and "exceeds a NeuronCore's 17.18 GB (16 GiB)" in r["reason"]
    assert r["per_rank_total_bytes"] > CORE_HBM
    uncounted = r["per_rank_total_bytes"] - per_rank["lm_head"] - per_rank["graph"] - per_rank["runtime"]
    assert uncounted < CORE_HBM  # it is those that tip it over
    assert per_rank["lm_head"] == per_rank["embeddings"] - 4  # the same 1/t of the vocab (+ an int32 rank)


def test_per_rank_bytes_add_up_to_info_counts(big):
    counts = parameter_counts(big)
    r = plan(big, "inf2.48xlarge", 1, "none", batch=1, seq=128)
    w = r["per_rank_bytes"]
    weights = sum(v for k, v in w.items() if k not in ("lm_head", "kv_cache", "graph", "runtime"))
    spmd_ranks = 4  # the embedding's int32 SPMDRank (the channel layout's MoE blocks have none)
    layer_scalars = 2 * big.num_hidden_layers  # a buffer, not a parameter: info does not count it
    assert weights - spmd_ranks - layer_scalars == counts["bytes"]["bfloat16"]  # info counts tied lm_head once
    for tp in (2, 4, 8):  # split groups shrink by exactly t
        wt = plan(big, "inf2.48xlarge", tp, "none", batch=1, seq=128)["per_rank_bytes"]
        assert wt["experts"] * tp == w["experts"] and wt["dense_mlp"] * tp == w["dense_mlp"]
        assert wt["router"] == w["router"]  # replicated


def test_kv_cache_and_decode_floor_on_the_tiny_port(tiny_port):
    r = plan(tiny_port.config, "inf2.24xlarge", 8, "none", batch=2, seq=64)
    # sliding layers 0, 2: window 16, 4 KV heads -> 1 per rank, head_dim 32; global 1, 3: 64, 2 -> 1 (replicated), 64
    assert r["per_rank_bytes"]["kv_cache"] == 2 * (2 * 2 * 16 * 1 * 32 * 2) + 2 * (2 * 2 * 64 * 1 * 64 * 2)
    # prefix caching's whole-row layout: the sliding layers hold all 64 positions too
    r = plan(tiny_port.config, "inf2.24xlarge", 8, "none", batch=2, seq=64, prefix_caching=True)
    assert r["per_rank_bytes"]["kv_cache"] == 2 * (2 * 2 * 64 * 1 * 32 * 2) + 2 * (2 * 2 * 64 * 1 * 64 * 2)
    # TP 2, batch 1: the channel layout's decode graph gathers 4 experts' 32 of 64 channels; the
    # expert layout's computes its 8 experts whole
    r = plan(tiny_port.config, "inf2.24xlarge", 2, "none", batch=1, seq=64)
    channel, whole = r["decode"]
    assert (channel["expert_layout"], channel["this_plan"], whole["expert_layout"]) == ("channel", True, "expert")
    expert = 3 * 64 * 128 * 2 * 4  # one expert's bf16 bytes, times 4 layers
    rank_scalar = 4 * 4  # the expert layout's int32 SPMDRank in each of 4 MoE blocks
    assert whole["bytes_per_token"] - channel["bytes_per_token"] == 8 * expert - 4 * expert / 2 + rank_scalar
    assert channel["decode_graph"] == "gathers 1×4 experts' 32 of 64 channels per layer"
    assert whole["floor_ms"] == pytest.approx(1e3 * whole["bytes_per_token"] / (CHIP_HBM_BW / 2))
    # batch 4: 4 × top-4 = 16 = E, so the channel decode graph computes all experts (NxD's rule)
    channel4 = plan(tiny_port.config, "inf2.24xlarge", 2, "none", batch=4, seq=64)["decode"][0]
    assert channel4["decode_graph"] == "all 16 experts' 32 of 64 channels per layer"
    assert (
        channel4["bytes_per_token"]
        - plan(tiny_port.config, "inf2.24xlarge", 2, "none", batch=4, seq=64, expert_layout="expert")["decode"][0][
            "bytes_per_token"
        ]
        == -rank_scalar
    )


def test_full_size_decode_table_is_what_the_built_graphs_read(big):
    """TP 8, batch 1: the channel layout's decode graph gathers 8 experts × 88 of 704 channels
    (1.06 GB/token/rank, a 2.40 ms floor); the expert layout's reads all 16 of its experts."""
    r = plan(big, "inf2.24xlarge", 8, "none", batch=1, seq=4096)
    channel, whole = r["decode"]
    assert channel["decode_graph"] == "gathers 1×8 experts' 88 of 704 channels per layer" and channel["this_plan"]
    assert channel["GB_per_token"] == pytest.approx(1.055, abs=5e-4) and round(channel["floor_ms"], 2) == 2.40
    assert whole["decode_graph"] == "all 16 of its experts, whole, per layer"
    assert whole["GB_per_token"] == pytest.approx(6.407, abs=5e-4) and round(whole["floor_ms"], 2) == 14.55
    # the experts' share of the difference: 30 layers × (16 whole experts - 8 slices of 1/8) in bf16
    assert whole["bytes_per_token"] - channel["bytes_per_token"] == pytest.approx(
        30 * (16 - 1) * 3 * 704 * 2816 * 2 + 4 * 30, rel=1e-12
    )
    # int8: the channel layout's per-(expert, hidden) down scales are gathered with the weights
    r8 = plan(big, "inf2.24xlarge", 8, "int8", batch=1, seq=4096)
    slice8 = 3 * 88 * 2816 + 4 * (2 * 88 + 2816)  # one expert's int8 slice on one rank, with its scales
    assert r8["per_rank_bytes"]["experts"] == 30 * 128 * slice8
    assert r8["decode"][0]["bytes_per_token"] == pytest.approx(
        r["decode"][0]["bytes_per_token"] - 30 * 8 * 3 * 88 * 2816 * 2 + 30 * 8 * slice8, rel=1e-12
    )


def test_full_size_decode_with_the_reader(big, capsys):
    """TP 8, batch 1, the reader at 17.8 %: each rank reads its sketch, norms, 55 exact channels and
    recovery of its 8 experts' 88 channels per layer (`neuron-moe reads --tp 8`): 17.8 % of the selective
    row's expert bytes, so 0.761 GB/token/rank and a 1.73 ms floor against 1.055 and 2.40; each rank
    holds its sidecar shard (0.75 GB)."""
    from neuron_moe.reader.accounting import rank_geometry, reads
    from neuron_moe.reader.geometry import Geometry

    reader = Reader(budget=17.8, scan=80, recovery_rank=32)
    r = plan(big, "inf2.24xlarge", 8, "none", batch=1, seq=4096, reader=reader)
    channel, with_reader, _ = r["decode"]
    assert not channel["this_plan"] and with_reader["this_plan"] and with_reader["reader"]["k_per_rank"] == 55
    per_layer = sum(reads(rank_geometry(Geometry.from_config(big), 8), Reader().resolved(), 55).values())
    assert per_layer <= 0.178 * 8 * 3 * 88 * 2816 * 2
    assert channel["bytes_per_token"] - with_reader["bytes_per_token"] == pytest.approx(
        30 * (8 * 3 * 88 * 2816 * 2 - per_layer), rel=1e-12
    )
    assert round(with_reader["GB_per_token"], 3) == 0.761 and round(with_reader["floor_ms"], 2) == 1.73
    assert round(r["per_rank_bytes"]["reader_sidecar"] / GB, 2) == 0.75 and r["fits"]
    assert (
        cli.main(
            [
                "plan",
                "--model",
                "gemma4-26b-a4b",
                "--instance",
                "inf2.24xlarge",
                "--tp",
                "8",
                "--reader",
                "--budget",
                "17.8",
            ]
        )
        == 0
    )
    assert "channel + reader (this plan)" in capsys.readouterr().out
    with pytest.raises(Exception, match="the reader runs in the channel expert layout's bf16 graphs"):
        plan(big, "inf2.24xlarge", 8, "int8", batch=1, seq=4096, reader=reader)


def test_no_kv_bytes_cross_the_host_per_decode_step(big):
    r = plan(big, "inf2.24xlarge", 8, "none", batch=4, seq=4096)
    rows = {row["what"].split(" [")[0].split(" (")[0]: row for row in r["host_per_step"]}
    assert rows["KV cache"]["bytes"] == 0
    assert rows["input_ids + position_ids"]["bytes"] == 2 * 4 * 8 and rows["token"]["bytes"] == 4 * 8
    assert rows["sampling"]["bytes"] == 4 * 4 * 4  # the graphs choose the token: no logits for sampled requests
    assert rows["logits"]["bytes"] == 4 * 262144 * 4 and "--with-logits" in rows["logits"]["what"]
    every = [row for row in r["host_per_step"] if row["when"] == "every step"]
    assert (
        sum(row["bytes"] for row in every if row["direction"] == "in") == 2 * 4 * 8 + 4 * 4 * 4
    )  # a row that asks nothing
    # the logits-processing decode's own, only in a step where some row asks
    assert rows["process"]["bytes"] == 4 * 7 * 4 and rows["logit_bias and bans"]["bytes"] == 4 * 64 * 12
    assert rows["grammar bitmask"]["bytes"] == 4 * (262144 // 32) * 4  # 32 KiB a row
    assert rows["logprob"]["bytes"] == 4 * (4 + 8 + 20 * 12) and rows["token counts"]["bytes"] == 0
    assert {row["when"] for row in r["host_per_step"]} == {"every step", "a row asks"}


def test_tp_beyond_the_instance_or_the_model_is_refused_with_a_reason(big):
    r = plan(big, "inf2.xlarge", 8, "none", batch=1, seq=4096)
    assert not r["fits"] and r["reason"] == "inf2.xlarge has 2 NeuronCores; TP 8 needs 8"
    r = plan(big, "inf2.48xlarge", 24, "none", batch=1, seq=4096)
    assert not r["fits"] and r["reason"].startswith(
        "not shardable: TP 24 (channel expert layout): 16 attention "
        "heads do not split over 24 ranks; 704 expert intermediate channels"
    )


@pytest.mark.parametrize(
    "field,value,refused,message",
    [
        ("moe_intermediate_size", 60, "channel", "60 expert intermediate channels do not split over 8 ranks"),
        ("num_experts", 12, "expert", "12 experts do not split over 8 ranks"),
    ],
)
def test_a_degree_that_does_not_split_what_the_layout_splits_is_refused(
    tiny_port, tmp_path, capsys, field, value, refused, message
):
    """The channel layout splits each expert's I channels, the expert layout the E experts: a TP
    degree dividing one but not the other is refused by that layout only, naming both numbers."""
    text = port_text_elsewhere(tiny_port).replace(f"{field} = {getattr(tiny_port.config, field)}", f"{field} = {value}")
    (tmp_path / "p.toml").write_text(text)
    args = ["plan", "--model", str(tmp_path / "p.toml"), "--instance", "inf2.24xlarge", "--tp", "8"]
    other = next(n for n in ("channel", "expert") if n != refused)
    assert cli.main([*args, "--expert-layout", refused]) == 1
    assert f"DOES NOT FIT: not shardable: TP 8 ({refused} expert layout): {message}" in capsys.readouterr().out
    assert cli.main([*args, "--expert-layout", other]) == 0
    assert "FITS:" in capsys.readouterr().out
    # no decode row for a graph that cannot be built at this degree
    config = load_port(str(tmp_path / "p.toml")).config
    rows = plan(config, "inf2.24xlarge", 8, "none", batch=1, seq=64, expert_layout=other)["decode"]
    assert [r["expert_layout"] for r in rows] == [other]


def test_plan_cli(capsys):
    args = ["plan", "--model", "gemma4-26b-a4b", "--instance", "inf2.24xlarge", "--tp", "8"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "FITS:" in out and "HBM floor ms/token" in out and "lm_head" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("channel ", "expert  "))]
    assert rows[0][:3] == ["channel", "(this", "plan)"] and rows[0][-3:] == ["1.055", "2.40", "417.4"]
    assert rows[1][0] == "expert" and rows[1][-3:] == ["6.407", "14.55", "68.7"]
    assert "KV cache (device state, aliased)" in out and "host <-> device per decode step" in out
    assert cli.main(args + ["--expert-layout", "expert"]) == 0
    assert "expert (this plan)" in capsys.readouterr().out
    assert (
        cli.main(
            [
                "plan",
                "--model",
                "gemma4-26b-a4b",
                "--instance",
                "inf2.8xlarge",
                "--tp",
                "2",
                "--quantization",
                "int8",
                "--json",
                "-",
            ]
        )
        == 1
    )
    assert json.loads(capsys.readouterr().out)["fits"] is False
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--instance", "inf2.8xlarge", "--tp", "3"])
    assert e.value.code == 2 and "invalid choice: 3" in capsys.readouterr().err


ONE_CHIP = ("inf2.xlarge", "inf2.8xlarge")


@pytest.mark.parametrize("instance", ONE_CHIP)
def test_int4_experts_fit_one_chip_at_tp2_and_bf16_int8_do_not(big, instance):
    """int4 experts (two values a byte, a bf16 scale per DEFAULT_GROUP inputs) at TP 2: the experts' bytes
    are the geometry's, the verdict and margin follow from the rows, and nothing but the experts moved
    against int8 (the graph row aside: its dequantised layer)."""
    r = plan(big, instance, 2, "int4", batch=1, seq=4096)
    L, E, inter, H = big.num_hidden_layers, big.num_experts, big.moe_intermediate_size, big.hidden_size
    weights = L * E * 3 * inter * H // 2  # one rank's expert weights: [E, H, 2I/2] and [E, I/2, H] per layer
    assert r["per_rank_bytes"]["experts"] == weights // 2 + weights // DEFAULT_GROUP * SCALE_BYTES
    assert r["fits"], r["reason"]
    assert r["per_rank_total_bytes"] == sum(r["per_rank_bytes"].values()) < CORE_HBM
    assert r["margin_per_core_bytes"] == CORE_HBM - r["per_rank_total_bytes"]
    assert f"{r['margin_per_core_bytes'] / GB:.2f} GB spare per core" in r["reason"]
    int8 = plan(big, instance, 2, "int8", batch=1, seq=4096)
    moved = {k for k in r["per_rank_bytes"] if r["per_rank_bytes"][k] != int8["per_rank_bytes"][k]}
    assert moved == {"experts", "graph"}
    for quantization in ("none", "int8"):
        other = plan(big, instance, 2, quantization, batch=1, seq=4096)
        assert not other["fits"] and other["per_rank_total_bytes"] > CORE_HBM
    # every saving counted is named: the experts' format, the vocabulary split of embeddings and lm_head
    bf16 = plan(big, instance, 2, "none", batch=1, seq=4096)["per_rank_bytes"]
    experts, vocab = r["savings"]
    assert "int4 experts" in experts["what"] and experts["saved_bytes"] == bf16["experts"] - weights // 2 - (
        weights // DEFAULT_GROUP * SCALE_BYTES
    )
    assert "sharded over the vocabulary" in vocab["what"]
    assert vocab["saved_bytes"] == r["per_rank_bytes"]["embeddings"] + r["per_rank_bytes"]["lm_head"]
    assert r["per_rank_bytes"]["lm_head"] == big.vocab_size // 2 * H * 2  # 1/2 of the rows, bf16


def test_the_largest_shapes_are_the_edge_of_the_fit(big):
    """Each row of the largest batch × context table fits, and one step more context does not."""
    r = plan(big, "inf2.xlarge", 2, "int4", batch=1, seq=4096)
    shapes = {row["batch"]: row["context"] for row in r["largest_shapes"]}
    assert shapes[1] > 4096 and list(shapes) == sorted(shapes)
    assert all(shapes[b] >= shapes[b2] for b, b2 in zip(shapes, list(shapes)[1:]))  # more rows, less context
    for batch in (1, 8):
        edge = shapes[batch]
        assert plan(big, "inf2.xlarge", 2, "int4", batch=batch, seq=edge)["fits"]
        assert not plan(big, "inf2.xlarge", 2, "int4", batch=batch, seq=edge + SHAPE_STEP)["fits"]


@pytest.mark.parametrize("instance", ONE_CHIP)
def test_the_host_peak_is_one_load_group_not_the_model(big, instance):
    """Host memory to load and serve: the stated reserves and HOST_LOAD_COPIES × the largest load
    group of one rank (the vocabulary half of the embeddings at TP 2), within the instance's host."""
    host = plan(big, instance, 2, "int4", batch=1, seq=4096)["host"]
    embeddings = big.vocab_size // 2 * big.hidden_size * 2
    assert host["largest_load_group_bytes"] == embeddings
    assert host["peak_bytes"] == HOST_PROCESS_RESERVE + HOST_GRAPHS_RESERVE + HOST_LOAD_COPIES * embeddings
    assert host["fits"] and host["margin_bytes"] == INSTANCES[instance].host_memory - host["peak_bytes"] > 0
    assert host["whole_shards_peak_bytes"] > 16 * GiB  # both ranks' shards whole would not fit inf2.xlarge


def test_one_chip_int4_plan_cli(capsys):
    args = ["plan", "--model", "gemma4-26b-a4b", "--instance", "inf2.xlarge", "--tp", "2", "--quantization", "int4"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("FITS: ") and "GB spare per core" in out and "GiB spare" in out
    assert out.startswith("gemma4-26b-a4b on inf2.xlarge: TP 2, int4 experts, the rest bf16, the channel expert layout")
    for named in ("int4 experts (4.50 bits a weight", "embeddings and lm_head sharded over the vocabulary", "peak"):
        assert named in out
    assert "HBM-bound floor per token" in out and "longest context that fits" in out
    assert "largest batch × context that fits: " in out
    assert cli.main(args[:-1] + ["int8"]) == 1 and "DOES NOT FIT" in capsys.readouterr().out


def test_the_compile_host_estimate_is_stated_per_key_and_anchored_on_its_one_report(capsys):
    """neuronx-cc's host memory per key: COMPILE_HOST_MULTIPLE × (a rank's weights + the key's largest
    activation), the multiple the least that puts Gemma-4 31B's 16384-token key at TP 16 over 128 GiB
    (NxDI PR #106); the port's plain keys, the largest the longest bucket's prefill, and whether the
    instance holds it, beside (not in) the plan's verdict."""
    assert (
        COMPILE_HOST_MULTIPLE * COMPILE_ANCHOR_GRAPH_BYTES
        > 128 * GiB
        >= (COMPILE_HOST_MULTIPLE - 1) * (COMPILE_ANCHOR_GRAPH_BYTES)
    )
    args = ["plan", "--model", "gemma4-26b-a4b", "--instance", "inf2.xlarge", "--tp", "2", "--quantization", "int4"]
    assert cli.main([*args, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    compile_host, weights = report["compile_host"], sum(report["per_rank_bytes"][g] for g in WEIGHT_GROUPS)
    assert [k["key"] for k in compile_host["keys"]] == [f"context_encoding_1x{b}" for b in (128, 512, 2048)] + [
        "token_generation"
    ]
    for key in compile_host["keys"]:
        assert key["graph_bytes"] > weights and key["estimate_bytes"] == COMPILE_HOST_MULTIPLE * key["graph_bytes"]
    assert compile_host["largest_key"] == "context_encoding_1x2048" and compile_host["fits"] is False
    assert compile_host["memory_bytes"] == 16 * GiB < compile_host["largest_bytes"] < 384 * GiB
    assert report["fits"]  # the serving box's verdict: the compile host is another machine
    out = render_plan(report)  # the text `plan` prints of the same report
    assert "a stated estimate, not a measurement" in out and "NxDI PR #106" in out
    assert f"compile host: at least {compile_host['largest_bytes'] / GiB:.1f} GiB for context_encoding_1x2048" in out


def test_int4_where_a_rank_holds_part_of_a_group_is_refused_by_name(big):
    """At TP 8 the channel layout's down holds I/8 = 88 input channels a rank: not whole groups. The
    expert layout's down holds E·I/8 (whole experts): its plan stands, without the channel row."""
    with pytest.raises(
        UserError, match=r"does not divide the 88 input channels \(.*down_proj.weight on each of 8 ranks"
    ):
        plan(big, "inf2.24xlarge", 8, "int4", batch=1, seq=4096)
    r = plan(big, "inf2.24xlarge", 8, "int4", batch=1, seq=4096, expert_layout="expert")
    assert r["fits"] and [row["expert_layout"] for row in r["decode"]] == ["expert"]


@pytest.mark.parametrize("expert_layout", ["channel", "expert"])
@pytest.mark.parametrize("quantization", list(FORMATS))
def test_the_weights_planned_are_the_rank_modules_tensors_each_once(tiny_port, quantization, expert_layout):
    """Every linear quantized, in every format: a rank's weights in the plan are the bytes of the tensors
    its rank module holds (built on the meta device, in bf16), each tensor counted once."""
    config = tiny_port.config
    module = rank_model(
        config,
        2,
        cpu,
        expert_layout=expert_layout,
        quantization=quantization,
        quantized_layers=LAYER_GROUPS,
        dtype=torch.bfloat16,
        device="meta",
    )
    tensors = {id(t): t for t in module.state_dict(keep_vars=True).values()}
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    r = plan(config, None, 2, quantization, 1, 64, expert_layout=expert_layout, quantized_layers=LAYER_GROUPS)
    assert r["quantized_layers"] == list(LAYER_GROUPS)
    assert sum(v for k, v in r["per_rank_bytes"].items() if k not in ("kv_cache", "graph", "runtime")) == held


@pytest.mark.parametrize("q", ["int4", "q4_0"])
def test_every_linear_in_4_5_bits_saves_its_bytes_against_the_experts_alone(big, q):
    """The 26B at TP 2 with every linear in int4 or q4_0 (4.5 bits a weight: a nibble and a 16-bit scale
    per 32 inputs) against the experts alone in it: attention, the dense MLP and lm_head shrink to 4.5 / 16
    of their bf16 linears (their norms and the embeddings stay bf16), nothing else moves; each group's
    saving is named; the decode floor falls below 3.2 ms (issue 55) and both one-chip instances hold it."""
    alone = plan(big, "inf2.xlarge", 2, q, batch=1, seq=4096)
    every = plan(big, "inf2.xlarge", 2, q, batch=1, seq=4096, quantized_layers=LAYER_GROUPS)
    H, V, L = big.hidden_size, big.vocab_size, big.num_hidden_layers
    saved = lambda values: values * 2 - values // 2 - values // 32 * 2  # noqa: E731 bf16 - 4.5 bits
    before, after = alone["per_rank_bytes"], every["per_rank_bytes"]
    assert before["lm_head"] - after["lm_head"] == saved(V // 2 * H)
    assert before["dense_mlp"] - after["dense_mlp"] == saved(L * 3 * big.intermediate_size // 2 * H)
    rows = {row["what"].split(" (")[0]: row for row in every["savings"]}
    assert [w for w in rows if w.startswith(q)] == [f"{q} {g}" for g in LAYER_GROUPS]
    assert all("(4.50 bits a weight, scales included)" in rows[f"{q} {g}"]["what"] for g in LAYER_GROUPS)
    bf16 = rank_model(big, 2, cpu, dtype=torch.bfloat16, device="meta").state_dict()
    attention = sum(t.numel() for n, t in bf16.items() if spec.layer_group(n) == "attention")  # q, k, v, o
    assert before["attention"] - after["attention"] == rows[f"{q} attention"]["saved_bytes"] == saved(attention)
    assert rows[f"{q} mlp"]["saved_bytes"] == before["dense_mlp"] - after["dense_mlp"]
    assert rows[f"{q} lm_head"]["saved_bytes"] == before["lm_head"] - after["lm_head"]
    assert (
        rows[f"{q} experts"]["saved_bytes"]
        == next(r for r in alone["savings"] if "experts" in r["what"])["saved_bytes"]
    )
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {"attention", "dense_mlp", "lm_head"}  # the graph row: the experts' transient still the larger
    assert sum(before.values()) - sum(after.values()) == sum(rows[f"{q} {g}"]["saved_bytes"] for g in LAYER_GROUPS[1:])
    floors = {r["expert_layout"]: r["floor_ms"] for r in every["decode"]}
    assert floors["channel"] <= 3.2 < {r["expert_layout"]: r["floor_ms"] for r in alone["decode"]}["channel"]
    assert every["decode"][0]["bytes_per_token"] == alone["decode"][0]["bytes_per_token"] - sum(
        rows[f"{q} {g}"]["saved_bytes"] for g in ("attention", "mlp", "lm_head")
    )
    for instance in ONE_CHIP:  # through a run configuration, as `plan` and `deploy k8s` make it
        backend = spec.compiled_backend("plan", 2, q, quantized_layers=LAYER_GROUPS)
        r = port_plan(load_port("gemma4-26b-a4b"), RunConfig(backend=backend), instance)
        assert r["fits"] and r["quantized_layers"] == list(LAYER_GROUPS) and r["decode"][0]["floor_ms"] <= 3.2
        assert f"{q} experts, attention, mlp, lm_head, the rest bf16" in render_plan(r).splitlines()[0]


def test_a_quantized_linears_dequantised_copy_is_the_graph_rows_transient(big, tiny_port):
    """The graph row's dequantised transient is the format's (from its tensors): none for bf16, a bf16
    copy for int8, that and a byte a value more for int4's unpack; a short prefill's largest transient
    is then a quantized lm_head's copy (1/t of the vocabulary), not the MoE stage's."""
    from neuron_moe.neuron.plan import _dequantised_bytes

    shape = (64, 128)
    assert [_dequantised_bytes(FORMATS[q], shape) for q in ("none", "int8", "int4")] == [0, 2 * 64 * 128, 3 * 64 * 128]
    H, V, E, inter = big.hidden_size, big.vocab_size, big.num_experts // 2, big.moe_intermediate_size
    moe = 128 * E * 3 * inter * 2 + E * 2 * inter * H * 3  # the MoE stage's activation and one gate_up dequantised
    assert plan(big, None, 2, "int4", batch=1, seq=128)["per_rank_bytes"]["graph"] == moe
    every = plan(big, None, 2, "int4", batch=1, seq=128, quantized_layers=LAYER_GROUPS)
    assert every["per_rank_bytes"]["graph"] == V // 2 * H * 3 > moe
    assert plan(big, None, 2, "none", batch=1, seq=128, quantized_layers=LAYER_GROUPS)["per_rank_bytes"]["graph"] == (
        128 * E * 3 * inter * 2
    )
