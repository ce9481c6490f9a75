"""int4 experts: the format (experts/int4.py). Packing is exact, dequantising errs by at most half a
step of each group's grid (the step is the group's amax / 7, rounded up to a bf16), the scale search
never reconstructs worse than round-to-nearest, and the byte counts are what the tensors hold."""

import pytest
import torch

from neuron_moe.experts import int4


def _weight(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(24, 64), (3, 64, 10)])  # [out, in] and expert-fused [E, in, out]
def test_pack_unpack_round_trip_is_exact(shape):
    """Every int4 value -7 … 7 at every position survives packing: unpack(quantize(q·s)) == q·s."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-int4.QMAX, int4.QMAX + 1, shape, generator=gen).to(torch.float32)
    q[:, ::16] = int4.QMAX  # every group reaches ±7, so its scale is exactly the one given
    q[:, 3::16] = -int4.QMAX
    scale = torch.full((shape[0], shape[1] // 16, *shape[2:]), 0.25)  # a power of two: exact in bf16
    w = q * scale.repeat_interleave(16, dim=1)
    packed, got_scale = int4.quantize(w, 16)
    assert packed.dtype == torch.uint8 and packed.shape == int4.shapes(shape, 16)[0]
    assert got_scale.dtype == int4.SCALE_DTYPE and torch.equal(got_scale.float(), scale)
    assert torch.equal(int4.unpack(packed, got_scale), w)
    low, high = packed.select(1, 0) & 15, packed.select(1, 0) >> 4  # input channels 0 and 1
    assert torch.equal(low.float() - int4.OFFSET, q.select(1, 0)) and torch.equal(high.float() - 8, q.select(1, 1))


@pytest.mark.parametrize("group", int4.GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantised_error_is_at_most_half_a_step(group, dtype):
    w = _weight((32, 256, 6)).to(dtype)
    w[:, :group] = 0  # an all-zero group stays zero
    w[:, group : 2 * group] *= 100  # a loud group does not coarsen its neighbours
    before, version = w.clone(), w._version
    packed, scale = int4.quantize(w, group)
    assert torch.equal(w, before) and w._version == version  # the source is untouched
    step = w.float().reshape(32, 256 // group, group, 6).abs().amax(2) / int4.QMAX
    s = scale.float()
    assert torch.all(s[:, 1:] >= step[:, 1:]) and torch.all(s[:, 1:] <= step[:, 1:] * (1 + 2**-7))
    err = (int4.unpack(packed, scale) - w.float()).abs().reshape(32, 256 // group, group, 6)
    assert torch.all(err <= s.unsqueeze(2) / 2)  # round to nearest on the group's grid
    assert torch.all(err[:, 0] == 0)
    assert s[:, 1].min() > 20 * s[:, 2].max()


def test_scale_search_never_reconstructs_worse_than_round_to_nearest():
    w = _weight((64, 256))
    nearest = int4.unpack(*int4.quantize(w, 32))
    searched = int4.unpack(*int4.quantize(w, 32, search=True))
    per_group = lambda d: ((d - w) ** 2).reshape(64, 8, 32).sum(2)  # noqa: E731
    assert torch.all(per_group(searched) <= per_group(nearest))
    assert per_group(searched).sum() < 0.95 * per_group(nearest).sum()  # about 0.88 on a Gaussian


def test_bytes_are_what_the_tensors_hold():
    packed, scale = int4.quantize(_weight((48, 96)), 32)
    assert int4.packed_bytes(48, 96, 32) == (packed.numel(), scale.numel() * scale.element_size())
    assert int4.nbytes(48, 96, 32) == 48 * 96 // 2 + 48 * 3 * 2
    meta = int4.quantize(torch.empty(4, 64, 8, device="meta"), 16)
    assert [t.shape for t in meta] == [(4, 32, 8), (4, 4, 8)] and meta[0].device.type == "meta"


def test_a_group_that_does_not_divide_the_input_dim_is_refused():
    with pytest.raises(int4.Int4Error, match="group size 64 does not divide the input dim 96"):
        int4.packed_bytes(8, 96, 64)
    with pytest.raises(int4.Int4Error, match="even number"):
        int4.quantize(_weight((4, 18)), 9)
