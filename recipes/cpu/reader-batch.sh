#!/usr/bin/env bash
# bench/results/reader-batch.md's numbers: the batch rule against independent per-token top-k on
# teacher-forced decode batches of B = 1, 4, 8, 16 tokens of the committed default model (CPU, one
# thread), task accuracy in batched generation at B = 1 and 8, and the accounting on the Gemma-4 and
# Qwen3-30B-A3B geometries. Resumable (cells under $WORK/reader-batch). Needs the corpus
# (neuron-moe build-corpus; the Debian package `fortunes`).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-build/tiny}
PY=${PY:-.venv/bin/python}

[ -f "$WORK/corpus/eval_text.jsonl" ] || $PY -m neuron_moe build-corpus --out "$WORK/corpus"
$PY -m bench.reader_batch --corpus "$WORK/corpus" --per-task 20 --text-docs 30 --batches 1,4,8,16 \
    --step-budgets 2,3,4,16:6 --raw 8 --scans 40 --accuracy 1,8 --work "${BATCH_WORK:-build/reader-batch}" \
    --out bench/results/reader-batch
