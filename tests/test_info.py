from neuron_moe.info import geometry, parameter_counts
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
