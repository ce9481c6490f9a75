"""trace-and-compile --dry-run: the artifact a Neuron server would load, written on CPU. The exported
rank-0 graphs and the per-rank shards it writes are loaded back and run on 2 gloo ranks, and give
the reference tokens; a directory is never half-written or mixed with an earlier one; the decode
graph of the full-size port reads what its expert layout says; an artifact or shard of one expert
layout is refused by the other."""

import dataclasses
import json
import os
import re
import stat
import threading

import pytest
import torch
from safetensors.torch import load_file

from neuron_moe.cli import main
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.neuron import artifact as na
from neuron_moe.neuron import compile as nc
from neuron_moe.parallel import nxd
from neuron_moe.parallel.trace import generation_job, run_replicated
from neuron_moe.port import load_port, with_shapes
from neuron_moe.run_config import Shapes
from neuron_moe.report import OutputError, file_digest

from conftest import expert_reads, random_prompts


@pytest.fixture(scope="module")
def one_bucket_port(tiny_port):
    """The tiny port with one prefill bucket and one-prompt prefill graphs: three keys (the prefill, the
    decode over the first 64 positions and the decode over all 96; and their logits-processing
    variants) to export instead of six (test_the_manifest_lists_a_key_per_prefill_row_count_and_bucket:
    the others)."""
    return dataclasses.replace(
        tiny_port, static=dataclasses.replace(tiny_port.static, buckets=(16,), prefill_rows=(1,), prefill_chunk=16)
    )


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, one_bucket_port):
    out = tmp_path_factory.mktemp("art") / "tp2"
    return nc.trace_and_compile(one_bucket_port, nc.Build.at(tp=2, out=out, dtype="float32", dry_run=True)), out


