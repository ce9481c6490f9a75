#!/usr/bin/env bash
# End to end on inf2.24xlarge (6 Inferentia2 chips, 12 NeuronCores): Gemma-4 26B-A4B at TP 8,
# compiled in bf16 and with int8 experts, checked, then served, every step in the project's own
# Neuron image (docker/Dockerfile.neuron: the Neuron DLC for inf2 plus this package).
#
# NOT RUN ON NEURON: written against the public Neuron SDK 2.31.1 / NxD APIs; every step was
# only checked on CPU (the --dry-run path and the gloo backend). See README.md next to this file.
#
# Usage, on the instance (Deep Learning AMI Neuron, Ubuntu 24.04, Docker installed):
#   ARTIFACTS=/data/artifacts recipes/inf2-24xlarge/run.sh [step...]
# CHECKPOINT is a Hugging Face Hub repository id (default google/gemma-4-26B-A4B-it; downloaded into
# HF_HOME, $HOME/.cache/huggingface unless set; HF_TOKEN is passed on when set) or a local
# HF-layout directory. Steps (default: all, in order): image plan compile-bf16 compile-int8 validate serve
set -euo pipefail
shopt -s nullglob

# The Neuron SDK (docs/neuron.md, "Which Neuron SDK"): 2.31.1, the last with torch-neuronx and NxD for
# inf2 and the line that keeps their fixes; NEURON_SDK=2.28.0 for the reader's NKI kernels (nki 0.2.x,
# the last NKI with inf2). Compile and serve an artifact on the same SDK: the image is built on it.
NEURON_SDK=${NEURON_SDK:-2.31.1}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
# the default SDK's image is neuron-moe:neuron (as README builds it); another SDK's gets its own tag
if [ "$NEURON_SDK" = 2.31.1 ]; then IMAGE=${IMAGE:-neuron-moe:neuron}; else IMAGE=${IMAGE:-neuron-moe:neuron-sdk$NEURON_SDK}; fi
CHECKPOINT=${CHECKPOINT:-google/gemma-4-26B-A4B-it}
ARTIFACTS=${ARTIFACTS:?set ARTIFACTS to a directory for the compiled artifacts}
HF_CACHE=${HF_HOME:-$HOME/.cache/huggingface}
MODEL=${MODEL:-gemma4-26b-a4b}
TP=${TP:-8}
PORT=${PORT:-8080}
NAME=${NAME:-neuron-moe-serve}  # the serving container
STEPS=${*:-image plan compile-bf16 compile-int8 validate serve}
mkdir -p "$ARTIFACTS" "$HF_CACHE"

# One --device per chip (inf2.24xlarge: /dev/neuron0..5; TP 8 uses 8 of the 12 cores). The image runs as
# this user, with the devices' group, so that what it writes under ARTIFACTS and the cache is this user's.
DEVICES=()
for dev in /dev/neuron*; do DEVICES+=(--device "$dev"); done
RUN_AS=(--user "$(id -u):$(id -g)" -e HOME=/tmp)
if [ ${#DEVICES[@]} -gt 0 ]; then RUN_AS+=(--group-add "$(stat -c %g /dev/neuron0)"); fi
MOUNTS=(-v "$ARTIFACTS":/artifacts -v "$HF_CACHE":/hf -e HF_HOME=/hf)
if [ -n "${HF_TOKEN:-}" ]; then MOUNTS+=(-e HF_TOKEN); fi
if [ -d "$CHECKPOINT" ]; then
  MOUNTS+=(-v "$(cd "$CHECKPOINT" && pwd)":/checkpoint:ro)
  CKPT=/checkpoint
else
  CKPT=$CHECKPOINT
fi

neuron_moe() {  # one neuron-moe command in the image, removed when it ends
  docker run --rm "${DEVICES[@]}" "${RUN_AS[@]}" "${MOUNTS[@]}" -e NEURON_RT_NUM_CORES="$TP" \
    --entrypoint neuron-moe "$IMAGE" "$@"
}

compile() {  # bf16 | int8 (the experts' format, the artifact's name): one already built is kept (OVERWRITE=1 rebuilds it)
  local out=/artifacts/$MODEL-$1-tp$TP quantization=none
  [ "$1" = int8 ] && quantization=int8
  if [ -f "$ARTIFACTS/$MODEL-$1-tp$TP/manifest.json" ] && [ -z "${OVERWRITE:-}" ]; then
    echo "$ARTIFACTS/$MODEL-$1-tp$TP exists: kept (OVERWRITE=1 rebuilds it)"
    return
  fi
  neuron_moe trace-and-compile --model "$MODEL" --checkpoint "$CKPT" --dtype bfloat16 --quantization "$quantization" \
    --tp "$TP" --out "$out" \
    ${OVERWRITE:+--overwrite}
}

serve() {  # the bf16 artifact alone (it carries its tokenizer); then one request
  docker rm -f "$NAME" > /dev/null 2>&1 || true  # a server left by an earlier run
  docker run -d --rm --name "$NAME" "${DEVICES[@]}" "${RUN_AS[@]}" -v "$ARTIFACTS":/artifacts:ro -p "$PORT":8080 \
    "$IMAGE" --model "$MODEL" --backend neuron --artifacts "/artifacts/$MODEL-bf16-tp$TP" > /dev/null
  local log=$ARTIFACTS/$NAME.log
  docker logs -f "$NAME" > "$log" 2>&1 &  # kept after the container is gone (--rm)
  echo "waiting for $NAME to load and warm up (minutes); its log: $log"
  until curl -sf "http://127.0.0.1:$PORT/ping" > /dev/null; do
    if [ -z "$(docker ps -q --filter "name=^$NAME\$")" ]; then
      sleep 1  # the log follower's last lines
      echo "$NAME exited before it was ready:" >&2
      tail -n 20 "$log" >&2
      exit 1
    fi
    sleep 10
  done
  curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}"
  echo
  echo "serving on http://127.0.0.1:$PORT (docker stop $NAME stops it)"
}

for step in $STEPS; do
  echo "== $step"
  case $step in
    image)
      docker build -f "$REPO/docker/Dockerfile.neuron" --build-arg NEURON_SDK="$NEURON_SDK" -t "$IMAGE" "$REPO" ;;
    plan)
      neuron_moe plan --model "$MODEL" --instance inf2.24xlarge --tp "$TP" ;;
    compile-bf16)
      compile bf16 ;;
    compile-int8)
      compile int8 ;;
    validate)  # the artifacts' manifests and tokenizers; SEQ_MATCH of the TP-8 rank modules on CPU (gloo), on
               # the tiny port: the full-size fp32 reference alone would need ~100 GB of host memory and hours
      docker run --rm "${RUN_AS[@]}" -v "$ARTIFACTS":/artifacts:ro --entrypoint python3 "$IMAGE" -c '
import sys
from neuron_moe.neuron.artifact import check_tokenizer, read_manifest
from neuron_moe.port import load_port
for d in sys.argv[1:]:
    manifest = read_manifest(d)
    check_tokenizer(d, manifest, load_port(manifest["port"]))
    print(d, sorted(manifest["files"]))' "/artifacts/$MODEL-bf16-tp$TP" "/artifacts/$MODEL-int8-tp$TP"
      neuron_moe validate --model tiny-gemma4-moe --backend tp ;;
    serve)
      serve ;;
    *)
      echo "unknown step $step (image plan compile-bf16 compile-int8 validate serve)" >&2; exit 2 ;;
  esac
done
