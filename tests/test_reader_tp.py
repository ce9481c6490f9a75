"""The reader inside the TP decode graph, trace once / replicate on gloo: each rank's sidecar shard is
state of its channel-layout experts, the decode graph exported once as rank 0 reads through it, and
every rank runs that one graph with its own shard.

- MoE block at TP 1/2/4/8: every rank's output = the per-rank reader emulated in one process
  (`shard.forward_ranks`), and at TP 1 the one-rank reader bit for bit; no data-dependent op.
- The full model: TP 1 = the one-rank reader (`validate --backend reader`), token for token and to
  the fp32 bound; TP 2 at a budget = the one-process emulation (`attach_reader(..., tp=2)`), through
  a `trace-and-compile --reader` dry-run artifact. (Budget 100 against HF eager, and TP 4 and 8 at the
  model level: bench/reader_tp.py, recorded in bench/results/reader-tp.md.)
- The full-size decode graph at TP 8 reads per layer exactly what the accounting charges a rank.
- Bad input: a shard of another TP degree, rank, layout or model, a budget below a rank's floor."""

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from neuron_moe import spec
from neuron_moe.spec import Reader, tp_backend
from neuron_moe.cli import main
from neuron_moe.experts.channel_reader import attach_reader
from neuron_moe.model import prep_port, reader_model
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.neuron import artifact as na
from neuron_moe.neuron import compile as nc
from neuron_moe.parallel import cpu, layout, nxd, reader
from neuron_moe.parallel.tp_generator import TPGenerator
from neuron_moe.parallel.moe import ParallelMoE
from neuron_moe.parallel.trace import export_rank0, forward_job, generation_job, run_replicated
from neuron_moe.reader import reference, shard
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.hadamard import random_signs
from neuron_moe.reader.prep import prep_layer
from neuron_moe.reader.sidecar import LayerSidecar, Sidecar, SidecarError, SidecarLayout
from neuron_moe.static import data_dependent_ops

from conftest import preflight_violations, random_prompts, reseeded
from test_parallel_layout import LAYER, block_state

NEW_TOKENS = 6
BUDGET = 40.0  # above the tiny port's floors at TP 1 and 2 with recovery rank 32 (18.5 %, 27.9 %)
RANK = 32  # recovery on (the tiny port's own default is 0), so that these tests read its map too


@pytest.fixture(scope="module")
def shards(tiny_port, tmp_path_factory):
    """`prep-reader --tp` for TP 1, 2, 4 and 8: the whole sidecar and every rank's shard."""
    out = tmp_path_factory.mktemp("reader-tp")
    whole = Sidecar(prep_port(tiny_port, out / shard.WHOLE))
    for tp in (1, 2, 4, 8):
        shard.write_shards(whole, out, tp, progress=False)
    return out


@pytest.fixture(scope="module")
def prompts(tiny_port):
    return left_pad(random_prompts(tiny_port.config.vocab_size, [7, 4], seed=44), 0)  # one bucket (8)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_moe_block_on_every_rank_is_the_per_rank_reader(tiny_eager, tp):
    config, hf = tiny_eager.config, tiny_eager.model.layers[LAYER]
    signs = random_signs(config.hidden_size, 0)
    prepped = prep_layer(hf.experts.gate_up_proj, hf.experts.down_proj, signs, 32)
    whole = LayerSidecar.from_tensors({n: t.contiguous() for n, t in prepped.items()}, signs)  # as read from a file
    parts = [shard.rank_sidecar(whole, tp, r) for r in range(tp)]
    k, scan, rank = 20 // tp, 80, 32
    decode = spec.dispatching(config, spec.CHANNEL_READER)  # what a decode graph built with the reader holds
    module = ParallelMoE(decode, tp, cpu)
    local = SidecarLayout(
        Geometry(
            hidden=config.hidden_size, experts=config.num_experts, intermediate=config.moe_intermediate_size // tp
        ),
        32,
    )
    module.experts.reader = reader.ReaderShard(local, tp, k, scan, rank)
    full = block_state(layout.parallel_state_dict(tiny_eager.state_dict(), config, tp))
    full.update({f"experts.reader.{n}": t for n, t in reader.layer_state(parts).items()})
    states = cpu.shard_checkpoint(full, module, tp)
    module.load_state_dict(states[0])  # rank 0, as the trace sees it
    gen = torch.Generator().manual_seed(5)
    inputs = [tuple(torch.randn(2, 1, config.hidden_size, generator=gen) for _ in range(2)) for _ in range(2)]
    wants = []
    down_rows = hf.experts.down_proj.mT.contiguous()
    ranks = [(*shard.shard_weights(hf.experts.gate_up_proj, down_rows, tp, r), parts[r]) for r in range(tp)]
    with torch.no_grad():
        for router_in, experts_in in inputs:
            _, w, idx = hf.router(router_in.reshape(-1, config.hidden_size))
            x = experts_in.reshape(-1, config.hidden_size)
            wants.append(shard.forward_ranks(x, idx, w, ranks, k=k, scan=scan, rank=rank, act_fn=hf.experts.act_fn))
            every = shard.forward_ranks(
                x, idx, w, ranks, k=4 * 64 // tp, scan=scan, rank=rank, act_fn=hf.experts.act_fn
            )
            full = hf.experts(x, idx, w)  # every channel of every rank: HF's experts
            assert (every - full).abs().max() <= 1e-5 * full.abs().max()
            if tp == 1:  # the one-rank reader's path (channel_reader), bit for bit
                one = reference.forward(
                    x,
                    idx,
                    w,
                    hf.experts.gate_up_proj,
                    down_rows,
                    whole,
                    k=k,
                    scan=scan,
                    rank=rank,
                    act_fn=hf.experts.act_fn,
                )
                assert torch.equal(module(router_in, experts_in).view_as(one), one)
    if tp == 1:
        return
    program = export_rank0(module, inputs[0], tp)  # traced once, as rank 0
    assert data_dependent_ops(program) == []
    results = run_replicated({"reader": program}, {"reader": states}, forward_job, {"reader": inputs})
    for r, out in enumerate(results):
        for got, want in zip(out["reader"], wants):
            assert (got.view_as(want) - want).abs().max() <= 1e-5 * want.abs().max(), r


