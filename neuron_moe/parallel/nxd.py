"""The parallel-layer surface of `parallel/cpu.py` on neuronx-distributed (NxD, the Neuron SDK).

Same names and arguments as the CPU backend, so the rank modules (`parallel/moe.py`, …) are
written once. This module imports without the SDK; the first use without it raises
`NeuronSDKMissing`, one clear line instead of an ImportError from inside the SDK.

Every NxD name this module touches goes through `_nxd` / `_bound`, which accept only the names in
NXD_API, and every call passes keyword arguments only. NXD_API lists each name with its file in
aws-neuron/neuronx-distributed and the keywords we pass; `tests/test_nxd_api.py` checks that this
module uses nothing outside the table, and `tools/check_nxd_api.py SRC` checks the table against
a checkout of the NxD source (each name defined there, each keyword a parameter of it).

Traps (shared/notes/neuron-apis.md):
- `initialize_model_parallel`'s third positional parameter is context_parallel_size, not the
  expert-parallel degree some callers pass there: keywords only.
- NxD's `scale_dequantize` multiplies an fp32 input in place. Its quantized layers call it on the
  fresh matmul output only, which is harmless; we never call it ourselves, and the int8
  checkpoint is made by `experts.int8.quantize_per_channel`, which never writes to its input.
- The quantized layers broadcast the scale as [1, 1, out]: their inputs must be 3-D [B, S, H]
  (the rank modules pass 3-D tensors throughout). The quantized expert-fused layers broadcast
  their [E, 1, out] scale as [E, 1, 1, out]: their inputs must be 4-D [E, 1, tokens, in], as NxD's
  own `modules/moe/experts.py` passes them.
- NxD's sharding (`trace/trace.py: shard_children`) cuts only parameters of its parallel-layer
  classes: a tagged parameter of any other module is silently replicated. Hence the expert-fused
  layers for the channel layout's 3-D experts, not tagged parameters of our own.
- Weight formats (`formats/`): none and int8 run on NxD's own layers (its quantized layers for int8).
  NxD has no 4-bit layer for inf2 (its MXFP4 MoE kernel is Trn3-only): int4 and q4_0 run on
  `parallel/cpu.py`'s layers made subclasses of NxD's `BaseParallelLinear` (so `shard_children` cuts
  their parameters), with NxD's own `set_tensor_model_parallel_attributes` on the format's tensors
  and NxD's all-reduce.
- `ParallelEmbedding` takes its vocabulary offset from the Python-int rank unless
  `use_spmd_rank=True`: the same frozen-at-trace-time bug as the router scatter.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import UserError
from ..formats import NONE, Format
from ..formats.int8 import INT8
from . import cpu

NXD_SOURCE = "aws-neuron/neuronx-distributed @ fbac349 (Release 2.29)"
_L = "src/neuronx_distributed/parallel_layers/layers.py"
_M = "src/neuronx_distributed/parallel_layers/mappings.py"
_PS = "src/neuronx_distributed/parallel_layers/parallel_state.py"
_Q = "src/neuronx_distributed/quantization/quantization_layers.py"
_QC = "src/neuronx_distributed/quantization/quantization_config.py"
_MB = "src/neuronx_distributed/trace/model_builder.py"
_MOE = "src/neuronx_distributed/modules/moe/moe_parallel_layers.py"
_U = "src/neuronx_distributed/parallel_layers/utils.py"

# dotted name -> (file in NXD_SOURCE, keyword arguments we pass; None for a value we only read)
NXD_API: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "neuronx_distributed.parallel_layers.layers.ColumnParallelLinear": (
        _L,
        ("input_size", "output_size", "bias", "gather_output", "dtype"),
    ),
    "neuronx_distributed.parallel_layers.layers.RowParallelLinear": (
        _L,
        ("input_size", "output_size", "bias", "input_is_parallel", "dtype"),
    ),
    "neuronx_distributed.parallel_layers.layers.ParallelEmbedding": (
        _L,
        ("num_embeddings", "embedding_dim", "dtype", "shard_across_embedding", "use_spmd_rank"),
    ),
    "neuronx_distributed.parallel_layers.layers.SPMDRank": (_L, ("world_size", "tensor_model_parallel_size")),
    "neuronx_distributed.parallel_layers.mappings.scatter_to_process_group_spmd": (
        _M,
        ("input_", "partition_dim", "rank"),
    ),
    "neuronx_distributed.parallel_layers.mappings.scatter_to_tensor_model_parallel_region": (_M, ("input_",)),
    "neuronx_distributed.parallel_layers.mappings.reduce_from_tensor_model_parallel_region": (_M, ("input_",)),
    "neuronx_distributed.parallel_layers.layers.BaseParallelLinear": (_L, None),
    "neuronx_distributed.parallel_layers.utils.set_tensor_model_parallel_attributes": (
        _U,
        ("tensor", "is_parallel", "dim", "stride", "num_partitions"),
    ),
    "neuronx_distributed.modules.moe.moe_parallel_layers.ExpertFusedColumnParallelLinear": (
        _MOE,
        ("num_experts", "input_size", "output_size", "bias", "dtype", "stride"),
    ),
    "neuronx_distributed.modules.moe.moe_parallel_layers.ExpertFusedRowParallelLinear": (
        _MOE,
        ("num_experts", "input_size", "output_size", "bias", "reduce_output", "dtype"),
    ),
    "neuronx_distributed.parallel_layers.parallel_state.initialize_model_parallel": (
        _PS,
        (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "skip_collective_init",
        ),
    ),
    "neuronx_distributed.parallel_layers.parallel_state.model_parallel_is_initialized": (_PS, ()),
    "neuronx_distributed.parallel_layers.parallel_state.get_tensor_model_parallel_size": (_PS, ()),
    "neuronx_distributed.quantization.quantization_layers.QuantizedColumnParallel": (
        _Q,
        (
            "input_size",
            "output_size",
            "bias",
            "quantization_type",
            "gather_output",
            "dtype",
            "quantized_dtype",
            "quantization_per_channel_axis",
            "scale_dtype",
        ),
    ),
    "neuronx_distributed.quantization.quantization_layers.QuantizedRowParallel": (
        _Q,
        (
            "input_size",
            "output_size",
            "bias",
            "quantization_type",
            "input_is_parallel",
            "dtype",
            "quantized_dtype",
            "quantization_per_channel_axis",
            "scale_dtype",
        ),
    ),
    "neuronx_distributed.quantization.quantization_layers.QuantizedExpertFusedColumnParallel": (
        _Q,
        (
            "num_experts",
            "input_size",
            "output_size",
            "bias",
            "quantization_type",
            "dtype",
            "quantized_dtype",
            "stride",
            "quantization_per_channel_axis",
            "scale_dtype",
        ),
    ),
    "neuronx_distributed.quantization.quantization_layers.QuantizedExpertFusedRowParallel": (
        _Q,
        (
            "num_experts",
            "input_size",
            "output_size",
            "reduce_output",
            "bias",
            "quantization_type",
            "quantized_dtype",
            "dtype",
            "quantization_per_channel_axis",
            "scale_dtype",
        ),
    ),
    "neuronx_distributed.quantization.quantization_config.QuantizationType.PER_CHANNEL_SYMMETRIC": (_QC, None),
    "neuronx_distributed.quantization.quantization_config.QuantizationType.EXPERT_WISE_PER_CHANNEL_SYMMETRIC": (
        _QC,
        None,
    ),
    "neuronx_distributed.quantization.quantization_config.QuantizedDtype.INT8": (_QC, None),
    "neuronx_distributed.trace.model_builder.ModelBuilder": (
        _MB,
        ("router", "tp_degree", "checkpoint_loader", "compiler_workdir"),
    ),
    "neuronx_distributed.trace.model_builder.BaseModelInstance": (_MB, ("module_cls", "input_output_aliases")),
    "neuronx_distributed.trace.model_builder.ModelBuilder.add": (
        _MB,
        ("key", "model_instance", "example_inputs", "compiler_args"),
    ),
    "neuronx_distributed.trace.model_builder.ModelBuilder.trace": (_MB, ("initialize_model_weights",)),
    "neuronx_distributed.trace.model_builder.ModelBuilder.shard_checkpoint": (_MB, ("serialize_path",)),
}


_SDK_PACKAGES = ("neuronx_distributed", "torch_neuronx", "torch_xla")


class NeuronSDKMissing(UserError):
    pass


def _nxd(dotted: str):
    """The NxD object named `dotted` (a module attribute, or a class attribute such as an enum member)."""
    if dotted not in NXD_API:
        raise KeyError(f"{dotted} is not in NXD_API: verify it against {NXD_SOURCE} and add it")
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith(_SDK_PACKAGES):
                raise
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise NeuronSDKMissing(
        f"{dotted} needs the Neuron SDK (neuronx-distributed, torch-neuronx), which is not installed here. "
        "It is not on PyPI: use the Neuron SDK 2.31 deep-learning container for inf2 (recipes/inf2-24xlarge/)"
    )


def _bound(obj, dotted: str) -> Callable:
    """Method `dotted` (Class.method in NXD_API) of an NxD object."""
    if dotted not in NXD_API:
        raise KeyError(f"{dotted} is not in NXD_API: verify it against {NXD_SOURCE} and add it")
    cls, method = dotted.split(".")[-2:]
    if type(obj).__name__ != cls:
        raise TypeError(f"{dotted} called on a {type(obj).__name__}")
    return getattr(obj, method)


def sdk_available() -> bool:
    try:
        _nxd("neuronx_distributed.parallel_layers.parallel_state.model_parallel_is_initialized")
    except NeuronSDKMissing:
        return False
    return True


def initialize_model_parallel(tp: int) -> None:
    """NxD's parallel state for `tp` ranks, keywords only (see the trap above)."""
    _nxd("neuronx_distributed.parallel_layers.parallel_state.initialize_model_parallel")(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        skip_collective_init=True,
    )


