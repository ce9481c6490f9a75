"""`bench/gpu_decode.py --dry-run`: the whole-model decode benchmark end to end on the CPU (the tiny
port's geometry and a tiny Qwen3, eager steps, Triton's interpreter), so that its device call is never
its first run; and the two pieces a dry run cannot show: that the model built on the meta device and
materialised is HF's own initialisation, when a second model is skipped for time, and which kernel
variant of bench/gpu_reader.py's result joins the decode (and how the variants' names map to kernels)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_decode.py"


def env():
    out = {**os.environ, "PYTHONPATH": str(ROOT)}
    out.pop("OUT", None)
    return out


@pytest.mark.slow
def test_gpu_decode_bench_dry_run(tmp_path):
    out = tmp_path / "gpu_decode.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--json", str(out)], capture_output=True,
                          text=True, env=env(), timeout=600)
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
        k = {r["experts"]: r["k"] for r in rows}
        assert k["reader-12.8"] < k["reader-17.8"]
    md = out.with_suffix(".md").read_text()
    assert "a dry run on the CPU" in md and "| tiny-qwen3 | 1 | reader-17.8 |" in md and "1.15–1.36×" in md
    assert done.stdout.strip().splitlines()[-1].split()[:3] == ["tiny-qwen3", "2", "reader-12.8"]


PIECES = r"""
import sys, torch
sys.argv = ["gpu_decode.py", "--dry-run"]
sys.path.insert(0, sys.argv_path)
import gpu_decode as g

# built on the meta device, materialised, initialised by HF there: the same as a model built directly
for name in ("tiny-gemma4", "tiny-qwen3"):
    cls, config, _ = g.models()[name]
    built, direct = g.build(cls, config), cls(config).to(g.BF16)
    for (n, a), (m, b) in zip(built.named_buffers(), direct.named_buffers()):
        assert n == m and torch.equal(a, b), n  # rotary tables, embedding scale
    for (n, a), (m, b) in zip(built.named_parameters(), direct.named_parameters()):
        assert n == m and a.isfinite().all(), n
        if (b == b.flatten()[0]).all():  # a constant init (norms, scales): the same constant
            assert torch.equal(a, b), n
        else:  # a random one: of the same spread
            assert 0.5 < a.float().std() / b.float().std() < 2, n
    print("same", name)

# a second model is skipped where the first one's time, scaled by parameters, would not fit
report = {"models": {"tiny-gemma4": {"seconds": 10.0, "parameters": 1_000_000}}}
assert g.skip_reason(report, "tiny-qwen3", None) is None
assert g.skip_reason({"models": {}}, "tiny-qwen3", 0.0) is None  # the first model always runs
need = 10.0 * sum(p.numel() for p in g.build(*g.models()["tiny-qwen3"][:2]).parameters()) / 1e6
assert g.skip_reason(report, "tiny-qwen3", need * 1.1) is None
assert "needed at the first model's rate" in g.skip_reason(report, "tiny-qwen3", need * 0.9)
print("skips")

# the kernel comparison's fastest checked variant at batch 1 joins the decode, where it beat the default
import json, tempfile
rows = [dict(geometry="g", tokens=1, impl="reader-17.8", check_ok=True, us=60.0),
        dict(geometry="g", tokens=1, impl="reader-17.8 persistent", check_ok=True, us=40.0),
        dict(geometry="g", tokens=1, impl="reader-17.8 relaxed", check_ok=False, us=30.0),  # mismatched: never
        dict(geometry="g", tokens=4, impl="reader-17.8 fused", check_ok=True, us=20.0),  # batch 4: not this
        dict(geometry="other", tokens=1, impl="reader-17.8 fused", check_ok=True, us=10.0)]  # not the variants'
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump({"variant_geometry": "g", "rows": rows}, f)
assert g.fastest_variant(f.name) == "persistent"
rows[1]["us"] = 70.0  # slower than the default: none
with open(f.name, "w") as f2:
    json.dump({"variant_geometry": "g", "rows": rows}, f2)
assert g.fastest_variant(f.name) is None
print("fastest")

# the kernel variants by bench/gpu_reader.py's names (the extra ones a device run adds); an unknown name refused
from neuron_moe.errors import UserError
from neuron_moe.reader.triton import persistent as ps
assert g.triton_variant("bisect").keywords == {"select_variant": "bisect"}
assert g.triton_variant("relaxed").keywords == {"atomics": "relaxed"} and g.triton_variant("fused").keywords == {"fuse": True}
assert g.triton_variant("persistent w8").func is ps.forward and g.triton_variant("persistent w8").keywords["shape"].warps == 8
try:
    g.triton_variant("radix")
except UserError as e:
    assert "unknown reader variant 'radix'" in str(e)
else:
    raise AssertionError("an unknown variant was accepted")
print("variants")
"""


def test_materialised_models_and_the_time_budget():
    code = PIECES.replace("sys.argv_path", repr(str(ROOT / "bench")))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split() == ["same", "tiny-gemma4", "same", "tiny-qwen3", "skips", "fastest", "variants"]
