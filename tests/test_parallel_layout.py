"""The TP layout and the CPU backend's sharding, in one process: who owns what in each expert
layout, sliced as NxD's shard_checkpoint slices it (partition stride included), the rank modules'
parameters tagged as the layout says, and one layout's checkpoint refused by the other's module."""

import copy

import pytest
import torch
import torch.distributed as dist

from neuron_moe import spec
from neuron_moe.experts.dense_masked import router_weight_matrix
from neuron_moe.errors import UserError
from neuron_moe.formats import FORMATS, quantize_state
from neuron_moe.parallel import cpu, layout
from neuron_moe.parallel.moe import ParallelMoE
from neuron_moe.port import load_port

LAYER = 1  # a global (full-attention) layer: 2 KV heads, head_dim 64, in the tiny port


def block_state(parallel_state, layer=LAYER):
    """The MoE block's part of a parallel-layout state dict, named as in ParallelMoE."""
    prefix = f"model.layers.{layer}."
    return {
        k[len(prefix) :]: v
        for k, v in parallel_state.items()
        if k.startswith(prefix) and k[len(prefix) :].split(".")[0] in ("router", "experts")
    }


@pytest.fixture(scope="module")
def hf_state(tiny_eager):
    return tiny_eager.state_dict()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_expert_layout_experts_are_whole_and_expert_major_on_each_rank(tiny_eager, hf_state, tp):
    config = tiny_eager.config
    par = layout.parallel_state_dict(hf_state, config, tp, layout.EXPERT)
    gate_up, down = (
        hf_state[f"model.layers.{LAYER}.experts.gate_up_proj"],
        hf_state[f"model.layers.{LAYER}.experts.down_proj"],
    )
    for rank in range(tp):
        mine = list(layout.expert_range(config, tp, rank))
        assert mine == list(range(rank * config.num_experts // tp, (rank + 1) * config.num_experts // tp))
        gu = layout.shard(par[f"model.layers.{LAYER}.experts.gate_up_proj.weight"], layout.COLUMN, tp, rank)
        dn = layout.shard(par[f"model.layers.{LAYER}.experts.down_proj.weight"], layout.ROW, tp, rank)
        assert torch.equal(gu, gate_up[mine].reshape(-1, config.hidden_size))
        assert torch.equal(dn, down[mine].permute(1, 0, 2).reshape(config.hidden_size, -1))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_channel_layout_ranks_hold_every_experts_channels_gate_paired_with_up(tiny_eager, hf_state, tp):
    config = tiny_eager.config
    I = config.moe_intermediate_size
    par = layout.parallel_state_dict(hf_state, config, tp, layout.CHANNEL)
    gate_up, down = (
        hf_state[f"model.layers.{LAYER}.experts.gate_up_proj"],
        hf_state[f"model.layers.{LAYER}.experts.down_proj"],
    )
    assert f"model.layers.{LAYER}.experts.spmd_rank.rank" not in par  # nothing in the block depends on the rank
    gu_full, dn_full = (
        par[f"model.layers.{LAYER}.experts.gate_up_proj.weight"],
        par[f"model.layers.{LAYER}.experts.down_proj.weight"],
    )
    pieces = []
    for rank in range(tp):
        mine = list(layout.channel_range(config, tp, rank))
        assert mine == list(range(rank * I // tp, (rank + 1) * I // tp))
        gu = layout.shard(gu_full, layout.placement(f"model.layers.{LAYER}.experts.gate_up_proj.weight"), tp, rank)
        dn = layout.shard(dn_full, layout.placement(f"model.layers.{LAYER}.experts.down_proj.weight"), tp, rank)
        # [E, H, 2I/t]: this rank's gate channels, then the same channels of up (HF: gate rows 0:I, up I:2I)
        want_gate_up = torch.cat([gate_up[:, mine], gate_up[:, [I + i for i in mine]]], dim=1).transpose(1, 2)
        assert torch.equal(gu, want_gate_up)
        assert torch.equal(dn, down[:, :, mine].transpose(1, 2))  # [E, I/t, H]
        pieces.append(dn)
    assert torch.equal(torch.cat(pieces, 1), dn_full)  # the ranks' channels tile the experts'


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
    for expert_layout in layout.EXPERT_LAYOUTS:
        par = layout.parallel_state_dict(hf_state, tiny_eager.config, 8, expert_layout)
        assert all(hf_state[k]._version == ver and torch.equal(hf_state[k], old) for k, (ver, old) in before.items())
        assert torch.equal(par["model.embed_tokens.rank_util.rank"], torch.arange(8, dtype=torch.int32))
        assert "model.layers.0.experts.gate_up_proj" not in par
        assert layout.expert_layout_of(par) == expert_layout
    assert torch.equal(par["model.layers.0.experts.spmd_rank.rank"], torch.arange(8, dtype=torch.int32))


def test_degrees_that_do_not_split_are_named():
    big = load_port("gemma4-26b-a4b").config
    with pytest.raises(
        layout.LayoutError,
        match=r"TP 24 \(channel expert layout\): 16 attention heads do not "
        "split over 24 ranks; 704 expert intermediate channels do not split",
    ):
        layout.check_degree(big, 24)
    with pytest.raises(
        layout.LayoutError,
        match="16 attention heads do not split over 24 ranks; 128 experts do not split over 24 ranks",
    ):
        layout.check_degree(big, 24, layout.EXPERT)
    with pytest.raises(layout.LayoutError, match=r"TP degree 3 is not one of \(1, 2, 4, 8, 24\)"):
        layout.check_degree(big, 3)
    layout.check_degree(big, 8)
    layout.check_degree(big, 8, layout.EXPERT)
    # each layout checks what it splits: the channel layout I, the expert layout E
    odd = copy.deepcopy(big)
    odd.moe_intermediate_size = 700
    with pytest.raises(layout.LayoutError, match="700 expert intermediate channels do not split over 8 ranks"):
        layout.check_degree(odd, 8)
    layout.check_degree(odd, 8, layout.EXPERT)
    with pytest.raises(layout.LayoutError, match="unknown expert layout 'rows'; expected one of channel, expert"):
        layout.check_degree(big, 8, "rows")


@pytest.mark.parametrize("expert_layout", layout.EXPERT_LAYOUTS)
@pytest.mark.parametrize("quantization", list(FORMATS))
def test_rank_module_tags_agree_with_the_layout(tiny_eager, expert_layout, quantization):
    """Every tensor of a rank's experts is split as the layout places its linear's weight, but for a
    format's tensor with one entry per output channel (int8's scale) in a row layer, which every rank
    holds whole."""
    fmt = FORMATS[quantization]
    tp = 4 if _holds(fmt, tiny_eager.config.moe_intermediate_size // 4) else 2  # a row rank holds whole groups
    module = ParallelMoE(tiny_eager.config, tp, cpu, expert_layout=expert_layout, fmt=fmt)
    names = {name for name, _ in module.named_parameters()}
    assert ("experts.spmd_rank.rank" in names) == (expert_layout == layout.EXPERT)
    params = dict(module.named_parameters())
    for name, p in params.items():
        kind = layout.placement(name, expert_layout)
        split = getattr(p, "tensor_model_parallel", False)  # HF's router: untagged, as in NxD
        whole = kind != layout.REPLICATED and fmt.replicated(name.rpartition(".")[2], layout.PARTITION[kind][0])
        assert split == (kind != layout.REPLICATED and not whole), name
        if split:
            assert (p.partition_dim, p.partition_stride) == layout.PARTITION[kind] and p.num_partitions == tp, name


def test_shard_checkpoint_cuts_as_nxd_does(tiny_eager, hf_state):
    config, tp = tiny_eager.config, 4
    full = block_state(quantize_state(layout.parallel_state_dict(hf_state, config, tp, layout.EXPERT), "int8"))
    module = ParallelMoE(config, tp, cpu, expert_layout=layout.EXPERT, fmt=FORMATS["int8"])
    shards = cpu.shard_checkpoint(full, module, tp)
    gu, gu_s = full["experts.gate_up_proj.weight"], full["experts.gate_up_proj.scale"]
    dn, dn_s = full["experts.down_proj.weight"], full["experts.down_proj.scale"]
    assert gu.dtype == dn.dtype == torch.int8
    for rank, state in enumerate(shards):
        assert torch.equal(state["experts.gate_up_proj.weight"], gu.chunk(tp, 0)[rank])  # column: dim 0
        assert torch.equal(state["experts.gate_up_proj.scale"], gu_s.chunk(tp, 0)[rank])  # scale split with it
        assert torch.equal(state["experts.down_proj.weight"], dn.chunk(tp, 1)[rank])  # row: dim 1
        assert torch.equal(state["experts.down_proj.scale"], dn_s)  # scale replicated
        assert (
            state["experts.spmd_rank.rank"].tolist() == [rank] and state["experts.spmd_rank.rank"].dtype == torch.int32
        )
        assert torch.equal(state["router.proj.weight"], full["router.proj.weight"])  # replicated
    # reassembled, the shards are the checkpoint
    assert torch.equal(torch.cat([s["experts.down_proj.weight"] for s in shards], 1), dn)


def test_shard_checkpoint_cuts_the_channel_layout_with_its_stride(tiny_eager, hf_state):
    """gate_up [E, H, 2I] has partition stride 2: NxD cuts it into 2t chunks of I/t and gives rank r
    chunks r and r + t (its gate and its up channels); its scale [E, 1, 2I] is cut the same way,
    down's [E, 1, H] is replicated."""
    config, tp = tiny_eager.config, 4
    n, I = config.moe_intermediate_size // tp, config.moe_intermediate_size
    full = block_state(quantize_state(layout.parallel_state_dict(hf_state, config, tp, layout.CHANNEL), "int8"))
    module = ParallelMoE(config, tp, cpu, fmt=FORMATS["int8"])
    shards = cpu.shard_checkpoint(full, module, tp)
    gu, gu_s = full["experts.gate_up_proj.weight"], full["experts.gate_up_proj.scale"]
    dn, dn_s = full["experts.down_proj.weight"], full["experts.down_proj.scale"]
    assert gu.shape == (16, 128, 2 * I) and gu_s.shape == (16, 1, 2 * I) and dn_s.shape == (16, 1, 128)
    for rank, state in enumerate(shards):
        mine = [*range(rank * n, (rank + 1) * n), *range(I + rank * n, I + (rank + 1) * n)]
        assert torch.equal(state["experts.gate_up_proj.weight"], gu[:, :, mine])
        assert torch.equal(state["experts.gate_up_proj.scale"], gu_s[:, :, mine])
        assert torch.equal(state["experts.down_proj.weight"], dn[:, rank * n : (rank + 1) * n])
        assert torch.equal(state["experts.down_proj.scale"], dn_s)
    assert torch.equal(torch.cat([s["experts.down_proj.weight"] for s in shards], 1), dn)


def test_shard_checkpoint_is_strict(tiny_eager, hf_state):
    config = tiny_eager.config
    full = block_state(layout.parallel_state_dict(hf_state, config, 2, layout.EXPERT))
    module = ParallelMoE(config, 2, cpu, expert_layout=layout.EXPERT)
    with pytest.raises(cpu.ShardError, match=r"missing \['experts.spmd_rank.rank'\]"):
        cpu.shard_checkpoint({k: v for k, v in full.items() if k != "experts.spmd_rank.rank"}, module, 2)
    wrong = dict(full, **{"experts.down_proj.weight": full["experts.down_proj.weight"][:, :-2]})
    with pytest.raises(
        cpu.ShardError,
        match=r"experts\.down_proj\.weight: rank 0 expects shape \(128, 512\), "
        r"the checkpoint's \(128, 1022\) gives \(128, 511\)",
    ):
        cpu.shard_checkpoint(wrong, module, 2)
    # one expert layout's checkpoint in the other's rank module: refused, naming both
    with pytest.raises(
        layout.LayoutError,
        match=r"the checkpoint holds its experts in the 'expert' layout "
        r"\(experts.gate_up_proj.weight \[2048, 128\]\); it is used here "
        r"with the 'channel' layout",
    ):
        cpu.shard_checkpoint(full, ParallelMoE(config, 2, cpu), 2)
    channel = block_state(layout.parallel_state_dict(hf_state, config, 2, layout.CHANNEL))
    with pytest.raises(layout.LayoutError, match="in the 'channel' layout .* with the 'expert' layout"):
        cpu.shard_checkpoint(channel, module, 2)


@pytest.mark.parametrize("tp", [2, 8])
def test_each_rank_running_its_own_code_takes_its_own_router_slice(tiny_eager, hf_state, tp):
    """Eager, rank by rank (PyTorch's fake process group supplies the Python-int rank): both
    scatters take the right slice. Only a graph traced once on rank 0 tells them apart
    (tests/test_tensor_parallel.py)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = tiny_eager.config
    full = block_state(layout.parallel_state_dict(hf_state, config, tp, layout.EXPERT))
    x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, w, idx = tiny_eager.model.layers[LAYER].router(x.reshape(10, -1))
    dense = router_weight_matrix(idx, w, config.num_experts).view(2, 5, -1)
    n = config.num_experts // tp
    for scatter in ("spmd", "naive"):
        module = ParallelMoE(config, tp, cpu, expert_layout=layout.EXPERT, scatter=scatter)
        for rank, state in enumerate(cpu.shard_checkpoint(full, module, tp)):
            module.load_state_dict(state)
            dist.init_process_group("fake", rank=rank, world_size=tp, store=FakeStore())
            try:
                with torch.no_grad():
                    local = module.local_router_weights(x)
            finally:
                dist.destroy_process_group()
            assert torch.equal(local, dense[..., rank * n : (rank + 1) * n]), (scatter, rank)


@pytest.mark.parametrize("tokens,gathers", [(3, True), (4, False)])
def test_a_decode_graph_gathers_only_while_tokens_times_k_is_below_e(tiny_eager, hf_state, tokens, gathers):
    """NxD's rule, fixed per graph while it is traced: the tiny port's 16 experts, top-4, so a decode
    graph of 3 tokens gathers 12 expert slices and one of 4 tokens (16 ≥ 16) computes all experts,
    with HF's output either way. A graph that is not a decode graph never gathers."""
    from neuron_moe.parallel.trace import export_rank0

    from conftest import expert_reads

    config = spec.dispatching(tiny_eager.config, spec.SELECTIVE)  # what a decode graph's view holds
    module = ParallelMoE(config, 1, cpu)
    module.load_state_dict(block_state(layout.parallel_state_dict(hf_state, config, 1)))
    x = torch.randn(tokens, 1, config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    program = export_rank0(module, (x, x), 1)
    assert bool(expert_reads(program)["gathered"]) == gathers
    layer = tiny_eager.model.layers[LAYER]
    with torch.no_grad():
        _, w, idx = layer.router(x.reshape(tokens, -1))
        want = layer.experts(x.reshape(tokens, -1), idx, w)
        got = program.module()(x, x).reshape(tokens, -1)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    module.experts.config = spec.dispatching(config, spec.DENSE_MASKED)  # a prefill graph's
    assert not expert_reads(export_rank0(module, (x, x), 1))["gathered"]


def _holds(fmt, inputs: int) -> bool:
    """Whether `inputs` input channels hold whole groups of `fmt`."""
    try:
        fmt.check(inputs)
    except UserError:
        return False
    return True
