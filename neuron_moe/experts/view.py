"""A view of a model whose experts run one implementation: what each static graph is built over.

transformers dispatches an experts module on its config's experts implementation at call time, and
the prefill and decode graphs share one model but not one implementation. So each graph holds a
view: the model's own modules, shallow-copied along the path to each decoder layer's experts module,
whose copy carries a config of its own that names the graph's implementation (`spec.dispatching`).
Every parameter, buffer, hook and other submodule is the model's: the view's state names are the
model's and a weight loaded into the model is the view's. The path is copied when the view is made:
a module later put in place of one on it (a decoder layer, an experts module) is not seen.
"""

from __future__ import annotations

import copy

from .. import spec


def _own_children(module):
    """A shallow copy of `module` with a children table of its own (nn.Module's shallow copies share
    `_modules`, `_parameters` and `_buffers`: the copy keeps sharing the last two)."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


def with_experts(model, experts: spec.Experts):
    """`model` (HF's Gemma4ForCausalLM, or a rank module of parallel/model.py) whose every decoder
    layer's experts module dispatches to `experts`."""
    view, inner = _own_children(model), _own_children(model.model)
    layers = _own_children(inner.layers)
    view._modules["model"], inner._modules["layers"] = inner, layers
    for key, layer in layers._modules.items():
        if "experts" not in layer._modules:  # a decoder layer without an MoE block
            continue
        layer = layers._modules[key] = _own_children(layer)
        moe = layer._modules["experts"] = copy.copy(layer.experts)  # the same weights and submodules
        moe.config = spec.dispatching(moe.config, experts)
    return view
