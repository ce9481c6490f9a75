"""int4 experts: the format (formats/int4.py). Packing is exact, dequantising errs by at most half a
step of each group's grid (the step is the group's amax / 7, rounded up to a bf16), the scale search
never reconstructs worse than round-to-nearest, and the byte counts are what the tensors hold."""

import argparse

import pytest
import torch
from safetensors.torch import load_file

from neuron_moe import cli_parser, spec
from neuron_moe.cli import main
from neuron_moe.errors import UserError
from neuron_moe.formats import int4
from neuron_moe.formats import FORMATS, quantize_state
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.neuron import artifact as na
from neuron_moe.neuron import compile as nc
from neuron_moe.parallel import cpu, layout
from neuron_moe.parallel.layout import fused
from neuron_moe.parallel.moe import ParallelMoE
from neuron_moe.parallel.tp_generator import TPGenerator, generate_replicated
from neuron_moe.quantize import quantize_model
from neuron_moe.reader import accounting as acc
from neuron_moe.reader.geometry import Geometry
from neuron_moe.spec import Reader, tp_backend

from conftest import expert_reads, preflight_violations, random_prompts
from test_dense_masked import prefill_logits


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


class _Unpack(torch.nn.Module):
    def forward(self, packed, scale):
        return int4.unpack(packed, scale, torch.bfloat16)


def test_the_unpack_shifts_and_masks_32_bit_words_only():
    """The exported unpack of a packed uint8 weight (NCC_EVRF022: neuronx-cc refuses an arithmetic
    right shift of a non-32-bit input): every bitwise op of the graph takes int32, the weight stays
    uint8 in memory, and the bf16 weight is the one unpacked eagerly."""
    packed, scale = int4.quantize(_weight((3, 64, 10)), 32)
    program = torch.export.export(_Unpack(), (packed, scale), strict=True)
    bitwise = [n for n in program.graph.nodes if n.op == "call_function" and "bitwise" in str(n.target)]
    assert {str(n.target).split(".")[1] for n in bitwise} == {"bitwise_and", "bitwise_right_shift"}
    assert {n.args[0].meta["val"].dtype for n in bitwise} == {int4.WORD} == {torch.int32}
    assert torch.equal(program.module()(packed, scale), int4.unpack(packed, scale, torch.bfloat16))


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
    assert int4.Int4(32).nbytes((48, 96)) == packed.numel() + scale.numel() * scale.element_size()
    assert int4.Int4(32).nbytes((48, 96)) == 48 * 96 // 2 + 48 * 3 * 2
    meta = int4.quantize(torch.empty(4, 64, 8, device="meta"), 16)
    assert [t.shape for t in meta] == [(4, 32, 8), (4, 4, 8)] and meta[0].device.type == "meta"


def test_a_group_that_does_not_divide_the_input_dim_is_refused():
    with pytest.raises(int4.Int4Error, match="group size 64 does not divide the 96 input channels"):
        int4.Int4(64).nbytes((8, 96))
    with pytest.raises(int4.Int4Error, match="even number"):
        int4.quantize(_weight((4, 18)), 9)


# ---- the experts in the model: one rank (HF's model) and the TP rank modules ----


def test_int4_experts_are_the_dequantised_model(tiny_port):
    """HF's model with int4 experts computes what the float model holding the dequantised weights does,
    and never touches the float weights it was made from."""
    model = build_model(tiny_port, "dense_masked", torch.float32)
    before = {k: (p, p.clone()) for k, p in model.named_parameters()}
    quantize_model(model, "int4")
    assert all(torch.equal(p, copy) for p, copy in before.values())
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [30, 12], seed=2), pad_id=0)
    got = prefill_logits(model, ids, mask)
    dq = build_model(tiny_port, "dense_masked", torch.float32)
    with torch.no_grad():
        for layer in dq.model.layers:
            for p in (layer.experts.gate_up_proj, layer.experts.down_proj):
                p.copy_(fused(int4.unpack(*int4.quantize(fused(p)))))
    want = prefill_logits(dq, ids, mask)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # fp32 summation order only
    eager = prefill_logits(build_model(tiny_port, "eager", torch.float32), ids, mask)
    assert (got - eager).abs().max() > 1e-3 * eager.abs().max()  # it is int4, not the float model