def test_tp1_is_the_one_rank_reader(tiny_port, shards, prompts):
    """TP 1's per-rank selection (its one shard, static graphs on a gloo rank) = `validate --backend
    reader` (HF's model with the one-rank reader): the same tokens, the logits to the fp32 bound."""
    gen = TPGenerator(tiny_port, tp_backend(1, reader=Reader(sidecar=shards, budget=BUDGET, recovery_rank=RANK)))
    got = gen.generate(*prompts, NEW_TOKENS)
    want = greedy(
        reader_model(tiny_port, reader=Reader(sidecar=shards / shard.WHOLE, budget=BUDGET, recovery_rank=RANK)),
        *prompts,
        NEW_TOKENS,
    )
    assert gen.reader_k == attach_reader(build_model(tiny_port, "eager"), shards / shard.WHOLE, BUDGET)
    assert preflight_violations(gen.programs) == []  # the reader at TP 1: its prefill and decode keys
    assert torch.equal(got.tokens, want.tokens)
    assert (got.logits - want.logits).abs().max() <= 2e-6 * want.logits.abs().max()


def test_tp2_artifact_is_the_per_rank_reader_emulated(tiny_port, tiny_eager, shards, prompts, tmp_path):
    """A `trace-and-compile --reader` dry-run artifact at TP 2 (its rank-0 graphs and per-rank weights,
    loaded back and run on 2 gloo ranks) = the per-rank reader emulated in one process
    (`attach_reader(..., tp=2)`, what eval-reader measures), token for token."""
    port = dataclasses.replace(
        tiny_port, static=dataclasses.replace(tiny_port.static, buckets=(8,), prefill_rows=(1,), prefill_chunk=8)
    )
    out = nc.trace_and_compile(
        port,
        nc.Build.at(
            tp=2,
            out=tmp_path / "art",
            dtype="float32",
            dry_run=True,
            logits=True,
            reader=Reader(sidecar=shards, budget=BUDGET, recovery_rank=RANK),
        ),
    )
    programs = {
        f"a/{name}": torch.export.load(tmp_path / "art" / na.GRAPHS.format(key=key))
        for name, key in (("prefill 8", "context_encoding_1x8"), ("decode", "token_generation"))
    }
    weights = [load_file(tmp_path / "art" / na.RANK_WEIGHTS.format(rank=r)) for r in range(2)]
    tokens, logits = run_replicated(
        programs, {k: weights for k in programs}, generation_job, [("a", 2, 0, [(*prompts, NEW_TOKENS)])]
    )[0]["a"]
    emulated = build_model(tiny_port, "eager")
    k = attach_reader(emulated, shards / shard.WHOLE, BUDGET, tp=2)
    want = greedy(emulated, *prompts, NEW_TOKENS)
    assert out["reader"]["k_per_rank"] == k
    assert torch.equal(tokens, want.tokens) and (logits - want.logits).abs().max() <= 1e-4 * want.logits.abs().max()
    assert not torch.equal(tokens, greedy(tiny_eager, *prompts, NEW_TOKENS).tokens)  # teeth: 40 % is not the full model
    # the rank-0 decode program: no data-dependent op, the KV cache as mutated state, its reader read;
    # the prefill program reads no reader tensor (prefill runs the full experts)
    decode, prefill = programs["a/decode"], programs["a/prefill 8"]
    assert data_dependent_ops(decode) == []
    sig = decode.graph_signature
    cache = {s.target for s in sig.input_specs if (s.target or "").startswith("cache.")}
    assert (
        cache and set(sig.buffers_to_mutate.values()) == cache and len(sig.user_inputs) == 3
    )  # ids, positions, sampling
    assert _reads(decode, "experts.reader.codes") and not _reads(prefill, "experts.reader.codes")
    # every rank's weights hold its own shard
    for r in range(2):
        mine = Sidecar(shards / shard.shard_name(2, r)).layer(0)
        assert torch.equal(weights[r]["model.model.layers.0.experts.reader.codes"], mine.codes)


