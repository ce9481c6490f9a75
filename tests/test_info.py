import torch

from neuron_moe import info
from neuron_moe.formats import FORMATS, Format
from neuron_moe.formats.int4 import Int4
from neuron_moe.info import geometry, parameter_counts, per_token_costs
from neuron_moe.port import load_port


def test_gemma4_26b_counts_from_the_meta_device():
    config = load_port("gemma4-26b-a4b").config
    params = parameter_counts(config)
    assert abs(params["total"] / 1e9 - 25.23) < 0.01
    assert params["groups"]["experts"] == 30 * (128 * 1408 * 2816 + 128 * 2816 * 704)  # ≈ 22.84 B
    assert abs(params["active_per_token"] / 1e9 - 3.82) < 0.01
    geo = geometry(config)
    assert geo["experts_gate_up_shape"] == [128, 1408, 2816]
    assert geo["experts_down_shape"] == [128, 2816, 704]
    assert (geo["sliding_layers"], geo["full_layers"]) == (25, 5)
    assert (geo["kv_heads_full"], geo["head_dim_full"]) == (2, 512)


def test_bytes_per_dtype_are_consistent():
    params = parameter_counts(load_port("tiny-gemma4-moe").config)
    b = params["bytes"]
    assert b["float32"] == 2 * b["bfloat16"] == 4 * params["total"]
    experts = params["groups"]["experts"]
    # int8 experts save one byte per expert weight against bf16, minus the per-channel scales
    assert b["bfloat16"] - experts < b["int8_experts_bf16_rest"] < b["bfloat16"]


def test_per_token_bytes_and_flops_at_full_size():
    port = load_port("gemma4-26b-a4b")
    costs = per_token_costs(port.config, port.dtype)
    assert costs["dtype"] == "bfloat16"
    rows = {r["experts"]: r for r in costs["implementations"]}
    expert = 3 * 704 * 2816  # gate_up + down of one expert
    dense, selective = rows["dense_masked"], rows["selective"]
    assert dense["expert_bytes_per_layer"] == 128 * expert * 2  # ≈ 1.52 GB
    assert abs(dense["expert_bytes_per_layer"] / 1e9 - 1.52) < 0.01
    assert selective["expert_bytes_per_layer"] == 8 * expert * 2  # ≈ 95 MB
    assert abs(selective["expert_bytes_per_layer"] / 1e6 - 95.2) < 0.1
    assert selective["expert_bytes_reduction"] == 16
    assert dense["flops_per_token"] - selective["flops_per_token"] == 2 * 30 * (128 - 8) * expert
    # top-k experts plus everything else is exactly the active parameter count (tied LM head read whole)
    assert selective["weight_bytes_per_token"] == 2 * parameter_counts(port.config)["active_per_token"]
    assert costs["selective_below_batch"] == 16


class _Fp8(Format):
    """A format the registry does not hold: one byte a weight, no scale."""

    name = "fp8"

    def shapes(self, shape, dtype):
        return {"weight": (tuple(shape), torch.float8_e4m3fn)}


def test_the_bytes_table_has_a_row_for_each_registered_format(monkeypatch):
    """The 26B's weights with the experts in each format the registry holds, the rest bf16: int8 a byte
    a weight and an fp32 scale per output channel, int4 half a byte and a bf16 scale per 32 inputs; a
    format registered later appears without an edit, and one whose groups do not divide the experts'
    input dims (704 channels in groups of 128) has no row."""
    config = load_port("gemma4-26b-a4b").config
    params = parameter_counts(config)
    rest, experts = params["total"] - params["groups"]["experts"], params["groups"]["experts"]
    b = params["bytes"]
    assert list(b) == ["float32", "bfloat16"] + [f"{q}_experts_bf16_rest" for q in FORMATS if q != "none"]
    assert b["int8_experts_bf16_rest"] == rest * 2 + experts + 30 * 128 * (1408 + 2816) * 4
    assert b["int4_experts_bf16_rest"] == rest * 2 + experts // 2 + 30 * 128 * (1408 * 88 + 2816 * 22) * 2
    monkeypatch.setattr(info, "FORMATS", {**FORMATS, "fp8": _Fp8(), "int4_128": Int4(group=128)})
    b = parameter_counts(config)["bytes"]
    assert b["fp8_experts_bf16_rest"] == rest * 2 + experts and "int4_128_experts_bf16_rest" not in b
