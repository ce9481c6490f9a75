"""HF's one-rank model with its linears in a weight format (neuron_moe/quantize.py): every format of the
registry on the experts alone and on every linear computes what the float model holding the
dequantised weights does, through every experts implementation; every one-rank backend of validate
runs it; --quantized-layers is one flag, checked in one error line, and recorded where a run reports."""

import json

import pytest
import torch

from neuron_moe import cli, formats, spec
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.parallel.layout import fused
from neuron_moe.quantize import QuantizedExperts, QuantizedLinear, quantize_model

from conftest import prefill_logits, random_prompts

QUANTIZED = sorted(name for name in formats.FORMATS if name != spec.NO_QUANTIZATION)
ALL_LINEARS = spec.LAYER_GROUPS
INT4_LINEARS = "experts,attention,mlp"  # validate's runs below


def _round_trip(fmt, w: torch.Tensor) -> torch.Tensor:
    return fmt.dequantize(fmt.quantize(w), w.dtype)


def _dequantised_copy(port, fmt, layers) -> torch.nn.Module:
    """The float model whose linears of `layers` hold fmt.dequantize(fmt.quantize(w)) (the experts' in
    their input-dim-1 view, as the format groups them); lm_head untied from the embedding when quantized."""
    model = build_model(port, spec.DENSE_MASKED, torch.float32)
    with torch.no_grad():
        if "lm_head" in layers:
            model.lm_head.weight = torch.nn.Parameter(_round_trip(fmt, model.lm_head.weight))
        for name, p in model.named_parameters():
            group = spec.layer_group(name if name.endswith(".weight") else f"{name}.weight")
            if group in layers and group != "lm_head":
                p.copy_(fused(_round_trip(fmt, fused(p))) if group == "experts" else _round_trip(fmt, p))
    return model


@pytest.mark.parametrize("layers", [("experts",), ALL_LINEARS], ids=["experts", "all"])
@pytest.mark.parametrize("quantization", QUANTIZED)
def test_a_quantized_model_is_the_float_model_of_its_dequantised_weights(tiny_port, quantization, layers):
    """Prefill logits of the quantized model (dense_masked, fp32) equal those of the float model holding
    the round-tripped weights up to fp32 summation order (int8 scales after the matmul, not folded into
    the weight: ~1e-6 of the largest logit), and differ from the float model's by far more; the
    embedding keeps its float weight, every linear of `layers` and no other is swapped."""
    fmt = formats.get(quantization)
    model = quantize_model(build_model(tiny_port, spec.DENSE_MASKED, torch.float32), quantization, layers)
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [30, 12], seed=2), pad_id=0)
    real = mask.bool()
    got = prefill_logits(model, ids, mask)[real]
    want = prefill_logits(_dequantised_copy(tiny_port, fmt, layers), ids, mask)[real]
    floats = prefill_logits(build_model(tiny_port, spec.DENSE_MASKED, torch.float32), ids, mask)[real]
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (got - floats).abs().max() > 1e-3 * scale  # it is quantized, not the float model

    swapped = {name for name, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedExperts))}
    linears = {
        name
        for name, m in build_model(tiny_port).named_modules()
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Gemma4TextExperts"
    }
    assert swapped == {name for name in linears if spec.layer_group(_weight_name(name)) in layers}
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert ("lm_head" in swapped) == ("lm_head" in layers)


def _weight_name(module: str) -> str:
    """The parallel layout's name of a module's weight (an experts module: its gate_up)."""
    return f"{module}.gate_up_proj.weight" if module.endswith("experts") else f"{module}.weight"


@pytest.mark.parametrize("quantization", QUANTIZED)
def test_every_experts_implementation_reads_the_dequantised_experts(tiny_port, quantization):
    """HF's eager loop, dense_masked and selective (whose one-token decode steps gather each token's
    experts) all read `gate_up_proj` / `down_proj`: over the quantized experts they generate the same
    tokens, their logits equal up to fp32 summation order."""
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [9, 5], seed=4), pad_id=0)
    runs = {
        experts: greedy(build_model(tiny_port, experts, torch.float32, quantization=quantization), ids, mask, 4)
        for experts in (spec.EAGER, spec.DENSE_MASKED, spec.SELECTIVE)
    }
    want = runs[spec.DENSE_MASKED]
    for experts, got in runs.items():
        assert torch.equal(got.tokens, want.tokens), experts.name
        assert (got.logits - want.logits).abs().max() <= 1e-5 * want.logits.abs().max(), experts.name


def test_the_source_weights_are_never_written(tiny_port):
    model = build_model(tiny_port, spec.DENSE_MASKED, torch.float32)
    held = {name: (p, p._version, p.clone()) for name, p in model.named_parameters()}
    quantize_model(model, "int4", ALL_LINEARS)
    assert all(p._version == version and torch.equal(p, before) for p, version, before in held.values())