def test_dry_run_writes_the_contract(artifact, one_bucket_port):
    manifest, out = artifact
    assert na.read_manifest(out) == {k: v for k, v in manifest.items() if k != "out"}
    assert list(manifest["keys"]) == [
        "context_encoding_1x16",
        "token_generation_64",
        "token_generation",
        "context_encoding_processing_1x16",
        "token_generation_processing_64",
        "token_generation_processing",
    ]
    assert (
        manifest["port"],
        manifest["tp"],
        manifest["buckets"],
        manifest["max_cache_len"],
        manifest["expert_layout"],
    ) == (one_bucket_port.name, 2, [16], 96, "channel")
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == sorted([*manifest["files"], na.MANIFEST])  # nothing else, nothing hidden
    for name, meta in manifest["files"].items():
        assert (out / name).stat().st_size == meta["size"] and file_digest(out / name).sha256 == meta["sha256"]
    plan = json.loads((out / na.SHARD_PLAN).read_text())
    gu = plan["model.layers.1.experts.gate_up_proj.weight"]  # [E, H, 2I], each rank's gate and up channels
    assert (gu["placement"], gu["partition_dim"], gu["partition_stride"], gu["full_shape"], gu["rank_shape"]) == (
        "experts_column",
        2,
        2,
        [16, 128, 128],
        [16, 128, 64],
    )
    shard = load_file(out / na.RANK_WEIGHTS.format(rank=1))
    assert shard["model.model.embed_tokens.rank_util.rank"].tolist() == [1]
    assert not any(k.endswith("experts.spmd_rank.rank") for k in shard)  # the channel layout slices nothing by rank
    assert not [k for k in shard if "cache" in k]  # the KV cache is state, in no weight shard
    # the contract: what goes in and out of each key (never a KV tensor), and the state they share
    assert manifest["format"] == na.FORMAT == 10 and manifest["logits"] is False
    assert manifest["target"] == na.TARGET and na.TARGET["name"] == "inf2"  # a dry run records it too
    assert (manifest["prefill_rows"], manifest["prefill_chunk"], manifest["candidates"]) == ([1], 16, 256)
    assert manifest["decode_lengths"] == [64, 96]  # the port's: a decode key per length
    # the tokenizer travels with the graphs: its files copied, named and digested (the server reads no other)
    tokenizer = ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]
    assert manifest["tokenizer"] == {"kind": "checkpoint", "files": tokenizer}
    for name in tokenizer:
        assert (out / name).read_bytes() == (one_bucket_port.checkpoint / name.split("/")[1]).read_bytes()
    assert manifest["keys"]["context_encoding_1x16"]["inputs"] == {
        "input_ids": [1, 16],
        "attention_mask": [1, 16],
        "position_ids": [1, 16],
        "row_ids": [1],
        "sampling": [1, 4],
    }
    assert manifest["keys"]["token_generation"]["inputs"] == {
        "input_ids": [2, 1],
        "position_ids": [2, 1],
        "sampling": [2, 4],
    }
    # the shorter decode key: the same inputs and a kv_length [64] whose shape alone routes a call to it
    assert manifest["keys"]["token_generation_64"]["inputs"] == {
        "input_ids": [2, 1],
        "position_ids": [2, 1],
        "sampling": [2, 4],
        "kv_length": [64],
    }
    assert [k["outputs"] for k in list(manifest["keys"].values())[:3]] == [{"token": [1, 1]}, *[{"token": [2, 1]}] * 2]
    # the logits-processing variants: the prefill takes the prompt's next tokens instead of sampling and
    # returns their logprobs; the decode takes the penalties, bias and bitmask, and returns logprobs too
    variant = manifest["keys"]["context_encoding_processing_1x16"]
    assert variant["inputs"]["targets"] == [1, 16] and "sampling" not in variant["inputs"]
    assert variant["outputs"] == {
        "logprob": [1, 16],
        "rank": [1, 16],
        "top_ids": [1, 16, 20],
        "top_logprobs": [1, 16, 20],
    }
    variant = manifest["keys"]["token_generation_processing"]
    assert variant["inputs"] == {
        "input_ids": [2, 1],
        "position_ids": [2, 1],
        "sampling": [2, 4],
        "process": [2, 7],
        "bias_ids": [2, 64],
        "bias": [2, 64],
        "mask": [2, 64],  # 2048 tokens / 32 bits
    }
    assert manifest["keys"]["token_generation_processing_64"]["inputs"] == {**variant["inputs"], "kv_length": [64]}
    assert manifest["keys"]["token_generation_processing_64"]["outputs"] == variant["outputs"]
    assert variant["outputs"] == {
        "token": [2, 1],
        "logprob": [2, 1],
        "rank": [2, 1],
        "top_ids": [2, 20],
        "top_logprobs": [2, 20],
    }
    state = manifest["state"]
    assert list(state) == [f"cache.{kv}{i}" for i in range(4) for kv in "kv"] + ["counts.output", "counts.prompt"]
    assert state["counts.output"] == {"shape": [2, 2048], "dtype": "float32"}
    assert state["cache.k0"] == {"shape": [2, 2, 16, 32], "dtype": "float32"}  # sliding: 2 of 4 KV heads, ring 16
    assert state["cache.v1"] == {"shape": [2, 1, 96, 64], "dtype": "float32"}  # global: 1 of 2, every position