def _check_tp(tp: int) -> None:
    """NxD's layers take the degree from its parallel state; ours take it as an argument. They must agree."""
    initialized = _nxd("neuronx_distributed.parallel_layers.parallel_state.model_parallel_is_initialized")()
    size = (
        _nxd("neuronx_distributed.parallel_layers.parallel_state.get_tensor_model_parallel_size")()
        if initialized
        else None
    )
    if size != tp:
        raise RuntimeError(
            f"NxD parallel state has TP {size}, the rank module was built for TP {tp}: "
            "build rank modules inside ModelBuilder (or after initialize_model_parallel)"
        )


def _linear(input_size: int, output_size: int, tp: int, dtype) -> dict:
    """A linear's arguments to NxD (no bias), once the degree agrees with NxD's (`_check_tp`)."""
    _check_tp(tp)
    return dict(input_size=input_size, output_size=output_size, bias=False, dtype=dtype)


def _fused(num_experts: int, input_size: int, output_size: int, tp: int, dtype) -> dict:
    """An expert-fused layer's arguments to NxD (no bias), once the degree agrees with NxD's."""
    _check_tp(tp)
    return dict(num_experts=num_experts, input_size=input_size, output_size=output_size, bias=False, dtype=dtype)


def _int8(expert_wise: bool) -> dict:
    """NxD's int8 arguments: a linear's, a scale per output channel (axis 0 of its [out, in] weight);
    an expert-fused layer's (`expert_wise`), a scale per expert and output channel (axis 2 of [E, in,
    out]), [E, 1, out], which selective loading gathers with the weight (`scale[expert_indices]`)."""
    return dict(
        quantization_type=_nxd(
            "neuronx_distributed.quantization.quantization_config.QuantizationType.EXPERT_WISE_PER_CHANNEL_SYMMETRIC"
        )
        if expert_wise
        else _nxd("neuronx_distributed.quantization.quantization_config.QuantizationType.PER_CHANNEL_SYMMETRIC"),
        quantized_dtype=_nxd("neuronx_distributed.quantization.quantization_config.QuantizedDtype.INT8"),
        quantization_per_channel_axis=2 if expert_wise else 0,
        scale_dtype=torch.float32,
    )


