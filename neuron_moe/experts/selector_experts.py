"""`selector`: a channel selector of `reader/selectors.py` in place of each layer's routed experts.

`attach_selector(model, name, rules)` gives every MoE layer's experts module a `selector`
attribute: the layer's weights as a `selectors.MoeLayer` (HF's tensors, not copied; the
reader's sidecar layer when the selector is the reader), the layer's retention rule and a
list that collects each call's `selectors.Result` when one is wanted (`state.results`).
Every token that reaches the experts goes through the selector, prefill and decode alike;
the router, the dense MLP beside the MoE and everything else run unchanged (the same seam as
`channel_reader`: transformers' experts-implementation registry).
"""

from __future__ import annotations

import torch

from .. import spec
from ..spec import Reader
from ..errors import UserError
from ..reader import selectors
from .int8 import int8_experts

# Tokens per selectors.run call: the baselines gather each token's routed experts in fp32
# ([T, k, 2I, H]), so memory grows with T; the rules decide per token, so chunking changes nothing.
CHUNK = 256


class SelectorState:
    def __init__(self, name: str, layer: selectors.MoeLayer, rule):
        self.name, self.layer, self.rule = name, layer, rule
        self.results: list | None = None  # a list to collect each call's Result, or None
        self.active: torch.Tensor | None = None  # bool [T]: the tokens a call selects for (None: all);
        # the others (idle rows of a decode batch) get a zero output and take no part in a Step rule


def moe_layers(model, sidecar=None, rank: int | None = None, int8: bool = False) -> list[selectors.MoeLayer]:
    """Each decoder layer's routed experts as a MoeLayer; with a sidecar (sidecar.Sidecar) the reader's
    tensors too, at `rank` (default: the sidecar's) and the sidecar's scan; `int8`: the reader reads
    its exact rows from the `int8` experts' numbers (experts/int8.py)."""
    top_k = model.config.top_k_experts
    layers = []
    for i, decoder_layer in enumerate(model.model.layers):
        ex = decoder_layer.experts
        layer = selectors.MoeLayer(ex.gate_up_proj.data, ex.down_proj.data, ex.act_fn, top_k)
        if sidecar is not None:
            layer.sidecar = sidecar.layer(i)
            layer.settings = Reader(
                scan=sidecar.scan,
                recovery_rank=sidecar.layout.rank if rank is None else rank,
                quantization="int8" if int8 else "none",
            ).resolved()
            if int8:
                layer.int8 = int8_experts(ex)
        layers.append(layer)
    return layers


def attach_selector(model, name: str, layers: list[selectors.MoeLayer], rules: list) -> list[SelectorState]:
    """Run selector `name` with rules[i] in layer i (layers from `moe_layers`); returns the states."""
    if name not in selectors.SELECTORS:
        raise UserError(f"unknown selector {name!r}; known: {', '.join(selectors.SELECTORS)}")
    states = []
    for decoder_layer, layer, rule in zip(model.model.layers, layers, rules, strict=True):
        decoder_layer.experts.selector = SelectorState(name, layer, rule)
        states.append(decoder_layer.experts.selector)
    spec.set_experts(model, spec.SELECTOR)
    return states


def attached(experts, attr: str, missing: str):
    """The state an attach call put on an experts module as `attr`; where there is none (an
    implementation that needs one, set without it), a UserError: `missing`, which names that call."""
    state = getattr(experts, attr, None)
    if state is None:
        raise UserError(missing)
    return state


def selector_forward(self, hidden_states, top_k_index, top_k_weights):
    state = attached(
        self,
        "selector",
        "selector: no selector attached to this layer; call "
        "neuron_moe.experts.selector_experts.attach_selector(model, name, layers, rules) first",
    )
    if state.active is not None:
        out = torch.zeros_like(hidden_states)
        rows = state.active
        if rows.any():
            result = selectors.run(
                state.name, state.layer, hidden_states[rows], top_k_index[rows], top_k_weights[rows], state.rule
            )
            if state.results is not None:
                state.results.append(result)
            out[rows] = result.out
        return out
    outs = []
    for s in range(0, hidden_states.shape[0], CHUNK):
        part = slice(s, s + CHUNK)
        result = selectors.run(
            state.name, state.layer, hidden_states[part], top_k_index[part], top_k_weights[part], state.rule
        )
        if state.results is not None:
            state.results.append(result)
        outs.append(result.out)
    return torch.cat(outs) if outs else torch.zeros_like(hidden_states)
