"""`python -m bench.gpu_reader --dry-run`: the GPU benchmark end to end on the CPU (tiny shapes, Triton's
interpreter), so that its one GPU run is never its first run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRY_VARIANTS = ["radix5+1scan", "fused", "relaxed", "persistent"]  # the script's: one of each kind


def md_rows(md: str) -> list[list[str]]:
    """The cells of every markdown table row (header and rule rows included)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in md.splitlines() if line.startswith("|")]


@pytest.mark.slow
def test_gpu_reader_bench_dry_run(tmp_path):
    out = tmp_path / "gpu_reader.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_reader", "--dry-run", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    machine = report["machine"]
    assert (
        machine["dry_run"]
        and machine["device"].startswith("cpu")
        and {"driver", "transformers", "triton"} <= set(machine)
    )
    assert report["preflight"] == {v: True for v in ["bisect", *DRY_VARIANTS]}  # each agrees: default or reference
    base = {"hf-batched_mm", "hf-grouped_mm", "triton-dense", "reader-17.8", "reader-12.8"}
    for geometry, variants in (("tiny-gemma-like", DRY_VARIANTS), ("tiny-qwen-like", [])):  # variants: the first only
        for tokens in (1, 2):
            rows = [r for r in report["rows"] if r["geometry"] == geometry and r["tokens"] == tokens]
            assert {r["impl"] for r in rows} == base | {f"reader-17.8 {v}" for v in variants}
            for r in rows:  # every implementation checked against its fp32 reference, with time and bytes
                assert r["check_ok"] and r["check_rel_err"] <= 2e-2 and r["us"] > 0 and r["bytes"] > 0, r
            reads = {r["impl"]: r["read_percent"] for r in rows}
            assert 12 < reads["reader-12.8"] <= 12.8 < reads["reader-17.8"] <= 17.8 < reads["triton-dense"] == 100
            stages = {
                r["stage"]: r for r in report["reader_stages"] if r["geometry"] == geometry and r["tokens"] == tokens
            }
            extra = {"select, radix5+1scan", "select, across programs", "screen, relaxed", "down (+U), relaxed"}
            if tokens == 1:  # a dry run runs each stage once, at its first batch
                assert len(stages) == 14 + (len(extra) if variants else 0) and {"screen", "down (+U)"} <= set(stages)
                assert (extra <= set(stages)) == bool(variants)
            else:
                assert not stages
            if variants and tokens == 1:  # the selections across programs and by radix pick what the default does
                assert stages["select, across programs"]["same_picks"] and stages["select, radix5+1scan"]["same_picks"]
            side = [r for r in report["variants"] if r["geometry"] == geometry and r["tokens"] == tokens]
            assert [r["variant"] for r in side] == ["bisect", *variants] and all(r["check_ok"] for r in side)
    assert [t["tokens"] for t in report["targets"]] == [1, 4] and report["targets"][0]["best_reader"]
    assert report["command"] == f"python -m bench.gpu_reader --dry-run --json {out}"
    # the markdown's tables: every row of the JSON's, by its first cells (the main table's (geometry, T, impl))
    md = {tuple(cells[:3]) for cells in md_rows(out.with_suffix(".md").read_text())}
    assert {(r["geometry"], str(r["tokens"]), r["impl"]) for r in report["rows"]} <= md
    assert {(t["geometry"], str(t["tokens"]), t["best_reader"] or "-") for t in report["targets"]} <= md
    last = done.stdout.strip().splitlines()
    assert last[-1].split()[:3] == ["tiny-qwen-like", "2", "reader-12.8"]  # the main table is printed last