@pytest.mark.slow
def test_tp2_int4_in_both_layouts_is_the_one_rank_int4(tiny_port):
    """At TP 2 over parallel.cpu (graphs traced once as rank 0), the channel layout (decode gathering
    each token's experts: packed weights and scales gathered, then dequantised) and the expert layout
    give the one-rank int4 model's tokens, and its logits up to fp32 summation order: the groups lie
    along the input dim, so both layouts hold the one-rank numbers."""

    prompts = left_pad(random_prompts(tiny_port.config.vocab_size, [23, 7], seed=44), 0)
    gens = {
        "channel": TPGenerator(tiny_port, tp_backend(2, quantization="int4")),
        "expert": TPGenerator(tiny_port, tp_backend(2, expert_layout=layout.EXPERT, quantization="int4")),
    }
    out = generate_replicated(gens, *prompts, 6)  # raises if rank 1's tokens differ from rank 0's
    want = greedy(build_model(tiny_port, "dense_masked", torch.float32, quantization="int4"), *prompts, 6)
    for name, got in out.items():
        assert torch.equal(got.tokens, want.tokens), name
        assert (got.logits - want.logits).abs().max() <= 1e-4 * want.logits.abs().max(), name
    assert expert_reads(gens["channel"].programs["decode"])["gathered"]
    for name, gen in gens.items():  # int4 at TP 2: no right shift of a non-32-bit integer (NCC_EVRF022)
        assert preflight_violations(gen.programs) == [], name
    packed = gens["channel"].states[1]["model.model.layers.0.experts.down_proj.weight"]
    assert packed.dtype == torch.uint8 and packed.shape == (16, 16, 128)  # rank 1's I/t = 32 channels, packed


def test_int4_group_must_fit_a_row_rank(tiny_port):
    """The channel layout at TP 4 leaves each rank 16 of an expert's 64 channels: no whole group of 32."""

    with pytest.raises(int4.Int4Error, match="group size 32 does not divide the 16 input channels of a rank"):
        ParallelMoE(tiny_port.config, 4, cpu, fmt=FORMATS["int4"])


def _experts_bytes(out) -> int:
    """Bytes of the routed experts' tensors (weights and scales) in every rank's weight file."""
    total = 0
    for rank in range(2):
        for name, t in load_file(out / na.RANK_WEIGHTS.format(rank=rank)).items():
            if ".experts.gate_up_proj." in name or ".experts.down_proj." in name:
                total += t.numel() * t.element_size()
    return total


