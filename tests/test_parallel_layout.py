"""The TP layout and the CPU backend's sharding, in one process: who owns what, sliced as NxD's
shard_checkpoint slices it, and the rank modules' parameters tagged as the layout says."""

import pytest
import torch
import torch.distributed as dist

from neuron_moe.experts.dense_masked import router_weight_matrix
from neuron_moe.experts.int8 import quantize_experts
from neuron_moe.parallel import cpu, layout
from neuron_moe.parallel.moe import ParallelMoE
from neuron_moe.port import load_port

LAYER = 1  # a global (full-attention) layer: 2 KV heads, head_dim 64, in the tiny port


def block_state(parallel_state, layer=LAYER):
    """The MoE block's part of a parallel-layout state dict, named as in ParallelMoE."""
    prefix = f"model.layers.{layer}."
    return {k[len(prefix):]: v for k, v in parallel_state.items()
            if k.startswith(prefix) and k[len(prefix):].split(".")[0] in ("router", "experts")}


@pytest.fixture(scope="module")
def hf_state(tiny_eager):
    return tiny_eager.state_dict()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_experts_are_whole_and_expert_major_on_each_rank(tiny_eager, hf_state, tp):
    config = tiny_eager.config
    par = layout.parallel_state_dict(hf_state, config, tp)
    gate_up, down = hf_state[f"model.layers.{LAYER}.experts.gate_up_proj"], hf_state[f"model.layers.{LAYER}.experts.down_proj"]
    for rank in range(tp):
        mine = list(layout.expert_range(config, tp, rank))
        assert mine == list(range(rank * config.num_experts // tp, (rank + 1) * config.num_experts // tp))
        gu = layout.shard(par[f"model.layers.{LAYER}.experts.gate_up_proj.weight"], layout.COLUMN, tp, rank)
        dn = layout.shard(par[f"model.layers.{LAYER}.experts.down_proj.weight"], layout.ROW, tp, rank)
        assert torch.equal(gu, gate_up[mine].reshape(-1, config.hidden_size))
        assert torch.equal(dn, down[mine].permute(1, 0, 2).reshape(config.hidden_size, -1))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_each_rank_holds_the_kv_head_its_query_heads_read(tiny_eager, hf_state, tp):
    config = tiny_eager.config
    par = layout.parallel_state_dict(hf_state, config, tp)
    heads = config.num_attention_heads
    for layer in (0, 1):  # sliding (4 KV heads) and global (2)
        kv, d = layout.kv_heads(config, layer), config.per_layer_config[layer].head_dim
        k_full = hf_state[f"model.layers.{layer}.self_attn.k_proj.weight"].view(kv, d, -1)
        for rank in range(tp):
            k = layout.shard(par[f"model.layers.{layer}.self_attn.k_proj.weight"], layout.COLUMN, tp, rank)
            local_kv = layout.kv_heads_per_rank(config, layer, tp)
            assert k.shape[0] == local_kv * d
            q_heads = range(rank * heads // tp, (rank + 1) * heads // tp)
            for i, q in enumerate(q_heads):  # HF's GQA: query head q reads KV head q // (heads / kv)
                wanted = q // (heads // kv)
                got = k.view(local_kv, d, -1)[i * local_kv // len(q_heads)]
                assert torch.equal(got, k_full[wanted])


def test_parallel_state_dict_leaves_its_input_alone(hf_state, tiny_eager):
    before = {k: (v._version, v.clone()) for k, v in hf_state.items()}
    par = layout.parallel_state_dict(hf_state, tiny_eager.config, 8)
    assert all(hf_state[k]._version == ver and torch.equal(hf_state[k], old) for k, (ver, old) in before.items())
    assert torch.equal(par["model.layers.0.experts.spmd_rank.rank"], torch.arange(8, dtype=torch.int32))
    assert torch.equal(par["model.embed_tokens.rank_util.rank"], torch.arange(8, dtype=torch.int32))
    assert "model.layers.0.experts.gate_up_proj" not in par


def test_degrees_that_do_not_split_are_named():
    big = load_port("gemma4-26b-a4b").config
    with pytest.raises(layout.LayoutError, match="16 attention heads do not split over 24 ranks; "
                                                 "128 experts do not split over 24 ranks"):
        layout.check_degree(big, 24)
    with pytest.raises(layout.LayoutError, match=r"TP degree 3 is not one of \(1, 2, 4, 8, 24\)"):
        layout.check_degree(big, 3)
    layout.check_degree(big, 8)


@pytest.mark.parametrize("int8", [False, True])
def test_rank_module_tags_agree_with_the_layout(tiny_eager, int8):
    module = ParallelMoE(tiny_eager.config, 4, cpu, int8=int8)
    for name, p in module.named_parameters():
        kind = layout.placement(name)
        if name.endswith(".scale"):  # int8 scales: split with a column layer, replicated with a row layer
            kind = layout.placement(name.removesuffix("scale") + "weight")
            kind = kind if kind == layout.COLUMN else layout.REPLICATED
        split = getattr(p, "tensor_model_parallel", False)  # HF's router: untagged, as in NxD
        assert split == (kind != layout.REPLICATED), name
        if split:
            assert p.partition_dim == layout.SPLIT_DIM[kind] and p.num_partitions == 4, name


def test_shard_checkpoint_cuts_as_nxd_does(tiny_eager, hf_state):
    config, tp = tiny_eager.config, 4
    full = block_state(quantize_experts(layout.parallel_state_dict(hf_state, config, tp)))
    module = ParallelMoE(config, tp, cpu, int8=True)
    shards = cpu.shard_checkpoint(full, module, tp)
    gu, gu_s = full["experts.gate_up_proj.weight"], full["experts.gate_up_proj.scale"]
    dn, dn_s = full["experts.down_proj.weight"], full["experts.down_proj.scale"]
    assert gu.dtype == dn.dtype == torch.int8
    for rank, state in enumerate(shards):
        assert torch.equal(state["experts.gate_up_proj.weight"], gu.chunk(tp, 0)[rank])  # column: dim 0
        assert torch.equal(state["experts.gate_up_proj.scale"], gu_s.chunk(tp, 0)[rank])  # scale split with it
        assert torch.equal(state["experts.down_proj.weight"], dn.chunk(tp, 1)[rank])  # row: dim 1
        assert torch.equal(state["experts.down_proj.scale"], dn_s)  # scale replicated
        assert state["experts.spmd_rank.rank"].tolist() == [rank] and state["experts.spmd_rank.rank"].dtype == torch.int32
        assert torch.equal(state["router.proj.weight"], full["router.proj.weight"])  # replicated
    # reassembled, the shards are the checkpoint
    assert torch.equal(torch.cat([s["experts.down_proj.weight"] for s in shards], 1), dn)


def test_shard_checkpoint_is_strict(tiny_eager, hf_state):
    config = tiny_eager.config
    full = block_state(layout.parallel_state_dict(hf_state, config, 2))
    module = ParallelMoE(config, 2, cpu)
    with pytest.raises(cpu.ShardError, match=r"missing \['experts.spmd_rank.rank'\]"):
        cpu.shard_checkpoint({k: v for k, v in full.items() if k != "experts.spmd_rank.rank"}, module, 2)
    wrong = dict(full, **{"experts.down_proj.weight": full["experts.down_proj.weight"][:, :-2]})
    with pytest.raises(cpu.ShardError, match=r"experts\.down_proj\.weight: rank 0 expects shape \(128, 512\), "
                                             r"the checkpoint's \(128, 1022\) gives \(128, 511\)"):
        cpu.shard_checkpoint(wrong, module, 2)


@pytest.mark.parametrize("tp", [2, 8])
def test_each_rank_running_its_own_code_takes_its_own_router_slice(tiny_eager, hf_state, tp):
    """Eager, rank by rank (PyTorch's fake process group supplies the Python-int rank): both
    scatters take the right slice. Only a graph traced once on rank 0 tells them apart
    (tests/test_tensor_parallel.py)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = tiny_eager.config
    full = block_state(layout.parallel_state_dict(hf_state, config, tp))
    x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, w, idx = tiny_eager.model.layers[LAYER].router(x.reshape(10, -1))
    dense = router_weight_matrix(idx, w, config.num_experts).view(2, 5, -1)
    n = config.num_experts // tp
    for scatter in ("spmd", "naive"):
        module = ParallelMoE(config, tp, cpu, scatter=scatter)
        for rank, state in enumerate(cpu.shard_checkpoint(full, module, tp)):
            module.load_state_dict(state)
            dist.init_process_group("fake", rank=rank, world_size=tp, store=FakeStore())
            try:
                with torch.no_grad():
                    local = module.local_router_weights(x)
            finally:
                dist.destroy_process_group()
            assert torch.equal(local, dense[..., rank * n:(rank + 1) * n]), (scatter, rank)
