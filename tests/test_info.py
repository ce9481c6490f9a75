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
