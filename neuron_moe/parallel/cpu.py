"""NxD's parallel-layer surface on torch.distributed (gloo, or PyTorch's fake group while tracing).

Same names and semantics as `parallel/nxd.py`, so the rank modules are written once:

  ColumnParallelLinear     weight [out/t, in], partition dim 0, no collective (gather_output=False)
                           or an all-gather of the outputs (gather_output=True, for lm_head)
  RowParallelLinear        weight [out, in/t], partition dim 1, input already parallel, all-reduce
                           (in fp32, as NxD's reduce_dtype) after the matmul
  ExpertFusedColumnParallelLinear  weight [E, in, out/t], partition dim 2 (stride 2 for a fused
                           gate_up: each rank's gate columns, then the same up columns)
  ExpertFusedRowParallelLinear     weight [E, in/t, out], partition dim 1; no collective
                           (reduce_output=False: one all-reduce after the router-weighted sum)
                           Each takes its weight in any format (`fmt`, `formats/`): the format's
                           tensors carry the float weight's partition tags, but for one it
                           replicates (int8's per-output-channel scale of a row layer, as NxD's
                           quantized layers hold it), and are unpacked on the rank's own shard (or
                           the gathered experts) in the graph
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
from ..formats import NONE, Format
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


class _Weight(nn.Module):
    """A parallel linear's weight in a format (`formats/`): each of the format's tensors a parameter
    tagged as the float weight would be, or replicated where the format says so (`Format.replicated`);
    written once over a tag (`tag`) and an all-reduce (`reduce`) so `parallel/nxd.py` reuses it with
    NxD's."""

    tag = staticmethod(_tag)
    reduce = staticmethod(all_reduce)

    def _weight(self, shape: tuple[int, ...], dim: int, tp: int, dtype, fmt: Format, stride: int = 1) -> None:
        """`shape`: the rank's float weight (dim 1 its input dim; a row layer's already split)."""
        fmt.check(shape[1], "input channels of a rank")
        self.format, self.tensor_names = fmt, fmt.tensors
        for name, (size, tensor_dtype) in fmt.shapes(shape, dtype).items():
            param = nn.Parameter(torch.zeros(size, dtype=tensor_dtype), requires_grad=False)
            if fmt.replicated(name, dim):
                setattr(self, name, _tag(param, None, tp))
            else:
                setattr(self, name, self.tag(param, dim, tp, stride))

    def tensors(self, expert_indices: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The format's tensors, each gathered by `expert_indices` when given (NxD's selective loading)."""
        tensors = {name: getattr(self, name) for name in self.tensor_names}
        if expert_indices is None:
            return tensors
        return {name: t[expert_indices] for name, t in tensors.items()}


class ColumnParallelLinear(_Weight):
    """An [out, in] linear split on the output dim; no collective (gather_output=False) or an all-gather
    of the outputs (gather_output=True, for lm_head)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp: int,
        dtype=torch.float32,
        fmt: Format = NONE,
        gather_output=False,
    ):
        super().__init__()
        self.tp, self.gather_output = tp, gather_output
        self._weight((_per_rank(output_size, tp, "output size"), input_size), 0, tp, dtype, fmt)

    def forward(self, x):
        y = self.format.linear(x, self.tensors())
        return all_gather_last_dim(y, self.tp) if self.gather_output else y


class RowParallelLinear(_Weight):
    """An [out, in] linear split on the input dim (the input already parallel), all-reduce after the matmul."""

    def __init__(self, input_size: int, output_size: int, *, tp: int, dtype=torch.float32, fmt: Format = NONE):
        super().__init__()
        self.tp = tp
        self._weight((output_size, _per_rank(input_size, tp, "input size")), 1, tp, dtype, fmt)

    def forward(self, x):
        return self.reduce(self.format.linear(x, self.tensors()), self.tp)


class ExpertFusedColumnParallelLinear(_Weight):
    """E linears in one [E, in, out/t] weight, split on the output dim (with stride 2 for a fused
    gate_up). forward(x [E or 1, 1, c, in], expert_indices [E'] or None) -> [E', 1, c, out/t]: with
    expert_indices the weight is gathered (`weight[expert_indices]`, NxD's selective loading), x's
    leading dim is 1 or E'."""

    def __init__(
        self,
        num_experts: int,
        input_size: int,
        output_size: int,
        *,
        tp: int,
        dtype=torch.float32,
        fmt: Format = NONE,
        stride: int = 1,
    ):
        super().__init__()
        out = _per_rank(output_size, tp * stride, "output size") * stride
        self._weight((num_experts, input_size, out), 2, tp, dtype, fmt, stride)

    def forward(self, x, expert_indices=None):
        return _expert_matmul(x, self, expert_indices)


class ExpertFusedRowParallelLinear(_Weight):
    """E linears in one [E, in/t, out] weight, split on the input dim; no all-reduce (NxD's
    reduce_output=False): each rank's output is a partial sum over its input channels."""

    def __init__(
        self, num_experts: int, input_size: int, output_size: int, *, tp: int, dtype=torch.float32, fmt: Format = NONE
    ):
        super().__init__()
        self._weight((num_experts, _per_rank(input_size, tp, "input size"), output_size), 1, tp, dtype, fmt)

    def forward(self, x, expert_indices=None):
        return _expert_matmul(x, self, expert_indices)


def _expert_matmul(x: torch.Tensor, layer: _Weight, expert_indices: torch.Tensor | None) -> torch.Tensor:
    """NxD's expert-fused forward: the layer's tensors gathered by expert_indices when given, then
    einsum("e...h,ehi->e...i") on 4-D inputs as NxD's Experts module passes them (its quantized
    layers broadcast an int8 scale as [E, 1, 1, out]), in the layer's format."""
    if x.dim() != 4:
        raise ValueError(f"expert-fused layers take [E, 1, tokens, in] inputs, got shape {tuple(x.shape)}")
    return layer.format.expert_matmul(x, layer.tensors(expert_indices))


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
