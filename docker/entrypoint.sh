#!/bin/sh
# Container entrypoint: `neuron-moe serve` on $HOST:$PORT, with the image's CMD (or the
# arguments given to `docker run IMAGE ...`) as its options. The images set HOST=0.0.0.0 so
# that `-p` reaches the server; run outside an image it stays on loopback. An API key is read
# from $NEURON_MOE_API_KEY by the CLI itself, so that it never shows in the process list.
# SageMaker runs the image as `docker run IMAGE serve`: that first word selects its contract
# (neuron_moe/deploy/sagemaker.py: the artifact in /opt/ml/model, port 8080, /ping and /invocations).
set -eu
if [ "${1:-}" = serve ]; then
  shift
  exec python3 -m neuron_moe.deploy.sagemaker "$@"
fi
exec python3 -m neuron_moe serve --host "${HOST:-127.0.0.1}" --port "${PORT:-8080}" "$@"
