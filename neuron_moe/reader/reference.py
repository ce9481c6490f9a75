"""The reader's PyTorch reference forward: what the Triton and NKI kernels must compute.

In expert e, channel j owns row j of the gate G_e and the up V_e and row j of the
transposed down D_e; a_j = φ(g_jᵀx)(v_jᵀx) and the routed output is Σ_e w_e Σ_j a_j d_j.
Per token (each token its own selection, batched over tokens):

1. screen: rotate x once (the sidecar's block Hadamard); per block keep the `scan`
   coordinates of largest |Rx| and read only their ternary codes; estimate ĝ_j, v̂_j for
   every channel of the token's experts.
2. select: s_j = |w_e·‖d_j‖·φ(ĝ_j)v̂_j|; the top k across all of the token's experts
   (one expert may get many channels, another none); compute a_j exactly for those.
3. recover: y = Σ_{j∈K} w_e a_j d_j + U·Σ_{j∉K} w_e p_j b_j with p_j = φ(ĝ_j)v̂_j.

Every shape depends only on (tokens, k, scan): no data-dependent op. All math in fp32.
"""

from __future__ import annotations

import torch

from ..errors import UserError
from .hadamard import rotate_blocks
from .sidecar import BLOCK, LayerSidecar, unpack_codes

# `layer` below is a LayerSidecar or anything with its attributes (the HF integration's ReaderState).

ACTIVATIONS = {
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "GELUPytorchTanh": "gelu_tanh",
    "SiLUActivation": "silu",
    "SiLU": "silu",
}


def activation_name(act_fn) -> str:
    """The kernels' name for an HF activation module: gelu_tanh (Gemma-4) or silu (Qwen3)."""
    name = type(act_fn).__name__
    if name not in ACTIVATIONS:
        raise UserError(f"reader kernels: activation {name} not supported (gelu_pytorch_tanh or silu)")
    return ACTIVATIONS[name]


def scanned(x: torch.Tensor, layer: LayerSidecar, scan: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate x [T, H] once; per block the `scan` coordinates of largest |Rx| and Rx there, [T, nb, scan] each."""
    rotated = rotate_blocks(x, layer.signs, BLOCK)  # [T, nb, 128]
    coords = rotated.abs().topk(scan, dim=-1).indices
    return coords, rotated.gather(-1, coords)


def sketch_estimates(x: torch.Tensor, top_k_index: torch.Tensor, layer: LayerSidecar, scan: int) -> torch.Tensor:
    """[T, H] -> estimates of every gate/up row's dot with x, [T, k_e, 2I] (gate rows first)."""
    coords, values = scanned(x, layer, scan)
    nb, rows = layer.scales.shape[1:]
    experts = top_k_index[:, :, None, None]  # [T, ke, 1, 1]
    blocks = torch.arange(nb, device=x.device)[None, None, :, None]  # [1, 1, nb, 1]
    strips = layer.codes[experts, blocks, coords[:, None]]  # [T, ke, nb, scan, R_pad/5]: only the scanned strips
    return code_estimates(unpack_codes(strips)[..., :rows].to(torch.float32), values, layer.scales[top_k_index])


def code_estimates(codes: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The scanned strips' codes [T, ke, nb, scan, 2I] (fp32), Rx there ([T, nb, scan], or [T, ke, nb,
    scan] when each expert scans its own) and the experts' scales [T, ke, nb, 2I] -> the gate/up row
    estimates [T, ke, 2I]."""
    partial = torch.einsum("tkbcr,tbc->tkbr" if values.dim() == 3 else "tkbcr,tkbc->tkbr", codes, values)
    return (partial * scales.to(torch.float32)).sum(dim=2)


def exact_estimates(x: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """The unquantised, full-scan screen: the true dots, [T, k_e, 2I] (for tests and ablations)."""
    return torch.einsum("th,tkrh->tkr", x.to(torch.float32), gate_up[top_k_index].to(torch.float32))


def scores(estimates, top_k_index, top_k_weights, down_norms, act_fn):
    """s_j = |w_e·‖d_j‖·p_j| and p_j = φ(ĝ_j)v̂_j for every channel of the token's experts, [T, k_e, I] each."""
    gate, up = estimates.chunk(2, dim=-1)
    p = act_fn(gate) * up
    return (top_k_weights.to(torch.float32)[..., None] * down_norms[top_k_index].to(torch.float32) * p).abs(), p


def select(estimates, top_k_index, top_k_weights, down_norms, k: int, act_fn):
    """Top-k channels per token by s_j over all its experts' channels.

    Returns (chosen [T, k] indices into the flattened (slot, channel) grid, p [T, k_e, I]).
    """
    score, p = scores(estimates, top_k_index, top_k_weights, down_norms, act_fn)
    return score.flatten(1).topk(k, dim=-1).indices, p


def chosen_rows(chosen, top_k_index, top_k_weights, inter: int):
    """Flattened (slot, channel) picks [T, k] -> expert, channel and router weight of each, [T, k] each."""
    slot, channel = chosen // inter, chosen % inter
    return top_k_index.gather(1, slot), channel, top_k_weights.to(torch.float32).gather(1, slot)


def unchosen_weights(p, chosen, top_k_weights):
    """w_e·p_j for the channels recovery covers (j ∉ K), 0 for the chosen: [T, k_e, I]."""
    rest = torch.ones_like(p).flatten(1).scatter(1, chosen, 0.0).view_as(p)
    return top_k_weights.to(torch.float32)[..., None] * p * rest


def forward(
    x,
    top_k_index,
    top_k_weights,
    gate_up,
    down_rows,
    layer: LayerSidecar,
    *,
    k: int,
    scan: int,
    rank: int,
    act_fn,
    screen: str = "sketch",
    int8=None,
) -> torch.Tensor:
    """The reader's routed output for tokens x [T, H]; gate_up [E, 2I, H], down_rows [E, I, H].

    `screen="exact"` replaces the sketch by the true dots (an ablation the tests use). `int8`
    (reader/int8.py's Int8Experts): the exact channels are read from those int8 rows instead.
    """
    xf = x.to(torch.float32)
    if screen == "sketch":
        estimates = sketch_estimates(xf, top_k_index, layer, scan)
    elif screen == "exact":
        estimates = exact_estimates(xf, top_k_index, gate_up)
    else:
        raise ValueError(f"screen must be 'sketch' or 'exact', got {screen!r}")
    chosen, p = select(estimates, top_k_index, top_k_weights, layer.down_norms, k, act_fn)
    expert, channel, weight = chosen_rows(chosen, top_k_index, top_k_weights, down_rows.shape[1])
    if int8 is None:
        gate = gate_up[expert, channel].to(torch.float32)  # [T, k, H]: one contiguous row each
        up = gate_up[expert, channel + down_rows.shape[1]].to(torch.float32)
        down = down_rows[expert, channel].to(torch.float32)
    else:
        gate, up, down = int8.rows(expert, channel)
    a = act_fn(torch.einsum("tkh,th->tk", gate, xf)) * torch.einsum("tkh,th->tk", up, xf)
    out = torch.einsum("tk,tkh->th", weight * a, down)
    if rank:
        z = torch.einsum(
            "tki,tkir->tr",
            unchosen_weights(p, chosen, top_k_weights),
            layer.coeffs[top_k_index][..., :rank].to(torch.float32),
        )
        out = out + z @ layer.basis[:, :rank].to(torch.float32).T
    return out.to(x.dtype)