def _reads(program, suffix) -> bool:
    names = [s.arg.name for s in program.graph_signature.input_specs if (s.target or "").endswith(suffix)]
    return any(len(n.users) for n in program.graph.nodes if n.name in names)


def test_neuron_path_writes_each_ranks_shard(tiny_port, shards, tmp_path, monkeypatch):
    """On Neuron, NxD's shard_checkpoint replicates what is not its own layers' (stood in for here): the
    checkpoint it gets holds the reader's split tensors at one rank's shape, and each rank's weights
    file ends with its own shard."""
    from safetensors.torch import save_file

    seen = {}

    def trace_keys(keys, checkpoint_loader, tp, workdir, compiler_args):
        seen.update(checkpoint=checkpoint_loader())
        return "builder", torch.jit.script(torch.nn.Identity())

    def shard_checkpoint(builder, serialize_path):  # NxD: the reader's tensors replicated, as handed over
        serialize_path.mkdir()
        for r in range(2):
            state = {k: v for k, v in seen["checkpoint"].items() if ".reader." in k}
            save_file(state, str(serialize_path / f"tp{r}_sharded_checkpoint.safetensors"))

    monkeypatch.setattr(nxd, "sdk_available", lambda: True)
    monkeypatch.setattr(nxd, "trace_keys", trace_keys)
    monkeypatch.setattr(nxd, "shard_checkpoint", shard_checkpoint)
    nc.trace_and_compile(
        tiny_port, nc.Build.at(tp=2, out=tmp_path / "out", dry_run=False, reader=Reader(sidecar=shards, budget=BUDGET))
    )
    name = "model.model.layers.3.experts.reader.coeffs"
    mine = [Sidecar(shards / shard.shard_name(2, r)).layer(3).coeffs for r in range(2)]
    assert seen["checkpoint"][name].shape == mine[0].shape
    for r in range(2):
        assert torch.equal(load_file(tmp_path / "out" / na.RANK_WEIGHTS.format(rank=r))[name], mine[r])
    manifest = json.loads((tmp_path / "out" / na.MANIFEST).read_text())
    assert manifest["reader"]["budget"] == BUDGET and manifest["reader"]["k_per_rank"] > 0


# ---- bad input ----


def _copy(src, dst, text=None):
    shutil.copy(src, dst)
    if text is not None:  # rewrite a metadata value in place (same length: the offsets stay)
        data = dst.read_bytes()
        old, new = text
        assert len(old) == len(new) and data.count(old) == 1
        dst.write_bytes(data.replace(old, new))


def test_a_shard_for_another_tp_rank_layout_or_model_is_refused(tiny_port, shards, tmp_path):
    config = tiny_port.config
    _copy(shards / "tp2-rank0.safetensors", tmp_path / "tp4-rank0.safetensors")
    with pytest.raises(SidecarError, match="a shard for TP 2, loaded at TP 4"):
        shard.open_shard(tmp_path, 4, 0, config)
    _copy(shards / "tp2-rank1.safetensors", tmp_path / "tp2-rank0.safetensors")
    with pytest.raises(SidecarError, match="holds rank 1's channels, loaded on rank 0"):
        shard.open_shard(tmp_path, 2, 0, config)
    _copy(
        shards / "tp2-rank0.safetensors",
        tmp_path / "tp2-rank0.safetensors",
        (b'"expert_layout":"channel"', b'"expert_layout":"expert" '),
    )
    with pytest.raises(SidecarError, match="a shard of the 'expert' expert layout, used with the 'channel' layout"):
        shard.open_shard(tmp_path, 2, 0, config)
    with pytest.raises(SidecarError, match=r"no reader shard for rank 0 at TP 8 \(the directory holds tp2-rank0"):
        shard.open_shard(tmp_path, 8, 0, config)
    from neuron_moe.port import load_port

    with pytest.raises(SidecarError, match="a sidecar of another model"):
        shard.open_shard(shards, 8, 0, load_port("gemma4-26b-a4b").config)
    with pytest.raises(SidecarError, match="made from other expert weights"):
        TPGenerator(reseeded(tiny_port, 3), tp_backend(2, reader=Reader(sidecar=shards, budget=BUDGET)))
    with pytest.raises(SidecarError, match="reader shards exist for the 'channel' expert layout only"):
        shard.write_shards(Sidecar(shards / shard.WHOLE), tmp_path, 2, expert_layout="expert")


