#!/usr/bin/env bash
# One run on an NVIDIA H200 for the reader's GPU targets, at most SESSION_S seconds (default 340 s; the kernel
# comparison at most READER_S, default 200 s, the decode what is left):
#   1. bench.gpu_reader: the reader's MoE block against the dense baselines, every kernel variant
#      preflighted against the reference at the real shapes, then timed side by side;
#   2. bench.gpu_decode: whole-model decode tokens/s, full experts vs the reader, batch 1/4/8 —
#      Gemma-4 26B-A4B, then Qwen3-30B-A3B if the time left allows — with the fastest checked kernel
#      variant of part 1 beside the default.
# Everything goes to $OUT (JSON + markdown per part, logs, session.json with each part's exit status and
# seconds). Exit status: 0 only if every part ran and every check passed.
#
# Run from the repository root: OUT=DIR bash bench/gpu_session.sh
# Expects the GPU machine's python3 with torch (CUDA) and triton, and transformers 5.24.0 (the project's
# pin; the image has another), carried as a wheel in .whl/ — docs/reader.md, "On a GPU", says how. It
# installs nothing else and reaches no network. GPU_SESSION_DRY=1: both parts with --dry-run, no CUDA
# needed (the CPU, tiny shapes; tests/test_gpu_session.py runs the script that way with stand-ins).
set -u -o pipefail

: "${OUT:?OUT must name the folder whose files come back}"
cd "$(dirname "$0")/.."
SESSION_S=${SESSION_S:-340}
DRY=()
[ "${GPU_SESSION_DRY:-0}" = 1 ] && DRY=(--dry-run)
START=$SECONDS
mkdir -p "$OUT"
log() { echo "[gpu_session $((SECONDS - START)) s] $*" | tee -a "$OUT/session.log"; }
fail() { log "FAILED: $*"; exit 2; }

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || fail "installing the carried wheels (.whl/)"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

python3 - "${DRY[@]}" <<'EOF' 2>&1 | tee -a "$OUT/session.log" || fail "the device's Python does not have what the benchmarks need"
import sys, torch, triton, transformers
assert torch.cuda.is_available() or "--dry-run" in sys.argv, "torch sees no CUDA device"
assert transformers.__version__ == "5.24.0", (f"transformers {transformers.__version__}: the project pins 5.24.0; "
                                              "carry its wheel in .whl/ (docs/reader.md)")
print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu (dry run)'}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, transformers {transformers.__version__}")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >> "$OUT/session.log" 2>&1 || true

declare -A RC SEC
part() {  # part NAME TIMEOUT_S COMMAND...: run it under a timeout, its output to $OUT/NAME.log
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    log "$name: $* (timeout ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    RC[$name]=$?
    SEC[$name]=$((SECONDS - t0))
    log "$name: exit ${RC[$name]} after ${SEC[$name]} s$([ "${RC[$name]}" = 124 ] && echo ' (timed out)')"
}

part gpu_reader "${READER_S:-200}" python3 -m bench.gpu_reader "${DRY[@]}" --json "$OUT/gpu_reader.json"
left=$((SESSION_S - (SECONDS - START) - 15))
[ "$left" -gt 60 ] || fail "no time left for the decode benchmark ($left s)"
MODELS=(gemma4-26b-a4b qwen3-30b-a3b)
[ ${#DRY[@]} = 1 ] && MODELS=(tiny-gemma4 tiny-qwen3)
FASTEST=()
[ -f "$OUT/gpu_reader.json" ] && FASTEST=(--fastest-from "$OUT/gpu_reader.json")
part gpu_decode "$left" python3 -m bench.gpu_decode "${DRY[@]}" --models "${MODELS[@]}" --prep-seconds 30 \
    --time-budget $((left - 20)) "${FASTEST[@]}" --json "$OUT/gpu_decode.json"

python3 - "$OUT/session.json" "$((SECONDS - START))" "gpu_reader=${RC[gpu_reader]}:${SEC[gpu_reader]}" \
    "gpu_decode=${RC[gpu_decode]}:${SEC[gpu_decode]}" <<'EOF'
import json, sys
dest, total, *parts = sys.argv[1:]
parts = {name: dict(zip(("exit", "seconds"), map(int, value.split(":")))) for name, value in
         (p.split("=") for p in parts)}
json.dump({"seconds": int(total), "parts": parts}, open(dest, "w"), indent=2)
EOF
tail -n 40 "$OUT/gpu_reader.log" "$OUT/gpu_decode.log"
log "done in $((SECONDS - START)) s"
[ "${RC[gpu_reader]}" = 0 ] && [ "${RC[gpu_decode]}" = 0 ] || { log "FAILED: a part exited non-zero (above)"; exit 1; }
