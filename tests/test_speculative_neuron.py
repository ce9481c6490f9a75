"""Speculative decoding in the Neuron artifact: trace-and-compile --speculative-config writes the verify
key (`speculation`) over k + 1 positions per row and every key's cache k slots longer, records the
config in the manifest (which verify checks), refuses what it cannot build, and a server drives the
artifact's verify key as it drives the CPU graphs' (`Rows._speculate`)."""

import dataclasses
import json

import pytest
import torch

from neuron_moe.cli import main
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.neuron import artifact as na
from neuron_moe.neuron import compile as nc
from neuron_moe.serve import neuron
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.engine import SamplingParams
from neuron_moe.speculative import SpeculativeConfig
from neuron_moe.static.decoder import Decode, Prefill, Verify, new_cache
from neuron_moe.static.export import prefill_inputs

from serving import IdTokenizer, serve_together, tokens_of
from test_serve_neuron import StandInRuntime, _neuron_runtime

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}


def _build(port, out, speculative: dict, **build) -> nc.Build:
    base = nc.Build.at(tp=2, out=out, dtype="float32", dry_run=True, **build)
    config = dataclasses.replace(base.config, speculative=SpeculativeConfig.from_json(json.dumps(speculative)))
    return dataclasses.replace(base, config=config)


@pytest.fixture(scope="module")
def one_bucket_port(tiny_port):
    """The tiny port with one prefill bucket and one-prompt prefill graphs (fewer keys to export)."""
    static = dataclasses.replace(tiny_port.static, buckets=(16,), prefill_rows=(1,), prefill_chunk=16)
    return dataclasses.replace(tiny_port, static=static)


@pytest.fixture(scope="module")
def speculating(tmp_path_factory, one_bucket_port):
    out = tmp_path_factory.mktemp("spec") / "art"
    return nc.trace_and_compile(one_bucket_port, _build(one_bucket_port, out, NGRAM)), out


def test_the_dry_run_writes_the_verify_key_over_a_cache_with_slack(speculating, one_bucket_port):
    manifest, out = speculating
    batch, window = one_bucket_port.static.batch_size, one_bucket_port.config.sliding_window
    assert list(manifest["keys"])[-1] == na.SPECULATION_KEY
    assert manifest["keys"][na.SPECULATION_KEY]["inputs"] == {
        "input_ids": [batch, K + 1],
        "position_ids": [batch, K + 1],
        "sampling": [batch, 4],
        "drafted": [batch],
        "uniforms": [batch, K + 1],
    }
    assert manifest["keys"][na.SPECULATION_KEY]["outputs"] == {"tokens": [batch, K + 1], "accepted": [batch]}
    assert manifest["speculative"] == dataclasses.asdict(SpeculativeConfig("ngram", K, None, 3, 3))
    lengths = {manifest["state"][f"cache.k{i}"]["shape"][2] for i in range(4)}
    assert lengths == {window + K, one_bucket_port.static.max_cache_len + K}  # sliding and global, each k longer
    assert na.verify(out, one_bucket_port)["speculative"] == manifest["speculative"]
    program = torch.export.load(out / na.GRAPHS.format(key=na.SPECULATION_KEY))
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    assert mutated == {f"cache.{kv}{i}" for i in range(4) for kv in "kv"}  # it writes the state, as decode does


def test_verify_refuses_a_manifest_whose_speculation_is_not_its_key(speculating, tmp_path):
    manifest, out = speculating
    raw = json.loads((out / na.MANIFEST).read_text())
    for field, value, message in (
        ("speculative", dict(raw["speculative"], num_speculative_tokens=K + 1), "not k \\+ 1 = 6 per row"),
        ("speculative", {"method": "beam"}, "'speculative' is not a speculative config: .*method 'beam'"),
        ("speculative", None, "'keys' must be the graphs of its buckets .*not one of them: \\['speculation'\\]"),
    ):
        with pytest.raises(na.ArtifactError, match=message):
            na.check_manifest(dict(raw, **{field: value}), tmp_path / na.MANIFEST)


def test_keys_that_nxd_could_not_route_apart_are_refused_before_any_work(one_bucket_port, tmp_path):
    """NxD routes a call by its inputs' shapes alone: a bucket of 4 over both rows makes a prefill key
    and its logits-processing variant of the same shapes (and a verify key of k = 3 too)."""
    static = dataclasses.replace(one_bucket_port.static, buckets=(4, 16), prefill_rows=(2,), prefill_chunk=16)
    port = dataclasses.replace(one_bucket_port, static=static)
    out = tmp_path / "art"
    clash = "keys 'context_encoding_2x4' and 'context_encoding_processing_2x4' take inputs of the same shapes"
    with pytest.raises(na.ArtifactError, match=clash):
        nc.trace_and_compile(port, _build(port, out, NGRAM, export=False))
    assert not out.exists()
    with pytest.raises(na.ArtifactError, match="keys 'prefill' and 'verify' take inputs of the same shapes"):
        nc.check_routes({"prefill": prefill_inputs(static, 4, 2), "verify": nc.verify_inputs(2, 4)})
    nc.check_routes({"prefill": prefill_inputs(static, 4, 2), "verify": nc.verify_inputs(2, K + 1)})