def _validate(tmp_path, backend: str, *flags: str) -> dict:
    out = tmp_path / f"{backend}.json"
    argv = ["validate", "--backend", backend, "--quantization", "int4", "--quantized-layers", INT4_LINEARS]
    assert cli.main([*argv, "--max-new-tokens", "12", *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def dense_report(tmp_path_factory):
    return _validate(tmp_path_factory.mktemp("dense"), "dense_masked")


@pytest.mark.parametrize(
    "backend,flags",
    [
        ("dense_masked", ()),
        ("eager", ()),
        ("static", ("--no-compile",)),
        pytest.param("traced", (), marks=pytest.mark.slow),
    ],
)
def test_validate_runs_int4_on_every_linear_on_each_one_rank_backend(tmp_path, dense_report, backend, flags):
    """validate compares against the float model (HF eager, fp32), as with any format: int4 on the
    experts, attention and the dense MLP of the trained tiny port keeps every prompt's first 12 tokens
    (it first diverges at token 22). Each backend computes the same quantized model: the step-0
    |Δlogit| against the reference is dense_masked's up to fp32 summation order, and far from 0."""
    report = _validate(tmp_path, backend, *flags) if backend != "dense_masked" else dense_report
    assert report["all_match"]
    assert report["backend_options"]["quantization"] == "int4"
    assert report["backend_options"]["quantized_layers"] == INT4_LINEARS
    for row, want in zip(report["prompts"], dense_report["prompts"]):
        assert abs(row["max_abs_dlogit_step0"] - want["max_abs_dlogit_step0"]) <= 1e-4, row["prompt"]
        assert row["max_abs_dlogit_step0"] > 0.1, row["prompt"]


ERROR = f"error: --quantized-layers 'experts,mpl': expected a comma-separated list of {', '.join(spec.LAYER_GROUPS)}"


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "--backend", "eager", "--quantization", "int8"],
        ["validate", "--backend", "tp", "--tp", "2", "--quantization", "int8"],
        ["eval-tasks", "--quantization", "int8"],
        ["plan", "--instance", "inf2.xlarge", "--tp", "2", "--quantization", "int4"],
        ["trace-and-compile", "--tp", "2", "--quantization", "int4", "--dry-run", "--out", "OUT"],
        ["serve", "--backend", "static", "--quantization", "int8", "--port", "0"],
        [
            "deploy",
            "k8s",
            "--instance",
            "inf2.xlarge",
            "--artifacts",
            "s3://b/p",
            "--out",
            "OUT",
            "--quantization",
            "int4",
        ],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_a_bad_layer_group_is_one_error_line_before_any_work(tmp_path, capsys, argv):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert cli.main([*argv, "--quantized-layers", "experts,mpl"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ERROR and not captured.out
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_layers_without_a_format_and_formats_a_backend_lacks_are_refused(capsys):
    cases = [
        (["validate", "--quantized-layers", "attention"], "--quantized-layers names the linears --quantization"),
        (["plan", "--instance", "inf2.xlarge", "--tp", "2", "--quantized-layers", "mlp"], "pass --quantization"),
        (
            [
                "validate",
                "--backend",
                "reader",
                "--budget",
                "50",
                "--quantization",
                "int8",
                "--quantized-layers",
                "mlp",
            ],
            "--backend reader reads the routed experts alone in int8, not --quantized-layers mlp",
        ),
        (["serve", "--backend", "neuron", "--quantization", "int8", "--port", "0"], "in the format it was built with"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_eval_tasks_records_the_format_and_its_layers(tmp_path, capsys):
    """eval-tasks names the backend's format and the linears in it, in its header and its JSON."""
    out = tmp_path / "tasks.json"
    argv = ["eval-tasks", "--quantization", "int8", "--quantized-layers", "lm_head,experts", "--items", "1"]
    assert cli.main([*argv, "--task", "reverse", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["quantization"], report["quantized_layers"]) == ("int8", ["experts", "lm_head"])
    assert "greedy answers with eager (int8 on experts, lm_head)" in capsys.readouterr().out
    assert cli.main(["eval-tasks", "--items", "1", "--task", "reverse", "--json", str(out)]) == 0
    assert (json.loads(out.read_text())["quantization"], json.loads(out.read_text())["quantized_layers"]) == (
        "none",
        [],
    )


@pytest.mark.parametrize("argv", [["--backend", "dense_masked"], ["--backend", "static", "--no-compile"]])
def test_serve_builds_its_cpu_backends_model_in_the_format(tiny_port, monkeypatch, argv):
    """serve's transformers-model and static backends load the model with --quantized-layers in
    --quantization's format (the static graphs are then built over it)."""
    from neuron_moe.serve import backends

    built = []
    monkeypatch.setattr(backends, "build_model", lambda *a, **k: built.append(build_model(*a, **k)) or built[-1])
    config = cli.serve_config(["serve", *argv, "--quantization", "int4", "--quantized-layers", "attention,experts"])
    backends.load_engine(tiny_port, config.backend)
    (model,) = built
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantizedLinear) and isinstance(layer.experts, QuantizedExperts)
    assert isinstance(layer.mlp.up_proj, torch.nn.Linear) and isinstance(model.lm_head, torch.nn.Linear)