def _nxd_int8(fmt: Format) -> bool:
    """int8 runs on NxD's own quantized layers; every other quantized format on `parallel/cpu.py`'s."""
    return fmt.name == INT8.name


def ColumnParallelLinear(
    input_size: int, output_size: int, *, tp: int, dtype=torch.float32, fmt: Format = NONE, gather_output=False
):
    if fmt is NONE:
        return _nxd("neuronx_distributed.parallel_layers.layers.ColumnParallelLinear")(
            **_linear(input_size, output_size, tp, dtype), gather_output=gather_output
        )
    if _nxd_int8(fmt):
        return _nxd("neuronx_distributed.quantization.quantization_layers.QuantizedColumnParallel")(
            **_linear(input_size, output_size, tp, dtype), gather_output=gather_output, **_int8(expert_wise=False)
        )
    _check_tp(tp)
    return _formatted(cpu.ColumnParallelLinear)(
        input_size, output_size, tp=tp, dtype=dtype, fmt=fmt, gather_output=gather_output
    )


def RowParallelLinear(input_size: int, output_size: int, *, tp: int, dtype=torch.float32, fmt: Format = NONE):
    if fmt is NONE:
        return _nxd("neuronx_distributed.parallel_layers.layers.RowParallelLinear")(
            **_linear(input_size, output_size, tp, dtype), input_is_parallel=True
        )
    if _nxd_int8(fmt):
        return _nxd("neuronx_distributed.quantization.quantization_layers.QuantizedRowParallel")(
            **_linear(input_size, output_size, tp, dtype), input_is_parallel=True, **_int8(expert_wise=False)
        )
    _check_tp(tp)
    return _formatted(cpu.RowParallelLinear)(input_size, output_size, tp=tp, dtype=dtype, fmt=fmt)


