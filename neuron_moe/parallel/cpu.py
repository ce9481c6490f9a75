"""NxD's parallel-layer surface on torch.distributed (gloo, or PyTorch's fake group while tracing).

Same names and semantics as `parallel/nxd.py`, so the rank modules are written once:

  ColumnParallelLinear     weight [out/t, in], partition dim 0, no collective (gather_output=False)
                           or an all-gather of the outputs (gather_output=True, for lm_head)
  RowParallelLinear        weight [out, in/t], partition dim 1, input already parallel, all-reduce
                           (in fp32, as NxD's reduce_dtype) after the matmul
  QuantizedColumnParallel  int8 weight as the column layer; fp32 scale [out/t, 1] split with it
  QuantizedRowParallel     int8 weight as the row layer; fp32 scale [out, 1] replicated
  ExpertFusedColumnParallelLinear  weight [E, in, out/t], partition dim 2 (stride 2 for a fused
                           gate_up: each rank's gate columns, then the same up columns)
  ExpertFusedRowParallelLinear     weight [E, in/t, out], partition dim 1; no collective
                           (reduce_output=False: one all-reduce after the router-weighted sum)
  QuantizedExpertFusedColumnParallel / QuantizedExpertFusedRowParallel   their int8 forms,
                           expert_wise_per_channel: fp32 scale [E, 1, out(/t)], split with the
                           column layer (with its stride), replicated with the row layer
  Int4ColumnParallel / Int4RowParallel / Int4ExpertFusedColumnParallel / Int4ExpertFusedRowParallel
                           int4 forms (`experts/int4.py`; NxD has no int4 layer for inf2): the packed
                           uint8 weight and its bf16 `group_scale` carry the float weight's partition
                           tags (the row layers' scale is split with the weight), dequantised on the
                           rank's own shard (or the gathered experts) before the matmul
  reduce_from_tensor_model_parallel_region   the all-reduce itself
  ParallelEmbedding        rows split over the vocabulary; out-of-range ids masked, all-reduce
  SPMDRank                 a [1] int32 parameter, `arange(t)` in the checkpoint, split on dim 0
  scatter_to_process_group_spmd           slice by the SPMDRank tensor: right on every rank
  scatter_to_tensor_model_parallel_region slice by the Python-int rank: frozen at trace time

Collectives are torch.distributed's functional ones, which trace into an exported graph. Each
parameter carries NxD's tags (tensor_model_parallel, partition_dim, partition_stride,
num_partitions), and `shard_checkpoint` slices by those tags, as NxD's does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..experts import int4
from ..experts.int8 import dequantize_output
from . import layout


class ShardError(UserError):
    pass


def _tag(param: nn.Parameter, dim: int | None, tp: int, stride: int = 1) -> nn.Parameter:
    """NxD's set_tensor_model_parallel_attributes: how shard_checkpoint will cut this parameter."""
    param.tensor_model_parallel = dim is not None
    param.partition_dim = 0 if dim is None else dim
    param.partition_stride = stride if dim is not None else 1
    param.num_partitions = tp if dim is not None else 1
    return param


def _per_rank(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ShardError(f"{what} {n} does not split over {tp} ranks")
    return n // tp


def all_reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    """Sum over the ranks, in fp32 (gloo has no bf16 sum; NxD reduces in fp32 by default)."""
    if tp == 1:
        return x
    return fc.all_reduce(x.to(torch.float32), "sum", dist.group.WORLD).to(x.dtype)


def all_gather_last_dim(x: torch.Tensor, tp: int) -> torch.Tensor:
    if tp == 1:
        return x
    return fc.all_gather_tensor(x.contiguous(), x.dim() - 1, dist.group.WORLD)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, *, tp: int, dtype=torch.float32, gather_output=False):
        super().__init__()
        self.tp, self.gather_output = tp, gather_output
        out = _per_rank(output_size, tp, "output size")
        self.weight = _tag(nn.Parameter(torch.zeros(out, input_size, dtype=dtype), requires_grad=False), 0, tp)

    def forward(self, x):
        y = F.linear(x, self.weight)
        return all_gather_last_dim(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, *, tp: int, dtype=torch.float32):
        super().__init__()
        self.tp = tp
        inp = _per_rank(input_size, tp, "input size")
        self.weight = _tag(nn.Parameter(torch.zeros(output_size, inp, dtype=dtype), requires_grad=False), 1, tp)

    def forward(self, x):
        return all_reduce(F.linear(x, self.weight), self.tp)


