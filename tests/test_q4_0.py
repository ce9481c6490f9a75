"""q4_0 (formats/q4_0.py) is llama.cpp's Q4_0: the same nibbles and the same fp16 scales, bit for bit,
as the gguf package's Q4_0 quantizer (llama.cpp's Python port of ggml's reference) on random tensors
and on every quantizable linear of the tiny port; a weight on Q4_0's grid comes back exactly (int4
does not keep it); and the parallel layers hold it as any format, one rank or split over two."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from neuron_moe import spec
from neuron_moe.formats import FORMATS, q4_0
from neuron_moe.formats.q4_0 import Q4_0
from neuron_moe.parallel import cpu, layout

Q4 = GGMLQuantizationType.Q4_0


def as_gguf(tensors: dict[str, torch.Tensor]) -> np.ndarray:
    """Our tensors ([a, n/2, *rest] packed, [a, n/32, *rest] scales) as GGUF's bytes of the weight
    with its input dim last: per block of 32, the fp16 d (2 bytes) then the 16 bytes of nibbles."""
    packed, scale = tensors["weight"].movedim(1, -1), tensors["block_scale"].movedim(1, -1)
    blocks = scale.shape[-1]
    d = scale.contiguous().view(torch.uint8).reshape(*scale.shape, 2)
    qs = packed.reshape(*packed.shape[:-1], blocks, q4_0.HALF)
    return torch.cat([d, qs], dim=-1).reshape(*scale.shape[:-1], blocks * 18).numpy()


def reference(w: torch.Tensor) -> np.ndarray:
    """The gguf package's Q4_0 bytes of `w` ([out, in] or [E, in, out]), its input dim moved last."""
    return gguf_quantize(w.movedim(1, -1).to(torch.float32).contiguous().numpy(), Q4)


def assert_gguf_equal(w: torch.Tensor) -> None:
    mine, theirs = as_gguf(Q4_0.quantize(w)), reference(w)
    assert mine.shape == theirs.shape
    differ = np.argwhere(mine != theirs)
    assert differ.size == 0, f"{len(differ)} bytes differ, first at {differ[0].tolist()}"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _ties(shape, seed):
    """Integers whose blocks peak at ±16 (d = ∓2): every odd value lands halfway between two steps,
    where ggml's trunc(x·id + 8.5) rounds half up (round-half-to-even would take half of them down);
    peaks of both signs and of equal magnitude in one block (the first one sets d)."""
    w = torch.randint(-15, 16, shape, generator=_gen(seed)).to(torch.float32)
    w[:, ::32] = 16 * torch.sign(torch.randn(w[:, ::32].shape, generator=_gen(seed + 1)))
    w[:, 5::32] = 16
    w[:, 7::32] = -16
    return w


DISTRIBUTIONS = {
    "gaussian": lambda shape, seed: torch.randn(shape, generator=_gen(seed)),
    "heavy tailed": lambda shape, seed: torch.randn(shape, generator=_gen(seed)) ** 3,
    "tiny": lambda shape, seed: torch.randn(shape, generator=_gen(seed)) * 1e-4,  # fp16-subnormal scales
    "large": lambda shape, seed: torch.randn(shape, generator=_gen(seed)) * 3e3,
    "bf16 values": lambda shape, seed: torch.randn(shape, generator=_gen(seed)).to(torch.bfloat16),
    "ties": _ties,
}


@pytest.mark.parametrize("shape", [(24, 256), (3, 96, 10)])  # [out, in] and expert-fused [E, in, out]
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_q4_0_is_the_gguf_packages_q4_0_on_random_tensors(distribution, shape):
    w = DISTRIBUTIONS[distribution](shape, 7)
    w[:, 32:64] = 0  # a block of zeros: d = -0.0, every nibble 8
    w[:, 64:96] = -w[:, 64:96].abs()  # a block whose largest magnitude is negative: d > 0
    before = w.clone()
    assert_gguf_equal(w)
    assert torch.equal(w, before)  # the source is untouched


def test_the_nibbles_are_in_gguf_block_order_and_the_largest_magnitude_is_minus_8():
    """Byte j of a block holds element j in its low nibble and element j + 16 in its high one (int4's
    order would pair elements 2j and 2j + 1); the value of largest magnitude, of either sign, is q = 0
    (-8 · d)."""
    q = torch.tensor([*range(16), *range(15, -1, -1)])  # element j + 16 holds 15 - j
    d = torch.tensor([[-0.5], [0.25]])  # largest values +4 and -2
    w = (q - 8) * d
    t = Q4_0.quantize(w)
    assert t["block_scale"].tolist() == [[-0.5], [0.25]]
    want = torch.tensor([j | (15 - j) << 4 for j in range(16)], dtype=torch.uint8)
    assert torch.equal(t["weight"], want.expand(2, 16))
    assert torch.equal(Q4_0.dequantize(t, torch.float32), w)


