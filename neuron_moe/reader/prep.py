"""The reader's weight prep and sidecar format: the one definition every backend consumes.

Per MoE layer, once, from the expert weights alone (no calibration data):

- every gate and up row (gate_up_proj [E, 2I, H]) is zero-padded to whole 128-coordinate
  blocks and rotated per block by R = H·diag(s)/√128 (`hadamard.py`, seeded signs s);
- each rotated (row, block) gets a ternary sketch: codes in {-1, 0, +1} and one scale, the
  least-squares optimum over all thresholds;
- the codes are stored coordinate-major, base 3, 5 per byte (3⁵ = 243 ≤ 256): for (expert,
  block, coordinate) one contiguous strip holds that coordinate's code for every row, so a
  token that scans 80 of a block's 128 coordinates reads 80 strips and nothing else;
- ‖d_j‖ for every channel j (column j of down_proj);
- the recovery map: U, the top-`rank` left singular vectors of all the layer's down
  columns stacked ([H, E·I]), and b_j = Uᵀd_j per channel.

The down projection itself is read in rows of the transposed [E, I, H] layout
(`down_rows`): the reader rearranges the model's one copy in place, nothing is duplicated.

The sidecar is a safetensors file written layer by layer (bounded memory) under a temp name
and renamed into place. docs/reader.md describes it byte by byte.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..errors import UserError
from ..report import atomic_write
from .hadamard import padded, random_signs, rotate_blocks

FORMAT = "neuron-moe-reader"
FORMAT_VERSION = 2  # 1: 2-bit codes (4 per byte); 2: base-3 codes (5 per byte)
BLOCK = 128  # coordinates per Hadamard block
SCAN = 80  # coordinates per block a token scans (recorded; a reader may scan any number)
RANK = 32  # recovery-map rank
SECTOR = 32  # bytes: the unit a GPU memory read is charged in
CODES_PER_BYTE = 5  # base-3 digits: byte = Σ_t digit(row 5q+t)·3^t, digit = code mod 3 (0, +1 -> 1, -1 -> 2)
POW3 = (1, 3, 9, 27, 81)
FLOAT = torch.bfloat16  # scales, norms, U and b
LAYER_TENSORS = ("codes", "scales", "down_norms", "basis", "coeffs")
SIGNS = "hadamard_signs"
_ST_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.bfloat16: "BF16", torch.float32: "F32"}


class SidecarError(UserError):
    pass


@dataclass(frozen=True)
class Layout:
    """Shapes of one layer's sidecar tensors, from the expert geometry."""

    hidden: int
    experts: int
    intermediate: int
    rank: int = RANK

    @property
    def hidden_padded(self) -> int:
        return padded(self.hidden, BLOCK)

    @property
    def blocks(self) -> int:
        return self.hidden_padded // BLOCK

    @property
    def rows(self) -> int:  # gate rows then up rows, as in gate_up_proj
        return 2 * self.intermediate

    @property
    def rows_padded(self) -> int:
        """Rows rounded up so one coordinate's strip of codes is whole sectors."""
        return padded(self.rows, SECTOR * CODES_PER_BYTE)

    def layer_tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        E, I, nb = self.experts, self.intermediate, self.blocks
        return {
            "codes": (torch.uint8, (E, nb, BLOCK, self.rows_padded // CODES_PER_BYTE)),
            "scales": (FLOAT, (E, nb, self.rows)),
            "down_norms": (FLOAT, (E, I)),
            "basis": (FLOAT, (self.hidden, self.rank)),
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


def ternary(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Best 3-level code of each vector over the last dim: x ≈ scale·codes, codes in {-1, 0, 1}.

    Keeping the m largest magnitudes with scale = their mean leaves error ‖x‖² − (Σ top-m)²/m,
    so the best m maximises (Σ top-m |x|)²/m; every m is tried (one sort per vector).
    """
    mag = x.abs()
    top = mag.sort(dim=-1, descending=True).values
    m = torch.arange(1, x.shape[-1] + 1, dtype=x.dtype, device=x.device)
    best = (top.cumsum(-1).square() / m).argmax(dim=-1, keepdim=True)
    keep = mag >= top.gather(-1, best)
    codes = torch.sign(x) * keep
    scale = (mag * keep).sum(-1) / keep.sum(-1)  # least squares for the kept set (ties included)
    return codes.to(torch.int8), scale


def down_rows(down_proj: torch.Tensor) -> torch.Tensor:
    """HF's down_proj [E, H, I] as rows [E, I, H]: channel j's down weights contiguous."""
    return down_proj.mT


@torch.no_grad()
def prep_layer(gate_up: torch.Tensor, down: torch.Tensor, signs: torch.Tensor, rank: int = RANK) -> dict:
    """One layer's sidecar tensors from gate_up_proj [E, 2I, H] and down_proj [E, H, I] (any float dtype).

    Works one expert at a time, so the transient memory is a few fp32 copies of one expert. Runs on
    the weights' device (bench/gpu_decode.py preps on the GPU); the result is there too.
    """
    E, H, I = down.shape
    layout = Layout(H, E, I, rank)
    nb, R = layout.blocks, layout.rows
    dev = gate_up.device
    signs = signs.to(dev)
    codes = torch.zeros(E, nb, BLOCK, layout.rows_padded // CODES_PER_BYTE, dtype=torch.uint8, device=dev)
    scales = torch.empty(E, nb, R, dtype=FLOAT, device=dev)
    norms = torch.empty(E, I, dtype=FLOAT, device=dev)
    gram = torch.zeros(H, H, dtype=torch.float64, device=dev)
    for e in range(E):
        code, scale = ternary(rotate_blocks(gate_up[e], signs, BLOCK))  # [R, nb, 128], [R, nb]
        code = torch.nn.functional.pad(code.permute(1, 2, 0), (0, layout.rows_padded - R))  # coordinate-major
        codes[e] = pack_codes(code)
        scales[e] = scale.T.to(FLOAT)
        d = down[e].to(torch.float32)  # [H, I]: columns are channels
        norms[e] = d.norm(dim=0).to(FLOAT)
        gram += (d @ d.T).double()
    # Left singular vectors of [H, E·I] = eigenvectors of its Gram matrix, largest first;
    # each sign fixed (largest entry positive) so a given set of weights gives one U.
    _, vectors = torch.linalg.eigh(gram)
    basis = vectors.flip(-1)[:, :rank]
    basis *= torch.sign(basis.gather(0, basis.abs().argmax(0, keepdim=True)))
    basis = basis.to(torch.float32)
    coeffs = torch.stack([(basis.T @ down[e].to(torch.float32)).T for e in range(E)])
    return {"codes": codes, "scales": scales, "down_norms": norms,
            "basis": basis.to(FLOAT), "coeffs": coeffs.to(FLOAT)}


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


def model_expert_weights(model) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(gate_up_proj, down_proj) of every layer of an HF Gemma-4 MoE model."""
    for layer in model.model.layers:
        yield layer.experts.gate_up_proj.data, layer.experts.down_proj.data


def _metadata(layout: Layout, layers: int, scan: int, seed: int, digest: str) -> dict[str, str]:
    return {"format": FORMAT, "format_version": str(FORMAT_VERSION), "block": str(BLOCK), "scan": str(scan),
            "rank": str(layout.rank), "seed": str(seed), "codes_per_byte": str(CODES_PER_BYTE),
            "hidden": str(layout.hidden), "experts": str(layout.experts),
            "intermediate": str(layout.intermediate), "layers": str(layers), "source_sha256": digest}


def _specs(layout: Layout, layers: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    specs = {SIGNS: (torch.int8, (layout.hidden_padded,))}
    for i in range(layers):
        specs.update({f"layers.{i}.{name}": spec for name, spec in layout.layer_tensors().items()})
    return specs


def write_sidecar(out: Path, weights: Iterable[tuple[torch.Tensor, torch.Tensor]], *, hidden: int, experts: int,
                  intermediate: int, layers: int, seed: int = 0, rank: int = RANK, scan: int = SCAN,
                  progress: bool = True) -> Path:
    """Prep every layer of `weights` and stream the sidecar to `out` (temp file, then rename).

    The safetensors header holds every tensor's offset up front (all shapes follow from the
    geometry) and a placeholder digest, patched once all weights have streamed through.
    """
    if not 0 <= rank <= hidden or not 1 <= scan <= BLOCK:
        raise SidecarError(f"rank must be in [0, {hidden}] and scan in [1, {BLOCK}]; got rank {rank}, scan {scan}")
    layout = Layout(hidden, experts, intermediate, rank)
    signs = random_signs(layout.hidden_padded, seed)
    digest = SourceDigest()
    expected = ((experts, 2 * intermediate, hidden), (experts, hidden, intermediate))

    def prepped():
        count = 0
        for i, (gate_up, down) in enumerate(tqdm(weights, total=layers, desc="reader prep", unit="layer",
                                                 disable=not progress)):
            if i >= layers or (tuple(gate_up.shape), tuple(down.shape)) != expected:
                raise SidecarError(f"layer {i}: expert weights {tuple(gate_up.shape)}, {tuple(down.shape)} "
                                   f"do not fit the declared geometry ({layers} layers of {expected})")
            digest.update(gate_up, down)
            yield prep_layer(gate_up, down, signs, rank)
            count += 1
        if count != layers:
            raise SidecarError(f"expected {layers} layers of expert weights, got {count}")

    meta = _metadata(layout, layers, scan, seed, _PLACEHOLDER)
    with atomic_write(Path(out), "wb", seekable=True) as f:  # the digest is patched in at the end
        stream_layers(f, layout, layers, meta, signs, prepped(), digest.hexdigest)
    return Path(out)


_PLACEHOLDER = "0" * 64  # the source digest's place in the header, until the weights have streamed through


def stream_layers(f, layout: Layout, layers: int, meta: dict[str, str], signs: torch.Tensor,
                  tensors: Iterable[dict[str, torch.Tensor]], digest=None) -> None:
    """Write a sidecar to the open file `f`: the header (every offset follows from the geometry), the
    signs, then each layer's tensors as `tensors` yields them (bounded memory). `digest()`, if given,
    replaces the placeholder `source_sha256` of `meta` once every layer is written."""
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
        f.write(tensor.contiguous().view(torch.uint8).numpy().data)

    put(SIGNS, signs)
    for i, layer in enumerate(tensors):
        for name in LAYER_TENSORS:
            put(f"layers.{i}.{name}", layer[name])
    if digest is not None:
        f.seek(8 + text.index(_PLACEHOLDER.encode()))
        f.write(digest().encode())


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
        if not self.path.is_file():
            raise SidecarError(f"reader sidecar not found: {self.path}")
        try:
            with safe_open(self.path, framework="pt") as f:
                meta, keys = f.metadata() or {}, set(f.keys())
        except Exception as e:  # safetensors' own error type, or OSError
            raise SidecarError(f"{self.path}: not a readable safetensors file ({e})") from None
        if meta.get("format") != FORMAT:
            raise SidecarError(f"{self.path}: not a reader sidecar (metadata format {meta.get('format')!r}, "
                               f"expected {FORMAT!r})")
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise SidecarError(f"{self.path}: sidecar format version {meta.get('format_version')!r}; this build "
                               f"reads version {FORMAT_VERSION} (re-run `neuron-moe prep-reader`)")
        try:
            fields = {k: int(meta[k]) for k in ("block", "scan", "rank", "seed", "codes_per_byte", "hidden",
                                                "experts", "intermediate", "layers")}
        except (KeyError, ValueError) as e:
            raise SidecarError(f"{self.path}: metadata field {e} missing or not an integer") from None
        if (fields["block"], fields["codes_per_byte"]) != (BLOCK, CODES_PER_BYTE):
            raise SidecarError(f"{self.path}: block {fields['block']}, {fields['codes_per_byte']} codes per byte; "
                               f"this build reads block {BLOCK}, {CODES_PER_BYTE} codes per byte")
        if not 1 <= fields["layers"] <= len(keys):
            # before the table of every layer's tensors is built: a header claiming 10^8 layers is not believed
            raise SidecarError(f"{self.path}: metadata says {fields['layers']} layers; the file holds "
                               f"{len(keys)} tensors (1 + {len(LAYER_TENSORS)} per layer)")
        self.scan, self.seed, self.layers = fields["scan"], fields["seed"], fields["layers"]
        self.source_sha256 = meta.get("source_sha256", "")
        # a tensor-parallel shard (`shard.py`): one rank's channels of every expert; None for a whole sidecar
        self.tp = self.tp_rank = self.expert_layout = None
        if "tp" in meta:
            try:
                self.tp, self.tp_rank = int(meta["tp"]), int(meta["tp_rank"])
            except (KeyError, ValueError):
                raise SidecarError(f"{self.path}: metadata tp / tp_rank missing or not an integer") from None
            self.expert_layout = meta.get("expert_layout")
        self.layout = Layout(fields["hidden"], fields["experts"], fields["intermediate"], fields["rank"])
        specs = _specs(self.layout, self.layers)
        if keys != set(specs):
            missing, extra = sorted(set(specs) - keys), sorted(keys - set(specs))
            raise SidecarError(f"{self.path}: tensors do not match the metadata; missing {missing[:5]}, "
                               f"unexpected {extra[:5]}")
        with safe_open(self.path, framework="pt") as f:
            for name, (dtype, shape) in specs.items():
                sl = f.get_slice(name)
                if _ST_DTYPES[dtype] != sl.get_dtype() or tuple(sl.get_shape()) != shape:
                    raise SidecarError(f"{self.path}: {name} is {sl.get_dtype()} {tuple(sl.get_shape())}, "
                                       f"expected {_ST_DTYPES[dtype]} {shape}")
            self.signs = f.get_tensor(SIGNS)
        if not torch.equal(self.signs, random_signs(self.layout.hidden_padded, self.seed)):
            raise SidecarError(f"{self.path}: {SIGNS} are not those of seed {self.seed}")

    def check_source(self, weights: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Refuse unless the sidecar was made from exactly these expert weights (bf16-equal)."""
        got = source_digest(weights)
        if got != self.source_sha256:
            raise SidecarError(f"{self.path}: made from other expert weights (sidecar source sha256 "
                               f"{self.source_sha256[:16]}…, these weights {got[:16]}…); re-run "
                               f"`neuron-moe prep-reader` for this model")

    def layer(self, index: int) -> LayerSidecar:
        with safe_open(self.path, framework="pt") as f:
            tensors = {name: f.get_tensor(f"layers.{index}.{name}") for name in LAYER_TENSORS}
        return LayerSidecar.from_tensors(tensors, self.signs)