class QuantizedColumnParallel(nn.Module):
    """per_channel_symmetric int8: the scale has one row per output channel and is split with them."""

    def __init__(self, input_size: int, output_size: int, *, tp: int, dtype=torch.float32):
        super().__init__()
        self.tp = tp
        out = _per_rank(output_size, tp, "output size")
        self.weight = _tag(nn.Parameter(torch.zeros(out, input_size, dtype=torch.int8), requires_grad=False), 0, tp)
        self.scale = _tag(nn.Parameter(torch.ones(out, 1), requires_grad=False), 0, tp)

    def forward(self, x):
        return dequantize_output(F.linear(x, self.weight.to(x.dtype)), self.scale)


class QuantizedRowParallel(nn.Module):
    """per_channel_symmetric int8 over the input-sharded weight: the output channels are whole on
    every rank, so the scale is replicated and applied before the all-reduce (as NxD does)."""

    def __init__(self, input_size: int, output_size: int, *, tp: int, dtype=torch.float32):
        super().__init__()
        self.tp = tp
        inp = _per_rank(input_size, tp, "input size")
        self.weight = _tag(nn.Parameter(torch.zeros(output_size, inp, dtype=torch.int8), requires_grad=False), 1, tp)
        self.scale = _tag(nn.Parameter(torch.ones(output_size, 1), requires_grad=False), None, tp)

    def forward(self, x):
        return all_reduce(dequantize_output(F.linear(x, self.weight.to(x.dtype)), self.scale), self.tp)


class ExpertFusedColumnParallelLinear(nn.Module):
    """E linears in one [E, in, out/t] weight, split on the output dim. forward(x [E or 1, 1, c, in],
    expert_indices [E'] or None) -> [E', 1, c, out/t]: with expert_indices the weight is gathered
    (`weight[expert_indices]`, NxD's selective loading), x's leading dim is 1 or E'."""

    def __init__(
        self, num_experts: int, input_size: int, output_size: int, *, tp: int, dtype=torch.float32, stride: int = 1
    ):
        super().__init__()
        out = _per_rank(output_size, tp * stride, "output size") * stride
        self.weight = _tag(
            nn.Parameter(torch.zeros(num_experts, input_size, out, dtype=dtype), requires_grad=False), 2, tp, stride
        )

    def forward(self, x, expert_indices=None):
        return _expert_matmul(x, self.weight, expert_indices)


class ExpertFusedRowParallelLinear(nn.Module):
    """E linears in one [E, in/t, out] weight, split on the input dim; no all-reduce (NxD's
    reduce_output=False): each rank's output is a partial sum over its input channels."""

    def __init__(self, num_experts: int, input_size: int, output_size: int, *, tp: int, dtype=torch.float32):
        super().__init__()
        inp = _per_rank(input_size, tp, "input size")
        self.weight = _tag(
            nn.Parameter(torch.zeros(num_experts, inp, output_size, dtype=dtype), requires_grad=False), 1, tp
        )

    def forward(self, x, expert_indices=None):
        return _expert_matmul(x, self.weight, expert_indices)


class QuantizedExpertFusedColumnParallel(ExpertFusedColumnParallelLinear):
    """int8 weight as the float layer; expert_wise_per_channel scale [E, 1, out/t], split with it."""

    def __init__(
        self, num_experts: int, input_size: int, output_size: int, *, tp: int, dtype=torch.float32, stride: int = 1
    ):
        super().__init__(num_experts, input_size, output_size, tp=tp, dtype=torch.int8, stride=stride)
        E, _, out = self.weight.shape
        self.scale = _tag(nn.Parameter(torch.ones(E, 1, out), requires_grad=False), 2, tp, stride)

    def forward(self, x, expert_indices=None):
        return _expert_matmul(x, self.weight, expert_indices, self.scale)


class QuantizedExpertFusedRowParallel(ExpertFusedRowParallelLinear):
    """int8 weight as the float layer; expert_wise_per_channel scale [E, 1, out], replicated (the
    output channels are whole on every rank) and applied before the caller's all-reduce."""

    def __init__(self, num_experts: int, input_size: int, output_size: int, *, tp: int, dtype=torch.float32):
        super().__init__(num_experts, input_size, output_size, tp=tp, dtype=torch.int8)
        self.scale = _tag(nn.Parameter(torch.ones(num_experts, 1, output_size), requires_grad=False), None, tp)

    def forward(self, x, expert_indices=None):
        return _expert_matmul(x, self.weight, expert_indices, self.scale)


