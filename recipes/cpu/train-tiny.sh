#!/usr/bin/env bash
# Rebuild the embedded default model (port tiny-gemma4-moe) from scratch on CPU:
# the Debian text package, the corpus, the tokenizer + training run, and the task evaluation.
# Usage: recipes/cpu/train-tiny.sh [OUT_DIR]   (default: ports/tiny-gemma4-moe, the committed copy)
# Needs root (or sudo) for apt-get; 6000 steps on 2 torch threads: 50-57 min measured on the 2 cores (nothing else heavy
# running; 2 threads on shared cores run several times slower) (`make test` never runs this). See bench/results/tiny-model.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-ports/tiny-gemma4-moe}
WORK=${WORK:-build/tiny}
NEURON_MOE=${NEURON_MOE:-.venv/bin/neuron-moe}
FORTUNES_PIN=$(.venv/bin/python -c 'from neuron_moe.training.corpus import FORTUNES_PACKAGE; print(FORTUNES_PACKAGE)')

SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
if ! dpkg-query -W -f='${Version}' fortunes 2>/dev/null | grep -qx "${FORTUNES_PIN#fortunes=}"; then
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "$FORTUNES_PIN"
fi

mkdir -p "$WORK"
$NEURON_MOE build-corpus --out "$WORK/corpus" --json "$WORK/corpus.json"
$NEURON_MOE train-tiny --corpus "$WORK/corpus" --out "$OUT" --seed 1 --steps 6000 --threads 2 --json "$WORK/train.json"
$NEURON_MOE eval-tasks --checkpoint "$OUT" --corpus "$WORK/corpus" --split valid --json "$WORK/valid-tasks.json"
$NEURON_MOE eval-tasks --checkpoint "$OUT" --corpus "$WORK/corpus" --json "$WORK/eval-tasks.json"
