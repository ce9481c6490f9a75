"""Expert weights and tokens shaped like a trained MoE's, not i.i.d. Gaussian noise.

What the reader relies on and Gaussian noise lacks: activations with a few outlier hidden
channels and a low-rank bulk, heavy-tailed weights and channel norms, gate/up rows aligned
with the directions tokens actually use, and down columns concentrated in a low-dimensional
subspace shared across experts (the structure a rank-32 recovery map can capture).
"""

import math
from types import SimpleNamespace

import torch
from transformers.activations import ACT2FN

OUTLIER_CHANNELS = 4
FEATURES = 16  # rank of the shared token features / down subspace


def _student_t(shape, gen, dof=3.0):
    normal = torch.randn(shape, generator=gen)
    chi2 = torch.randn((*shape, int(dof)), generator=gen).square().sum(-1)
    return normal / torch.sqrt(chi2 / dof)


def experts(num_experts=8, inter=48, hidden=256, seed=0):
    """An object with HF Gemma4TextExperts' attributes: gate_up_proj [E, 2I, H], down_proj [E, H, I], act_fn."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.linalg.qr(torch.randn(hidden, FEATURES, generator=gen))[0].T  # [F, H] token directions
    decay = torch.logspace(0, -1.5, FEATURES)  # a few dominant directions
    rows = []
    for _ in range(2):  # gate, up
        mix = torch.randn(num_experts, inter, FEATURES, generator=gen) * decay
        noise = 0.3 * _student_t((num_experts, inter, hidden), gen) / math.sqrt(hidden)
        rows.append(mix @ features + noise)
    gate_up = torch.cat(rows, dim=1)
    gate_up *= torch.exp(0.5 * torch.randn(num_experts, 2 * inter, 1, generator=gen))  # heavy-tailed row norms
    basis = torch.linalg.qr(torch.randn(hidden, FEATURES, generator=gen))[0] * decay  # shared down subspace
    down = basis @ torch.randn(num_experts, FEATURES, inter, generator=gen)
    down = down + 0.15 * torch.randn(num_experts, hidden, inter, generator=gen) / math.sqrt(hidden)
    down *= torch.exp(0.7 * torch.randn(num_experts, 1, inter, generator=gen))  # heavy-tailed channel norms
    return SimpleNamespace(gate_up_proj=gate_up, down_proj=down, act_fn=ACT2FN["gelu_pytorch_tanh"], features=features)


def tokens(ex, count=64, seed=1):
    """Tokens in the experts' feature directions, heavy-tailed, with a few outlier hidden channels."""
    gen = torch.Generator().manual_seed(seed)
    hidden = ex.gate_up_proj.shape[-1]
    x = 3.0 * _student_t((count, FEATURES), gen) @ ex.features + 0.5 * torch.randn(count, hidden, generator=gen)
    x[:, :OUTLIER_CHANNELS] *= 20.0
    return x


def routing(count, num_experts, top_k, seed=2):
    """Random distinct experts per token and softmax-like positive weights (HF's router's output shape)."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.rand(count, num_experts, generator=gen).argsort(dim=-1)[:, :top_k]
    weights = torch.softmax(torch.randn(count, top_k, generator=gen), dim=-1)
    return index, weights


def full_moe(ex, x, index, weights):
    """The routed output computed the plain way: every channel of every chosen expert."""
    gate, up = torch.einsum("th,tkrh->tkr", x, ex.gate_up_proj[index]).chunk(2, dim=-1)
    act = ex.act_fn(gate) * up
    return torch.einsum("tki,tkhi,tk->th", act, ex.down_proj[index], weights)
