"""The Neuron backend (serve/neuron.py) without the device: the artifact contract's checks, the
batching engine driving the artifact's calls on a stand-in for the NxD runtime that keeps its KV
cache inside, as the device does, and a dry-run artifact served alone (its own tokenizer)."""

import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from neuron_moe import cli
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.neuron import artifact
from neuron_moe.neuron import compile as compile_
from neuron_moe.neuron.artifact import FORMAT, TARGET
from neuron_moe import environment
from neuron_moe.serve import backends, neuron, server
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.decoding import RequestError, SamplingParams
from neuron_moe.static.runtime import static_runtime
from neuron_moe.tokenizer import answer_text, load_tokenizer

from serving import IdTokenizer, serve_together, serving, tokens_of, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _manifest(**fields):
    """A compiled artifact's manifest, its keys and files those of its shapes and TP degree."""
    rows, buckets, tp = fields.get("prefill_rows", [1, 2]), fields.get("buckets", [16]), fields.get("tp", 1)
    entry = {"size": 1, "sha256": "0" * 64}
    names = [artifact.MODEL, artifact.SHARD_PLAN, *(artifact.RANK_WEIGHTS.format(rank=r) for r in range(tp))]
    return json.dumps(
        dict(
            {
                "format": FORMAT,
                "dtype": "bfloat16",
                "quantization": "none",
                "quantized_layers": ["experts"],
                "batch_size": 2,
                "dry_run": False,
                "expert_layout": "channel",
                "logits": False,
                "weights": True,
                "prefill_rows": rows,
                "prefill_chunk": buckets[0],
                "decode_lengths": [fields.get("max_cache_len", 32)],
                "candidates": 256,
                "target": TARGET,
                "tokenizer": {"kind": "checkpoint", "files": []},
                "keys": {k: {"inputs": {}, "outputs": {}} for k in artifact.key_names(buckets, rows)},
                "state": {"cache.k0": {"shape": [2, 1, 16, 4], "dtype": "bfloat16"}},
                "files": {name: entry for name in names},
            },
            **fields,
        )
    )


def test_manifest_errors_name_the_problem(tmp_path):
    with pytest.raises(neuron.NeuronError, match="no manifest.json"):
        neuron.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(_manifest(port="p", tp=2, buckets=[64], max_cache_len=32))
    with pytest.raises(
        neuron.NeuronError,
        match=r"'buckets' must be 1 to 64 strictly increasing positive lengths up to max_cache_len \(32",
    ):
        neuron.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(_manifest(port="p", buckets=[8], max_cache_len=32))
    with pytest.raises(neuron.NeuronError, match="field 'tp' is missing"):
        neuron.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(
        _manifest(port="p", tp=2, buckets=[8], max_cache_len=32, prefill_rows=[1, 4])
    )
    with pytest.raises(neuron.NeuronError, match=r"'prefill_rows' must be .* at most batch_size \(2\), got \[1, 4\]"):
        neuron.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(
        _manifest(port="p", tp=2, buckets=[8, 16], max_cache_len=32, prefill_chunk=12)
    )
    with pytest.raises(neuron.NeuronError, match=r"'prefill_chunk' 12 is not one of the buckets \[8, 16\]"):
        neuron.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(
        _manifest(port="p", tp=2, buckets=[8], max_cache_len=32, target={"name": "inf2", "env": {}})
    )
    with pytest.raises(neuron.NeuronError, match=r"'target' must be \{\"name\": str, \"compiler_args\""):
        neuron.read_manifest(tmp_path)


def test_missing_sdk_is_a_clear_error():
    if all(importlib.util.find_spec(m) for m in neuron.SDK_MODULES):
        pytest.skip("the Neuron SDK is installed here")
    with pytest.raises(neuron.NeuronError, match="needs the Neuron SDK"):
        neuron.require_sdk()


class StandInNxDModel:
    """The NxDModel attributes the streamed load uses: its weights, set per rank, then handed to the keys."""

    weight_loader = None  # no layout transformation: the weights stream a load group at a time

    def __init__(self):
        self.weights, self.start_rank = None, None

    def initialize_with_saved_weights(self, start_rank):
        self.start_rank = start_rank


