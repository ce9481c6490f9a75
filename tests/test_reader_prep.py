"""Reader weight prep: the Hadamard rotation, the ternary sketch, the layout every kernel reads,
the recovery map, and the sidecar file (round trip, and every way it can be wrong)."""

import hashlib
import itertools
import json
import os
import shutil
import stat
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import trained_like
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.hadamard import fwht, padded, random_signs, rotate_blocks
from neuron_moe.reader.prep import prep_layer, ternary, write_sidecar
from neuron_moe.reader.sidecar import (
    BLOCK,
    FORMAT_VERSION,
    LAYER_TENSORS,
    Sidecar,
    SidecarError,
    SidecarLayout,
    pack_codes,
    source_digest,
    unpack_codes,
)


def sylvester(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("n", [1, 2, 8, 128])
def test_fwht_is_the_sylvester_hadamard_matrix(n):
    x = torch.randn(3, 5, n, dtype=torch.float64)
    assert torch.allclose(fwht(x), x @ sylvester(n).double(), atol=1e-10)


def test_fwht_refuses_a_length_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two length, got 96"):
        fwht(torch.zeros(96))


def test_rotation_keeps_inner_products_and_pads_odd_hidden_sizes():
    hidden = 200  # not a multiple of 128: padded to two blocks, not rejected
    signs = random_signs(padded(hidden, BLOCK), seed=3)
    x, rows = torch.randn(4, hidden, dtype=torch.float64), torch.randn(6, hidden, dtype=torch.float64)
    rx, rr = rotate_blocks(x, signs, BLOCK), rotate_blocks(rows, signs, BLOCK)
    assert rx.shape == (4, 2, BLOCK)
    assert torch.allclose(rr.flatten(1) @ rx.flatten(1).T, (rows @ x.T).float(), rtol=1e-5, atol=1e-4)
    assert torch.allclose(rx.flatten(1).norm(dim=1), x.norm(dim=1).float(), rtol=1e-5)
    # the signs matter: without them R is plain Hadamard, a different rotation
    assert not torch.allclose(rx, rotate_blocks(x, torch.ones_like(signs), BLOCK))


def test_signs_are_seeded():
    assert torch.equal(random_signs(256, 7), random_signs(256, 7))
    assert not torch.equal(random_signs(256, 7), random_signs(256, 8))
    assert set(random_signs(256, 7).tolist()) == {-1, 1}


def test_codes_pack_five_per_byte_base3_row_minor():
    # row r is base-3 digit r % 5 of byte r // 5; the digit is the code mod 3: 0 -> 0, +1 -> 1, -1 -> 2
    codes = torch.tensor([0, 1, -1, 0, -1, 1, 1, 0, 0, -1], dtype=torch.int8)
    assert pack_codes(codes).tolist() == [0 + 1 * 3 + 2 * 9 + 0 * 27 + 2 * 81, 1 + 1 * 3 + 0 * 9 + 0 * 27 + 2 * 81]
    assert unpack_codes(torch.zeros(3, dtype=torch.uint8)).eq(0).all()  # zero bytes are zero codes (padding)
    assert unpack_codes(torch.tensor([242], dtype=torch.uint8)).tolist() == [-1] * 5  # the largest byte written
    random = torch.randint(-1, 2, (5, 7, 60), dtype=torch.int8)
    assert torch.equal(unpack_codes(pack_codes(random)), random)


def test_ternary_is_the_least_squares_optimum():
    """Against brute force over every code vector in {-1,0,1}^8 (each with its best scale)."""
    all_codes = torch.tensor([c for c in itertools.product((-1.0, 0.0, 1.0), repeat=8) if any(c)])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(8, generator=gen, dtype=torch.float64) * torch.rand(8, generator=gen, dtype=torch.float64)
        scale = (all_codes.double() @ x) / all_codes.square().sum(1).double()
        best = (x - scale[:, None] * all_codes.double()).square().sum(1).min()
        codes, s = ternary(x)
        assert (x - s * codes).square().sum() <= best + 1e-12
    codes, s = ternary(torch.zeros(2, 128))
    assert codes.eq(0).all() and s.eq(0).all()


@pytest.fixture(scope="module")
def small():
    """Odd sizes on purpose: hidden 200 (padded to 256), 2I = 80 rows (padded to 128 in the strips)."""
    ex = trained_like.experts(num_experts=3, inter=40, hidden=200, seed=5)
    signs = random_signs(padded(200, BLOCK), seed=0)
    return ex, signs, prep_layer(ex.gate_up_proj, ex.down_proj, signs, rank=16)


def test_prep_layer_shapes_match_the_layout(small):
    ex, _, out = small
    spec = SidecarLayout(Geometry(hidden=200, experts=3, intermediate=40), rank=16).layer_tensors()
    assert set(out) == set(LAYER_TENSORS) == set(spec)
    for name, (dtype, shape) in spec.items():
        assert out[name].dtype == dtype and tuple(out[name].shape) == shape, name
    assert spec["codes"][1] == (3, 2, BLOCK, 32)  # 160 padded rows / 5 codes per byte = one sector per strip


def test_codes_are_coordinate_major_and_scales_per_row_and_block(small):
    """Byte layout: codes[e, b, c, r // 5] holds row r's code at coordinate c of block b."""
    ex, signs, out = small
    for e in range(3):
        want_codes, want_scales = ternary(rotate_blocks(ex.gate_up_proj[e], signs, BLOCK))  # [80, 2, 128], [80, 2]
        got = unpack_codes(out["codes"][e])  # [2, 128, 160 rows]
        assert torch.equal(got[..., :80], want_codes.permute(1, 2, 0))
        assert got[..., 80:].eq(0).all()  # padding rows
        assert torch.allclose(out["scales"][e].float(), want_scales.T, rtol=2**-8)
    # the sketch is a sketch: decoded and rotated back it approximates the rows
    decoded = (unpack_codes(out["codes"][0])[..., :80].float() * out["scales"][0].float()[:, None, :]).permute(2, 0, 1)
    true = rotate_blocks(ex.gate_up_proj[0], signs, BLOCK)
    cos = torch.nn.functional.cosine_similarity(decoded.flatten(1), true.flatten(1))
    assert cos.min() > 0.85


def test_norms_and_recovery_map(small):
    ex, _, out = small
    assert torch.allclose(out["down_norms"].float(), ex.down_proj.norm(dim=1), rtol=2**-8)
    basis = out["basis"].float()
    assert torch.allclose(basis.T @ basis, torch.eye(16), atol=2e-2)  # orthonormal up to bf16
    stacked = ex.down_proj.permute(1, 0, 2).reshape(200, -1)  # [H, E·I]: every down column
    u = torch.linalg.svd(stacked.double(), full_matrices=False).U[:, :16].float()
    assert (basis @ basis.T - u @ u.T).abs().max() < 2e-2  # the top-16 left singular subspace
    want = torch.einsum("hr,ehi->eir", basis, ex.down_proj)
    assert torch.allclose(out["coeffs"].float(), want, rtol=2e-2, atol=1e-3 * want.abs().max())


def write_small(path, layers, seed=0, rank=16):
    return write_sidecar(
        path,
        layers,
        Geometry(hidden=200, experts=3, intermediate=40),
        layers=len(layers),
        seed=seed,
        rank=rank,
        progress=False,
    )


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    layers = [(e.gate_up_proj, e.down_proj) for e in (trained_like.experts(3, 40, 200, seed=s) for s in (5, 6))]
    path = write_small(tmp_path_factory.mktemp("sidecar") / "reader.safetensors", layers)
    return path, layers


def test_sidecar_is_plain_safetensors_with_the_prep_output(sidecar):
    path, layers = sidecar
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # what open() gives, not mkstemp's 0600
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + header_len])
    meta = header["__metadata__"]
    assert meta["format"] == "neuron-moe-reader" and meta["format_version"] == str(FORMAT_VERSION)
    assert (meta["block"], meta["scan"], meta["rank"], meta["seed"], meta["layers"]) == ("128", "80", "16", "0", "2")
    assert meta["source_sha256"] == source_digest(layers)
    tensors = load_file(path)  # any safetensors reader can open it
    signs = random_signs(256, 0)
    assert torch.equal(tensors["hadamard_signs"], signs)
    for i, (gate_up, down) in enumerate(layers):
        for name, want in prep_layer(gate_up, down, signs, rank=16).items():
            assert torch.equal(tensors[f"layers.{i}.{name}"], want), name
    side = Sidecar(path)
    assert (side.layers, side.scan, side.layout.rank) == (2, 80, 16)
    side.check_source(layers)  # the same weights pass
    assert torch.equal(side.layer(1).codes, tensors["layers.1.codes"])


