"""The NKI reader without the Neuron SDK: its tile and index plan, executed by a PyTorch stand-in
for the three kernels that reads only what the plan addresses, matches the reference; the kernels
are handed the sidecar's own tensors (views, same bytes, same format); out-of-limit geometries and
a missing SDK are refused. The NKI kernels themselves have not run (no SDK, no NeuronCore here)."""

import importlib.util
import py_compile
from pathlib import Path

import pytest
import torch
from transformers.activations import ACT2FN

import trained_like
from neuron_moe.errors import UserError
from neuron_moe.reader import reference
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.hadamard import padded, random_signs
from neuron_moe.reader.nki import forward as nki_reader
from neuron_moe.reader.nki.plan import NkiPlanError, plan
from neuron_moe.reader.prep import prep_layer
from neuron_moe.reader.sidecar import BLOCK, LayerSidecar, SidecarLayout, unpack_codes


class TorchKernels:
    """The three kernels' contracts in PyTorch: every weight or sidecar row is read through the
    plan's indices from the 2-D views, exactly as the indirect DMAs would."""

    ACTIVATIONS = {"gelu_tanh": ACT2FN["gelu_pytorch_tanh"], "silu": ACT2FN["silu"]}

    def __init__(self):
        self.calls = {}

    def screen_kernel(self, codes, strip_idx, values):
        self.calls["screen"] = dict(codes=codes, strip_idx=strip_idx, values=values)
        strips = unpack_codes(codes[strip_idx[..., 0].long()]).float()  # [P, scan, 5S], row order
        partial = torch.einsum("pcr,pc->pr", strips, values[..., 0])
        return partial.view(partial.shape[0], -1, 5).transpose(1, 2)  # digit-major [P, 5, S]

    def exact_kernel(self, gate_up, down, x, gate_idx, up_idx, down_idx, weights, act):
        self.calls["exact"] = dict(gate_up=gate_up, down=down)
        T = x.shape[0]
        g, u, d = (
            table[idx.view(T, -1).long()].float()
            for table, idx in ((gate_up, gate_idx), (gate_up, up_idx), (down, down_idx))
        )
        coef = act(torch.einsum("tkh,th->tk", g, x)) * torch.einsum("tkh,th->tk", u, x) * weights.view(T, -1)
        return torch.einsum("tk,tkh->th", coef, d)

    def recover_kernel(self, coeffs, basis, coeff_idx, unchosen, rank):
        self.calls["recover"] = dict(coeffs=coeffs, basis=basis)
        T = unchosen.shape[0]
        b = coeffs[coeff_idx.view(T, -1).long(), :rank].float()
        z = torch.einsum("tj,tjr->tr", unchosen.view(T, -1), b)
        return (z @ basis[:, :rank].float().T)[..., None]


def case(experts, inter, hidden, tokens, top_k, seed, rank):
    ex = trained_like.experts(num_experts=experts, inter=inter, hidden=hidden, seed=seed)
    signs = random_signs(padded(hidden, BLOCK), seed)
    layer = LayerSidecar.from_tensors(prep_layer(ex.gate_up_proj, ex.down_proj, signs, rank), signs)
    index, weights = trained_like.routing(tokens, experts, top_k)
    return ex, layer, trained_like.tokens(ex, count=tokens), index, weights


@pytest.mark.parametrize(
    "geometry,k,rank",
    [
        ((4, 40, 200, 3, 2, 0), 30, 16),  # hidden 200: not a multiple of 128; k < 128: one padded tile
        ((5, 100, 256, 2, 3, 1), 150, 8),  # k = 150: two exact tiles; 300 channels: three recover tiles
        ((5, 100, 256, 2, 3, 1), 150, 0),
    ],
)
def test_the_plan_executed_in_torch_is_the_reference(geometry, k, rank):
    ex, layer, x, index, weights = case(*geometry, rank=16)
    args = (x, index, weights, ex.gate_up_proj, ex.down_proj.mT.contiguous(), layer)
    kw = dict(k=k, scan=48, rank=rank, act_fn=ex.act_fn)
    want = reference.forward(*args, **kw)
    got = nki_reader.forward(*args, **kw, kernels=TorchKernels())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # teeth: a plan that addressed the neighbouring strip would not be
    broken = TorchKernels()
    screen = broken.screen_kernel
    broken.screen_kernel = lambda codes, strip_idx, values: screen(codes, (strip_idx + 1) % codes.shape[0], values)
    assert (nki_reader.forward(*args, **kw, kernels=broken) - want).abs().max() > 1e-3 * want.abs().max()


