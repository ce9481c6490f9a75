#!/bin/sh
# Container entrypoint: `neuron-moe serve` on $HOST:$PORT, with the image's CMD (or the
# arguments given to `docker run IMAGE ...`) as its options. The images set HOST=0.0.0.0 so
# that `-p` reaches the server; run outside an image it stays on loopback. An API key is read
# from $NEURON_MOE_API_KEY by the CLI itself, so that it never shows in the process list.
set -eu
exec python3 -m neuron_moe serve --host "${HOST:-127.0.0.1}" --port "${PORT:-8080}" "$@"