def test_the_digest_is_that_of_the_bf16_weights(sidecar):
    _, layers = sidecar
    bf16 = [(g.bfloat16(), d.bfloat16()) for g, d in layers]
    assert source_digest(bf16) == source_digest(layers)  # fp32 or bf16 copy of one checkpoint: same sidecar
    nudged = [(layers[0][0].clone(), layers[0][1]), layers[1]]
    nudged[0][0][2, 7, 9] += 0.1
    assert source_digest(nudged) != source_digest(layers)


def test_a_sidecar_of_other_weights_is_refused(sidecar):
    path, layers = sidecar
    other = [(e.gate_up_proj, e.down_proj) for e in (trained_like.experts(3, 40, 200, seed=s) for s in (5, 7))]
    with pytest.raises(SidecarError, match="made from other expert weights"):
        Sidecar(path).check_source(other)


def _rewrite(src, dst, edit_meta=None, edit_tensors=None):
    with safe_open(src, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (edit_meta or (lambda m: None))(meta)
    (edit_tensors or (lambda t: None))(tensors)
    save_file(tensors, dst, metadata=meta)
    return dst


@pytest.mark.parametrize(
    "edit_meta,edit_tensors,message",
    [
        (lambda m: m.update(format_version="2"), None, r"sidecar format version '2'; this build reads version 3"),
        (
            lambda m: m.update(codes_per_byte="4"),
            None,
            "4 codes per byte; this build reads block 128, 5 codes per byte",
        ),
        (lambda m: m.update(format="something-else"), None, "not a reader sidecar"),
        (lambda m: m.update(block="64"), None, "block 64"),
        (lambda m: m.pop("rank"), None, "metadata field 'rank' missing"),
        (lambda m: m.update(seed="1"), None, "hadamard_signs are not those of seed 1"),
        # a header claiming 10^8 layers is refused before a table of 5·10^8 tensor specs is built (minutes, GBs)
        (lambda m: m.update(layers="100000000"), None, "metadata says 100000000 layers; the file holds 11 tensors"),
        (lambda m: m.update(layers="-3"), None, "metadata says -3 layers"),
        (None, lambda t: t.pop("layers.1.coeffs"), r"missing \['layers.1.coeffs'\]"),
        (None, lambda t: t.update({"layers.0.scales": t["layers.0.scales"].float()}), "layers.0.scales is F32"),
    ],
)
def test_bad_sidecars_name_the_problem(sidecar, tmp_path, edit_meta, edit_tensors, message):
    bad = _rewrite(sidecar[0], tmp_path / "bad.safetensors", edit_meta, edit_tensors)
    with pytest.raises(SidecarError, match=message):
        Sidecar(bad)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m.pop("layers_sha256"), "metadata layers_sha256 is not 2 sha256 digests"),
        (lambda m: m.update(layers_sha256=m["layers_sha256"].split(",")[0]), "layers_sha256 is not 2 sha256 digests"),
        (lambda m: m.update(layers_sha256=m["layers_sha256"].upper()), "layers_sha256 is not 2 sha256 digests"),
        (lambda m: m.update(seed=str(2**64)), r"metadata seed 18446744073709551616 is outside \[-2\^63, 2\^64\)"),
    ],
)
def test_bad_digests_and_seeds_are_refused_on_open(sidecar, tmp_path, edit, message):
    with pytest.raises(SidecarError, match=message):
        Sidecar(_rewrite(sidecar[0], tmp_path / "bad.safetensors", edit))


