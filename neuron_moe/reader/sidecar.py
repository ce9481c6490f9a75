"""The reader's sidecar format: what the file holds, byte by byte, and how it is read back.

One safetensors file per model (or per rank: `shard.py`), docs/reader.md describing it in full:

- metadata (`metadata`): format and version, the block, scan, recovery rank and seed it was made
  with, the expert geometry, the layer count, `source_sha256`, the digest of the expert weights
  it was made from (`SourceDigest`: bf16, HF's layout), so a sidecar is never used with other weights,
  and `layers_sha256`, each layer's digest of its own bytes, so a corrupt file is never read as data;
- `hadamard_signs` [H_pad] int8, then per layer `LAYER_TENSORS`, shaped by `SidecarLayout`:
  codes (base-3, 5 per byte, coordinate-major: `pack_codes` / `unpack_codes`), scales, down_norms,
  basis (U) and coeffs (b_j).

`stream_layers` writes that layout from tensors as they come (bounded memory); `Sidecar` opens a file
and checks every field against it, and each layer as it is read (`Sidecar.layer`): its digest, its code
bytes, its numbers finite. What goes into the tensors, the prep algorithm, is `prep.py`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError
from ..spec import BLOCK  # coordinates per Hadamard block
from .geometry import Geometry
from .hadamard import padded, random_signs

FORMAT = "neuron-moe-reader"
FORMAT_VERSION = 3  # 1: 2-bit codes (4 per byte); 2: base-3 codes (5 per byte); 3: and each layer's sha256
SECTOR = 32  # bytes: the unit a GPU memory read is charged in; a coordinate's strip of codes is whole sectors
CODES_PER_BYTE = 5  # base-3 digits: byte = Σ_t digit(row 5q+t)·3^t, digit = code mod 3 (0, +1 -> 1, -1 -> 2)
POW3 = (1, 3, 9, 27, 81)
CODE_BYTES = 3**CODES_PER_BYTE  # 243: bytes 0..242 hold five codes; 243..255 are never written
FLOAT = torch.bfloat16  # scales, norms, U and b
LAYER_TENSORS = ("codes", "scales", "down_norms", "basis", "coeffs")
SIGNS = "hadamard_signs"
_ST_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.bfloat16: "BF16", torch.float32: "F32"}


class SidecarError(UserError):
    pass


@dataclass(frozen=True)
class SidecarLayout:
    """Shapes and paddings of one layer's sidecar tensors: the experts' geometry (its top_k plays no
    part) and the recovery rank U and b_j are stored at."""

    geometry: Geometry
    rank: int  # columns of U and of every b_j

    @property
    def hidden_padded(self) -> int:
        return padded(self.geometry.hidden, BLOCK)

    @property
    def blocks(self) -> int:
        return self.hidden_padded // BLOCK

    @property
    def rows(self) -> int:  # gate rows then up rows, as in gate_up_proj
        return 2 * self.geometry.intermediate

    @property
    def rows_padded(self) -> int:
        """Rows rounded up so one coordinate's strip of codes is whole sectors."""
        return padded(self.rows, SECTOR * CODES_PER_BYTE)

    @property
    def strip_bytes(self) -> int:
        """Bytes of one coordinate's strip of codes: every gate/up row's code, 5 per byte, whole sectors."""
        return self.rows_padded // CODES_PER_BYTE

    def layer_tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        E, I, nb = self.geometry.experts, self.geometry.intermediate, self.blocks
        return {
            "codes": (torch.uint8, (E, nb, BLOCK, self.strip_bytes)),
            "scales": (FLOAT, (E, nb, self.rows)),
            "down_norms": (FLOAT, (E, I)),
            "basis": (FLOAT, (self.geometry.hidden, self.rank)),
            "coeffs": (FLOAT, (E, I, self.rank)),
        }


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in {-1, 0, 1} [..., R] (R % 5 == 0) -> uint8 [..., R/5]; row r is base-3 digit r % 5 of
    byte r // 5, the digit being the code mod 3 (0 -> 0, +1 -> 1, -1 -> 2), so zero bytes are zero codes."""
    digits = (codes.to(torch.int16) % 3).reshape(*codes.shape[:-1], -1, CODES_PER_BYTE)
    return (digits * torch.tensor(POW3, dtype=torch.int16, device=codes.device)).sum(-1).to(torch.uint8)


