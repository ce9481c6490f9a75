"""bench/gpu_session.sh, the one prepared GPU run, run here with stand-ins for its two benchmarks
(each has a dry-run test of its own): it runs both in order with the arguments the device run needs,
keeps each part's output under $OUT, records each part's exit status and time in session.json, and
exits non-zero when a part fails or times out."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# python3 for the script: the version check answers as a CPU would (importing torch three times is slow),
# the summary snippet runs for real; the two benchmarks are stand-ins that record their arguments, write
# what the real ones would, and exit as told, once the module named is found where the script runs
# (PYTHONPATH the checkout, nothing installed but the venv's own packages: bench is never installed)
SHIM = """#!/bin/bash
if [ "$1" = "-" ] && [ "$2" = "--dry-run" ]; then cat > /dev/null; echo "cpu (dry run), torch (stand-in)"; exit 0; fi
if [ "$1" = "-" ]; then exec {python} "$@"; fi
echo "$*" >> {calls}
[ "$1" = "-m" ] && {python} -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)' \\
    "$2" || exit 98
case "$2" in
  bench.gpu_reader) sleep "${{READER_SLEEP:-0}}"; echo '{{"rows": []}}' > "$OUT/gpu_reader.json"; echo reader-table;;
  bench.gpu_decode) echo decode-table; exit "${{DECODE_EXIT:-0}}";;
  *) exit 99;;
esac
"""


def session(tmp_path, out="out", **env):
    """Run the script with $OUT an empty folder `out` (as a GPU run starts with it)."""
    bin_dir, out = tmp_path / "bin", tmp_path / out
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    shim = bin_dir / "python3"
    shim.write_text(SHIM.format(python=sys.executable, calls=calls))
    shim.chmod(0o755)
    run_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "GPU_SESSION_DRY": "1", **env}
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_session.sh")], capture_output=True, text=True, env=run_env, timeout=120
    )
    return done, out, calls.read_text().splitlines() if calls.exists() else []


def test_both_parts_run_with_their_arguments_and_outputs(tmp_path):
    done, out, calls = session(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls[0] == f"-m bench.gpu_reader --dry-run --json {out}/gpu_reader.json"
    decode = calls[1].split()
    assert decode[:6] == ["-m", "bench.gpu_decode", "--dry-run", "--models", "tiny-gemma4", "tiny-qwen3"]
    assert decode[decode.index("--fastest-from") + 1] == f"{out}/gpu_reader.json"  # part 1's result feeds part 2
    assert 0 < int(decode[decode.index("--time-budget") + 1]) < 340
    assert (out / "gpu_reader.log").read_text().strip() == "reader-table"
    assert (out / "gpu_decode.log").read_text().strip() == "decode-table"
    summary = json.loads((out / "session.json").read_text())
    assert {name: part["exit"] for name, part in summary["parts"].items()} == {"gpu_reader": 0, "gpu_decode": 0}
    assert "torch" in (out / "session.log").read_text()  # the versions it ran with


def test_a_failed_or_timed_out_part_fails_the_session(tmp_path):
    done, out, _ = session(tmp_path, DECODE_EXIT="1")
    assert done.returncode == 1 and json.loads((out / "session.json").read_text())["parts"]["gpu_decode"]["exit"] == 1
    done, out, calls = session(tmp_path, "out2", READER_S="1", READER_SLEEP="5")
    parts = json.loads((out / "session.json").read_text())["parts"]
    assert done.returncode == 1 and parts["gpu_reader"]["exit"] == 124  # timed out
    assert "--fastest-from" not in calls[1]  # no result from part 1: the decode runs without it