def test_a_block_of_negative_zeros_has_ggmls_scale():
    """ggml's C reference starts its search at max = +0, so every all-zero block has d = +0 / -8 = -0.0
    (the fp16 bits 0x8000), whatever the sign of its zeros. (The gguf package's numpy port takes the
    block's first element there, +0.0 for a block of -0.0: the C reference is the one followed.)"""
    t = Q4_0.quantize(torch.full((2, 32), -0.0))
    assert t["block_scale"].view(torch.int16).tolist() == [[-0x8000], [-0x8000]]
    assert torch.equal(t["weight"], torch.full((2, 16), 0x88, dtype=torch.uint8))


@pytest.fixture(scope="module")
def tiny_linears(tiny_eager):
    """Every quantizable linear of the tiny port in the parallel layout at one rank ([out, in], the
    experts fused [E, in, out]): the weights `--quantized-layers` quantizes."""
    state = layout.parallel_state_dict(tiny_eager.state_dict(), tiny_eager.config, 1)
    linears = {name: w for name, w in state.items() if spec.layer_group(name) is not None}
    assert {spec.layer_group(name) for name in linears} == set(spec.LAYER_GROUPS)
    return linears


def test_q4_0_is_the_gguf_packages_q4_0_on_the_tiny_ports_linears(tiny_linears):
    for name, w in tiny_linears.items():
        try:
            assert_gguf_equal(w)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_a_weight_on_q4_0s_grid_is_kept_exactly_and_int4_does_not_keep_it(tiny_linears):
    """A simulated QAT checkpoint (each linear rounded onto Q4_0's grid): q4_0 quantizes it to the same
    nibbles and scales and dequantises it to itself (max |Δw| = 0); int4 (-7 … 7, amax / 7) re-rounds it."""
    int4 = FORMATS["int4"]
    for name, w in tiny_linears.items():
        on_grid = Q4_0.dequantize(Q4_0.quantize(w), torch.float32)
        again = Q4_0.quantize(on_grid)
        assert torch.equal(Q4_0.dequantize(again, torch.float32), on_grid), name
        assert np.array_equal(as_gguf(again), as_gguf(Q4_0.quantize(w))), name
        assert (int4.dequantize(int4.quantize(on_grid), torch.float32) - on_grid).abs().max() > 0, name


def test_the_gguf_packages_dequantised_weight_is_ours():
    w = torch.randn(3, 64, 40, generator=_gen(3))
    t = Q4_0.quantize(w)
    theirs = torch.from_numpy(gguf_dequantize(reference(w), Q4)).movedim(-1, 1)
    assert torch.equal(Q4_0.dequantize(t, torch.float32), theirs)
    # in bf16: the exact fp32 weight rounded once
    assert torch.equal(Q4_0.dequantize(t, torch.bfloat16), theirs.to(torch.bfloat16))


class _Dequantize(torch.nn.Module):
    def forward(self, packed, scale):
        return q4_0.dequantize(packed, scale, torch.bfloat16)


def test_the_dequantise_shifts_and_masks_32_bit_words_only():
    """neuronx-cc refuses a shift of a non-32-bit integer (NCC_EVRF022): every bitwise op of the
    exported graph takes int32, and the graph computes the eager weight."""
    t = Q4_0.quantize(torch.randn(3, 64, 10, generator=_gen(4)))
    program = torch.export.export(_Dequantize(), (t["weight"], t["block_scale"]), strict=True)
    bitwise = [n for n in program.graph.nodes if n.op == "call_function" and "bitwise" in str(n.target)]
    assert {str(n.target).split(".")[1] for n in bitwise} == {"bitwise_and", "bitwise_right_shift"}
    assert {n.args[0].meta["val"].dtype for n in bitwise} == {torch.int32}
    assert torch.equal(program.module()(t["weight"], t["block_scale"]), Q4_0.dequantize(t, torch.bfloat16))


def test_bytes_are_gguf_s_18_per_block_of_32():
    shape = (48, 96)
    assert Q4_0.nbytes(shape) == reference(torch.zeros(shape)).nbytes == 48 * 3 * 18
    assert Q4_0.nbytes((4, 64, 8)) == sum(
        t.numel() * t.element_size() for t in Q4_0.quantize(torch.ones(4, 64, 8)).values()
    )
    meta = Q4_0.quantize(torch.empty(4, 64, 8, device="meta"))
    assert {k: (tuple(t.shape), t.dtype, t.device.type) for k, t in meta.items()} == {
        "weight": ((4, 32, 8), torch.uint8, "meta"),
        "block_scale": ((4, 2, 8), torch.float16, "meta"),
    }