def _unpack_table() -> torch.Tensor:
    """int8 [256, 5]: the five codes of every byte (digit d = byte // 3^t % 3, code = d − 3·(d >> 1))."""
    digits = torch.arange(256, dtype=torch.int16)[:, None] // torch.tensor(POW3, dtype=torch.int16) % 3
    return (digits - 3 * (digits >> 1)).to(torch.int8)


_UNPACK = _unpack_table()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., B] -> int8 codes [..., 5B], by table lookup (one gather: 3-4x faster than the arithmetic)."""
    return _UNPACK.to(packed.device)[packed.int()].reshape(*packed.shape[:-1], -1)


class SourceDigest:
    """sha256 of the expert weights a sidecar is made from, layer by layer, as bf16 in HF's layout.

    bf16 is the canonical form, so one sidecar serves the same checkpoint loaded in fp32 or bf16.
    """

    def __init__(self):
        self._hash = hashlib.sha256()

    def update(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        for t in (gate_up, down):
            self._hash.update(repr(tuple(t.shape)).encode())
            self._hash.update(t.detach().to(torch.bfloat16).contiguous().view(torch.uint8).numpy().data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def source_digest(layers: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> str:
    digest = SourceDigest()
    for gate_up, down in layers:
        digest.update(gate_up, down)
    return digest.hexdigest()


def metadata(layout: SidecarLayout, layers: int, scan: int, seed: int, digest: str) -> dict[str, str]:
    """The header's `__metadata__`: every field `Sidecar` reads back (a shard adds tp, tp_rank, expert_layout).
    `layers_sha256` holds placeholders until `stream_layers` has written the layers."""
    geo = layout.geometry
    return {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "block": str(BLOCK),
        "scan": str(scan),
        "rank": str(layout.rank),
        "seed": str(seed),
        "codes_per_byte": str(CODES_PER_BYTE),
        "hidden": str(geo.hidden),
        "experts": str(geo.experts),
        "intermediate": str(geo.intermediate),
        "layers": str(layers),
        "source_sha256": digest,
        "layers_sha256": ",".join([PLACEHOLDER] * layers),
    }


def _specs(layout: SidecarLayout, layers: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    specs = {SIGNS: (torch.int8, (layout.hidden_padded,))}
    for i in range(layers):
        specs.update({f"layers.{i}.{name}": spec for name, spec in layout.layer_tensors().items()})
    return specs


PLACEHOLDER = "0" * 64  # a digest's place in the header, until what it digests has streamed through


def _raw(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes as they lie in the file (row-major, little-endian); an empty one's are none."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data


def stream_layers(
    f,
    layout: SidecarLayout,
    layers: int,
    meta: dict[str, str],
    signs: torch.Tensor,
    tensors: Iterable[dict[str, torch.Tensor]],
    digest=None,
) -> None:
    """Write a sidecar to the open, seekable file `f`: the header (every offset follows from the geometry),
    the signs, then each layer's tensors as `tensors` yields them (bounded memory); then each layer's
    digest in place of the placeholders of `layers_sha256`, and `digest()`, if given, in place of
    the placeholder `source_sha256` of `meta`."""
    specs = _specs(layout, layers)
    header, offset = {"__metadata__": meta}, 0
    for name, (dtype, shape) in specs.items():
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    f.write(struct.pack("<Q", len(text)) + text)

    def put(name, tensor):
        dtype, shape = specs[name]
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape, (name, tensor.dtype, tensor.shape)
        data = _raw(tensor)
        f.write(data)
        return data

    def patch(key: str, value: str) -> None:  # a metadata value of the same length as its placeholder
        f.seek(8 + text.index(json.dumps(key).encode() + b":") + len(json.dumps(key)) + 2)
        f.write(value.encode())

    put(SIGNS, signs)
    layer_digests = []
    for i, layer in enumerate(tensors):
        layer_digest = hashlib.sha256()
        for name in LAYER_TENSORS:
            layer_digest.update(put(f"layers.{i}.{name}", layer[name]))
        layer_digests.append(layer_digest.hexdigest())
    patch("layers_sha256", ",".join(layer_digests))
    if digest is not None:
        patch("source_sha256", digest())


@dataclass(frozen=True)
class LayerSidecar:
    """One layer's sidecar tensors, as the reference forward consumes them."""

    codes: torch.Tensor  # uint8 [E, nb, 128, R_pad/5]
    scales: torch.Tensor  # bf16 [E, nb, 2I]
    down_norms: torch.Tensor  # bf16 [E, I]
    basis: torch.Tensor  # bf16 [H, rank]   U
    coeffs: torch.Tensor  # bf16 [E, I, rank]   b_j = Uᵀ d_j
    signs: torch.Tensor  # int8 [H_pad]

    @classmethod
    def from_tensors(cls, tensors: dict, signs: torch.Tensor) -> "LayerSidecar":
        return cls(signs=signs, **{name: tensors[name] for name in LAYER_TENSORS})