class StandInRuntime:
    """What a compiled artifact does, computed with the CPU model's static graphs (static/decoder.py,
    the graphs trace-and-compile traces) over one KV state that stays inside, as NxD keeps it on the
    device: NxD routes a call to the key whose input shapes match, here prefill (P chunks of prompts
    in one bucket, their row ids and sampling, P one of the manifest's prefill_rows) or decode (ids,
    positions and sampling of every row). Every call's input and output shapes are recorded."""

    def __init__(self, model, buckets, batch, max_cache_len, logits, prefill_rows=(1, 2)):
        from neuron_moe.static.decoder import Decode, Prefill, new_cache

        self.buckets, self.batch, self.prefill_rows = buckets, batch, prefill_rows
        cache = new_cache(model, max_cache_len, batch)
        self.prefill = Prefill(model, cache, "dense_masked", logits)
        self.decode = Decode(model, cache, "selective", logits)
        self.nxd_model = StandInNxDModel()
        self.calls = []

    @torch.no_grad()
    def __call__(self, *inputs):
        shapes = [tuple(x.shape) for x in inputs]
        assert all(x.dtype == torch.long for x in inputs[:-1]) and inputs[-1].dtype == torch.float32
        if len(inputs) == 5:  # ids, mask, positions [P, bucket], row ids [P], sampling [P, 4]
            rows, bucket = shapes[0]
            assert shapes == [(rows, bucket)] * 3 + [(rows,), (rows, 4)]
            assert bucket in self.buckets and rows in self.prefill_rows
            outputs = self.prefill(*inputs)
        else:  # ids, positions [B, 1], sampling [B, 4]
            assert shapes == [(self.batch, 1)] * 2 + [(self.batch, 4)]
            outputs = self.decode(*inputs)
        self.calls.append((shapes, [tuple(x.shape) for x in outputs]))
        return outputs


def _neuron_runtime(tmp_path, monkeypatch, port, model, logits: bool, batch: int = 3, stand_in=None, **fields):
    """The Neuron runtime over a stand-in artifact (`stand_in`, default StandInRuntime) whose manifest
    has these shapes (and `fields` over them)."""
    (tmp_path / "manifest.json").write_text(
        _manifest(
            **{
                "port": port.name,
                "tp": 2,
                "buckets": [16, 64],
                "max_cache_len": 128,
                "batch_size": batch,
                "logits": logits,
                "prefill_rows": [1, 2],
                "prefill_chunk": 16,
                **fields,
            }
        )
    )
    (tmp_path / "weights").mkdir(exist_ok=True)
    for rank in range(2):
        save_file({"w": torch.full((1,), float(rank))}, tmp_path / f"weights/tp{rank}_sharded_checkpoint.safetensors")
    for name in neuron.SDK_MODULES:  # stand-ins found by importlib, as the SDK would be
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(environment, "neuron_devices", lambda: {"devices": 1, "cores": 2, "source": "a stand-in"})
    artifact = (stand_in or StandInRuntime)(model, {16, 64}, batch, 128, logits)
    monkeypatch.setattr(torch.jit, "load", lambda path: artifact)
    monkeypatch.setattr(neuron, "DEVICE", "cpu")  # the stand-in's cores
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")  # trn2's default: the artifact's target replaces it
    runtime = neuron.neuron_runtime(tmp_path, port)
    assert os.environ["NEURON_LOGICAL_NC_CONFIG"] == TARGET["env"]["NEURON_LOGICAL_NC_CONFIG"] == "1"
    return runtime, artifact


