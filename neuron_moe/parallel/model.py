"""The full Gemma-4 MoE model as a rank module: transformers' Gemma4ForCausalLM with each rank's
share of every weight (`layout.py`), so the static decoder (`static/decoder.py`) wraps it unchanged.

HF's modules are kept where a rank holds them whole (norms, router, rotary embedding, layer scalar)
and where their code is already per-head (attention: it reads the head counts from its config).
The rank's config has h/t query heads, max(kv/t, 1) KV heads per layer and I/t dense intermediate
channels; every module that holds a share is replaced by parallel layers of `layers` (`parallel.cpu`
or `parallel.nxd`), as the layout's placement of its weight says (`layout.placement`, the way HF
derives tensor parallelism from a model's tp_plan), at the weight's shape in the parallel layout
(`layout.parallel_state_dict`: KV heads replicated up to t):

  column      ColumnParallelLinear: q/k/v_proj, the dense MLP's gate/up_proj; lm_head too, its
              output gathered (`layout.GATHERED`): every rank has all logits, so every rank takes
              the same greedy token
  row         RowParallelLinear (all-reduce): o_proj, the dense MLP's down_proj
  vocab       ParallelEmbedding over the vocabulary (× HF's embed scale), all-reduce
  experts     `moe.parallel_experts`: in the channel layout every expert's I/t channels (one
              all-reduce after the router-weighted sum), in the expert layout the rank's experts
              whole (router weights scattered by rank)

The skeleton is built on the meta device (HF would otherwise allocate all E experts and the full
vocabulary once per rank), then materialised empty: every value comes from the rank's shard.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from transformers import Gemma4ForCausalLM, Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from .. import spec
from ..errors import UserError
from ..formats import NONE, format_of
from ..spec import DEFAULT_QUANTIZED_LAYERS, NO_QUANTIZATION, SPMD
from . import layout
from .moe import parallel_experts


def rank_config(
    config: Gemma4TextConfig, tp: int, expert_layout: str = layout.DEFAULT_EXPERT_LAYOUT
) -> Gemma4TextConfig:
    """The config one rank's HF modules see: its heads, KV heads and dense intermediate size."""
    layout.check_degree(config, tp, expert_layout)
    fields = config.to_dict()
    fields["num_attention_heads"] = config.num_attention_heads // tp
    fields["num_key_value_heads"] = max(fields["num_key_value_heads"] // tp, 1)
    fields["intermediate_size"] = config.intermediate_size // tp
    fields["per_layer_config"] = {
        i: dict(o, num_key_value_heads=max(o["num_key_value_heads"] // tp, 1)) if "num_key_value_heads" in o else o
        for i, o in fields.get("per_layer_config", {}).items()
    }
    local = Gemma4TextConfig(**fields)
    local._attn_implementation = "eager"  # what build_model uses: the reference's attention
    return local


def check_formats(
    config: Gemma4TextConfig, tp: int, expert_layout: str, quantization: str, quantized_layers: tuple[str, ...]
) -> None:
    """Every linear of `quantized_layers` holds whole groups of its format on each rank at TP `tp` in
    `expert_layout` (a row layer's rank: its share of the input channels), and each experts group lies
    within one expert's channels (so every layout holds the one-rank numbers). Checked on the meta
    device, before any weight loads; the error names the linear and what to change."""
    with torch.device("meta"):
        whole = Gemma4ForCausalLM(copy.deepcopy(config))
    experts = format_of(".experts.down_proj.weight", quantization, quantized_layers)
    experts.check(config.moe_intermediate_size, "intermediate channels of each expert")
    for name, w in layout.parallel_state_dict(whole.state_dict(), config, tp, expert_layout).items():
        fmt = format_of(name, quantization, quantized_layers)
        if fmt is NONE:
            continue
        local = layout.shard(w, layout.placement(name, expert_layout), tp, 0)
        try:
            fmt.check(
                local.shape[1], f"input channels each rank holds of {name} at TP {tp} in the {expert_layout} layout"
            )
        except UserError as e:
            hint = " or --expert-layout expert" if ".experts." in name and expert_layout == layout.CHANNEL else ""
            raise UserError(f"{e}: use a lower TP degree{hint}") from None


def _scaled(embedding: nn.Module, scale: torch.Tensor) -> nn.Module:
    """HF's Gemma4TextScaledWordEmbedding multiplies by sqrt(H) rounded to the weight dtype; a hook
    keeps the parallel embedding's own parameter names (`embed_tokens.weight`, `.rank_util.rank`)."""
    embedding.register_forward_hook(lambda module, args, out: out * scale.to(out.dtype))
    return embedding


def rank_model(
    config: Gemma4TextConfig,
    tp: int,
    layers,
    *,
    expert_layout: str = layout.DEFAULT_EXPERT_LAYOUT,
    quantization: str = NO_QUANTIZATION,
    quantized_layers: tuple[str, ...] = DEFAULT_QUANTIZED_LAYERS,
    scatter: str = SPMD,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Gemma4ForCausalLM:
    """One rank's Gemma4ForCausalLM over `layers` (`parallel.cpu` or `parallel.nxd`); its state dict
    names are those of `layout.parallel_state_dict` in `expert_layout` (quantized: of
    `formats.quantize_state` of it, `quantized_layers` in `quantization`). `device="meta"` builds it
    without memory (for plans and shape checks). Outside a graph it computes every expert
    (dense_masked); each static graph's view runs the graph's own experts implementation
    (`experts/view.py`)."""
    local = rank_config(config, tp, expert_layout)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(local)
        whole = Gemma4ForCausalLM(copy.deepcopy(config))  # the full shapes, no memory
    full = {
        name: t.shape for name, t in layout.parallel_state_dict(whole.state_dict(), config, tp, expert_layout).items()
    }
    if device != "meta":
        model.to_empty(device=device)
    model.to(dtype)
    with torch.device(device):
        for name, module in list(model.named_modules()):
            formats = functools.partial(format_of, quantization=quantization, layers=quantized_layers)
            share = _share(name, module, full, model.config, tp, layers, expert_layout, formats, scatter, dtype)
            if share is not None:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, share)
        model.model.rotary_emb = Gemma4TextRotaryEmbedding(local)  # its inv_freq buffers are computed, not loaded
    spec.set_experts(model, spec.DENSE_MASKED)
    return model.eval()


def _share(
    name: str,
    module: nn.Module,
    full: dict,
    local,
    tp: int,
    layers,
    expert_layout: str,
    formats,
    scatter: str,
    dtype: torch.dtype,
) -> nn.Module | None:
    """The parallel module in place of `module` (its name `name`), or None where a rank holds it whole;
    `formats(weight name)`: the format its weight is in."""
    if f"{name}.gate_up_proj.weight" in full:  # the experts, as the layout holds their linears
        fmt = formats(f"{name}.gate_up_proj.weight")
        return parallel_experts(local, tp, layers, expert_layout, fmt=fmt, scatter=scatter, dtype=dtype)
    kind = layout.placement(f"{name}.weight", expert_layout)
    if kind == layout.REPLICATED or not isinstance(module, (nn.Linear, nn.Embedding)):
        return None
    out, inp = full[f"{name}.weight"]
    if kind == layout.VOCAB:
        return _scaled(layers.ParallelEmbedding(out, inp, tp=tp, dtype=dtype), torch.tensor(inp**0.5))
    fmt = formats(f"{name}.weight")
    if kind == layout.COLUMN:
        gather = f"{name}.weight" in layout.GATHERED
        return layers.ColumnParallelLinear(inp, out, tp=tp, dtype=dtype, fmt=fmt, gather_output=gather)
    if kind == layout.ROW:
        return layers.RowParallelLinear(inp, out, tp=tp, dtype=dtype, fmt=fmt)
    raise ValueError(f"{name}: no parallel layer for placement {kind!r}")


def materialize(
    model: Gemma4ForCausalLM,
    config: Gemma4TextConfig,
    tp: int,
    expert_layout: str = layout.DEFAULT_EXPERT_LAYOUT,
    device: str = "cpu",
) -> Gemma4ForCausalLM:
    """A rank model built on the meta device, allocated on `device` (uninitialised: every value
    then comes from the rank's shard, `load_state_dict`), with what `rank_model` computes rather
    than loads computed again there: the rotary embedding's buffers and the embedding scale."""
    model.to_empty(device=device)
    embedding = model.model.embed_tokens
    embedding._forward_hooks.clear()  # the one hook `_scaled` registered, over a meta tensor
    _scaled(embedding, torch.tensor(config.hidden_size**0.5, device=device))
    model.model.rotary_emb = Gemma4TextRotaryEmbedding(rank_config(config, tp, expert_layout)).to(device)
    return model
