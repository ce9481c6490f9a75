#!/bin/sh
# Container entrypoint: `neuron-moe serve` on $HOST:$PORT, with the image's CMD (or the
# arguments given to `docker run IMAGE ...`) as its options. The images set HOST=0.0.0.0 so
# that `-p` reaches the server; run outside an image it stays on loopback. An API key is read
# from $NEURON_MOE_API_KEY by the CLI itself, so that it never shows in the process list.
# SageMaker runs the image as `docker run IMAGE serve`: that first word selects its contract
# (neuron_moe/deploy/sagemaker.py: the artifact in /opt/ml/model, port 8080, /ping and /invocations;
# serve checks that artifact against its manifest before it needs the SDK).
# A compiled artifact directory (--backend neuron --artifacts DIR) is first checked whole by
# `neuron-moe verify` (every file against its manifest; with --model, built for that port): a
# broken one stops the container with that one error line before serve starts. An s3:// one is
# checked by serve itself once pulled (the same checks, without reading it from S3 twice).
set -eu
if [ "${1:-}" = serve ]; then
  shift
  exec python3 -m neuron_moe.deploy.sagemaker "$@"
fi
artifacts='' backend='' model='' previous=''
for arg in "$@"; do
  case "$previous" in
    --artifacts) artifacts=$arg ;;
    --backend) backend=$arg ;;
    --model) model=$arg ;;
  esac
  case "$arg" in
    --artifacts=*) artifacts=${arg#*=} ;;
    --backend=*) backend=${arg#*=} ;;
    --model=*) model=${arg#*=} ;;
  esac
  previous=$arg
done
if [ "$backend" = neuron ] && [ -n "$artifacts" ] && [ "${artifacts#s3://}" = "$artifacts" ]; then
  if [ -n "$model" ]; then
    python3 -m neuron_moe verify "$artifacts" --model "$model"
  else
    python3 -m neuron_moe verify "$artifacts"
  fi
fi
exec python3 -m neuron_moe serve --host "${HOST:-127.0.0.1}" --port "${PORT:-8080}" "$@"
