#!/usr/bin/env bash
# Gemma-4 26B-A4B on one Inferentia2 chip (inf2.xlarge, or inf2.8xlarge with INSTANCE=inf2.8xlarge):
# TP 2 with every linear in llama.cpp's Q4_0 (experts, attention, dense MLP, lm_head; the embeddings
# stay bf16), from Google's QAT checkpoint for Q4_0. Compiled on a host with the memory for it (no
# Neuron device needed), published to S3, pulled and served on the one-chip box; every step in the
# project's own Neuron image (docker/Dockerfile.neuron: the Neuron DLC for inf2 plus this package).
#
# NOT RUN ON NEURON: written against the public Neuron SDK 2.31.1 / NxD APIs; only its flow was checked,
# against stand-ins for docker and curl (tests/test_recipe.py). See README.md next to this file.
#
# On the compile host (x86, Docker, host memory: README.md), then on the one-chip box:
#   S3=s3://BUCKET/PREFIX ARTIFACTS=/data/artifacts recipes/inf2-xlarge/run.sh compile-host
#   S3=s3://BUCKET/PREFIX ARTIFACTS=/data/artifacts recipes/inf2-xlarge/run.sh serve-host
# compile-host = image plan compile publish; serve-host = image plan pull serve; or any steps by name.
# CHECKPOINT is a Hugging Face Hub repository id (default google/gemma-4-26B-A4B-it-qat-q4_0-unquantized:
# bf16 weights trained onto Q4_0's grid; downloaded into HF_HOME, $HOME/.cache/huggingface unless set;
# HF_TOKEN is passed on when set) or a local HF-layout directory. S3 credentials: the AWS_* variables
# when set, else the host's (an instance role).
set -euo pipefail
shopt -s nullglob

ARTIFACTS=${ARTIFACTS:?set ARTIFACTS to a directory for the compiled artifact}
INSTANCE=${INSTANCE:-inf2.xlarge}  # the box that serves: one chip, 2 NeuronCores
TP=2
# this recipe's checkpoint: the QAT one, whose weights q4_0 holds as trained (README.md); common.sh's
# default is the other recipes'
CHECKPOINT=${CHECKPOINT:-google/gemma-4-26B-A4B-it-qat-q4_0-unquantized}
# the weight format and the linears in it, flags of trace-and-compile and plan
FORMAT=(--quantization q4_0 --quantized-layers experts,attention,mlp,lm_head)
# neuronx-cc's host memory for the largest key, GiB: `plan --tp 2` in that format, its "compile host"
# line, 196.4 GiB for context_encoding_1x2048 (an estimate, not a measurement: README.md), rounded up
COMPILE_HOST_GIB=197
if [ $# -eq 0 ]; then
  echo "usage: run.sh compile-host | serve-host | step... (image plan compile publish pull serve)" >&2
  exit 2
fi
STEPS=$*
STEPS=${STEPS//compile-host/image plan compile publish}
STEPS=${STEPS//serve-host/image plan pull serve}
# NEURON_SDK (docs/neuron.md, "Which Neuron SDK": compile and serve on the same one), the image, the
# checkpoint's mount, the containers' arguments, build_image and serve
source "$(dirname "$0")/../common.sh"
BUILD=$MODEL-q4_0-all-tp$TP  # q4_0 on all linears

# S3: the AWS_* variables that are set, and the host network (an instance role's credentials come
# from the instance metadata service, which a container on the default bridge may not reach)
AWS=(--network host)
for var in AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN AWS_REGION AWS_DEFAULT_REGION AWS_ENDPOINT_URL_S3; do
  if [ -n "${!var:-}" ]; then AWS+=(-e "$var"); fi
done

neuron_moe() {  # one neuron-moe command in the image, removed when it ends
  docker run --rm "${DEVICES[@]}" "${RUN_AS[@]}" "$@"
}

need_s3() {
  case ${S3:-} in
    s3://?*) ;;
    *) echo "set S3 to the publication's s3://BUCKET/PREFIX" >&2; exit 2 ;;
  esac
}

compile() {  # an artifact already built is kept (remove it, or OVERWRITE=1, to rebuild)
  if [ -f "$ARTIFACTS/$BUILD/manifest.json" ] && [ -z "${OVERWRITE:-}" ]; then
    echo "$ARTIFACTS/$BUILD exists: kept (OVERWRITE=1 rebuilds it)"
    return
  fi
  check_compile_host "$COMPILE_HOST_GIB"
  neuron_moe "${MOUNTS[@]}" --entrypoint neuron-moe "$IMAGE" trace-and-compile --model "$MODEL" --checkpoint "$CKPT" \
    "${FORMAT[@]}" --tp "$TP" --out "/artifacts/$BUILD" ${OVERWRITE:+--overwrite}
}

for step in $STEPS; do
  echo "== $step"
  case $step in
    image)
      build_image ;;
    plan)  # HBM per core and host memory on the serving box: exits 1 (and stops here) unless it fits
      neuron_moe --entrypoint neuron-moe "$IMAGE" plan --model "$MODEL" --instance "$INSTANCE" --tp "$TP" "${FORMAT[@]}" ;;
    compile)
      compile ;;
    publish)  # integrity-checked upload, manifest last
      need_s3
      neuron_moe "${AWS[@]}" -v "$ARTIFACTS":/artifacts:ro --entrypoint neuron-moe "$IMAGE" publish "/artifacts/$BUILD" "$S3" ;;
    pull)  # each file verified before it lands; files already there with the manifest's sha256 are kept
      need_s3
      neuron_moe "${AWS[@]}" -v "$ARTIFACTS":/artifacts --entrypoint neuron-moe "$IMAGE" pull "$S3" "/artifacts/$BUILD" ;;
    serve)
      serve "$BUILD" ;;
    *)
      echo "unknown step $step (image plan compile publish pull serve; compile-host, serve-host)" >&2; exit 2 ;;
  esac
done
