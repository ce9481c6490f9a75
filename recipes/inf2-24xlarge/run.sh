#!/usr/bin/env bash
# End to end on inf2.24xlarge (6 Inferentia2 chips, 12 NeuronCores): Gemma-4 26B-A4B at TP 8,
# compiled in bf16 and with int8 experts, checked, then served.
#
# NOT RUN ON NEURON: written against the public Neuron SDK 2.31.1 / NxD APIs; every step was
# only checked on CPU (the --dry-run path and the gloo backend). See README.md next to this file.
#
# Usage, on the instance (Deep Learning AMI Neuron, Ubuntu 24.04, Docker installed):
#   CHECKPOINT=/data/gemma-4-26b-a4b ARTIFACTS=/data/artifacts recipes/inf2-24xlarge/run.sh [step...]
# Steps (default: all, in order): image venv compile-bf16 compile-int8 validate serve
set -euo pipefail

# The Neuron SDK (docs/neuron.md, "Which Neuron SDK"): 2.31.1, the last with torch-neuronx and NxD for
# inf2 and the line that keeps their fixes; NEURON_SDK=2.28.0 for the reader's NKI kernels (nki 0.2.x,
# the last NKI with inf2). Compile and serve an artifact on the same SDK.
NEURON_SDK=${NEURON_SDK:-2.31.1}
IMAGE=public.ecr.aws/neuron/pytorch-inference-neuronx:2.9.0-neuronx-py312-sdk${NEURON_SDK}-ubuntu24.04
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CHECKPOINT=${CHECKPOINT:?set CHECKPOINT to the Gemma-4 26B-A4B checkpoint directory (HF layout)}
ARTIFACTS=${ARTIFACTS:?set ARTIFACTS to a directory for the compiled artifacts}
MODEL=${MODEL:-gemma4-26b-a4b}
TP=${TP:-8}
PORT=${PORT:-8080}
STEPS=${*:-image venv compile-bf16 compile-int8 validate serve}

# One chip per --device: inf2.24xlarge has /dev/neuron0..5 (TP 8 uses 8 of the 12 cores).
DEVICES=()
for dev in /dev/neuron*; do DEVICES+=(--device "$dev"); done

in_dlc() {  # run a command in the Neuron DLC with the repo, checkpoint and artifacts mounted
  docker run --rm "${DEVICES[@]}" --network host \
    -v "$REPO":/repo -v "$CHECKPOINT":/checkpoint:ro -v "$ARTIFACTS":/artifacts \
    -e NEURON_RT_NUM_CORES="$TP" -w /repo "$IMAGE" bash -c "$1"
}

VENV='. /repo/.venv-neuron/bin/activate'

for step in $STEPS; do
  echo "== $step"
  case $step in
    image)
      docker pull "$IMAGE" ;;
    venv)  # a venv over the DLC's torch / torch-neuronx / NxD, adding only this package
      in_dlc "python3 -m venv --system-site-packages /repo/.venv-neuron && $VENV && pip install -e '/repo[serve]' \
              && neuron-moe plan --model $MODEL --instance inf2.24xlarge --tp $TP --dtype bf16" ;;
    compile-bf16)
      in_dlc "$VENV && neuron-moe trace-and-compile --model $MODEL --checkpoint /checkpoint --dtype bf16 \
              --tp $TP --out /artifacts/$MODEL-bf16-tp$TP" ;;
    compile-int8)
      in_dlc "$VENV && neuron-moe trace-and-compile --model $MODEL --checkpoint /checkpoint --dtype int8 \
              --tp $TP --out /artifacts/$MODEL-int8-tp$TP" ;;
    validate)  # the artifacts' manifests; SEQ_MATCH of the TP-8 rank modules on CPU (gloo), on the tiny port:
               # the full-size fp32 reference alone would need ~100 GB of host memory and hours
      in_dlc "$VENV && python3 -c 'import sys; from neuron_moe.neuron.artifact import read_manifest; \
              [print(d, read_manifest(d)[\"files\"].keys()) for d in sys.argv[1:]]' \
              /artifacts/$MODEL-bf16-tp$TP /artifacts/$MODEL-int8-tp$TP \
              && neuron-moe validate --model tiny-gemma4-moe --backend tp8" ;;
    serve)  # OpenAI-compatible server on the bf16 artifact; then one request
      docker run -d --name neuron-moe "${DEVICES[@]}" -p "$PORT":8080 \
        -v "$REPO":/repo -v "$CHECKPOINT":/checkpoint:ro -v "$ARTIFACTS":/artifacts "$IMAGE" \
        bash -c "$VENV && neuron-moe serve --model $MODEL --checkpoint /checkpoint --backend neuron \
                 --artifacts /artifacts/$MODEL-bf16-tp$TP --host 0.0.0.0 --port 8080"
      until curl -sf "http://127.0.0.1:$PORT/ping" > /dev/null; do sleep 10; done  # loading takes minutes
      curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}"
      echo ;;
    *)
      echo "unknown step $step (image venv compile-bf16 compile-int8 validate serve)" >&2; exit 2 ;;
  esac
done
