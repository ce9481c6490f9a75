"""The reader's weight prep: from a model's expert weights to its sidecar (format: `sidecar.py`).

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

`write_sidecar` streams the result layer by layer (bounded memory) under a temp name and
renames it into place. docs/reader.md describes the file byte by byte.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from ..report import atomic_write

# The prep's defaults (spec.py): what `neuron-moe prep-reader` makes, and so what a reader reads unless told otherwise
from ..spec import RECOVERY_RANK as RANK, SCAN
from .geometry import Geometry
from .hadamard import random_signs, rotate_blocks
from .sidecar import (
    BLOCK,
    CODES_PER_BYTE,
    FLOAT,
    PLACEHOLDER,
    SidecarError,
    SidecarLayout,
    SourceDigest,
    metadata,
    pack_codes,
    stream_layers,
)


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
    layout = SidecarLayout(Geometry(hidden=H, experts=E, intermediate=I), rank)
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
    return {"codes": codes, "scales": scales, "down_norms": norms, "basis": basis.to(FLOAT), "coeffs": coeffs.to(FLOAT)}


def model_expert_weights(model) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(gate_up_proj, down_proj) of every layer of an HF Gemma-4 MoE model."""
    for layer in model.model.layers:
        yield layer.experts.gate_up_proj.data, layer.experts.down_proj.data


def write_sidecar(
    out: Path,
    weights: Iterable[tuple[torch.Tensor, torch.Tensor]],
    geometry: Geometry,
    *,
    layers: int,
    seed: int = 0,
    rank: int = RANK,
    scan: int = SCAN,
    progress: bool = True,
) -> Path:
    """Prep every layer of `weights` (each of `geometry`) and stream the sidecar to `out` (temp file, then rename).

    The safetensors header holds every tensor's offset up front (all shapes follow from the
    geometry) and a placeholder digest, patched once all weights have streamed through.
    """
    hidden, experts, intermediate = geometry.sizes
    if not 0 <= rank <= hidden or not 1 <= scan <= BLOCK:
        raise SidecarError(f"rank must be in [0, {hidden}] and scan in [1, {BLOCK}]; got rank {rank}, scan {scan}")
    layout = SidecarLayout(geometry, rank)
    signs = random_signs(layout.hidden_padded, seed)
    digest = SourceDigest()
    expected = ((experts, 2 * intermediate, hidden), (experts, hidden, intermediate))

    def prepped():
        count = 0
        for i, (gate_up, down) in enumerate(
            tqdm(weights, total=layers, desc="reader prep", unit="layer", disable=not progress)
        ):
            if i >= layers or (tuple(gate_up.shape), tuple(down.shape)) != expected:
                raise SidecarError(
                    f"layer {i}: expert weights {tuple(gate_up.shape)}, {tuple(down.shape)} "
                    f"do not fit the declared geometry ({layers} layers of {expected})"
                )
            digest.update(gate_up, down)
            yield prep_layer(gate_up, down, signs, rank)
            count += 1
        if count != layers:
            raise SidecarError(f"expected {layers} layers of expert weights, got {count}")

    meta = metadata(layout, layers, scan, seed, PLACEHOLDER)
    with atomic_write(Path(out), "wb", seekable=True) as f:  # the digest is patched in at the end
        stream_layers(f, layout, layers, meta, signs, prepped(), digest.hexdigest)
    return Path(out)
