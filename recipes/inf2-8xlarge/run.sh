#!/usr/bin/env bash
# Gemma-4 26B-A4B on inf2.8xlarge: the one-chip recipe (recipes/inf2-xlarge/) for this instance.
# NOT RUN ON NEURON. See recipes/inf2-xlarge/README.md.
INSTANCE=inf2.8xlarge exec "$(dirname "$0")/../inf2-xlarge/run.sh" "$@"