def _expert_matmul(x, weight, expert_indices, scale=None):
    """NxD's expert-fused forward: the weight (and an int8 layer's scale) gathered by expert_indices
    when given, einsum("e...h,ehi->e...i") on 4-D inputs as NxD's Experts module passes them (its
    quantized layers broadcast the scale as [E, 1, 1, out]), then the scale applied."""
    if x.dim() != 4:
        raise ValueError(f"expert-fused layers take [E, 1, tokens, in] inputs, got shape {tuple(x.shape)}")
    if expert_indices is not None:
        weight, scale = weight[expert_indices], None if scale is None else scale[expert_indices]
    y = torch.einsum("e...h,ehi->e...i", x, weight.to(x.dtype))
    return y if scale is None else dequantize_output(y, scale)


class _Int4:
    """The packed weight and its scales as parameters tagged as the float weight would be; written once
    over a tag (`tag`) and an all-reduce (`reduce`) so `parallel/nxd.py` reuses it with NxD's. The
    group size is int4's one (`experts/int4.py`), as `quantize_experts` writes the checkpoint."""

    tag = staticmethod(_tag)
    reduce = staticmethod(all_reduce)
    group = int4.DEFAULT_GROUP

    def _int4_params(self, shape: tuple[int, ...], dim: int, tp: int, stride: int = 1) -> None:
        """`shape`: the rank's float weight (dim 1 its input dim; a row layer's already split)."""
        int4.check_group(shape[1], self.group, "rank's input channels")
        packed, scales = int4.shapes(shape, self.group)
        self.weight = self.tag(
            nn.Parameter(torch.zeros(packed, dtype=torch.uint8), requires_grad=False), dim, tp, stride
        )
        self.group_scale = self.tag(
            nn.Parameter(torch.ones(scales, dtype=int4.SCALE_DTYPE), requires_grad=False), dim, tp, stride
        )


class Int4ColumnParallel(_Int4, nn.Module):
    """An [out, in] linear in int4, split on the output dim (packed [out/t, in/2], scale [out/t, in/g])."""

    def __init__(self, input_size: int, output_size: int, *, tp: int, dtype=torch.float32):
        super().__init__()
        self._int4_params((_per_rank(output_size, tp, "output size"), input_size), 0, tp)

    def forward(self, x):
        return F.linear(x, int4.unpack(self.weight, self.group_scale, x.dtype))


class Int4RowParallel(_Int4, nn.Module):
    """An [out, in] linear in int4, split on the input dim (packed [out, in/2t], scale [out, in/tg]),
    all-reduce after the matmul."""

    def __init__(self, input_size: int, output_size: int, *, tp: int, dtype=torch.float32):
        super().__init__()
        self.tp = tp
        self._int4_params((output_size, _per_rank(input_size, tp, "input size")), 1, tp)

    def forward(self, x):
        return self.reduce(F.linear(x, int4.unpack(self.weight, self.group_scale, x.dtype)), self.tp)


class Int4ExpertFusedColumnParallel(_Int4, nn.Module):
    """E linears [E, in, out/t] in int4 (packed [E, in/2, out/t], scale [E, in/g, out/t]), split on
    the output dim with the float layer's stride."""

    def __init__(
        self, num_experts: int, input_size: int, output_size: int, *, tp: int, dtype=torch.float32, stride: int = 1
    ):
        super().__init__()
        out = _per_rank(output_size, tp * stride, "output size") * stride
        self._int4_params((num_experts, input_size, out), 2, tp, stride)

    def forward(self, x, expert_indices=None):
        return _int4_expert_matmul(x, self.weight, self.group_scale, expert_indices)


class Int4ExpertFusedRowParallel(_Int4, nn.Module):
    """E linears [E, in/t, out] in int4 (packed [E, in/2t, out], scale [E, in/tg, out]), split on the
    input dim; no all-reduce (the caller's follows the router-weighted sum)."""

    def __init__(self, num_experts: int, input_size: int, output_size: int, *, tp: int, dtype=torch.float32):
        super().__init__()
        self._int4_params((num_experts, _per_rank(input_size, tp, "input size"), output_size), 1, tp)

    def forward(self, x, expert_indices=None):
        return _int4_expert_matmul(x, self.weight, self.group_scale, expert_indices)