def ExpertFusedColumnParallelLinear(
    num_experts: int,
    input_size: int,
    output_size: int,
    *,
    tp: int,
    dtype=torch.float32,
    fmt: Format = NONE,
    stride: int = 1,
):
    if fmt is NONE:
        return _nxd("neuronx_distributed.modules.moe.moe_parallel_layers.ExpertFusedColumnParallelLinear")(
            **_fused(num_experts, input_size, output_size, tp, dtype), stride=stride
        )
    if _nxd_int8(fmt):
        return _nxd("neuronx_distributed.quantization.quantization_layers.QuantizedExpertFusedColumnParallel")(
            **_fused(num_experts, input_size, output_size, tp, dtype), stride=stride, **_int8(expert_wise=True)
        )
    _check_tp(tp)
    layer = _formatted(cpu.ExpertFusedColumnParallelLinear)
    return layer(num_experts, input_size, output_size, tp=tp, dtype=dtype, fmt=fmt, stride=stride)


def ExpertFusedRowParallelLinear(
    num_experts: int, input_size: int, output_size: int, *, tp: int, dtype=torch.float32, fmt: Format = NONE
):
    if fmt is NONE:
        return _nxd("neuronx_distributed.modules.moe.moe_parallel_layers.ExpertFusedRowParallelLinear")(
            **_fused(num_experts, input_size, output_size, tp, dtype), reduce_output=False
        )
    if _nxd_int8(fmt):
        return _nxd("neuronx_distributed.quantization.quantization_layers.QuantizedExpertFusedRowParallel")(
            **_fused(num_experts, input_size, output_size, tp, dtype), reduce_output=False, **_int8(expert_wise=True)
        )
    _check_tp(tp)
    return _formatted(cpu.ExpertFusedRowParallelLinear)(
        num_experts, input_size, output_size, tp=tp, dtype=dtype, fmt=fmt
    )


def _tag(param, dim: int, tp: int, stride: int = 1):
    _nxd("neuronx_distributed.parallel_layers.utils.set_tensor_model_parallel_attributes")(
        tensor=param, is_parallel=True, dim=dim, stride=stride, num_partitions=tp
    )
    return param


def _reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    return reduce_from_tensor_model_parallel_region(x, tp=tp)


def _formatted(layer: type) -> type:
    """`parallel/cpu.py`'s layer of a weight format NxD has no layer for (int4, q4_0; its MXFP4 MoE
    kernel is Trn3-only) as an NxD parallel linear (`shard_children` cuts only those), tagged and
    all-reduced by NxD; it takes the same arguments."""
    base = _nxd("neuronx_distributed.parallel_layers.layers.BaseParallelLinear")
    return type(layer.__name__, (layer, base), {"tag": staticmethod(_tag), "reduce": staticmethod(_reduce)})


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, *, tp: int):
    return _nxd("neuronx_distributed.parallel_layers.mappings.reduce_from_tensor_model_parallel_region")(input_=input_)