@pytest.mark.parametrize("logits", [False, True])
def test_the_engine_drives_the_artifact_with_no_cache_across_the_calls(
    tmp_path, monkeypatch, tiny_port, tiny_eager, logits
):
    """Five requests on the artifact's three rows, in both buckets, two prompts to a prefill call
    and the long ones in chunks of 16: only ids, masks, positions, row ids and sampling go in,
    only the token (and the logits) come out, and each request's tokens are the CPU runtime's (the
    same static graphs as modules) and HF eager's, greedy or sampled in the graphs."""
    runtime, artifact = _neuron_runtime(tmp_path, monkeypatch, tiny_port, tiny_eager, logits)
    assert [float(w["w"]) for w in artifact.nxd_model.weights] == [0.0, 1.0]  # every rank's shard, in rank order
    assert artifact.nxd_model.start_rank.tolist() == [0]
    engine = Engine(runtime, IdTokenizer(), set())
    cpu = Engine(static_runtime(tiny_eager, tiny_port.static, chunk=8), IdTokenizer(), set())
    try:
        prompts = [[2] + list(range(40, 40 + n)) for n in (5, 30, 12, 50, 3)]  # buckets 16 and 64
        requests = [(p, SamplingParams(n, temperature=0.0)) for p, n in zip(prompts, (9, 4, 7, 6, 8))]
        together = serve_together(engine, requests)
        for (prompt, params), sink in zip(requests, together):
            assert sink.steps == list(cpu.generate(prompt, params))
            reference = greedy(tiny_eager, *left_pad([prompt], 0), params.max_tokens).tokens[0].tolist()
            assert tokens_of(sink.steps) == reference
        vocab = tiny_eager.config.vocab_size
        for inputs, outputs in artifact.calls:  # token [rows, 1] (and logits [rows, V]), no KV tensor
            rows = inputs[0][0]
            assert outputs == [(rows, 1)] + ([(rows, vocab)] if logits else [])
        prefills = [inputs[0] for inputs, _ in artifact.calls if len(inputs) == 5]
        assert {bucket for _, bucket in prefills} == {16} and max(rows for rows, _ in prefills) == 2  # chunks of 16
        assert sum(rows for rows, _ in prefills) >= sum(-(-len(p) // 16) for p in prompts)  # every chunk (P padded)
        assert engine.max_tokens_for(100, None) == 128 - 100 + 1  # past the largest bucket: chunked; positions 0..127
        sampled = SamplingParams(6, temperature=0.8, top_p=0.9, seed=1)  # sampled in the graphs, either artifact
        assert list(engine.generate(prompts[0], sampled)) == list(cpu.generate(prompts[0], sampled))
        with pytest.raises(RequestError, match="top_k must be at most 256") as e:
            list(engine.generate(prompts[0], SamplingParams(6, temperature=0.8, top_k=300)))
        assert e.value.param == "top_k"
    finally:
        engine.close()
        cpu.close()
    with pytest.raises(neuron.NeuronError, match="compiled for port 'tiny-gemma4-moe', not 'other'"):
        neuron.neuron_runtime(tmp_path, types.SimpleNamespace(name="other"))


def test_neuron_backend_refuses_an_artifact_of_another_format_by_its_number_alone(tmp_path):
    """Another format's manifest is refused by its format number, before any other field is read: a
    manifest with nothing else (no port, no files) gets the format error, not a missing-field one."""
    for other in (1, 4, 5, 6, FORMAT + 1):
        (tmp_path / "manifest.json").write_text(json.dumps({"format": other}))
        with pytest.raises(
            neuron.NeuronError, match=f"artifact format {other}, this version reads {FORMAT} \\(rebuild it"
        ):
            neuron.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "5"}))
    with pytest.raises(neuron.NeuronError, match="field 'format' is missing or not an int"):
        neuron.read_manifest(tmp_path)


def test_neuron_backend_refuses_an_artifact_of_the_other_expert_layout(tmp_path, tiny_port):
    """Checked from the manifest, before the SDK or any weights are needed."""
    (tmp_path / "manifest.json").write_text(
        _manifest(port=tiny_port.name, tp=2, buckets=[16], max_cache_len=96, expert_layout="expert")
    )
    with pytest.raises(
        neuron.NeuronError,
        match=r"built with the 'expert' expert layout, served here with the "
        r"'channel' layout \(the port's \[static\] expert_layout\)",
    ):
        neuron.neuron_runtime(tmp_path, tiny_port)
    (tmp_path / "manifest.json").write_text(
        _manifest(port=tiny_port.name, tp=2, buckets=[16], max_cache_len=96, expert_layout="rows")
    )
    with pytest.raises(neuron.NeuronError, match="expert_layout 'rows' is not one of"):
        neuron.read_manifest(tmp_path)


# ---- an artifact serves alone: its tokenizer travels with its graphs ------------------------------------


@pytest.fixture
def dry_run_artifact(tmp_path, tiny_port):
    """trace-and-compile --dry-run of the tiny port (not exported: the graphs are not what is served here)."""
    out = tmp_path / "art"
    compile_.trace_and_compile(tiny_port, compile_.Build.at(tp=1, out=out, dtype="float32", dry_run=True, export=False))
    return out


def _cpu_graphs_for_the_device(monkeypatch):
    """The Neuron runtime replaced by the CPU graphs of the artifact's port (the SDK's check passes)."""
    loaded = []

    def runtime(artifacts, port, prefix_caching=None):
        manifest = artifact.read_manifest(artifacts)
        assert manifest["port"] == port.name and manifest["dry_run"]
        loaded.append(artifacts)
        return static_runtime(build_model(port, port.static.decode_experts), port.static, manifest["batch_size"])

    monkeypatch.setattr(neuron, "require_sdk", lambda: None)
    monkeypatch.setattr(backends, "neuron_runtime", runtime)
    return loaded