@pytest.mark.parametrize(
    "speculative, flags, message",
    [
        ('{"model": "ASSISTANT", "num_speculative_tokens": 2}', [], "method 'mtp' (an assistant) has no draft key"),
        (json.dumps(NGRAM), ["--with-logits"], "the verify key returns no logits"),
    ],
)
def test_what_the_artifact_cannot_hold_is_one_error_line(tmp_path, capsys, speculative, flags, message):
    (tmp_path / "ASSISTANT").mkdir()
    argv = ["trace-and-compile", "--model", "tiny-gemma4-moe", "--tp", "2", "--dtype", "float32", "--dry-run"]
    speculative = speculative.replace("ASSISTANT", str(tmp_path / "ASSISTANT"))
    code = main([*argv, "--out", str(tmp_path / "out"), "--speculative-config", speculative, *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert not (tmp_path / "out").exists()


class SpeculatingStandIn(StandInRuntime):
    """The stand-in artifact with a verify key too, all over one cache k slots longer (as trace-and-compile
    builds it): a call of five inputs whose third is [B, 4] is the verify key's, as its shapes route it."""

    def __init__(self, model, buckets, batch, max_cache_len, logits):
        super().__init__(model, buckets, batch, max_cache_len, logits)
        cache = new_cache(model, max_cache_len, batch, slack=K)
        self.prefill = Prefill(model, cache, "dense_masked", logits)
        self.decode = Decode(model, cache, "selective", logits)
        self.verify = Verify(model, cache, "selective")

    @torch.no_grad()
    def __call__(self, *inputs):
        if len(inputs) == 5 and inputs[2].shape == (self.batch, 4) and inputs[0].shape[1] == K + 1:
            outputs = self.verify(*inputs)
            self.calls.append(([tuple(x.shape) for x in inputs], [tuple(x.shape) for x in outputs]))
            return outputs
        return super().__call__(*inputs)


def test_a_server_speculates_on_the_artifacts_verify_key(tmp_path, monkeypatch, tiny_port, tiny_eager):
    """An artifact built with prompt lookup: the runtime takes its config from the manifest and each
    step's drafts go through the verify key; greedy texts are HF eager's, repeats accepted."""
    keys = na.key_names([16, 64], [1, 2]) + [na.SPECULATION_KEY]
    runtime, stand_in = _neuron_runtime(
        tmp_path,
        monkeypatch,
        tiny_port,
        tiny_eager,
        False,
        stand_in=SpeculatingStandIn,
        speculative=dataclasses.asdict(SpeculativeConfig("ngram", K, None, 3, 3)),
        keys={k: {"inputs": {}, "outputs": {}} for k in keys},
    )
    assert runtime.speculative == SpeculativeConfig("ngram", K, None, 3, 3)
    engine = Engine(runtime, IdTokenizer(), set())
    try:
        prompts = [[2] + [40, 41, 42, 43] * 5, [2] + list(range(50, 62))]
        requests = [(p, SamplingParams(10, temperature=0.0)) for p in prompts]
        for (prompt, params), sink in zip(requests, serve_together(engine, requests)):
            reference = greedy(tiny_eager, *left_pad([prompt], 0), params.max_tokens).tokens[0].tolist()
            assert tokens_of(sink.steps) == reference
    finally:
        engine.close()
    verifies = [inputs for inputs, _ in stand_in.calls if len(inputs) == 5 and inputs[2] == (3, 4)]
    assert verifies and all(inputs[0] == (3, K + 1) for inputs in verifies)


def test_serve_refuses_the_flag_for_an_artifact(capsys, tmp_path):
    code = main(
        ["serve", "--backend", "neuron", "--artifacts", str(tmp_path), "--speculative-config", json.dumps(NGRAM)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "an artifact speculates as trace-and-compile --speculative-config built it" in err


def test_an_artifact_without_the_key_has_no_verify():
    assert neuron.speculation(object(), {"keys": {na.DECODE_KEYS[0]: {}}, "speculative": None}) == {}


def test_plan_counts_a_verify_step_and_its_floor_per_token_kept():
    """The 26B on one inf2 chip (TP 2, q4_0): a verify step reads the decode step's bytes plus the
    experts the other k positions gather; its floor per token is the step's over the tokens kept."""
    from neuron_moe.neuron.plan import plan
    from neuron_moe.port import load_port

    port = load_port("gemma4-26b-a4b")
    layers = ("experts", "attention", "mlp", "lm_head")
    args = (port.config, "inf2.xlarge", 2, "q4_0", 1, 4096)
    spec_plan = plan(*args, quantized_layers=layers, speculative=SpeculativeConfig("ngram", K, None, 3, 3))
    plain = plan(*args, quantized_layers=layers)
    decode = next(r for r in spec_plan["decode"] if r["this_plan"])["bytes_per_token"]
    s = spec_plan["speculation"]
    extra = spec_plan["per_rank_bytes"]["experts"] * K * port.config.top_k_experts / port.config.num_experts
    assert s["verify_bytes"] == pytest.approx(decode + extra) and s["draft_bytes"] == 0
    assert [r["kept"] for r in s["per_kept"]] == list(range(1, K + 2))
    assert all(r["floor_ms_per_token"] == pytest.approx(s["step_floor_ms"] / r["kept"]) for r in s["per_kept"])
    slack = spec_plan["per_rank_bytes"]["kv_cache"] - plain["per_rank_bytes"]["kv_cache"]
    assert slack > 0 and "speculation" not in plain  # the cache's k slots per layer
