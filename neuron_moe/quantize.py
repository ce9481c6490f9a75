"""HF's one-rank model with its linears in a weight format, as gpt-fast's quantize.py does it.

`quantize_model(model, quantization, layers)` swaps the modules of the layer groups `layers` names
(`spec.layer_group` of each weight's name) for modules that hold the format's tensors (buffers)
instead of the float weight; the model itself never sees a format:

  a linear   (attention's q/k/v/o, the dense MLP, lm_head): a `QuantizedLinear` whose forward is
             the format's matmul (`Format.linear`)
  experts    (a `Gemma4TextExperts`): a `QuantizedExperts` whose `gate_up_proj` and `down_proj` are
             properties that dequantise the format's tensors in the compute dtype, HF's [E, 2I, H]
             and [E, H, I]. So every experts implementation that reads those two (dense_masked,
             selective, HF's eager loop, the static graphs' views: `experts/`, spec.EXPERTS) computes
             with the dequantised weight, unpacked inside its graph. The tensors are those of the
             input-dim-1 view the TP channel layout quantises (`parallel.layout.fused`, [E, in, out]):
             the groups lie along each expert's input dim, so one rank holds the TP ranks' numbers.

Embeddings stay in the compute dtype (a lookup reads one row). Gemma ties lm_head to embed_tokens:
quantizing lm_head unties them, the embedding keeps its float weight. Norms, the router and the
scalars are not linears of a group and stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

from . import formats, spec
from .formats import Format
from .parallel.layout import fused

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # HF's names of an experts module's two weights


class QuantizedWeight(nn.Module):
    """One weight in a format: the format's tensors as buffers, named as the format names them."""

    def __init__(self, fmt: Format, w: torch.Tensor):
        super().__init__()
        self.fmt = fmt
        for name, tensor in fmt.quantize(w.detach()).items():
            self.register_buffer(name, tensor)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.fmt.tensors}

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the tensors stand for, in `dtype`, shaped as the float weight they were made of."""
        return self.fmt.dequantize(self.tensors(), dtype)


class QuantizedLinear(QuantizedWeight):
    """A bias-free nn.Linear whose [out, in] weight is in a format: x times it by the format's matmul."""

    def __init__(self, linear: nn.Linear, fmt: Format):
        if linear.bias is not None:
            raise ValueError(f"{fmt.name}: a linear with a bias is not quantized here (Gemma-4's have none)")
        super().__init__(fmt, linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fmt.linear(x, self.tensors())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"


class QuantizedExperts(Gemma4TextExperts):
    """A `Gemma4TextExperts` whose two weights are in a format: `gate_up` and `down` hold the format's
    tensors of their [E, in, out] views, and the properties `gate_up_proj` / `down_proj` give HF's
    weights back, dequantised in the module's compute dtype, wherever an implementation reads them.
    Everything else (the config that names the implementation, act_fn, the sizes) is the module's."""

    def __init__(self, experts: Gemma4TextExperts, fmt: Format):
        nn.Module.__init__(self)  # not Gemma4TextExperts': it would make the float weights again
        internals = set(vars(self))
        self.__dict__.update({k: v for k, v in vars(experts).items() if k not in internals})
        self.training = experts.training
        for name, child in experts.named_children():
            self.add_module(name, child)
        for name, param in experts.named_parameters(recurse=False):
            if name not in EXPERT_WEIGHTS:
                self.register_parameter(name, param)
        self.compute_dtype = experts.gate_up_proj.dtype
        self.gate_up = QuantizedWeight(fmt, fused(experts.gate_up_proj))
        self.down = QuantizedWeight(fmt, fused(experts.down_proj))

    @property
    def gate_up_proj(self) -> torch.Tensor:  # [E, 2I, H]
        return fused(self.gate_up.dequantize(self.compute_dtype))

    @property
    def down_proj(self) -> torch.Tensor:  # [E, H, I]
        return fused(self.down.dequantize(self.compute_dtype))


def _quantized(module: nn.Module, name: str, fmt: Format, layers: tuple[str, ...]) -> nn.Module | None:
    """The module to put in place of `module` (named `name` in the model), or None to keep it."""
    if isinstance(module, Gemma4TextExperts) and not isinstance(module, QuantizedExperts):
        if spec.layer_group(f"{name}.{EXPERT_WEIGHTS[0]}.weight") in layers:
            return QuantizedExperts(module, fmt)
    elif isinstance(module, nn.Linear) and spec.layer_group(f"{name}.weight") in layers:
        return QuantizedLinear(module, fmt)
    return None


def quantize_model(model: nn.Module, quantization: str, layers: Iterable[str] = spec.DEFAULT_QUANTIZED_LAYERS):
    """`model` (HF's Gemma4ForCausalLM, in its compute dtype) with the linears of `layers`
    (spec.LAYER_GROUPS) in `quantization`'s format, in place; returned. "none" leaves it as it is.
    The float weights are not modified: the swapped-out modules are dropped with them."""
    fmt = formats.get(quantization)
    layers = spec.check_quantized_layers(layers)
    if fmt is formats.NONE:
        return model
    swaps = [(name, new) for name, m in model.named_modules() if (new := _quantized(m, name, fmt, layers)) is not None]
    for name, new in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return model