def test_dry_run_artifact_holds_int4_experts_in_under_065_of_int8s_bytes(tiny_port, tmp_path):
    """trace-and-compile --dry-run --tp 2 of the tiny port: the int4 artifact's experts (packed weights
    and their scales, both ranks) take at most 0.65 of the int8 artifact's; the ranks hold the packed
    uint8 shards with bf16 scales, down's split with its weight."""
    for quantization in ("int8", "int4"):
        build = nc.Build.at(tp=2, out=tmp_path / quantization, quantization=quantization, dry_run=True, export=False)
        nc.trace_and_compile(tiny_port, build)
    manifest = na.read_manifest(tmp_path / "int4")
    assert (manifest["dtype"], manifest["quantization"]) == ("bfloat16", "int4")
    int8_bytes, int4_bytes = _experts_bytes(tmp_path / "int8"), _experts_bytes(tmp_path / "int4")
    assert int4_bytes <= 0.65 * int8_bytes
    E, inter, H, L = 16, 64, 128, 4  # the tiny port; group 32, bf16 scales
    assert int4_bytes == L * E * (
        2 * inter * H // 2 + 2 * inter * (H // 32) * 2 + H * inter // 2 + H * (inter // 32) * 2
    )
    shard = load_file(tmp_path / "int4" / na.RANK_WEIGHTS.format(rank=1))
    down, scale = (shard[f"model.model.layers.2.experts.down_proj.{n}"] for n in ("weight", "group_scale"))
    assert (down.dtype, tuple(down.shape)) == (torch.uint8, (E, inter // 2 // 2, H))
    assert (scale.dtype, tuple(scale.shape)) == (torch.bfloat16, (E, inter // 2 // 32, H))


def test_a_degree_whose_ranks_hold_no_whole_group_is_refused_before_any_weight(capsys):
    """validate's TP int4 at the default degree 8 leaves each rank 8 of the tiny port's 64 channels."""
    assert main(["validate", "--backend", "tp", "--quantization", "int4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: int4 group size 32 does not divide the 8 input channels each rank holds of "
        "model.layers.0.experts.down_proj.weight at TP 8 in the channel layout: use a lower TP degree or "
        "--expert-layout expert"
    )


def _quantization_choices(name: str, sub: argparse.ArgumentParser):
    """(command, --quantization's choices) of `sub` and of its own subcommands (`deploy k8s`)."""
    for action in sub._actions:
        if "--quantization" in action.option_strings:
            yield name, tuple(action.choices)
        if isinstance(action, argparse._SubParsersAction):
            for child, parser in action.choices.items():
                yield from _quantization_choices(f"{name} {child}", parser)


def test_int4_is_offered_wherever_int8_is_and_the_one_rank_reader_refuses_it(capsys):
    """--quantization int4 is offered wherever int8 is (every command's choices are the same: every
    registered format); the one-rank reader (no int4 reader is built) refuses it in one error line before any
    work."""
    subcommands = next(a for a in cli_parser.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    offers = dict(c for name, sub in subcommands.items() for c in _quantization_choices(name, sub))
    assert {"validate", "eval-tasks", "serve", "trace-and-compile", "reads", "plan", "deploy k8s"} <= set(offers)
    assert all(choices == spec.QUANTIZATIONS and "int4" in choices for choices in offers.values()), offers
    assert main(["validate", "--backend", "reader", "--budget", "50", "--quantization", "int4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --backend reader reads the model's own or the int8 experts, not --quantization int4 (no int4 "
        "reader is built; `neuron-moe reads --quantization int4` accounts one)"
    )


def test_quantizing_takes_each_float_experts_linear_out_as_it_goes(tiny_eager):
    """The state dict is consumed tensor by tensor (never the float and the int4 experts both whole);
    the result is the per-tensor quantisation, everything else passed on as it was."""
    full = layout.parallel_state_dict(tiny_eager.state_dict(), tiny_eager.config, 2, layout.CHANNEL)
    copy = dict(full)
    out = quantize_state(full, "int4")
    assert full == {}
    name = "model.layers.1.experts.down_proj.weight"
    packed, scale = int4.quantize(copy[name])
    assert torch.equal(out[name], packed) and torch.equal(out[name.replace("weight", "group_scale")], scale)
    assert all(out[k] is v for k, v in copy.items() if ".experts." not in k)
    with pytest.raises(UserError, match="--quantization 'int3'"):
        quantize_state(copy, "int3")


def test_the_reader_accounting_charges_int4_as_the_format_holds_it():
    """Gemma-4 26B's geometry: a routed expert read whole is the format's packed bytes and scales (to
    the sector), a channel three rows of H/2 bytes with H/32 bf16 scales each; the bf16 sketch and
    recovery then cost 19 % of the int4 read, so a 17.8 % budget is refused, naming that floor."""
    geo = Geometry(hidden=2816, experts=128, top_k=8, intermediate=704)
    whole = acc.expert_read_bytes(geo, "int4")
    assert 0 <= whole - (int4.INT4.nbytes((2 * 704, 2816)) + int4.INT4.nbytes((2816, 704))) < 2 * 2 * acc.SECTOR
    assert acc.channel_bytes(geo, "int4") == 3 * acc.row_sectors(2816 // 2 + 2816 // 32 * 2) * acc.SECTOR
    assert acc.channel_bytes(geo, "int4") < acc.channel_bytes(geo, "int8") / 1.7
    settings = Reader(quantization="int4").resolved()
    with pytest.raises(acc.BudgetError, match="budget 17.8% is below .* int4 experts"):
        acc.solve_k(geo, settings, 17.8)
    assert acc.solve_k(geo, settings, 25.0) == 328
