"""`channel_reader`: the sparse-channel reader inside HF's Gemma-4 model.

`attach_reader(model, sidecar, budget)` gives every MoE layer's experts module a `reader`
submodule: that layer's sidecar tensors as non-persistent buffers (they follow `.to()`, stay
out of the state dict) and the k the budget buys. It also rearranges `down_proj` in place
into the reader's [E, I, H] row layout: the parameter keeps HF's [E, H, I] shape as a
transposed view, so there is still one copy, `save_checkpoint` and every other experts
implementation see the same tensor, and the reader and prefill read rows.

Decode or prefill is decided from a shape, never from values: a pre-hook on each decoder
layer records whether its input holds one new token per sequence ([B, 1, H]); then the
experts run the reader, otherwise the full experts (DenseExperts' fixed-shape compute).

The reader's decode step runs on one of READER_KERNELS, all consuming the same sidecar
tensors: `reference` (PyTorch, any device), `triton` (CUDA kernels, `reader/triton/`), `nki`
(NeuronCore kernels, `reader/nki/`).

`quantization="int8"`: the reader over the `int8` experts (experts/int8.py's numbers): decode steps
read their exact channels as int8 rows with their scales (reader/int8.py), prefill runs the int8
experts whole; the budget is a share of the int8 experts' full read. The sidecar may be made from
the weights the int8 ones were quantised from or from the dequantised int8. Reference backend only.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

import torch

from .. import spec
from ..errors import UserError
from ..reader import reference, shard
from ..reader.accounting import solve_k, solve_rank_k
from ..reader.geometry import Geometry
from ..reader.nki import forward as nki
from ..reader.prep import down_rows, model_expert_weights
from ..reader.sidecar import LAYER_TENSORS, Sidecar, SidecarError
from ..spec import INT8_QUANTIZATION, NO_QUANTIZATION, READER_KERNELS, READER_QUANTIZATIONS, Reader, check_quantization
from .dense_masked import dense_masked_forward
from .int8 import int8_experts, int8_forward
from .selector_experts import attached


def reader_forward(kernel: str):
    """The decode-step forward of the reader on `kernel` (same signature as `reference.forward`)."""
    if kernel == "reference":
        return reference.forward
    if kernel == "triton":
        try:
            from ..reader.triton.forward import forward  # imports triton (the triton extra): only when asked
        except ImportError as e:
            raise UserError(f"reader kernel 'triton' needs triton ({e}); pip install 'neuron-moe[triton]'") from None
        return forward
    if kernel == "nki":
        nki.load_kernels()  # a UserError without the Neuron SDK, now rather than at the first decode step
        return nki.forward
    raise UserError(f"unknown reader kernel {kernel!r}; expected one of {', '.join(READER_KERNELS)}")


class ReaderState(torch.nn.Module):
    """One layer's sidecar tensors and reader settings, attached as `experts.reader`."""

    def __init__(self, layer, k: int, scan: int, rank: int, run=reference.forward):
        super().__init__()
        for name in (*LAYER_TENSORS, "signs"):
            self.register_buffer(name, getattr(layer, name), persistent=False)
        self.k, self.scan, self.rank, self.run = k, scan, rank, run  # run: the backend's forward
        self.decode = False  # set by the decoder layer's pre-hook on every call
        self.hook = None
        self.int8 = None  # reader.int8.Int8Experts: the exact rows are read there (quantization="int8")


def _mark_decode(layer, args, kwargs):
    hidden = args[0] if args else kwargs["hidden_states"]
    layer.experts.reader.decode = hidden.shape[1] == 1


def plan_reader(
    config, sidecar: str | Path, budget: float, rank: int | None = None, quantization: str = NO_QUANTIZATION
) -> tuple[Sidecar, int, int]:
    """Every check that needs no weights: the sidecar file against the config's geometry, the
    rank, the budget, the experts it reads (spec.READER_QUANTIZATIONS). Returns (sidecar, k per token,
    rank)."""
    check_quantization(quantization, READER_QUANTIZATIONS, "the reader's quantization")
    side, geo = Sidecar(Path(sidecar)), Geometry.from_config(config)
    want, have = (*geo.sizes, config.num_hidden_layers), (*side.layout.geometry.sizes, side.layers)
    if want != have:
        raise UserError(
            f"{side.path}: sidecar geometry (hidden, experts, intermediate, layers) = {have}, this model's = {want}"
        )
    rank = side.layout.rank if rank is None else rank
    if not 0 <= rank <= side.layout.rank:
        raise UserError(f"recovery rank {rank} outside [0, {side.layout.rank}] (the sidecar's rank)")
    settings = Reader(scan=side.scan, recovery_rank=rank, quantization=quantization).resolved()
    return side, solve_k(geo, settings, budget), rank


