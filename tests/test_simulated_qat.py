"""bench/simulated_qat.py: the copy's experts, attention and dense-MLP linears sit on Q4_0's grid (the
format quantizes them back to the same nibbles and scales, and gives them back exactly, in fp32), the
rest is the source's bit for bit, and the copy loads as the port's checkpoint; rounding lm_head unties it
from the embedding, which keeps its weight; a bad layer list is one error line and exit 2."""

import torch
from safetensors.torch import load_file

from bench import simulated_qat
from neuron_moe import spec
from neuron_moe.checkpoint import SINGLE
from neuron_moe.formats import get
from neuron_moe.model import build_model
from neuron_moe.parallel.layout import fused

Q4_0 = get("q4_0")


def group(name: str) -> str | None:
    return spec.layer_group(name if name.endswith(".weight") else f"{name}.weight")


def test_the_copy_is_on_the_grid_and_the_rest_is_the_source(tmp_path, tiny_port):
    out = tmp_path / "qat"
    assert simulated_qat.write(out) > 0
    got, source = load_file(out / SINGLE), load_file(tiny_port.checkpoint / SINGLE)
    assert set(got) == set(source)
    rounded = [k for k in got if group(k) in simulated_qat.QAT_LAYERS]
    assert {group(k) for k in rounded} == set(simulated_qat.QAT_LAYERS)
    for name, w in got.items():
        assert w.dtype == torch.float32, name
        if name not in rounded:
            assert torch.equal(w, source[name]), name
            continue
        view = fused(w) if w.dim() == 3 else w
        tensors = Q4_0.quantize(view)
        again = Q4_0.quantize(Q4_0.dequantize(tensors, torch.float32))
        assert all(torch.equal(tensors[t], again[t]) for t in Q4_0.tensors), name
        assert torch.equal(Q4_0.dequantize(tensors, torch.float32), view), name
        assert not torch.equal(w, source[name]), name  # the source's weights were not on the grid
    model = build_model(tiny_port, spec.EAGER, torch.float32, out)  # the port's config, the tokenizer beside it
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, got["model.layers.0.self_attn.q_proj.weight"])
    assert (out / "tokenizer.json").is_file()


def test_rounding_lm_head_unties_it_and_leaves_the_embedding(tiny_port):
    model = build_model(tiny_port, spec.EAGER, torch.float32)
    embedding = model.model.embed_tokens.weight.detach().clone()
    q_proj = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    assert simulated_qat.round_linears(model, Q4_0, ("lm_head",)) > 0
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, q_proj)
    w = model.lm_head.weight
    assert torch.equal(Q4_0.dequantize(Q4_0.quantize(w), torch.float32), w)


def test_a_bad_layer_list_is_one_error_line(tmp_path, capsys):
    assert simulated_qat.main(["--out", str(tmp_path / "qat"), "--quantized-layers", "experts,router"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --quantized-layers") and err.count("\n") == 1
    assert not (tmp_path / "qat").exists()