def test_verify_preflights_every_key_of_the_artifact(artifact, capsys):
    """The dry run preflighted its keys before it wrote them; verify reads them back and finds them clean
    (neuron-moe preflight's own CLI: tests/test_preflight.py)."""
    _, out = artifact
    assert main(["verify", str(out), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["preflight"] == {
        "target": "inf2",
        "violations": [],
        "clean": True,
        "keys": 6,
    }


def test_the_exported_keys_carry_the_cache_as_mutated_state(artifact):
    _, out = artifact
    kv = [f"cache.{kv}{i}" for i in range(4) for kv in "kv"]
    for key, state, outputs in [
        ("context_encoding_1x16", kv, 1),  # the token; no KV tensor, no logits
        ("token_generation_64", kv, 1),  # the whole cache is its state, whatever it attends over
        ("token_generation", kv, 1),
        ("context_encoding_processing_1x16", kv + ["counts.output", "counts.prompt"], 4),  # the prompt's scores
        ("token_generation_processing", kv + ["counts.output", "counts.prompt"], 5),  # the token and its scores
        ("token_generation_processing_64", kv + ["counts.output", "counts.prompt"], 5),
    ]:
        program = torch.export.load(out / na.GRAPHS.format(key=key))
        sig = program.graph_signature
        assert sorted(sig.buffers_to_mutate.values()) == sorted(state)
        assert len(sig.user_outputs) == outputs


def test_prefix_caching_adds_the_copy_key_over_whole_rows(tmp_path, one_bucket_port):
    """--enable-prefix-caching: a prefix_copy key whose program copies a row of every cache tensor, and
    every key's cache in the whole-row layout (the sliding layers' rings as long as the global ones)."""
    out = tmp_path / "art"
    manifest = nc.trace_and_compile(
        one_bucket_port, nc.Build.at(tp=2, out=out, dtype="float32", dry_run=True, prefix_caching=True)
    )
    assert manifest["prefix_caching"] is True and list(manifest["keys"])[-1] == na.COPY_KEY
    assert manifest["keys"][na.COPY_KEY]["inputs"] == {"src_row": [1], "dst_row": [1]}
    assert manifest["state"]["cache.k0"]["shape"] == [2, 2, 96, 32]  # sliding: every position
    assert na.read_manifest(out)["prefix_caching"] is True
    program = torch.export.load(out / na.GRAPHS.format(key=na.COPY_KEY))
    sig = program.graph_signature
    assert sorted(sig.buffers_to_mutate.values()) == sorted(f"cache.{kv}{i}" for i in range(4) for kv in "kv")
    module = program.module()
    state = dict(module.named_buffers())
    for t in state.values():
        t[1].normal_()
    module(torch.tensor([1]), torch.tensor([0]))
    assert all(torch.equal(t[0], t[1]) for t in state.values())


def test_the_artifact_runs_on_its_ranks(artifact, one_bucket_port, tiny_eager):
    """The written programs and shards, loaded back, generate the reference tokens at TP 2: a 60-token
    prompt in four chunks, then decode steps at positions 60 to 63 through the key over 64 positions
    and at 64 and 65 through the whole cache's."""
    _, out = artifact
    programs = {
        "a/prefill 16": torch.export.load(out / na.GRAPHS.format(key="context_encoding_1x16")),
        "a/decode 64": torch.export.load(out / na.GRAPHS.format(key="token_generation_64")),
        "a/decode": torch.export.load(out / na.GRAPHS.format(key="token_generation")),
    }
    shards = [load_file(out / na.RANK_WEIGHTS.format(rank=r)) for r in range(2)]
    ids, mask = left_pad(random_prompts(one_bucket_port.config.vocab_size, [60, 5], seed=3), 0)
    (result, _) = run_replicated(
        programs, {k: shards for k in programs}, generation_job, [("a", 2, 0, [(ids, mask, 7)])]
    )  # each rank zero-initialises its own state
    reference = greedy(tiny_eager, ids, mask, 7)
    assert torch.equal(result["a"][0], reference.tokens)


def test_a_second_run_never_mixes(artifact, one_bucket_port, tmp_path, monkeypatch):
    _, out = artifact
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(na.ArtifactError, match="already holds a complete artifact; pass --overwrite"):
        nc.trace_and_compile(one_bucket_port, nc.Build.at(tp=2, out=out, dtype="float32", dry_run=True))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before

    # an interrupted run leaves no output; its leftovers are removed by the next run
    target = tmp_path / "art"
    stale = tmp_path / ".art.partial-crashed"
    stale.mkdir()
    (stale / "model.pt").write_text("half")

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(nc, "export_rank0", boom)
    with pytest.raises(KeyboardInterrupt):
        nc.trace_and_compile(one_bucket_port, nc.Build.at(tp=2, out=target, dtype="float32", dry_run=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the output nor any partial
    (target / "stray").parent.mkdir()
    (target / "stray").write_text("x")
    with pytest.raises(na.ArtifactError, match="holds files but no manifest"):
        nc.trace_and_compile(one_bucket_port, nc.Build.at(tp=2, out=target, dtype="float32", dry_run=True))


def test_overwrite_replaces_only_an_artifact(one_bucket_port, tmp_path):
    """--overwrite replaces an artifact, never any other directory (files, subfolders)."""
    precious = tmp_path / "home"
    (precious / "notes").mkdir(parents=True)
    (precious / "notes" / "todo.txt").write_text("keep me")
    (precious / "config.json").write_text("{}")
    for manifest in (None, "[1, 2]", '{"name": "someone else\'s manifest.json"}'):
        if manifest is not None:
            (precious / na.MANIFEST).write_text(manifest)
        with pytest.raises(
            na.ArtifactError,
            match="--overwrite never replaces|is not replaced, --overwrite or not|expected a JSON object",
        ):
            nc.trace_and_compile(
                one_bucket_port,
                nc.Build.at(tp=2, out=precious, dtype="float32", dry_run=True, overwrite=True, export=False),
            )
        assert (precious / "notes" / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # nothing built beside it, no lock left


def test_a_second_run_on_the_same_out_is_refused_while_the_first_runs(one_bucket_port, tmp_path, monkeypatch):
    """Two runs on one --out: without a lock the second takes the first one's build directory for
    leftovers and deletes it. The first holds a lock; the second is refused and the first completes."""
    out = tmp_path / "art"
    inside, release = threading.Event(), threading.Event()
    full_state = nc._full_state

    def slow_full_state(*args):
        inside.set()
        assert release.wait(60)
        return full_state(*args)

    monkeypatch.setattr(nc, "_full_state", slow_full_state)
    first = {}
    thread = threading.Thread(
        target=lambda: first.update(
            manifest=nc.trace_and_compile(
                one_bucket_port, nc.Build.at(tp=2, out=out, dtype="float32", dry_run=True, export=False)
            )
        )
    )
    thread.start()
    try:
        assert inside.wait(60)
        (building,) = tmp_path.glob(".art.partial-*")
        with pytest.raises(OutputError, match=r"art is being written by another trace-and-compile \(pid \d+\)"):
            nc.trace_and_compile(
                one_bucket_port, nc.Build.at(tp=2, out=out, dtype="float32", dry_run=True, export=False, overwrite=True)
            )
        assert building.is_dir()  # the first run's build directory is untouched
    finally:
        release.set()
        thread.join(120)
    assert first["manifest"]["files"] and na.read_manifest(out)["tp"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no partial, no lock file left


def test_every_file_of_an_artifact_gets_the_mode_open_would_give(one_bucket_port, tmp_path, umask_027):
    """The weight shards (safetensors' save_file: 0600) included: an artifact built on the host is
    read by the image's non-root server."""
    out = tmp_path / "art"
    nc.trace_and_compile(one_bucket_port, nc.Build.at(tp=2, out=out, dtype="float32", dry_run=True, export=False))
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*")}
    assert na.RANK_WEIGHTS.format(rank=1) in modes and na.MANIFEST in modes
    assert modes == {name: 0o750 if (out / name).is_dir() else 0o640 for name in modes}
    assert stat.S_IMODE(out.stat().st_mode) == 0o750


def test_the_manifest_lists_a_key_per_prefill_row_count_and_bucket(tiny_port, tmp_path):
    """Prefill graphs of 1 and 4 prompts (the tiny port's prefill_rows), cut to its batch of 2."""
    port = dataclasses.replace(tiny_port, static=dataclasses.replace(tiny_port.static, prefill_rows=(1, 4)))
    manifest = nc.trace_and_compile(
        port, nc.Build.at(tp=2, out=tmp_path / "art", dtype="float32", dry_run=True, export=False)
    )
    assert list(manifest["keys"]) == [
        "context_encoding_1x8",
        "context_encoding_1x24",
        "context_encoding_1x56",
        "context_encoding_2x8",
        "context_encoding_2x24",
        "context_encoding_2x56",
        "token_generation_64",
        "token_generation",
        "context_encoding_processing_1x8",
        "context_encoding_processing_1x24",
        "context_encoding_processing_1x56",
        "context_encoding_processing_2x8",
        "context_encoding_processing_2x24",
        "context_encoding_processing_2x56",
        "token_generation_processing_64",
        "token_generation_processing",
    ]
    assert manifest["prefill_rows"] == [1, 2] and manifest["keys"]["context_encoding_2x56"]["inputs"] == {
        "input_ids": [2, 56],
        "attention_mask": [2, 56],
        "position_ids": [2, 56],
        "row_ids": [2],
        "sampling": [2, 4],
    }
    assert manifest["keys"]["context_encoding_2x56"]["outputs"] == {"token": [2, 1]}
    assert na.read_manifest(tmp_path / "art")["prefill_chunk"] == tiny_port.static.chunk


def test_full_size_port_dry_run_on_meta(tmp_path):
    """Shapes only (exporting 30 layers on the meta device takes minutes: the CLI does it, not this test)."""
    out = tmp_path / "big"
    report = nc.trace_and_compile(
        load_port("gemma4-26b-a4b"), nc.Build.at(tp=8, out=out, quantization="int8", dry_run=True, export=False)
    )
    assert not report["weights"] and not report["keys"]["token_generation"]["exported"]
    manifest = na.read_manifest(out)
    assert manifest["keys"].keys() == {
        "context_encoding_1x128",
        "context_encoding_1x512",
        "context_encoding_1x2048",
        "token_generation",
        "context_encoding_processing_1x128",
        "context_encoding_processing_1x512",
        "context_encoding_processing_1x2048",
        "token_generation_processing",
    }  # batch_size 1: one-prompt prefill graphs only
    plan = json.loads((out / na.SHARD_PLAN).read_text())
    down = plan["model.layers.5.experts.down_proj.weight"]  # every expert's 704 channels over 8 ranks, int8
    assert (down["full_shape"], down["rank_shape"], down["dtype"]) == ([128, 704, 2816], [128, 88, 2816], "int8")
    assert plan["model.layers.5.experts.down_proj.scale"]["rank_shape"] == [
        128,
        1,
        2816,
    ]  # per (expert, hidden), replicated
    assert plan["model.layers.5.experts.gate_up_proj.scale"]["rank_shape"] == [
        128,
        1,
        2 * 88,
    ]  # split with its channels
    k = plan["model.layers.5.self_attn.k_proj.weight"]  # 2 global KV heads of 512, replicated to 8
    assert (k["full_shape"], k["rank_shape"]) == ([8 * 512, 2816], [512, 2816])


@pytest.mark.parametrize(
    "expert_layout,gathered,whole",
    [
        ("channel", 8 * 3 * 88 * 2816, 0),  # k experts' slices of I/t channels
        ("expert", 0, 16 * 3 * 704 * 2816),  # all E/t experts, whole
    ],
)
def test_full_size_decode_graph_reads_what_its_layout_says(expert_layout, gathered, whole):
    """The token-generation key of the full-size port at TP 8, batch 1, exported as rank 0 on the meta
    device (two of its 30 layers, one sliding and one global, at full width): per layer and rank the
    channel layout's graph gathers k·3·(I/t)·H expert weights (11.9 MB in bf16), the expert layout's
    reads its (E/t)·3·I·H whole (190 MB): 16 times more."""
    from neuron_moe.config import gemma4_moe_config
    from neuron_moe.parallel import cpu
    from neuron_moe.parallel.model import rank_model
    from neuron_moe.parallel.trace import export_rank0
    from neuron_moe.static import data_dependent_ops
    from neuron_moe.static.decoder import new_cache

    port = load_port("gemma4-26b-a4b")
    config = gemma4_moe_config(
        dict(port.raw["config"], num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]), "two layers"
    )
    module = rank_model(config, 8, cpu, expert_layout=expert_layout, device="meta")
    graph = nc._graph(
        module,
        port.static,
        "token_generation",
        new_cache(module, port.static.max_cache_len, port.static.batch_size),
        False,
    )
    program = export_rank0(graph, tuple(x.to("meta") for x in nc._example(port.static, "token_generation")), 8)
    assert data_dependent_ops(program) == []
    reads = expert_reads(program)
    for layer in range(2):
        weights = [f"model.model.layers.{layer}.experts.{p}_proj.weight" for p in ("gate_up", "down")]
        assert sum(reads["gathered"].get(w, 0) for w in weights) == gathered
        assert sum(reads["whole"].get(w, 0) for w in weights) == whole


def test_an_artifact_or_shard_of_the_other_layout_is_refused(artifact, tmp_path):
    """The channel artifact above, its manifest edited to claim the expert layout: served with the
    port's channel layout it is refused, and its shards are refused as not the manifest's layout."""
    manifest, out = artifact
    manifest = na.read_manifest(out)
    na.check_expert_layout(manifest, "channel", out)
    with pytest.raises(
        na.ArtifactError, match="built with the 'channel' expert layout, served here with the 'expert' layout"
    ):
        na.check_expert_layout(manifest, "expert", out)
    claimed = dict(manifest, expert_layout="expert")
    with pytest.raises(
        na.ArtifactError,
        match=r"tp0_sharded_checkpoint.safetensors holds its experts in the "
        r"'channel' layout, the manifest says 'expert'",
    ):
        na.load_shards(out, claimed)
    assert len(na.load_shards(out, manifest)) == 2


def test_a_degree_that_does_not_split_the_channels_is_refused(tiny_port, tmp_path, capsys):
    from conftest import port_text_elsewhere

    (tmp_path / "p.toml").write_text(
        port_text_elsewhere(tiny_port).replace("moe_intermediate_size = 64", "moe_intermediate_size = 60")
    )
    args = [
        "trace-and-compile",
        "--model",
        str(tmp_path / "p.toml"),
        "--tp",
        "8",
        "--dry-run",
        "--out",
        str(tmp_path / "x"),
    ]
    assert main(args) == 2
    assert (
        "TP 8 (channel expert layout): 60 expert intermediate channels do not split over 8 ranks"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "x").exists()


def test_without_the_sdk_it_says_so(tmp_path, capsys):
    if nxd.sdk_available():
        pytest.skip("the Neuron SDK is installed here")
    assert main(["trace-and-compile", "--tp", "2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^error: trace-and-compile needs the Neuron SDK .* or pass --dry-run", err)
    assert not (tmp_path / "x").exists()


def test_neuron_path_hands_modelbuilder_every_key(one_bucket_port, tmp_path, monkeypatch):
    """Without the SDK, ModelBuilder stood in for: the keys, their example inputs, the checkpoint it
    is handed (named as the graphs' parameters), and what ends up in the directory."""
    from safetensors.torch import save_file

    from neuron_moe.parallel import cpu
    from neuron_moe.parallel.model import rank_model
    from neuron_moe.static.decoder import new_cache

    seen = {}

    def trace_keys(keys, checkpoint_loader, tp, workdir, compiler_args):
        seen.update(keys=keys, checkpoint=checkpoint_loader(), tp=tp, compiler_args=compiler_args)
        seen.update(env=os.environ.get("NEURON_LOGICAL_NC_CONFIG"))  # what neuronx-cc's processes inherit
        return "builder", torch.jit.script(torch.nn.Identity())

    def shard_checkpoint(builder, path):
        for rank in range(2):
            save_file({"w": torch.zeros(1)}, str(path / f"tp{rank}_sharded_checkpoint.safetensors"))

    monkeypatch.setattr(nxd, "sdk_available", lambda: True)
    monkeypatch.setattr(nxd, "trace_keys", trace_keys)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setattr(
        nxd,
        "shard_checkpoint",
        lambda builder, serialize_path: (serialize_path.mkdir(), shard_checkpoint(builder, serialize_path)),
    )
    report = nc.trace_and_compile(
        one_bucket_port, nc.Build.at(tp=2, out=tmp_path / "out", quantization="int8", dry_run=False)
    )

    assert seen["tp"] == 2 and list(seen["keys"]) == na.key_names([16], [1], spans=[64])
    # compiled for inf2 (ModelBuilder's default arguments and the target), in the environment inf2 needs
    assert (
        seen["compiler_args"]
        == "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1 --target inf2"
    )
    assert seen["env"] == "1" and os.environ.get("NEURON_LOGICAL_NC_CONFIG") is None  # set for the compile alone
    (_, [prefill]), (_, [decode_64]), (_, [decode]), (_, [variant_prefill]), (_, [variant_64]), (_, [variant]) = seen[
        "keys"
    ].values()
    assert [tuple(x.shape) for x in variant_prefill] == [(1, 16)] * 3 + [(1,), (1, 16)]  # the targets
    assert [tuple(x.shape) for x in variant] == [(2, 1), (2, 1), (2, 4), (2, 7), (2, 64), (2, 64), (2, 64)]
    assert [tuple(x.shape) for x in variant_64] == [tuple(x.shape) for x in variant] + [(64,)]
    assert [tuple(x.shape) for x in prefill] == [(1, 16)] * 3 + [(1,), (1, 4)]  # a prompt, its row, its sampling
    assert [tuple(x.shape) for x in decode] == [(2, 1), (2, 1), (2, 4)]  # ids, positions, sampling: no cache, no mask
    assert [tuple(x.shape) for x in decode_64] == [(2, 1), (2, 1), (2, 4), (64,)]  # kv_length's shape routes a call
    module = rank_model(one_bucket_port.config, 2, cpu, quantization="int8", device="meta")
    graph = nc._graph(module, one_bucket_port.static, "token_generation", new_cache(module, 96, 2), False)
    assert seen["checkpoint"].keys() == graph.state_dict().keys()  # weights only: the state is not in it
    assert seen["checkpoint"]["model.model.layers.0.experts.gate_up_proj.weight"].dtype == torch.int8
    tokenizer = ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]  # the artifact serves alone
    weights = [na.RANK_WEIGHTS.format(rank=r) for r in range(2)]
    assert sorted(report["files"]) == [na.MODEL, na.SHARD_PLAN, *tokenizer, *weights]
    assert not report["dry_run"] and na.read_manifest(tmp_path / "out")["quantization"] == "int8"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "manifest.json",
        "model.pt",
        "shard_plan.json",
        "tokenizer",
        "weights",
    ]


def test_modelbuilder_gets_each_keys_state_aliases(one_bucket_port, tiny_eager, monkeypatch):
    """nxd.trace_keys against stand-ins for NxD's ModelBuilder and BaseModelInstance that do what
    fbac349's do with them (the instance keeps the aliases dict it was given, load_module calls the
    factory, get returns both; trace runs each module on its example): every key's aliases map each
    state parameter of the module it built to the output that replaces it, and the keys name their
    state alike (one state set). The aliased outputs are the new cache: row 0 written, row 1 not."""
    from neuron_moe.parallel import cpu, layout
    from neuron_moe.parallel.model import rank_model
    from neuron_moe.static.decoder import new_cache

    class BaseModelInstance:
        def __init__(self, module_cls, input_output_aliases):
            self.module_cls, self.module, self.input_output_aliases = module_cls, None, [input_output_aliases]

        def load_module(self):
            self.module = self.module_cls()

        def get(self, bucket_rank, **kwargs):
            return self.module, self.input_output_aliases[0]

    class ModelBuilder:
        def __init__(self, router, tp_degree, checkpoint_loader, compiler_workdir):
            self.keys = {}

        def add(self, key, model_instance, example_inputs, compiler_args):
            self.keys[key] = (model_instance, example_inputs)

        def trace(self, initialize_model_weights):
            traced = {}
            for key, (instance, examples) in self.keys.items():
                instance.load_module()
                module, aliases = instance.get(0)
                with torch.no_grad():
                    traced[key] = (module, dict(aliases), module(*examples[0]))
            return traced

    stand_ins = {f"neuronx_distributed.trace.model_builder.{c.__name__}": c for c in (ModelBuilder, BaseModelInstance)}
    monkeypatch.setattr(nxd, "_nxd", stand_ins.__getitem__)
    spec = dataclasses.replace(one_bucket_port.static, prefill_rows=(1, 2))  # a key of 2 prompts too

    full = layout.parallel_state_dict(tiny_eager.state_dict(), tiny_eager.config, 1)

    def factory(key):  # as _neuron builds a key, on the CPU layers at TP 1 (no collectives to stand in for)
        def build():
            model = rank_model(one_bucket_port.config, 1, cpu)
            model.load_state_dict(cpu.shard_checkpoint(full, model, 1)[0], strict=True)
            return nc._graph(model, spec, key, new_cache(model, 96, 2, aliased=True), False)

        return build

    vocab = one_bucket_port.config.vocab_size
    names = na.key_names(spec.buckets, spec.prefill_rows)
    keys = {k: (factory(k), [nc._example(spec, k, vocab)]) for k in names}
    _, traced = nxd.trace_keys(keys, checkpoint_loader=dict, tp=1, workdir="unused")
    names, kv = [], [f"cache.{kv}{i}" for i in range(4) for kv in "kv"]
    for key, (module, aliases, outputs) in traced.items():
        state = dict(module.named_parameters())
        aliased = {n: aliases[p] for n, p in state.items() if p in aliases}
        # the token (a logits-processing key: its logprobs, or the prompt's), then the state
        own, held = (
            (1, kv)
            if not na.is_processing(key)
            else (5 - key.startswith("context"), kv + ["counts.output", "counts.prompt"])
        )
        assert list(aliased) == held and len(aliases) == len(held)
        assert sorted(aliased.values()) == list(range(own, own + len(held))) and len(outputs) == own + len(held)
        for name, index in aliased.items():
            assert outputs[index].shape == state[name].shape
        names.append(list(aliased)[:8])
        if key == "context_encoding_1x16":
            k0 = outputs[aliased["cache.k0"]]  # layer 0's K of the prompt, in row 0 only
            assert k0[0].abs().sum() > 0 and not k0[1].any()
        if key == "context_encoding_2x16":
            assert outputs[aliased["cache.k0"]].abs().sum((1, 2, 3)).gt(0).tolist() == [True, True]  # both rows
    assert names[0] == names[1] == names[2]


# ---- the graphs' shapes as flags over the port's [static], checked by the planner before any work ------------


def test_shape_flags_override_the_ports_static_table(tiny_port, tmp_path):
    port = with_shapes(tiny_port, Shapes(batch_size=3, max_cache_len=64, buckets=(16, 32)))
    manifest = nc.trace_and_compile(
        port, nc.Build.at(tp=2, out=tmp_path / "art", dtype="float32", dry_run=True, export=False)
    )
    assert (manifest["batch_size"], manifest["max_cache_len"], manifest["buckets"]) == (3, 64, [16, 32])
    assert list(manifest["keys"]) == na.key_names([16, 32], [1, 3])  # prefill_rows [1, 4] cut to 3
    assert list(manifest["keys"])[:5] == [
        "context_encoding_1x16",
        "context_encoding_1x32",
        "context_encoding_3x16",
        "context_encoding_3x32",
        "token_generation",
    ]
    assert manifest["keys"]["token_generation"]["inputs"]["input_ids"] == [3, 1]
    assert manifest["state"]["cache.k1"]["shape"][:3:2] == [3, 64]  # 3 rows, every one of the 64 positions
    assert with_shapes(tiny_port, Shapes()) is tiny_port  # no flag: the table as it is


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--max-cache-len", "32"],
            "--max-cache-len 32 (the KV cache's positions) is shorter than the largest prefill bucket 56 "
            "(the port's [static] buckets [8, 24, 56]): pass --buckets up to 32",
        ),
        (["--buckets", "56,8"], "--buckets must be strictly increasing positive lengths, got [56, 8]"),
        (["--max-cache-len", "600"], "--max-cache-len 600 exceeds the model's max_position_embeddings 512"),
    ],
)
def test_shape_flags_are_checked_before_any_work(tmp_path, capsys, flags, message):
    assert main(["trace-and-compile", "--tp", "2", "--dry-run", "--out", str(tmp_path / "art"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "art").exists()


def test_the_planner_refuses_what_a_neuroncore_cannot_hold_and_plan_agrees(tmp_path, capsys):
    shapes = ["--batch-size", "64", "--max-cache-len", "8192", "--buckets", "128,512"]
    assert (
        main(
            [
                "trace-and-compile",
                "--model",
                "gemma4-26b-a4b",
                "--tp",
                "8",
                "--dry-run",
                "--out",
                str(tmp_path / "big"),
                *shapes,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: port 'gemma4-26b-a4b' at TP 8, bfloat16, batch 64, seq 8192: ")
    assert not (tmp_path / "big").exists()
    per_rank = re.search(r"(\d+\.\d+) GB per rank exceeds a NeuronCore's", err)[1]
    assert main(["plan", "--model", "gemma4-26b-a4b", "--instance", "inf2.24xlarge", "--tp", "8", *shapes]) == 1
    assert f"DOES NOT FIT: {per_rank} GB per rank exceeds" in capsys.readouterr().out  # same names, same verdict
