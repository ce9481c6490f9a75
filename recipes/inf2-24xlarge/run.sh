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

ARTIFACTS=${ARTIFACTS:?set ARTIFACTS to a directory for the compiled artifacts}
TP=${TP:-8}
STEPS=${*:-image plan compile-bf16 compile-int8 validate serve}
# NEURON_SDK (2.31.1; 2.28.0 for the reader's NKI kernels: docs/neuron.md, "Which Neuron SDK"), the image,
# CHECKPOINT, the containers' arguments (one --device per chip: /dev/neuron0..5; TP 8 uses 8 of the 12
# cores), build_image and serve
source "$(dirname "$0")/../common.sh"

neuron_moe() {  # one neuron-moe command in the image, removed when it ends
  docker run --rm "${DEVICES[@]}" "${RUN_AS[@]}" "${MOUNTS[@]}" -e NEURON_RT_NUM_CORES="$TP" \
    --entrypoint neuron-moe "$IMAGE" "$@"
}

# neuronx-cc's host memory for the largest key at TP 8, GiB: `plan --tp 8`'s "compile host" line, 142.7 GiB
# with bf16 experts and 85.3 GiB with int8 (an estimate, not a measurement), rounded up; inf2.24xlarge has 384
declare -A COMPILE_HOST_GIB=([bf16]=143 [int8]=86)

compile() {  # bf16 | int8 (the experts' format, the artifact's name): one already built is kept (OVERWRITE=1 rebuilds it)
  local out=/artifacts/$MODEL-$1-tp$TP quantization=none
  [ "$1" = int8 ] && quantization=int8
  if [ -f "$ARTIFACTS/$MODEL-$1-tp$TP/manifest.json" ] && [ -z "${OVERWRITE:-}" ]; then
    echo "$ARTIFACTS/$MODEL-$1-tp$TP exists: kept (OVERWRITE=1 rebuilds it)"
    return
  fi
  check_compile_host "${COMPILE_HOST_GIB[$1]}"
  neuron_moe trace-and-compile --model "$MODEL" --checkpoint "$CKPT" --dtype bfloat16 --quantization "$quantization" \
    --tp "$TP" --out "$out" \
    ${OVERWRITE:+--overwrite}
}

for step in $STEPS; do
  echo "== $step"
  case $step in
    image)
      build_image ;;
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
      serve "$MODEL-bf16-tp$TP" ;;  # the bf16 artifact
    *)
      echo "unknown step $step (image plan compile-bf16 compile-int8 validate serve)" >&2; exit 2 ;;
  esac
done