class Sidecar:
    """An opened, checked sidecar: metadata and geometry now, layer tensors on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        meta, keys = self._header()
        fields = self._fields(meta, keys)
        self.scan, self.seed, self.layers = fields["scan"], fields["seed"], fields["layers"]
        if not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise SidecarError(f"{self.path}: metadata seed {self.seed} is outside [-2^63, 2^64)")
        self.source_sha256 = meta.get("source_sha256", "")
        self.layers_sha256 = meta.get("layers_sha256", "").split(",")
        if len(self.layers_sha256) != self.layers or not all(_is_sha256(d) for d in self.layers_sha256):
            raise SidecarError(
                f"{self.path}: metadata layers_sha256 is not {self.layers} sha256 digests "
                f"(one per layer, comma-separated)"
            )
        # a tensor-parallel shard (`shard.py`): one rank's channels of every expert; None for a whole sidecar
        self.tp = self.tp_rank = self.expert_layout = None
        if "tp" in meta:
            try:
                self.tp, self.tp_rank = int(meta["tp"]), int(meta["tp_rank"])
            except (KeyError, ValueError):
                raise SidecarError(f"{self.path}: metadata tp / tp_rank missing or not an integer") from None
            self.expert_layout = meta.get("expert_layout")
        geometry = Geometry(hidden=fields["hidden"], experts=fields["experts"], intermediate=fields["intermediate"])
        self.layout = SidecarLayout(geometry, fields["rank"])
        self.signs = self._check_tensors(keys)
        if not torch.equal(self.signs, random_signs(self.layout.hidden_padded, self.seed)):
            raise SidecarError(f"{self.path}: {SIGNS} are not those of seed {self.seed}")

    def _header(self) -> tuple[dict, set]:
        """The file's metadata and tensor names, once it is known to be a sidecar of this format version."""
        if not self.path.is_file():
            raise SidecarError(f"reader sidecar not found: {self.path}")
        try:
            with safe_open(self.path, framework="pt") as f:
                meta, keys = f.metadata() or {}, set(f.keys())
        except Exception as e:  # safetensors' own error type, or OSError
            raise SidecarError(f"{self.path}: not a readable safetensors file ({e})") from None
        if meta.get("format") != FORMAT:
            raise SidecarError(
                f"{self.path}: not a reader sidecar (metadata format {meta.get('format')!r}, expected {FORMAT!r})"
            )
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise SidecarError(
                f"{self.path}: sidecar format version {meta.get('format_version')!r}; this build "
                f"reads version {FORMAT_VERSION} (re-run `neuron-moe prep-reader`)"
            )
        return meta, keys

    def _fields(self, meta: dict, keys: set) -> dict[str, int]:
        """The metadata's integer fields, checked against this build's block and the file's tensor count."""
        names = ("block", "scan", "rank", "seed", "codes_per_byte", "hidden", "experts", "intermediate", "layers")
        try:
            fields = {k: int(meta[k]) for k in names}
        except (KeyError, ValueError) as e:
            raise SidecarError(f"{self.path}: metadata field {e} missing or not an integer") from None
        if (fields["block"], fields["codes_per_byte"]) != (BLOCK, CODES_PER_BYTE):
            raise SidecarError(
                f"{self.path}: block {fields['block']}, {fields['codes_per_byte']} codes per byte; "
                f"this build reads block {BLOCK}, {CODES_PER_BYTE} codes per byte"
            )
        if not 1 <= fields["layers"] <= len(keys):
            # before the table of every layer's tensors is built: a header claiming 10^8 layers is not believed
            raise SidecarError(
                f"{self.path}: metadata says {fields['layers']} layers; the file holds "
                f"{len(keys)} tensors (1 + {len(LAYER_TENSORS)} per layer)"
            )
        return fields

    def _check_tensors(self, keys: set) -> torch.Tensor:
        """Refuse unless the file holds exactly the layout's tensors, each of its dtype and shape; the signs."""
        specs = _specs(self.layout, self.layers)
        if keys != set(specs):
            missing, extra = sorted(set(specs) - keys), sorted(keys - set(specs))
            raise SidecarError(
                f"{self.path}: tensors do not match the metadata; missing {missing[:5]}, unexpected {extra[:5]}"
            )
        with safe_open(self.path, framework="pt") as f:
            for name, (dtype, shape) in specs.items():
                sl = f.get_slice(name)
                if _ST_DTYPES[dtype] != sl.get_dtype() or tuple(sl.get_shape()) != shape:
                    raise SidecarError(
                        f"{self.path}: {name} is {sl.get_dtype()} {tuple(sl.get_shape())}, "
                        f"expected {_ST_DTYPES[dtype]} {shape}"
                    )
            return f.get_tensor(SIGNS)

    def check_source(self, weights: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Refuse unless the sidecar was made from exactly these expert weights (bf16-equal)."""
        got = source_digest(weights)
        if got != self.source_sha256:
            raise SidecarError(
                f"{self.path}: made from other expert weights (sidecar source sha256 "
                f"{self.source_sha256[:16]}…, these weights {got[:16]}…); re-run "
                f"`neuron-moe prep-reader` for this model"
            )

    def layer(self, index: int) -> LayerSidecar:
        """Layer `index`'s tensors, refused unless they are the bytes the sidecar was written with
        (a corrupt file), their codes valid bytes, their numbers finite and the norms and scales at least
        0 (a file written otherwise)."""
        with safe_open(self.path, framework="pt") as f:
            tensors = {name: f.get_tensor(f"layers.{index}.{name}") for name in LAYER_TENSORS}
        digest = hashlib.sha256()
        for name in LAYER_TENSORS:
            digest.update(_raw(tensors[name]))
        if digest.hexdigest() != self.layers_sha256[index]:
            raise SidecarError(
                f"{self.path}: layer {index}'s tensors do not match their sha256 in the metadata "
                f"(the file is corrupt); re-run `neuron-moe prep-reader`"
            )
        codes = tensors["codes"]
        if codes.numel() and int(codes.max()) >= CODE_BYTES:
            bad = int((codes >= CODE_BYTES).sum())
            raise SidecarError(
                f"{self.path}: layers.{index}.codes holds {bad} byte(s) above {CODE_BYTES - 1}, "
                f"which no five base-3 codes make"
            )
        for name in ("scales", "down_norms", "basis", "coeffs"):
            if not torch.isfinite(tensors[name]).all():
                raise SidecarError(f"{self.path}: layers.{index}.{name} holds NaN or inf")
        for name in ("scales", "down_norms"):  # a mean magnitude and a column norm: never below 0
            negative = int((tensors[name] < 0).sum())
            if negative:
                raise SidecarError(
                    f"{self.path}: layers.{index}.{name} holds {negative} negative value(s); "
                    f"{'scales are mean magnitudes' if name == 'scales' else 'down_norms are norms'}, "
                    "at least 0 (no prep writes this)"
                )
        return LayerSidecar.from_tensors(tensors, self.signs)


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)
