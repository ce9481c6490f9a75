"""`bench/gpu_reader.py --dry-run`: the GPU benchmark end to end on the CPU (tiny shapes, Triton's
interpreter), so that its one device call is never its first run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_moe.reader.triton.forward import SELECT_VARIANTS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_reader_bench_dry_run(tmp_path):
    out = tmp_path / "gpu_reader.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_reader.py"), "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["dry_run"] and report["machine"]["device"].startswith("cpu")
    selects = [v for v in SELECT_VARIANTS if v != "bisect"]  # the select kernel's, beside its default
    variants = selects + ["fused"]  # and forward(fuse=True)
    assert report["preflight"] == {v: True for v in variants}  # each agrees with the default
    impls = {"hf-batched_mm", "hf-grouped_mm", "triton-dense", "reader-17.8", "reader-12.8"}
    impls |= {f"reader-17.8 {v}" for v in variants}
    for geometry in ("tiny-gemma-like", "tiny-qwen-like"):
        for tokens in (1, 2):
            rows = [r for r in report["rows"] if r["geometry"] == geometry and r["tokens"] == tokens]
            assert {r["impl"] for r in rows} == impls
            for r in rows:  # every implementation checked against its fp32 reference, with time and bytes
                assert r["check_ok"] and r["check_rel_err"] <= 2e-2 and r["us"] > 0 and r["bytes"] > 0, r
            reads = {r["impl"]: r["read_percent"] for r in rows}
            assert 12 < reads["reader-12.8"] <= 12.8 < reads["reader-17.8"] <= 17.8 < reads["triton-dense"] == 100
            stages = [r["stage"] for r in report["reader_stages"] if r["geometry"] == geometry and r["tokens"] == tokens]
            assert len(stages) == 14 + len(selects) and "screen" in stages and "down (+U)" in stages  # each ran once
            assert {f"select, {v}" for v in selects} | {"rotate+scan, zeroing", "exact+recover, one launch"} <= set(stages)
            side = [r for r in report["variants"] if r["geometry"] == geometry and r["tokens"] == tokens]
            assert [r["variant"] for r in side] == ["bisect", *variants] and all(r["check_ok"] for r in side)
    last = done.stdout.strip().splitlines()
    assert last[-1].split()[:3] == ["tiny-qwen-like", "2", "reader-12.8"]  # the table is printed last
