"""The NKI kernels' tile and index plan: pure PyTorch, no Neuron SDK, tested on the CPU.

The kernels (`kernels.py`) read the sidecar tensors (`reader/sidecar.py`), as 2-D
views whose rows are what one DMA descriptor moves (`sidecar_views`), and gather those rows
with indirect DMA: one row index per SBUF partition. Every row index they use comes from
here, computed in PyTorch before the kernel runs:

- screen: the scanned code strips of each (token, slot, block): rows of codes [E·nb·128, S]
  (`strip_rows`); ≤ 128 strips per gather, one per partition;
- exact: the chosen channels' gate and up rows of gate_up [E·2I, H] and down rows of the
  [E·I, H] layout (`channel_rows`), 128 channels per tile;
- recover: the b_j rows of coeffs [E·I, rank] of each routed expert (`coeff_rows`).

`plan` checks a geometry against the NeuronCore-v2 (inf2) tile limits the kernels assume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UserError
from ..sidecar import BLOCK, CODES_PER_BYTE, SidecarLayout

# NeuronCore-v2 limits (nki.language.tile_size): partitions of SBUF/PSUM, the free size of a
# matmul's moving tile / one PSUM bank in fp32, and of its stationary tile.
PMAX = 128
MOVING_FMAX = 512
STATIONARY_FMAX = 128
SBUF_PARTITION_BYTES = 192 * 1024  # per partition on NeuronCore-v2 (24 MiB / 128)


class NkiPlanError(UserError):
    pass


@dataclass(frozen=True)
class TilePlan:
    """How the kernels tile one layer's decode step; every count follows from the geometry."""

    hidden: int
    blocks: int
    strip: int  # code bytes per strip (5 rows each)
    rows: int  # 2I
    inter: int
    rank: int
    scan: int
    k: int
    top_k: int

    @property
    def k_tiles(self) -> int:  # exact: 128 chosen channels per tile (one per partition)
        return -(-self.k // PMAX)

    @property
    def h_tiles(self) -> int:  # down/recover matmuls: output columns per PSUM tile
        return -(-self.hidden // MOVING_FMAX)

    @property
    def i_tiles(self) -> int:  # recover: 128 channels of one expert per matmul
        return -(-self.inter // PMAX)

    def check(self) -> "TilePlan":
        limits = [
            (
                self.scan <= PMAX,
                f"scan {self.scan} > {PMAX}: the scanned strips of a block are one gather, one per partition",
            ),
            (
                self.strip <= MOVING_FMAX,
                f"strip of {self.strip} bytes > {MOVING_FMAX}: the screen matmul's moving tile",
            ),
            (self.rank <= STATIONARY_FMAX, f"rank {self.rank} > {STATIONARY_FMAX}"),
            (
                3 * self.hidden * 4 <= SBUF_PARTITION_BYTES,
                f"hidden {self.hidden}: a gate, an up and a down row in fp32 must fit one SBUF partition",
            ),
        ]
        for ok, message in limits:
            if not ok:
                raise NkiPlanError(f"reader nki kernels: {message}")
        return self


def plan(layout: SidecarLayout, top_k: int, k: int, scan: int, rank: int) -> TilePlan:
    strip = layout.rows_padded // CODES_PER_BYTE
    geo = layout.geometry
    return TilePlan(geo.hidden, layout.blocks, strip, layout.rows, geo.intermediate, rank, scan, k, top_k).check()


def sidecar_views(layer) -> dict[str, torch.Tensor]:
    """The sidecar tensors as the 2-D HBM views the kernels index: views, never copies."""
    E, nb, block, strip = layer.codes.shape
    return {
        "codes": layer.codes.view(E * nb * block, strip),  # one strip per row
        "scales": layer.scales.view(E * nb, -1),  # one (expert, block) per row, 2I scales
        "coeffs": layer.coeffs.view(-1, layer.coeffs.shape[-1]),  # one channel per row: b_j
        "basis": layer.basis,  # U [H, rank]
    }


def strip_rows(top_k_index: torch.Tensor, coords: torch.Tensor, blocks: int) -> torch.Tensor:
    """Row of codes [E·nb·128, S] holding the strip of (expert, block, coordinate), [T, ke, nb, scan]."""
    block = torch.arange(blocks, device=coords.device)[None, None, :, None]
    return ((top_k_index[:, :, None, None] * blocks + block) * BLOCK + coords[:, None]).to(torch.int32)


def scale_rows(top_k_index: torch.Tensor, blocks: int) -> torch.Tensor:
    """Row of scales [E·nb, 2I] of each (token, slot, block), [T, ke, nb]."""
    return (top_k_index[:, :, None] * blocks + torch.arange(blocks, device=top_k_index.device)).to(torch.int32)


def channel_rows(expert: torch.Tensor, channel: torch.Tensor, inter: int) -> tuple[torch.Tensor, ...]:
    """Gate and up rows of gate_up [E·2I, H] and down rows of [E·I, H] of the chosen channels, [T, k] each."""
    gate = expert * 2 * inter + channel
    return gate.to(torch.int32), (gate + inter).to(torch.int32), (expert * inter + channel).to(torch.int32)


def coeff_rows(top_k_index: torch.Tensor, inter: int) -> torch.Tensor:
    """Rows of coeffs [E·I, rank] of every channel of each routed expert, [T, ke, I]."""
    return (top_k_index[..., None] * inter + torch.arange(inter, device=top_k_index.device)).to(torch.int32)