def test_a_dry_run_artifact_serves_without_a_checkpoint(dry_run_artifact, monkeypatch, tiny_port, tiny_eager):
    """`serve --backend neuron --artifacts DIR`, no --checkpoint: the tokenizer is the artifact's own, its
    files digest-checked against the manifest, and completions are the reference's."""
    loaded = _cpu_graphs_for_the_device(monkeypatch)
    digested, digest = [], artifact.file_digest
    monkeypatch.setattr(artifact, "file_digest", lambda path, *a, **k: digested.append(path) or digest(path, *a, **k))
    config = cli.serve_config(["serve", "--backend", "neuron", "--artifacts", str(dry_run_artifact)])
    app = server.make_app(config)
    tokenizer = load_tokenizer(tiny_port)
    prompt = "The capital of France is"
    reference = greedy(tiny_eager, *left_pad([tokenizer.encode(prompt)], 0), 8).tokens[0].tolist()
    with serving(app) as url:
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "the model to load")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        got = client.completions.create(model=tiny_port.name, prompt=prompt, max_tokens=8, temperature=0)
    assert got.choices[0].text == answer_text(tokenizer, reference)
    assert loaded == [dry_run_artifact]
    served = app.state.server.engine.tokenizer
    assert Path(served._tok.name_or_path) == dry_run_artifact / "tokenizer"
    files = {dry_run_artifact / "tokenizer" / n for n in ("tokenizer.json", "tokenizer_config.json")}
    assert files <= set(map(Path, digested))


@pytest.mark.parametrize(
    "tamper,named",
    [
        (
            lambda d: (d / "tokenizer.json").write_text(
                (d / "tokenizer.json").read_text().replace('"<eos>"', '"<EOS>"')
            ),
            "tokenizer/tokenizer.json: sha256 ",
        ),
        (
            lambda d: (d / "chat_template.jinja").write_text("{{ messages }}"),
            "tokenizer/chat_template.jinja: not in the artifact's manifest (added after trace-and-compile)",
        ),
        (
            lambda d: (d / "tokenizer_config.json").unlink(),
            "tokenizer/tokenizer_config.json: missing (the manifest lists it)",
        ),
    ],
)
def test_a_tampered_tokenizer_is_refused_by_name_before_binding(dry_run_artifact, monkeypatch, capsys, tamper, named):
    _cpu_graphs_for_the_device(monkeypatch)
    tamper(dry_run_artifact / "tokenizer")
    assert cli.main(["serve", "--backend", "neuron", "--artifacts", str(dry_run_artifact)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {dry_run_artifact}/{named}") and err.count("\n") == 1, err


def test_an_artifact_compiled_for_another_target_is_refused_naming_both(
    dry_run_artifact, monkeypatch, capsys, tiny_port
):
    """The dry-run artifact records the target it is built for (inf2); edited to another, `serve
    --backend neuron --artifacts` refuses it with one line naming both, before binding."""
    _cpu_graphs_for_the_device(monkeypatch)
    manifest = json.loads((dry_run_artifact / "manifest.json").read_text())
    assert manifest["target"] == TARGET and "inf2" in TARGET["compiler_args"]
    manifest["target"]["name"] = "trn2"
    (dry_run_artifact / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["serve", "--backend", "neuron", "--artifacts", str(dry_run_artifact)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {dry_run_artifact}: compiled for the 'trn2' target, served here on 'inf2': rebuild it with this "
        "version's trace-and-compile, which compiles for 'inf2'\n"
    )
    with pytest.raises(neuron.NeuronError, match="compiled for the 'trn2' target, served here on 'inf2'"):
        neuron.neuron_runtime(dry_run_artifact, tiny_port)  # an artifact pulled from s3 meets it there


def test_an_artifact_that_transforms_its_weights_on_load_takes_the_whole_shards(tmp_path, monkeypatch, caplog):
    """NxD's weight_loader (a layout transformation) takes every rank's shard through `initialize`;
    without one the weights stream to the device and `initialize_with_saved_weights` hands them on."""
    (tmp_path / "weights").mkdir()
    for rank in range(2):
        save_file({"w": torch.full((2,), float(rank))}, tmp_path / f"weights/tp{rank}_sharded_checkpoint.safetensors")
    manifest = {"tp": 2, "expert_layout": "channel"}
    initialized = []
    transforming = types.SimpleNamespace(weight_loader=object(), initialize=lambda w, s: initialized.append((w, s)))
    with caplog.at_level("WARNING"):
        neuron.load_weights(transforming, tmp_path, manifest)
    ((weights, start),) = initialized
    assert [w["w"].tolist() for w in weights] == [[0.0, 0.0], [1.0, 1.0]] and start.tolist() == [0]
    assert "every shard is read whole" in caplog.text
    monkeypatch.setattr(neuron, "DEVICE", "cpu")
    streamed = StandInNxDModel()
    neuron.load_weights(streamed, tmp_path, manifest)
    assert [w["w"].tolist() for w in streamed.weights] == [[0.0, 0.0], [1.0, 1.0]]
    assert streamed.start_rank.tolist() == [0]
