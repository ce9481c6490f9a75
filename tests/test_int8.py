"""int8 experts: per-output-channel symmetric quantisation that never touches its source, a one-rank
model with int8 experts (quantize.py) exactly the model with dequantised weights, an error of bf16's
order, and down's scale per (expert, hidden channel) closer to fp32 than one shared by the experts."""

import pytest
import torch

from neuron_moe.formats.int8 import QMAX, quantize_per_channel
from neuron_moe.greedy import left_pad
from neuron_moe.model import build_model
from neuron_moe.parallel.layout import down_2d, fused
from neuron_moe.quantize import quantize_model

from conftest import random_prompts
from test_dense_masked import prefill_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_per_channel(dtype):
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    w[5] = 0  # an all-zero channel stays zero, without a zero scale
    w[7] *= 100  # a loud channel does not coarsen the others
    before, version = w.clone(), w._version
    q, scale = quantize_per_channel(w)
    assert torch.equal(w, before) and w._version == version  # the source is untouched
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (48, 1)
    assert q.abs().max() == QMAX and int(q.min()) >= -QMAX
    assert torch.equal(q.abs().amax(dim=1)[[0, 7]], torch.tensor([QMAX, QMAX], dtype=torch.int8))
    assert torch.all(q[5] == 0) and scale[5] > 0
    err = (q.float() * scale - w.float()).abs()
    assert torch.all(err <= 0.5001 * scale)  # rounding to the nearest step of each channel's grid
    assert scale[7] > 50 * scale[0]


def _dequantised_copy(port, down_shared_by_experts=False):
    """The float model whose expert weights are the int8 model's, dequantised (q · scale); or, with
    `down_shared_by_experts`, down quantised as the expert layout must (one scale per hidden channel)."""
    model = build_model(port, "dense_masked")
    with torch.no_grad():
        for layer in model.model.layers:
            e = layer.experts
            q, s = quantize_per_channel(fused(e.gate_up_proj))  # [E, H, 2I], a scale per (expert, channel)
            e.gate_up_proj.copy_(fused(q.float() * s))
            if down_shared_by_experts:
                E, H, _ = e.down_proj.shape
                q, s = quantize_per_channel(down_2d(e.down_proj))  # [H, E·I], a scale per hidden channel
                e.down_proj.copy_((q.float() * s).view(H, E, -1).permute(1, 0, 2))
            else:
                q, s = quantize_per_channel(fused(e.down_proj))  # [E, I, H], a scale per (expert, hidden)
                e.down_proj.copy_(fused(q.float() * s))
    return model


def test_int8_is_the_dequantised_model_and_leaves_the_weights_alone(tiny_port):
    model = build_model(tiny_port, "dense_masked")
    params = {k: (p, p._version, p.clone()) for k, p in model.named_parameters()}
    quantize_model(model, "int8")
    assert all(p._version == version and torch.equal(p, before) for p, version, before in params.values())
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [30, 12], seed=2), pad_id=0)
    real = mask.bool()
    got = prefill_logits(model, ids, mask)
    want = prefill_logits(_dequantised_copy(tiny_port), ids, mask)
    # the same weights (q · scale in fp32) through the same einsums: ~2e-5 was the bound while the scales
    # came after the matmul; a wrong scale or channel moves logits by far more than 5e-5
    assert (got[real] - want[real]).abs().max() <= 5e-5


def test_int8_error_is_of_bf16s_order(tiny_port):
    """The int8 experts move the logits less than running the whole model in bf16 does (mean
    |Δlogit| 0.039 against 0.051 on the committed checkpoint; 0.017 against 0.083 on the one
    before it)."""
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [24], seed=7), pad_id=0)
    real = mask.bool()
    ref = prefill_logits(build_model(tiny_port, "eager"), ids, mask)[real]
    int8 = prefill_logits(build_model(tiny_port, "dense_masked", quantization="int8"), ids, mask)[real]
    # the whole model in bf16 (dense_masked: HF's eager loop is ~10x slower in bf16 on this CPU)
    bf16 = prefill_logits(build_model(tiny_port, "dense_masked", torch.bfloat16), ids, mask)[real]
    err8, err16 = (int8 - ref).abs(), (bf16 - ref).abs()
    assert err8.mean() <= err16.mean()
    assert err8.mean() > 1e-4  # the quantisation is real


def test_down_scales_per_expert_are_closer_to_fp32_than_shared_ones(tiny_port):
    """Why `int8` (and the channel layout) quantise down per (expert, hidden channel): on the
    committed checkpoint the mean |Δlogit| against fp32 is 0.018, against 0.025 with the expert
    layout's scale per hidden channel shared by the experts (measured; 3 prompts, 81 positions)."""
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [24, 40, 17], seed=7), pad_id=0)
    real = mask.bool()
    ref = prefill_logits(build_model(tiny_port, "eager"), ids, mask)[real]
    per_expert = (prefill_logits(_dequantised_copy(tiny_port), ids, mask)[real] - ref).abs().mean()
    shared = prefill_logits(_dequantised_copy(tiny_port, down_shared_by_experts=True), ids, mask)[real] - ref
    assert per_expert < 0.8 * shared.abs().mean()