def ParallelEmbedding(num_embeddings: int, embedding_dim: int, *, tp: int, dtype=torch.float32):
    _check_tp(tp)
    return _nxd("neuronx_distributed.parallel_layers.layers.ParallelEmbedding")(
        num_embeddings=num_embeddings,
        embedding_dim=embedding_dim,
        dtype=dtype,
        shard_across_embedding=False,
        use_spmd_rank=True,
    )


def SPMDRank(tp: int):
    _check_tp(tp)
    return _nxd("neuronx_distributed.parallel_layers.layers.SPMDRank")(world_size=tp, tensor_model_parallel_size=tp)


def scatter_to_process_group_spmd(input_: torch.Tensor, partition_dim: int, rank: torch.Tensor, *, tp: int):
    return _nxd("neuronx_distributed.parallel_layers.mappings.scatter_to_process_group_spmd")(
        input_=input_, partition_dim=partition_dim, rank=rank
    )


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, *, tp: int):
    return _nxd("neuronx_distributed.parallel_layers.mappings.scatter_to_tensor_model_parallel_region")(input_=input_)


def trace_keys(
    keys: dict[str, tuple[Callable[[], torch.nn.Module], list[tuple]]],
    checkpoint_loader: Callable[[], dict],
    tp: int,
    workdir: Path,
    compiler_args: str | None = None,
):
    """ModelBuilder over several keys (e.g. one per context-encoding bucket and one for token
    generation): `keys[key] = (module factory, example input tuples)`. Traces rank 0 once per key
    and compiles; returns (builder, traced model without weights) for `torch.jit.save` and
    `shard_checkpoint`. `checkpoint_loader()` returns the full parallel-layout state dict.
    `compiler_args`: neuronx-cc's, for every key (trace-and-compile's: its target's, `--target inf2`
    among them; None: ModelBuilder's default, which names no target).

    A module with state (the static graphs' aliased KV cache) has `output_aliases()`: {state
    parameter: output index}, ModelBuilder's input_output_aliases. Those parameters exist only once
    ModelBuilder has built the module (`BaseModelInstance.load_module` calls the factory), so each
    key's instance holds a dict that its factory fills when it is called — the dict the instance
    returns from `get` (it keeps the object it was given, fbac349 model_builder.py); NxD's own
    StatefulModelInstance test subclasses for the same reason.
    """
    builder = _nxd("neuronx_distributed.trace.model_builder.ModelBuilder")(
        router=None, tp_degree=tp, checkpoint_loader=checkpoint_loader, compiler_workdir=str(workdir)
    )
    for key, (factory, examples) in keys.items():
        aliases: dict = {}
        instance = _nxd("neuronx_distributed.trace.model_builder.BaseModelInstance")(
            module_cls=_filling(factory, aliases), input_output_aliases=aliases
        )
        _bound(builder, "neuronx_distributed.trace.model_builder.ModelBuilder.add")(
            key=key, model_instance=instance, example_inputs=examples, compiler_args=compiler_args
        )
    traced = _bound(builder, "neuronx_distributed.trace.model_builder.ModelBuilder.trace")(
        initialize_model_weights=False
    )
    return builder, traced


def _filling(factory: Callable[[], torch.nn.Module], aliases: dict) -> Callable[[], torch.nn.Module]:
    """`factory`, which also makes `aliases` the built module's output aliases (none if stateless)."""

    def build():
        module = factory()
        aliases.clear()
        aliases.update(module.output_aliases() if hasattr(module, "output_aliases") else {})
        return module

    return build


def shard_checkpoint(builder, serialize_path: Path):
    """Per-rank checkpoints `tp{rank}_sharded_checkpoint.safetensors` under serialize_path."""
    return _bound(builder, "neuronx_distributed.trace.model_builder.ModelBuilder.shard_checkpoint")(
        serialize_path=str(serialize_path)
    )