@torch.no_grad()
def attach_reader(
    model,
    sidecar: str | Path,
    budget: float,
    rank: int | None = None,
    kernel: str = "reference",
    quantization: str = NO_QUANTIZATION,
    tp: int = 1,
) -> int:
    """Attach a sidecar to every MoE layer and select `channel_reader`; returns k per token.

    Refuses a sidecar of another geometry or made from other weights. `rank` (default: the
    sidecar's) may lower the recovery rank; 0 turns recovery off. `kernel`: one of READER_KERNELS.
    `quantization`: "none" (the model's own experts) or "int8" (the int8 experts' numbers).
    `tp` > 1 emulates in this one process the per-rank reader of TP `tp` on the channel layout
    (`shard.emulated`): each rank's k channels among its own, summed; returns k per rank.
    """
    if quantization == INT8_QUANTIZATION and kernel != "reference":
        raise UserError(f"the reader over int8 experts runs on the reference kernel only, not {kernel!r}")
    forward = reader_forward(kernel)
    if quantization == INT8_QUANTIZATION and tp > 1:
        raise UserError(f"the reader over int8 experts runs at TP 1 only, not the per-rank emulation at TP {tp}")
    side, k, rank = plan_reader(model.config, sidecar, budget, rank, quantization)
    if quantization == INT8_QUANTIZATION:
        _check_int8_source(side, model)
    else:
        side.check_source(model_expert_weights(model))
    if tp > 1:
        if kernel != "reference":
            raise UserError("the per-rank reader emulation (tp > 1) runs on the reference kernel")
        k = solve_rank_k(
            Geometry.from_config(model.config), Reader(scan=side.scan, recovery_rank=rank).resolved(), budget, tp
        )
    for i, layer in enumerate(model.model.layers):
        experts = layer.experts
        rows = down_rows(experts.down_proj.data).contiguous()  # no copy if already rearranged
        experts.down_proj = torch.nn.Parameter(rows.mT, requires_grad=False)
        if getattr(experts, "reader", None) is not None:
            experts.reader.hook.remove()
        state = ReaderState(side.layer(i), k, side.scan, rank, forward).to(experts.down_proj.device)
        if quantization == INT8_QUANTIZATION:
            state.int8 = int8_experts(experts)
        if tp > 1:
            state.run = shard.emulated(side.layer(i), tp)
        experts.reader = state
        state.hook = layer.register_forward_pre_hook(_mark_decode, with_kwargs=True)
    spec.set_experts(model, spec.CHANNEL_READER)
    return k


def _check_int8_source(side: Sidecar, model) -> None:
    """An int8 reader's sidecar comes from the weights int8 was quantised from, or from the dequantised int8."""
    try:
        side.check_source(model_expert_weights(model))
    except SidecarError:
        side.check_source(int8_experts(layer.experts).dequantized() for layer in model.model.layers)


def reader_settings(port, reader: Reader) -> Reader:
    """The reader's settings: those given (the command line's), else the port's [reader] table; a
    sidecar None when neither names one (the caller preps it). A budget is needed."""
    reader = reader.over(port.reader)
    if reader.budget is None:
        raise UserError("the reader needs a budget: pass --budget PERCENT or set [reader] budget in the port")
    return dataclasses.replace(
        reader, sidecar=None if reader.sidecar is None else Path(reader.sidecar), budget=float(reader.budget)
    )


def channel_reader_forward(self, hidden_states, top_k_index, top_k_weights):
    state = attached(
        self,
        "reader",
        "channel_reader: no sidecar attached to this layer; call "
        "neuron_moe.experts.channel_reader.attach_reader(model, sidecar, budget) first",
    )
    if not state.decode:
        full = dense_masked_forward if state.int8 is None else int8_forward
        return full(self, hidden_states, top_k_index, top_k_weights)
    int8 = {} if state.int8 is None else {"int8": state.int8}  # the kernels' forwards take no int8
    return state.run(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        down_rows(self.down_proj),
        state,
        k=state.k,
        scan=state.scan,
        rank=state.rank,
        act_fn=self.act_fn,
        **int8,
    )