def _flip_byte(path: Path, tensor: str, at: int) -> None:
    """XOR one byte of `tensor`'s data in place, as a bad disk or a truncated copy would."""
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    begin = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0]
    raw[8 + n + begin + at] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("tensor", ["layers.1.codes", "layers.1.scales", "layers.1.coeffs"])
def test_a_byte_flipped_layer_is_refused_by_name(sidecar, tmp_path, tensor):
    """Any one byte of a layer changed (here in the layer read second) fails that layer's sha256."""
    bad = tmp_path / "flipped.safetensors"
    shutil.copy(sidecar[0], bad)
    _flip_byte(bad, tensor, 7)
    side = Sidecar(bad)  # the header is intact
    side.layer(0)
    with pytest.raises(SidecarError, match=r"flipped\.safetensors: layer 1's tensors do not match their sha256"):
        side.layer(1)


def _restamp(meta: dict, tensors: dict, layers: int) -> None:
    """What a tool that rewrites the tensors and their digests would write: the digests match."""
    digests = []
    for i in range(layers):
        h = hashlib.sha256()
        for name in LAYER_TENSORS:
            h.update(tensors[f"layers.{i}.{name}"].contiguous().reshape(-1).view(torch.uint8).numpy().data)
        digests.append(h.hexdigest())
    meta["layers_sha256"] = ",".join(digests)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t["layers.0.codes"].fill_(250), r"layers\.0\.codes holds \d+ byte\(s\) above 242"),
        (lambda t: t["layers.0.codes"].view(-1)[3].fill_(243), r"layers\.0\.codes holds 1 byte\(s\) above 242"),
        (lambda t: t["layers.0.scales"].fill_(float("nan")), r"layers\.0\.scales holds NaN or inf"),
        (lambda t: t["layers.0.coeffs"].view(-1)[5].fill_(float("inf")), r"layers\.0\.coeffs holds NaN or inf"),
        (
            lambda t: t["layers.0.down_norms"].view(-1)[2].fill_(-0.5),
            r"layers\.0\.down_norms holds 1 negative value\(s\); down_norms are norms, at least 0",
        ),
        (
            lambda t: t["layers.0.scales"].view(-1)[0].fill_(-1.0),
            r"layers\.0\.scales holds 1 negative value\(s\); scales are mean magnitudes, at least 0",
        ),
    ],
)
def test_invalid_codes_and_non_finite_numbers_are_refused(sidecar, tmp_path, edit, message):
    """Content that no prep writes, even with digests that match it: invalid code bytes (the reader
    would read them as codes), NaN or inf (caught before, only as NaN logits), a negative norm or
    scale (which would rank channels backwards)."""
    with safe_open(sidecar[0], framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    _restamp(meta, tensors, 2)
    save_file(tensors, tmp_path / "bad.safetensors", metadata=meta)
    with pytest.raises(SidecarError, match=message):
        Sidecar(tmp_path / "bad.safetensors").layer(0)


def test_a_sidecar_of_rank_0_is_written_and_read(tmp_path):
    """Recovery off: U and every b_j have no columns (an empty tensor has no bytes to write)."""
    layers = [(e.gate_up_proj, e.down_proj) for e in (trained_like.experts(3, 40, 200, seed=5),)]
    side = Sidecar(write_small(tmp_path / "r0.safetensors", layers, rank=0))
    assert side.layout.rank == 0 and side.layer(0).basis.shape == (200, 0)


def test_truncated_and_missing_sidecars(sidecar, tmp_path):
    data = sidecar[0].read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(SidecarError, match=r"cut\.safetensors: not a readable safetensors file"):
        Sidecar(tmp_path / "cut.safetensors")
    with pytest.raises(SidecarError, match="reader sidecar not found"):
        Sidecar(tmp_path / "none.safetensors")


def test_weights_that_do_not_fit_the_geometry_leave_no_file(sidecar, tmp_path):
    _, layers = sidecar
    out = tmp_path / "x.safetensors"
    with pytest.raises(SidecarError, match="expected 3 layers of expert weights, got 2"):
        write_sidecar(out, layers, Geometry(hidden=200, experts=3, intermediate=40), layers=3, progress=False)
    wrong = [(layers[0][0][:2], layers[0][1][:2])]
    with pytest.raises(SidecarError, match=r"layer 0: expert weights \(2, 80, 200\)"):
        write_sidecar(out, wrong, Geometry(hidden=200, experts=3, intermediate=40), layers=1, progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing half-written