def test_the_kernels_consume_the_sidecar_tensors_themselves():
    """The kernels' HBM inputs are views of the sidecar tensors prep writes: same storage, same dtype,
    the byte layout of docs/reader.md — no repacking for Neuron."""
    ex, layer, x, index, weights = case(4, 40, 200, 2, 2, 0, rank=16)
    kernels = TorchKernels()
    down_rows = ex.down_proj.mT.contiguous()
    nki_reader.forward(
        x, index, weights, ex.gate_up_proj, down_rows, layer, k=30, scan=48, rank=16, act_fn=ex.act_fn, kernels=kernels
    )
    spec = SidecarLayout(Geometry(hidden=200, experts=4, intermediate=40), 16).layer_tensors()
    screen, recover = kernels.calls["screen"], kernels.calls["recover"]
    assert screen["codes"].dtype == spec["codes"][0] == torch.uint8
    assert screen["codes"].untyped_storage().data_ptr() == layer.codes.untyped_storage().data_ptr()
    assert screen["codes"].shape == (4 * 2 * BLOCK, spec["codes"][1][-1])  # one strip of R_pad/5 bytes per row
    assert torch.equal(screen["codes"].view(spec["codes"][1]), layer.codes)
    for name in ("coeffs", "basis"):
        assert recover[name].dtype == spec[name][0] == torch.bfloat16
        assert recover[name].untyped_storage().data_ptr() == getattr(layer, name).untyped_storage().data_ptr()
    assert kernels.calls["exact"]["down"].untyped_storage().data_ptr() == down_rows.untyped_storage().data_ptr()
    # the strips a token's screen reads are exactly the reference's scanned strips
    coords, _ = reference.scanned(x, layer, 48)
    rows = screen["strip_idx"].view(2, 2, 2, 48)
    e, b, c = rows // (2 * BLOCK), rows // BLOCK % 2, rows % BLOCK
    assert torch.equal(e, index[:, :, None, None].expand_as(e))
    assert torch.equal(b, torch.arange(2)[None, None, :, None].expand_as(b))
    assert torch.equal(c, coords[:, None].expand_as(c))


def layout(hidden, experts, intermediate, rank=32):
    return SidecarLayout(Geometry(hidden=hidden, experts=experts, intermediate=intermediate), rank)


def test_tiles_fit_neuroncore_v2_for_the_real_geometries():
    gemma = plan(layout(2816, 128, 704), top_k=8, k=703, scan=80, rank=32)
    assert (gemma.strip, gemma.k_tiles, gemma.h_tiles, gemma.i_tiles) == (288, 6, 6, 6)
    qwen = plan(layout(2048, 128, 768), top_k=8, k=755, scan=80, rank=32)
    assert (qwen.strip, qwen.k_tiles, qwen.h_tiles) == (320, 6, 4)
    with pytest.raises(NkiPlanError, match="strip of 544 bytes > 512"):
        plan(layout(2048, 8, 1300), top_k=2, k=10, scan=80, rank=32)
    with pytest.raises(NkiPlanError, match="rank 256 > 128"):
        plan(layout(2048, 8, 768), top_k=2, k=10, scan=80, rank=256)


@pytest.mark.parametrize("tp", [2, 4])
def test_per_rank_the_plan_executed_in_torch_is_the_reference(tp):
    """At TP t on the channel layout the NKI forward takes a rank's shard (`reader/shard.py`): the plan
    addresses that rank's sidecar and weights, and the ranks' outputs sum to the per-rank reader."""
    from neuron_moe.reader import shard

    ex, layer, x, index, weights = case(4, 40, 256, 3, 2, 0, rank=16)
    down_rows = ex.down_proj.mT.contiguous()
    kw = dict(k=12, scan=48, rank=16, act_fn=ex.act_fn)
    ranks = [
        (*shard.shard_weights(ex.gate_up_proj, down_rows, tp, r), shard.rank_sidecar(layer, tp, r)) for r in range(tp)
    ]
    outs = []
    for gate_up, down, part in ranks:
        want = reference.forward(x, index, weights, gate_up, down, part, **kw)
        kernels = TorchKernels()
        outs.append(
            nki_reader.forward(x, index, weights, gate_up.contiguous(), down.contiguous(), part, **kw, kernels=kernels)
        )
        assert (outs[-1] - want).abs().max() <= 1e-5 * want.abs().max()
        assert kernels.calls["screen"]["codes"].data_ptr() == part.codes.data_ptr()  # the rank's own shard
    total = shard.forward_ranks(x, index, weights, ranks, **kw)
    assert (sum(outs) - total).abs().max() <= 1e-5 * total.abs().max()


def test_a_ranks_tiles_fit_neuroncore_v2():
    """Gemma-4 at TP 8: a rank's strips are 64 B (176 rows padded to 320), its 55 channels at 17.8 % one tile."""
    rank = plan(layout(2816, 128, 88), top_k=8, k=55, scan=80, rank=32)
    assert (rank.strip, rank.k_tiles, rank.h_tiles, rank.i_tiles) == (64, 1, 6, 1)


def test_the_kernel_source_parses():
    py_compile.compile(str(Path(nki_reader.__file__).with_name("kernels.py")), doraise=True)


@pytest.mark.skipif(importlib.util.find_spec("nki") is not None, reason="the Neuron SDK is installed here")
def test_without_the_sdk_the_nki_backend_is_a_clear_error():
    from neuron_moe.experts.channel_reader import reader_forward

    with pytest.raises(UserError, match="reader kernel 'nki' needs the Neuron SDK's nki package"):
        reader_forward("nki")
