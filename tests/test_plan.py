"""The inf2 memory planner reproduces the seed port's findings and agrees with info.py's counts."""

import json

import pytest

from neuron_moe import cli
from neuron_moe.info import parameter_counts
from neuron_moe.neuron.plan import CHIP_HBM_BW, CORE_HBM, GB, plan
from neuron_moe.port import load_port


@pytest.fixture(scope="module")
def big():
    return load_port("gemma4-26b-a4b").config


def test_bf16_at_tp8_fits_inf2_24xlarge(big):
    r = plan(big, "inf2.24xlarge", 8, "bf16", batch=1, seq=4096)
    assert r["fits"], r["reason"]
    assert abs(r["experts_all_ranks_bytes"] / GB - 45.68) < 0.01  # ≈45.7 GB of bf16 experts
    assert r["per_rank_bytes"]["experts"] * 8 == r["experts_all_ranks_bytes"]


def test_int8_at_tp2_does_not_fit_inf2_8xlarge_once_lm_head_graph_and_runtime_count(big):
    r = plan(big, "inf2.8xlarge", 2, "int8", batch=1, seq=4096)
    per_rank = r["per_rank_bytes"]
    assert 11.4 <= per_rank["experts"] / GB < 11.5  # ≈11.4 GB of experts on each rank
    assert 22.8 <= r["experts_all_ranks_bytes"] / GB < 22.9  # ≈22.8 GB in all
    assert not r["fits"] and "exceeds a NeuronCore's 17.18 GB (16 GiB)" in r["reason"]
    assert r["per_rank_total_bytes"] > CORE_HBM
    uncounted = r["per_rank_total_bytes"] - per_rank["lm_head"] - per_rank["graph"] - per_rank["runtime"]
    assert uncounted < CORE_HBM  # it is those that tip it over
    assert per_rank["lm_head"] == per_rank["embeddings"] - 4  # the same 1/t of the vocab (+ an int32 rank)


def test_per_rank_bytes_add_up_to_info_counts(big):
    counts = parameter_counts(big)
    r = plan(big, "inf2.48xlarge", 1, "bf16", batch=1, seq=128)
    w = r["per_rank_bytes"]
    weights = sum(v for k, v in w.items() if k not in ("lm_head", "kv_cache", "graph", "runtime"))
    spmd_ranks = 4 * (big.num_hidden_layers + 1)  # int32 SPMDRank per MoE block and for the embedding
    layer_scalars = 2 * big.num_hidden_layers  # a buffer, not a parameter: info does not count it
    assert weights - spmd_ranks - layer_scalars == counts["bytes"]["bfloat16"]  # info counts tied lm_head once
    for tp in (2, 4, 8):  # split groups shrink by exactly t
        wt = plan(big, "inf2.48xlarge", tp, "bf16", batch=1, seq=128)["per_rank_bytes"]
        assert wt["experts"] * tp == w["experts"] and wt["dense_mlp"] * tp == w["dense_mlp"]
        assert wt["router"] == w["router"]  # replicated


def test_kv_cache_and_decode_floor_on_the_tiny_port(tiny_port):
    r = plan(tiny_port.config, "inf2.24xlarge", 8, "bf16", batch=2, seq=64)
    # sliding layers 0, 2: window 16, 4 KV heads -> 1 per rank, head_dim 32; global 1, 3: 64, 2 -> 1 (replicated), 64
    assert r["per_rank_bytes"]["kv_cache"] == 2 * (2 * 2 * 16 * 1 * 32 * 2) + 2 * (2 * 2 * 64 * 1 * 64 * 2)
    # TP 2, batch 1: 8 experts per rank, top-4 -> selective reads 4 of them, split on I 4 halves
    r = plan(tiny_port.config, "inf2.24xlarge", 2, "bf16", batch=1, seq=64)
    dense, selective, split = r["decode"]
    expert = 3 * 64 * 128 * 2 * 4  # one expert's bf16 bytes, times 4 layers
    assert dense["bytes_per_token"] - selective["bytes_per_token"] == 4 * expert
    assert selective["bytes_per_token"] - split["bytes_per_token"] == 2 * expert
    assert dense["bytes_per_token"] > selective["bytes_per_token"] > split["bytes_per_token"]
    assert dense["floor_ms"] == pytest.approx(1e3 * dense["bytes_per_token"] / (CHIP_HBM_BW / 2))


def test_no_kv_bytes_cross_the_host_per_decode_step(big):
    r = plan(big, "inf2.24xlarge", 8, "bf16", batch=4, seq=4096)
    rows = {row["what"].split(" [")[0].split(" (")[0]: row for row in r["host_per_step"]}
    assert rows["KV cache"]["bytes"] == 0
    assert rows["input_ids + position_ids"]["bytes"] == 2 * 4 * 8 and rows["token"]["bytes"] == 4 * 8
    assert rows["logits"]["bytes"] == 4 * 262144 * 4 and "--with-logits" in rows["logits"]["what"]


def test_tp_beyond_the_instance_or_the_model_is_refused_with_a_reason(big):
    r = plan(big, "inf2.xlarge", 8, "bf16", batch=1, seq=4096)
    assert not r["fits"] and r["reason"] == "inf2.xlarge has 2 NeuronCores; TP 8 needs 8"
    r = plan(big, "inf2.48xlarge", 24, "bf16", batch=1, seq=4096)
    assert not r["fits"] and r["reason"].startswith("not shardable: TP 24: 16 attention heads do not split")


def test_plan_cli(capsys):
    args = ["plan", "--model", "gemma4-26b-a4b", "--instance", "inf2.24xlarge", "--tp", "8"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "FITS:" in out and "HBM floor ms/token" in out and "lm_head" in out
    assert "KV cache (device state, aliased)" in out and "host <-> device per decode step" in out
    assert cli.main(["plan", "--model", "gemma4-26b-a4b", "--instance", "inf2.8xlarge", "--tp", "2",
                     "--dtype", "int8", "--json", "-"]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--instance", "inf2.8xlarge", "--tp", "3"])
    assert e.value.code == 2 and "invalid choice: 3" in capsys.readouterr().err