def test_a_byte_flipped_shard_is_refused_by_name(tiny_port, shards, tmp_path):
    """One byte of one rank's shard changed (a bad disk, a torn copy): the TP model refuses that shard,
    by file and layer, before anything is traced."""
    for r in range(2):
        _copy(shards / f"tp2-rank{r}.safetensors", tmp_path / f"tp2-rank{r}.safetensors")
    bad = tmp_path / "tp2-rank1.safetensors"
    raw = bytearray(bad.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8 : 8 + n])["layers.2.codes"]["data_offsets"][0]
    raw[8 + n + begin + 5] ^= 0x01
    bad.write_bytes(bytes(raw))
    with pytest.raises(SidecarError, match=r"tp2-rank1\.safetensors: layer 2's tensors do not match their sha256"):
        TPGenerator(tiny_port, tp_backend(2, reader=Reader(sidecar=tmp_path, budget=BUDGET)))


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--budget", "17.8", "--recovery-rank", "32"],
            r"per rank at TP 8 .* budget 17.8% is below what the reader reads "
            r"before any exact channel \(84\.90%: sketch 42\.19%, norms 1\.04%, "
            r"recovery 41\.67%\)",
        ),
        (["--budget", "17.8"], r"per rank at TP 8 .* \(43\.23%: sketch 42\.19%, norms 1\.04%\)"),  # the port's rank 0
        (["--budget", "60", "--reader-kernel", "nki"], "no --reader-kernel"),
        (["--budget", "60", "--quantization", "int8"], "not --quantization int8"),
        (["--budget", "60", "--expert-layout", "expert"], "the reader runs on the 'channel' expert layout"),
    ],
)
def test_validate_tp_reader_refuses_before_running(shards, capsys, flags, message):
    assert main(["validate", "--backend", "tp", "--sidecar", str(shards), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert re.search(message, err), err


def test_int8_experts_with_the_reader_are_refused(tiny_port, shards):
    with pytest.raises(Exception, match="the reader reads float"):
        TPGenerator(tiny_port, tp_backend(2, quantization="int8", reader=Reader(sidecar=shards, budget=BUDGET)))


_VIEWS = {
    "aten.mT.default",
    "aten.alias.default",
    "aten.t.default",
    "aten.transpose.int",
    "aten.permute.default",
    "aten.slice.Tensor",
    "aten.view.default",
}
_GATHERS = {"aten.index.Tensor", "aten.index_select.default"}


def _bytes_read(program, layer: int) -> dict[str, int]:
    """Elements of each experts/reader tensor of a layer that the graph reads: a gather's output, or
    the tensor (through views) whole, × its element size."""
    params = program.graph_signature.inputs_to_parameters
    out = {}
    for node in program.graph.nodes:
        name = params.get(node.name, "")
        if node.op != "placeholder" or f"layers.{layer}.experts." not in name:
            continue
        size, frontier, n = node.meta["val"].element_size(), [node], 0
        while frontier:
            for user in frontier.pop().users:
                if str(user.target) in _VIEWS:
                    frontier.append(user)
                elif str(user.target) in _GATHERS:
                    n += user.meta["val"].numel()
                else:
                    n = max(n, user.args[0].meta["val"].numel())  # read whole (or the viewed slice)
        out[name.removesuffix(".weight").rsplit(".", 1)[1]] = n * size
    return out


def test_full_size_decode_graph_with_the_reader_reads_its_plan():
    """The token-generation key of the full-size port at TP 8, batch 1, with the reader at 17.8 %, rank 0's
    export on the meta device (two of its 30 layers at full width): no data-dependent op, and per layer it
    reads what the accounting charges a rank (`neuron-moe reads --tp 8`): 55 exact channels' gate, up and
    down rows, its 8 experts' scanned strips and scales, norms, U and b_j; the experts' weights are
    otherwise untouched. The graph reads b_j of the chosen channels too (weighted 0; the accounting and
    kernels skip them: 55 × 64 B) and the norms unrounded (176 B, charged as 7 sectors)."""
    import dataclasses

    from neuron_moe.config import gemma4_moe_config
    from neuron_moe.parallel.model import rank_model
    from neuron_moe.port import load_port
    from neuron_moe.reader.accounting import rank_geometry, reads
    from neuron_moe.static.decoder import new_cache

    port = load_port("gemma4-26b-a4b")
    config = gemma4_moe_config(
        dict(port.raw["config"], num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]), "two layers"
    )
    module = rank_model(config, 8, cpu, device="meta", dtype=torch.bfloat16)
    reader.attach(module, SidecarLayout(Geometry(hidden=2816, experts=128, intermediate=88), 32), 8, 55, 80, 32)
    static = dataclasses.replace(port.static, decode_experts=spec.CHANNEL_READER.name)
    graph = nc._graph(module, static, "token_generation", new_cache(module, static.max_cache_len, 1), False)
    program = export_rank0(graph, tuple(x.to("meta") for x in nc._example(static, "token_generation")), 8)
    assert data_dependent_ops(program) == []
    plan = reads(rank_geometry(Geometry.from_config(config), 8), Reader().resolved(), 55)
    for layer in range(2):
        got = _bytes_read(program, layer)
        assert got["gate_up_proj"] + got["down_proj"] == plan["exact"] == 55 * 3 * 2816 * 2
        assert got["codes"] + got["scales"] == plan["sketch"]
        assert got["coeffs"] + got["basis"] == plan["recovery"] + 55 * 32 * 2
        assert got["down_norms"] == 8 * 88 * 2 and plan["norms"] == 8 * 7 * 32


def test_prep_reader_tp_cli(shards, tmp_path, capsys):
    whole = shards / shard.WHOLE
    assert main(["prep-reader", "--tp", "4", "--from", str(whole), "--out", str(tmp_path), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tp"] == 4 and sorted(p.name for p in tmp_path.iterdir()) == [
        f"tp4-rank{r}.safetensors" for r in range(4)
    ]
    for r in range(4):  # the same bytes as the fixture's shards
        assert (tmp_path / shard.shard_name(4, r)).read_bytes() == (shards / shard.shard_name(4, r)).read_bytes()
    assert main(["prep-reader", "--from", str(whole), "--out", str(tmp_path / "x")]) == 2
    assert "--from shards an existing sidecar: it needs --tp" in capsys.readouterr().err
    assert (
        main(["prep-reader", "--tp", "2", "--from", str(shards / "tp2-rank0.safetensors"), "--out", str(tmp_path)]) == 2
    )
    assert "already a TP shard (rank 0 of 2)" in capsys.readouterr().err


def test_full_size_dry_run_with_the_reader_on_meta(tmp_path):
    """Shapes only: the manifest's reader (55 channels per rank at 17.8 %), each rank's shard in the plan."""
    from neuron_moe.port import load_port

    port = load_port("gemma4-26b-a4b")
    report = nc.trace_and_compile(
        port, nc.Build.at(tp=8, out=tmp_path / "big", dry_run=True, export=False, reader=Reader(budget=17.8))
    )
    assert report["reader"] == {
        "budget": 17.8,
        "k_per_rank": 55,
        "scan": 80,
        "recovery_rank": 32,
        "source_sha256": None,
    }
    plan = json.loads((tmp_path / "big" / na.SHARD_PLAN).read_text())
    codes = plan["model.layers.7.experts.reader.codes"]
    assert (codes["placement"], codes["full_shape"], codes["rank_shape"]) == (
        "reader_shard",
        [8 * 128, 22, 128, 64],
        [128, 22, 128, 64],
    )
    assert plan["model.layers.7.experts.reader.basis"]["placement"] == "replicated"
    with pytest.raises(na.ArtifactError, match="has no weights here: --reader builds shapes only"):
        nc.trace_and_compile(
            port,
            nc.Build.at(
                tp=8, out=tmp_path / "b2", dry_run=True, export=False, reader=Reader(budget=17.8, sidecar=tmp_path)
            ),
        )
    with pytest.raises(Exception, match=r"per rank at TP 8 .*below what the reader reads"):
        nc.trace_and_compile(
            port, nc.Build.at(tp=8, out=tmp_path / "b3", dry_run=True, export=False, reader=Reader(budget=9))
        )