def _int4_expert_matmul(x, packed, scale, expert_indices):
    """The expert-fused forward over int4: the packed weight and its scales gathered by expert_indices
    when given, dequantised in x's dtype, then einsum("e...h,ehi->e...i") as `_expert_matmul`."""
    if x.dim() != 4:
        raise ValueError(f"expert-fused layers take [E, 1, tokens, in] inputs, got shape {tuple(x.shape)}")
    if expert_indices is not None:
        packed, scale = packed[expert_indices], scale[expert_indices]
    return torch.einsum("e...h,ehi->e...i", x, int4.unpack(packed, scale, x.dtype))


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, *, tp: int) -> torch.Tensor:
    return all_reduce(input_, tp)


class SPMDRank(nn.Module):
    def __init__(self, tp: int):
        super().__init__()
        self.rank = _tag(nn.Parameter(torch.zeros(1, dtype=torch.int32), requires_grad=False), 0, tp)

    def get_rank(self) -> torch.Tensor:
        return self.rank


class ParallelEmbedding(nn.Module):
    """Vocabulary-parallel embedding whose row offset comes from an SPMDRank, not a Python int
    (NxD's `use_spmd_rank=True`; without it the offset is rank 0's in the traced graph)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: int, dtype=torch.float32):
        super().__init__()
        self.tp = tp
        self.per_rank = _per_rank(num_embeddings, tp, "vocab size")
        self.weight = _tag(
            nn.Parameter(torch.zeros(self.per_rank, embedding_dim, dtype=dtype), requires_grad=False), 0, tp
        )
        self.rank_util = SPMDRank(tp)

    def forward(self, ids):
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        start = self.rank_util.get_rank() * self.per_rank
        local = ids - start
        inside = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local * inside, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out, self.tp)


def scatter_to_process_group_spmd(input_: torch.Tensor, partition_dim: int, rank: torch.Tensor, *, tp: int):
    """This rank's 1/t of `input_` along `partition_dim`, indexed by the rank *tensor*: in a graph
    traced on rank 0 the index is an input, so every rank takes its own slice."""
    n = _per_rank(input_.shape[partition_dim], tp, f"dim {partition_dim} of size")
    return torch.index_select(input_, partition_dim, torch.arange(n, device=input_.device) + rank * n)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, *, tp: int):
    """This rank's 1/t of `input_` along the last dim, indexed by the Python-int process-group rank,
    as NxD's `_split_along_dim` does. Right when each rank runs its own code; in a graph traced on
    rank 0 the slice is the constant 0:n on every rank (the seed bug)."""
    if tp == 1:
        return input_
    n = _per_rank(input_.shape[-1], tp, "last dim of size")
    rank = dist.get_rank()
    return torch.index_select(input_, input_.dim() - 1, torch.arange(n, device=input_.device) + rank * n)


def shard_checkpoint(checkpoint: dict[str, torch.Tensor], model: nn.Module, tp: int) -> list[dict[str, torch.Tensor]]:
    """One state dict per rank, cut from the full (parallel-layout) checkpoint as NxD's
    shard_checkpoint cuts it: a parameter tagged tensor_model_parallel is split on its
    partition_dim into t chunks (t·s with partition stride s, rank r taking r, r + t, …), everything
    else is replicated; each piece must have the module's shape, and is cast to the module's dtype.
    Strict: a checkpoint of the other expert layout, or a missing or unexpected key, is an error."""
    expected = model.state_dict()
    want = layout.expert_layout_of(expected)
    if want is not None:
        layout.check_expert_layout(checkpoint, want, "the checkpoint")
    missing = sorted(set(expected) - set(checkpoint))
    unexpected = sorted(set(checkpoint) - set(expected))
    if missing or unexpected:
        raise ShardError(
            f"checkpoint does not match the rank module: missing {missing[:5]}{'…' if len(missing) > 5 else ''}"
            f", unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''}"
        )
    params = dict(model.named_parameters())
    shards = []
    for rank in range(tp):
        state = {}
        for name, local in expected.items():
            full, param = checkpoint[name], params.get(name)
            piece = (
                layout.split(full, param.partition_dim, param.num_partitions, rank, param.partition_stride)
                if getattr(param, "tensor_model_parallel", False)
                else full
            )
            if piece.shape != local.shape:
                raise ShardError(
                    f"{name}: rank {rank} expects shape {tuple(local.shape)}, "
                    f"the checkpoint's {tuple(full.shape)} gives {tuple(piece.shape)}"
                )
            state[name] = piece.to(local.dtype).clone()
        shards.append(state)
    return shards
