"""`python -m bench.gpu_decode --dry-run`: the whole-model decode benchmark end to end on the CPU (the
tiny port's geometry and a tiny Qwen3, eager steps, Triton's interpreter), so that its run on a GPU is
never its first run; and the pieces a dry run cannot show: that the model built on the meta device and
materialised is HF's own initialisation, when a second model is skipped for time, which kernel variant
of bench.gpu_reader's result joins the decode (and how the variants' names map to kernels), and that a
dry run started without Triton's interpreter restarts itself with it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_decode as g
from bench import gpu_env
from neuron_moe.errors import UserError
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.triton import persistent as ps

ROOT = Path(__file__).resolve().parents[1]


def env():
    out = {**os.environ, "PYTHONPATH": str(ROOT)}
    out.pop("OUT", None)
    return out


def md_rows(md: str) -> list[list[str]]:
    """The cells of every markdown table row (header and rule rows included)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in md.splitlines() if line.startswith("|")]


@pytest.mark.slow
def test_gpu_decode_bench_dry_run(tmp_path):
    out = tmp_path / "gpu_decode.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_decode", "--dry-run", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env(),
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["dry_run"] and report["machine"]["device"].startswith("cpu")
    configs = ["batched_mm", "grouped_mm", "reader-17.8", "reader-12.8"]
    for model in ("tiny-gemma4", "tiny-qwen3"):
        info = report["models"][model]
        assert info["prepped_layers"] == info["layers"] and info["parameters"] > 0  # every layer prepped in time
        rows = [r for r in report["rows"] if r["model"] == model]
        assert [(r["experts"], r["batch"]) for r in rows] == [(c, b) for c in configs for b in (1, 2)]
        for r in rows:
            assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["cuda_graph"] is False, r
            if r["batch"] == 1:  # checked against dense_masked (full) or the reader's reference kernel
                assert r["check_ok"] and r["check_rel_err"] <= 2e-2 and r["logits_rel_err"] >= 0, r
            if r["experts"].startswith("reader"):
                assert 0 < r["k"] and (r["batch"] > 1 or r["vs_full"] > 1e-3), r  # it ran, and sparsely
            # the source paper's batch-1 gain beside each reader row at batch 1
            assert r.get("paper_batch1") == (
                "1.15–1.36×" if r["experts"].startswith("reader") and r["batch"] == 1 else None
            ), r
        k = {r["experts"]: r["k"] for r in rows}
        assert k["reader-12.8"] < k["reader-17.8"]
    assert report["command"] == f"python -m bench.gpu_decode --dry-run --json {out}"
    # the markdown's table: one row per measured row, in order (model, B, experts, k)
    table = [cells[:4] for cells in md_rows(out.with_suffix(".md").read_text())]
    assert table[2:] == [
        [r["model"], str(r["batch"]), r["experts"], "-" if r["k"] is None else str(r["k"])] for r in report["rows"]
    ]
    assert done.stdout.strip().splitlines()[-1].split()[:3] == ["tiny-qwen3", "2", "reader-12.8"]


@pytest.fixture
def on_cpu(monkeypatch):
    """The benchmark's models on the CPU; its seeding (`build`) kept out of the other tests' RNG."""
    monkeypatch.setattr(g, "DEVICE", "cpu")
    with torch.random.fork_rng():
        yield


@pytest.mark.parametrize("name", ["tiny-gemma4", "tiny-qwen3"])
def test_the_model_materialised_is_hfs_own_initialisation(on_cpu, name):
    """Built on the meta device, materialised, initialised by HF there: the same as a model built directly."""
    cls, config, _ = g.models()[name]
    built, direct = g.build(cls, config), cls(config).to(g.BF16)
    for (n, a), (m, b) in zip(built.named_buffers(), direct.named_buffers(), strict=True):
        assert n == m and torch.equal(a, b), n  # rotary tables, embedding scale
    for (n, a), (m, b) in zip(built.named_parameters(), direct.named_parameters(), strict=True):
        assert n == m and a.isfinite().all(), n
        if (b == b.flatten()[0]).all():  # a constant init (norms, scales): the same constant
            assert torch.equal(a, b), n
        else:  # a random one: of the same spread
            assert 0.5 < a.float().std() / b.float().std() < 2, n


@pytest.mark.parametrize("name", ["tiny-gemma4", "tiny-qwen3"])
def test_both_models_read_through_the_packages_geometry_and_layers(on_cpu, name):
    """Gemma-4 and Qwen3 alike: the package's Geometry.from_config reads the config's sizes, and every
    decoder layer's routed experts are `layer.experts` (Qwen3's own `mlp.experts`, the same module)."""
    cls, config, _ = g.models()[name]
    model = g.build(cls, config)
    moe = config.num_experts_per_tok if name == "tiny-qwen3" else config.top_k_experts
    assert Geometry.from_config(model.config) == Geometry(
        hidden=config.hidden_size, experts=config.num_experts, top_k=moe, intermediate=config.moe_intermediate_size
    )
    for layer in model.model.layers:
        assert layer.experts is (layer.mlp.experts if name == "tiny-qwen3" else layer.experts)
        assert layer.experts.gate_up_proj.shape == (
            config.num_experts,
            2 * config.moe_intermediate_size,
            config.hidden_size,
        )