def test_an_input_dim_of_partial_blocks_is_refused():
    with pytest.raises(q4_0.Q4_0Error, match="q4_0 block size 32 does not divide the 48 input channels"):
        Q4_0.quantize(torch.zeros(4, 48))
    with pytest.raises(q4_0.Q4_0Error, match="does not divide the 48 input channels of a rank"):
        cpu.RowParallelLinear(96, 8, tp=2, fmt=Q4_0)
    assert spec.check_quantization("q4_0") == "q4_0" and FORMATS["q4_0"] is Q4_0


# ---- the parallel layers: one rank is F.linear with the dequantised weight; two ranks sum to it ----

# (class, constructor's sizes, the weight's shape, the partition dim, whether the ranks' outputs are summed)
LAYERS = {
    "column": (cpu.ColumnParallelLinear, (64, 24), (24, 64), 0, False),
    "row": (cpu.RowParallelLinear, (64, 24), (24, 64), 1, True),  # one block per rank at tp 2
    "expert column": (cpu.ExpertFusedColumnParallelLinear, (3, 64, 24), (3, 64, 24), 2, False),
    "expert row": (cpu.ExpertFusedRowParallelLinear, (3, 128, 24), (3, 128, 24), 1, True),
}


def _full(kind):
    """A random weight of the layer's full shape as q4_0 tensors, its fp32 weight as the gguf package
    dequantises it, and an input."""
    _, _, shape, _, _ = LAYERS[kind]
    w = torch.randn(shape, generator=_gen(11))
    tensors = Q4_0.quantize(w)
    theirs = torch.from_numpy(gguf_dequantize(reference(w), Q4)).movedim(-1, 1)  # the gguf package's weight
    inputs = shape[1]
    x = (
        torch.randn(3, 1, 5, inputs, generator=_gen(12))
        if len(shape) == 3
        else torch.randn(5, inputs, generator=_gen(12))
    )
    return tensors, theirs, x


def _matmul(x, w):
    return F.linear(x, w) if w.dim() == 2 else torch.einsum("e...h,ehi->e...i", x, w)


def assert_is_the_matmul(got, x, w):
    """`got` is x @ w (F.linear's or the expert einsum's) up to the order of its fp32 sums: two sums of n
    terms in different orders lie within n·eps·(|x| @ |w|) of each other (each within (n - 1)·eps/2 of
    the exact one), and each result's rounding to its dtype adds at most an ulp between them."""
    want = _matmul(x, w)
    x32, w32 = x.to(torch.float32), w.to(torch.float32)
    n = w.shape[1]
    bound = n * torch.finfo(torch.float32).eps * _matmul(x32.abs(), w32.abs())
    bound += torch.finfo(want.dtype).eps * want.to(torch.float32).abs()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.all((got.to(torch.float32) - want.to(torch.float32)).abs() <= bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", LAYERS)
def test_a_q4_0_layer_at_one_rank_is_the_dequantised_linear(kind, dtype):
    cls, sizes, _, _, _ = LAYERS[kind]
    tensors, w, x = _full(kind)
    layer = cls(*sizes, tp=1, dtype=dtype, fmt=Q4_0)
    layer.load_state_dict(cpu.shard_checkpoint(tensors, layer, 1)[0])
    with torch.no_grad():
        got = layer(x.to(dtype))
    assert_is_the_matmul(got, x.to(dtype), w.to(dtype))  # the weight in `dtype`: the exact one rounded once


@pytest.mark.parametrize("kind", LAYERS)
def test_q4_0_layers_at_two_ranks_sum_to_the_one_rank_layer(kind):
    """Each rank's shard cut by shard_checkpoint, run as its rank runs it (PyTorch's fake process group
    stands in for the other rank: a row layer's all-reduce returns the rank's partial sum)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cls, sizes, shape, dim, summed = LAYERS[kind]
    tensors, w, x = _full(kind)
    layer = cls(*sizes, tp=2, fmt=Q4_0)
    shards = cpu.shard_checkpoint(tensors, layer, 2)
    outputs = []
    for rank, state in enumerate(shards):
        assert state["block_scale"].shape[dim] == tensors["block_scale"].shape[dim] // 2  # split, never replicated
        layer.load_state_dict(state)
        mine = x.chunk(2, dim=-1)[rank] if summed else x
        dist.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())
        try:
            with torch.no_grad():
                outputs.append(layer(mine))
        finally:
            dist.destroy_process_group()
    assert_is_the_matmul(outputs[0] + outputs[1] if summed else torch.cat(outputs, dim=-1), x, w)
