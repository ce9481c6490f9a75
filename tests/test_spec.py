"""The typed spec (neuron_moe/spec.py): every experts implementation is one entry, bound once to its
HF forward and to what a rank module computes for it; what the commands offer is derived from the
entries, so one more entry is offered everywhere it fits; a graph's experts are fixed when it is
built; the one adapter to transformers' registry is the only code that names its private field."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from neuron_moe import cli, experts, spec
from neuron_moe.eval import reader_eval, seq_match
from neuron_moe.experts.view import with_experts
from neuron_moe.parallel import moe
from neuron_moe.port import GRAPH_EXPERTS
from neuron_moe.reader import selectors
from neuron_moe.serve import backends
from neuron_moe.static.decoder import Decode, Prefill, new_cache

PACKAGE = Path(__file__).resolve().parents[1] / "neuron_moe"


def test_every_entry_has_exactly_one_hf_forward_and_is_registered():
    assert list(experts.FORWARDS) == list(spec.EXPERTS.values())  # a dict: one forward per entry, no other
    for entry, forward in experts.FORWARDS.items():
        if forward is None:  # HF's own loop, which transformers falls back to under "eager"
            assert entry is spec.EAGER
        else:
            assert ALL_EXPERTS_FUNCTIONS[entry.name] is forward


def test_every_entry_a_graph_may_trace_has_a_rank_module_compute():
    assert {e for e in spec.EXPERTS.values() if e.graphs} <= set(moe.COMPUTE)


def test_what_the_commands_offer_is_derived_from_the_entries():
    assert GRAPH_EXPERTS == ("dense_masked", "selective")
    # the int8 and int4 experts are formats (--quantization), not backends of their own
    assert list(backends.BACKENDS) == ["eager", "dense_masked", "selective", "static", "neuron"]
    assert sorted(backends.NOT_SERVED) == ["channel_reader", "selector"]
    assert sorted(seq_match.BACKENDS) == ["dense_masked", "eager", "reader", "static", "tp", "traced"]
    assert seq_match.BACKENDS["reader"].experts is spec.CHANNEL_READER
    assert spec.QUANTIZATIONS == ("none", "int8", "int4", "q4_0")
    # every backend but the reader and a compiled artifact takes any format on any layers, its own
    # experts implementation unchanged (the model's modules hold the format: quantize.py)
    for name in ("eager", "dense_masked", "static", "traced", "tp"):
        base = seq_match.BACKENDS[name]
        for quantization in spec.QUANTIZATIONS[1:]:
            q = spec.quantized(base, quantization, "mlp,experts")
            assert (q.experts, q.placement, q.graphs) == (base.experts, base.placement, base.graphs), name
            assert (q.quantization, q.quantized_layers) == (quantization, ("experts", "mlp")), name
    assert spec.quantized(seq_match.BACKENDS["traced"], "none") == seq_match.BACKENDS["traced"]
    assert spec.quantized(backends.BACKENDS["static"], "int8").quantized_layers == spec.DEFAULT_QUANTIZED_LAYERS
    with pytest.raises(spec.SpecError, match="in the format it was built with"):
        spec.quantized(backends.BACKENDS["neuron"], "int8")
    reader = seq_match.BACKENDS["reader"]
    assert spec.quantized(reader, "int8") == reader  # the reader's own setting (Reader.quantization)
    with pytest.raises(spec.SpecError, match="routed experts alone"):
        spec.quantized(reader, "int8", ("experts", "lm_head"))


def test_experts_read_and_the_gather_rule(tiny_port):
    c = tiny_port.config  # 16 experts, top-4
    assert [spec.DENSE_MASKED.experts_read(c), spec.SELECTIVE.experts_read(c), spec.EAGER.experts_read(c)] == [16, 4, 4]
    assert spec.SELECTIVE.experts_read(c, tokens=5) == 16
    assert spec.SELECTIVE.gathers(c, 3) and not spec.SELECTIVE.gathers(c, 4)  # 3·4 < 16 ≤ 4·4: NxD's rule
    assert not spec.DENSE_MASKED.gathers(c, 1) and not spec.EAGER.gathers(c, 1)  # all experts; data-dependent
    with pytest.raises(spec.SpecError, match="unknown experts implementation 'nope'"):
        spec.experts("nope")


def test_selector_specs_are_fields():
    known = ("teal", "reader")
    assert spec.parse_selector("reader-r8-tp4-split-global", known) == spec.SelectorSpec(
        "reader-r8-tp4-split-global", "reader", 8, 4, gathered=True, split=True
    )
    assert (
        spec.parse_selector("reader-tp2-global", known).gathered
        and not spec.parse_selector("reader-tp2-global", known).split
    )
    assert not spec.parse_selector("teal", known).reader
    with pytest.raises(spec.SpecError, match="TP degree 3"):
        spec.parse_selector("reader-tp3", known)
    with pytest.raises(spec.SpecError, match="unknown selector 'teal-tp2'"):
        spec.parse_selector("teal-tp2", known)


def test_a_graph_runs_the_experts_it_was_built_with(tiny_port, tiny_eager):
    """Two graphs over one model, one cache: each keeps its own implementation whatever the model's
    is set to afterwards, and neither changes the model's; the views hold the model's own weights."""
    from neuron_moe.model import build_model

    model = build_model(tiny_port, "eager")
    cache = new_cache(model, 16, 2)
    prefill, decode = Prefill(model, cache, spec.DENSE_MASKED), Decode(model, cache, "selective")
    assert spec.dispatched(model.config) is spec.EAGER
    spec.set_experts(model, spec.SELECTOR)  # the model's own, switched after the graphs were built
    for graph, want in ((prefill, spec.DENSE_MASKED), (decode, spec.SELECTIVE)):
        assert {spec.dispatched(layer.experts.config) for layer in graph.model.model.layers} == {want}
        assert dict(graph.model.named_parameters()).keys() == dict(model.named_parameters()).keys()
        assert all(a is b for a, b in zip(graph.model.parameters(), model.parameters()))
    assert spec.dispatched(model.config) is spec.SELECTOR
    # a weight the model takes later (as attach_reader replaces down_proj) is the graphs' too
    experts = model.model.layers[0].experts
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().clone(), requires_grad=False)
    assert decode.model.model.layers[0].experts.down_proj is experts.down_proj


def test_an_experts_view_keeps_the_models_modules_apart_from_the_path(tiny_eager):
    view = with_experts(tiny_eager, spec.SELECTIVE)
    layer, mine = tiny_eager.model.layers[0], view.model.layers[0]
    assert mine is not layer and mine.experts is not layer.experts
    assert mine.self_attn is layer.self_attn and mine.router is layer.router  # off the path: the model's own
    assert layer._modules is not mine._modules and layer._parameters is mine._parameters
    assert spec.dispatched(layer.experts.config) is spec.EAGER  # the model's untouched


def test_the_private_field_is_named_by_the_adapter_only():
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "_experts_implementation" in line:
                hits.append(f"{path.relative_to(PACKAGE)}:{n}")
    assert hits and all(h.startswith("spec.py:") for h in hits), hits


_ONE_MORE = """
import json, torch
from neuron_moe import spec
one = spec.Experts("dense_again", graphs=True, reads=spec.ALL, backend="dense_again")
spec.EXPERTS[one.name] = one  # one entry, before anything derives from the registry
from transformers.integrations.moe import ExpertsInterface
from neuron_moe import experts, info, cli_parser
from neuron_moe.experts.dense_masked import dense_masked_forward
from neuron_moe.eval import seq_match
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.parallel import moe
from neuron_moe.port import GRAPH_EXPERTS, load_port
from neuron_moe.serve import backends
experts.FORWARDS[one] = dense_masked_forward  # ... and its forward
ExpertsInterface.register(one.name, dense_masked_forward)
port = load_port("tiny-gemma4-moe")
ids, mask = left_pad([[2, 40, 41, 42], [2, 7]], 0)
got = greedy(build_model(port, one), ids, mask, 3)
want = greedy(build_model(port, "dense_masked"), ids, mask, 3)
print(json.dumps({
    "graph_experts": GRAPH_EXPERTS, "serve": list(backends.BACKENDS), "validate": sorted(seq_match.BACKENDS),
    "per_token": [r["experts"] for r in info.per_token_costs(port.config, torch.float32)["implementations"]],
    "validate_help": cli_parser.parser().parse_args(["validate", "--backend", "dense_again"]).backend,
    "serve_help": cli_parser.parser().parse_args(["serve", "--backend", "dense_again"]).backend.name,
    "same_tokens": bool(torch.equal(got.tokens, want.tokens)),
    "rank_compute": one in moe.COMPUTE,
}))
"""


def test_one_more_entry_is_offered_everywhere_it_fits():
    """A new fixed-shape implementation that needs nothing: the port's [static] may name it, validate
    and serve offer it, info costs it, HF's model runs it; the rank modules do not compute it until
    parallel/moe.py says how (the completeness test above then fails)."""
    done = subprocess.run(
        [sys.executable, "-c", _ONE_MORE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=PACKAGE.parent,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["graph_experts"] == ["dense_masked", "selective", "dense_again"]
    assert got["serve"] == ["eager", "dense_masked", "selective", "dense_again", "static", "neuron"]
    assert "dense_again" in got["validate"] and got["validate_help"] == "dense_again"
    assert got["per_token"] == ["dense_masked", "selective", "dense_again", "eager"]
    assert got["serve_help"] == "dense_again" and got["same_tokens"]
    assert not got["rank_compute"]


def test_the_readers_settings_are_one_object_from_the_flags_to_the_defaults():
    """The flags fill what they give, the port's [reader] table what they do not, the defaults the rest."""
    flags = ["--backend", "reader", "--budget", "30", "--reader-kernel", "nki", "--quantization", "int8"]
    given = cli.reader_settings(cli.parser().parse_args(["validate", *flags]))
    assert given == spec.Reader(budget=30.0, kernel="nki")  # --quantization is the command's, not the reader's
    assert given.given() == {"budget": 30.0, "reader_kernel": "nki"}  # by option, for error messages
    port_table = spec.Reader(sidecar=Path("p.safetensors"), budget=10.0, recovery_rank=0)
    merged = given.over(port_table)
    assert merged == spec.Reader(sidecar=Path("p.safetensors"), budget=30.0, recovery_rank=0, kernel="nki")
    assert merged.resolved() == dataclasses.replace(merged, quantization="none", scan=spec.SCAN)
    assert spec.Reader().resolved().recovery_rank == spec.RECOVERY_RANK


def test_the_parsers_plain_names_are_the_registries():
    """cli_parser reads spec.py's names (no torch); the modules that own the selectors and rules agree."""
    assert tuple(selectors.SELECTORS) == spec.SELECTOR_NAMES == reader_eval.SELECTORS
    assert reader_eval.RULES == spec.RETENTION_RULES