def test_a_second_model_is_skipped_where_it_would_not_fit_the_time_left(on_cpu):
    report = {"models": {"tiny-gemma4": {"seconds": 10.0, "parameters": 1_000_000}}}
    assert g.skip_reason(report, "tiny-qwen3", None) is None
    assert g.skip_reason({"models": {}}, "tiny-qwen3", 0.0) is None  # the first model always runs
    need = 10.0 * sum(p.numel() for p in g.build(*g.models()["tiny-qwen3"][:2]).parameters()) / 1e6
    assert g.skip_reason(report, "tiny-qwen3", need * 1.1) is None
    assert "needed at the first model's rate" in g.skip_reason(report, "tiny-qwen3", need * 0.9)


def test_the_kernel_comparisons_fastest_checked_variant_joins_the_decode(tmp_path):
    """Its fastest checked variant at batch 1 joins the decode, where it beat the default."""
    rows = [
        dict(geometry="g", tokens=1, impl="reader-17.8", check_ok=True, us=60.0),
        dict(geometry="g", tokens=1, impl="reader-17.8 persistent", check_ok=True, us=40.0),
        dict(geometry="g", tokens=1, impl="reader-17.8 relaxed", check_ok=False, us=30.0),  # mismatched: never
        dict(geometry="g", tokens=4, impl="reader-17.8 fused", check_ok=True, us=20.0),  # batch 4: not this
        dict(geometry="other", tokens=1, impl="reader-17.8 fused", check_ok=True, us=10.0),
    ]  # not the variants'
    path = tmp_path / "gpu_reader.json"
    path.write_text(json.dumps({"variant_geometry": "g", "rows": rows}))
    assert g.fastest_variant(path) == "persistent"
    rows[1]["us"] = 70.0  # slower than the default: none
    path.write_text(json.dumps({"variant_geometry": "g", "rows": rows}))
    assert g.fastest_variant(path) is None


def test_the_kernel_variants_by_the_kernel_comparisons_names():
    """The extra ones a device run adds; an unknown name refused."""
    assert g.triton_variant("bisect").keywords == {"select_variant": "bisect"}
    assert g.triton_variant("relaxed").keywords == {"atomics": "relaxed"}
    assert g.triton_variant("fused").keywords == {"fuse": True}
    assert g.triton_variant("persistent w8").func is ps.forward
    assert g.triton_variant("persistent w8").keywords["shape"].warps == 8
    with pytest.raises(UserError, match="unknown reader variant 'radix'"):
        g.triton_variant("radix")


def test_a_dry_run_without_the_interpreter_runs_again_with_it(monkeypatch):
    """Triton picks its interpreter when the kernels are defined (at import): a dry run started without
    TRITON_INTERPRET=1 replaces its process with the same command and the variable set; with it, it goes on."""
    execs = []
    monkeypatch.setattr(os, "execve", lambda *call: execs.append(call))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gpu_env.interpret_on_cpu("bench.gpu_decode", ["--dry-run", "--steps", "2"])
    assert execs == []
    monkeypatch.delenv("TRITON_INTERPRET")
    gpu_env.interpret_on_cpu("bench.gpu_decode", ["--dry-run", "--steps", "2"])
    ((path, argv, environ),) = execs
    assert path == sys.executable and argv == [sys.executable, "-m", "bench.gpu_decode", "--dry-run", "--steps", "2"]
    assert environ["TRITON_INTERPRET"] == "1" and environ["PATH"] == os.environ["PATH"]


def test_a_dry_run_without_json_writes_under_build_never_over_the_recorded_results(monkeypatch, tmp_path):
    """A dry run's numbers are the CPU interpreter's: without --json they go to build/dry-run/ (ignored by
    git), a real run's to bench/results/, and $OUT, where a GPU run sets it, takes both."""
    monkeypatch.delenv("OUT", raising=False)
    for name in ("gpu_decode", "gpu_reader"):
        assert gpu_env.default_json(name, dry_run=True) == ROOT / "build" / "dry-run" / f"{name}.json"
        assert gpu_env.default_json(name, dry_run=False) == ROOT / "bench" / "results" / f"{name}.json"
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_env.default_json("gpu_reader", dry_run=True) == tmp_path / "gpu_reader.json"
    assert gpu_env.default_json("gpu_reader", dry_run=False) == tmp_path / "gpu_reader.json"
