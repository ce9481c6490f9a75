"""The reader's forward on the NKI kernels: same inputs, same output as `reference.forward`.

As on Triton, the rotation of x, the selection (topk) and w·p of the unchosen channels stay in
PyTorch (no weights read); the kernels read the sidecar and the weights. The kernels take
2-D views of the sidecar tensors and row indices from `plan.py`; `*_inputs` below build them
(pure PyTorch, tested on the CPU). The per-block scales are applied here to the screen
kernel's unscaled partials (one [blocks, 2I] read per routed expert, as accounted).

`forward(..., kernels=None)` imports `kernels.py` (the Neuron SDK's `nki`) on first use; a
missing SDK, or an nki whose NKI does not support inf2, is a UserError. Tests pass a PyTorch
emulation of the three kernels instead.

The kernels target nki 0.2.x, the `nki.*` namespace of Neuron SDK 2.28: the last SDK whose NKI
supports inf2 (its NKI FAQ lists Inf2, Trn1, Trn1n and Trn2; from 2.29, nki 0.3.0, Trn2 and Trn3
only), and the first whose kernels may not use `neuronxcc.nki.*` (docs/neuron.md). Every nki.isa
call they make has the same parameters in 0.2.0 as in 0.5.0 (the two SDKs' API stubs), their
gathers use the access patterns of 2.28's `.ap(pattern, offset, vector_offset, indirect_dim)`, and
their activations are ops 2.28's nki.isa.activation table lists.
"""

from __future__ import annotations

import importlib.metadata

import torch

from ...errors import UserError
from .. import reference
from ..geometry import Geometry
from ..sidecar import SidecarLayout
from . import plan as tiles
from .plan import PMAX


def _padded(t: torch.Tensor, size: int, value=0) -> torch.Tensor:
    """Pad the last dim to `size` (rows index 0 with weight 0 on padding: read, contribute nothing)."""
    return torch.nn.functional.pad(t, (0, size - t.shape[-1]), value=value)


def screen_inputs(x, top_k_index, layer, scan: int) -> dict[str, torch.Tensor]:
    T, ke = top_k_index.shape
    coords, values = reference.scanned(x, layer, scan)  # [T, nb, scan]
    nb = coords.shape[1]
    rows = tiles.strip_rows(top_k_index, coords, nb)  # [T, ke, nb, scan]
    values = values[:, None].expand(T, ke, nb, scan)
    return {
        "codes": tiles.sidecar_views(layer)["codes"],
        "strip_idx": rows.reshape(-1, scan, 1),
        "values": values.reshape(-1, scan, 1).contiguous(),
    }


def scaled_estimates(partial: torch.Tensor, top_k_index, layer) -> torch.Tensor:
    """Screen kernel output [T·ke·nb, 5, S] (digit-major) -> estimates [T, ke, 2I] (row r = 5q + t)."""
    T, ke = top_k_index.shape
    nb, rows = layer.scales.shape[1:]
    by_row = partial.view(T, ke, nb, 5, -1).transpose(-1, -2).reshape(T, ke, nb, -1)[..., :rows]
    return (by_row * layer.scales[top_k_index].to(torch.float32)).sum(dim=2)


def exact_inputs(x, expert, channel, weight, gate_up, down_rows) -> dict[str, torch.Tensor]:
    T, k = expert.shape
    inter, H = down_rows.shape[1:]
    kt = -(-k // PMAX)
    gate, up, down = (_padded(r, kt * PMAX).view(T, kt, PMAX, 1) for r in tiles.channel_rows(expert, channel, inter))
    return {
        "gate_up": gate_up.view(-1, H),
        "down": down_rows.view(-1, H),
        "x": x,
        "gate_idx": gate,
        "up_idx": up,
        "down_idx": down,
        "weights": _padded(weight, kt * PMAX).view(T, kt, PMAX, 1),
    }


def recover_inputs(unchosen, top_k_index, layer, rank: int) -> dict[str, torch.Tensor]:
    T, ke, inter = unchosen.shape
    ct = -(-ke * inter // PMAX)
    rows = tiles.coeff_rows(top_k_index, inter).view(T, -1)
    views = tiles.sidecar_views(layer)
    return {
        "coeffs": views["coeffs"],
        "basis": views["basis"],
        "rank": rank,
        "coeff_idx": _padded(rows, ct * PMAX).view(T, ct, PMAX, 1),
        "unchosen": _padded(unchosen.reshape(T, -1), ct * PMAX).view(T, ct, PMAX, 1),
    }


NKI_TARGET = "0.2"  # nki 0.2.x: Neuron SDK 2.28.x
NKI_TARGET_SDK = "Neuron SDK 2.28"


def nki_unsupported(version: str | None) -> str | None:
    """Why nki `version` (None: not installed) cannot run these kernels on inf2; None when it can."""
    if version is None:
        return f"needs the Neuron SDK's nki package, nki {NKI_TARGET}.x ({NKI_TARGET_SDK}), which is not installed"
    if version.split("+")[0].split(".")[:2] != NKI_TARGET.split("."):
        return (
            f"targets nki {NKI_TARGET}.x ({NKI_TARGET_SDK}, the last whose NKI supports inf2), not nki {version}: "
            f"NKI 0.3.0 and later (Neuron SDK 2.29+) support Trn2 and Trn3 only; on this SDK the reader runs its "
            f"XLA-op path (--reader-kernel reference)"
        )
    return None


def nki_version() -> str | None:
    try:
        return importlib.metadata.version("nki")
    except importlib.metadata.PackageNotFoundError:
        return None


def load_kernels():
    version = nki_version()
    if version is not None and nki_unsupported(version):  # installed, but not an inf2 nki: refused by name
        raise UserError(f"reader kernel 'nki' {nki_unsupported(version)}")
    try:
        from . import kernels  # imports the Neuron SDK's nki: present only on Neuron
    except ImportError as e:
        raise UserError(
            f"reader kernel 'nki' needs the Neuron SDK's nki package ({e}); run it in the Neuron "
            f"images (see docs/neuron.md)"
        ) from None
    return kernels


def forward(
    x, top_k_index, top_k_weights, gate_up, down_rows, layer, *, k: int, scan: int, rank: int, act_fn, kernels=None
) -> torch.Tensor:
    """`reference.forward` (screen="sketch") on the NKI kernels (or `kernels`, anything with the same three)."""
    kernels = kernels or load_kernels()
    geo = Geometry(hidden=x.shape[-1], experts=layer.codes.shape[0], intermediate=down_rows.shape[1])
    layout = SidecarLayout(geo, layer.basis.shape[-1])
    tiles.plan(layout, top_k_index.shape[1], k, scan, rank)  # refuse a geometry outside the tile limits
    xf = x.to(torch.float32).contiguous()
    partial = kernels.screen_kernel(**screen_inputs(xf, top_k_index, layer, scan))
    estimates = scaled_estimates(partial, top_k_index, layer)
    chosen, p = reference.select(estimates, top_k_index, top_k_weights, layer.down_norms, k, act_fn)
    expert, channel, weight = reference.chosen_rows(chosen, top_k_index, top_k_weights, down_rows.shape[1])
    out = kernels.exact_kernel(
        **exact_inputs(xf, expert, channel, weight, gate_up, down_rows),
        act=kernels.ACTIVATIONS[reference.activation_name(act_fn)],
    )
    if rank:
        unchosen = reference.unchosen_weights(p, chosen, top_k_weights)
        out = out + kernels.recover_kernel(**recover_inputs(unchosen, top_k_index, layer, rank)).view_as(out)
    return out.to(x.dtype)
