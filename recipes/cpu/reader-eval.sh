#!/usr/bin/env bash
# bench/results/reader-eval.md's numbers for the committed default model (or a checkpoint):
# the corpus, eval-reader over every selector (the reader also at recovery ranks 16 and 0, which
# fit these budgets on the tiny geometry), the per-layer error analysis, and the copies that
# bench/results/reader-eval/ holds (report.md, report.json, the plots, layers.json), and the page
# bench/results/reader-eval.md written from them.
# Usage: recipes/cpu/reader-eval.sh [CHECKPOINT_DIR]   (default: the port's committed weights)
# ~11 min on 2 idle CPU cores (measured 2026-12-01); resumable (a rerun skips finished cells). Needs the Debian package
# `fortunes` for the corpus (recipes/cpu/train-tiny.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-build/tiny}
PY=${PY:-.venv/bin/python}
RESULTS=bench/results/reader-eval
CKPT=(); [ $# -ge 1 ] && CKPT=(--checkpoint "$1")

[ -f "$WORK/corpus/eval_text.jsonl" ] || $PY -m neuron_moe build-corpus --out "$WORK/corpus"
$PY -m neuron_moe eval-reader "${CKPT[@]}" --corpus "$WORK/corpus" --budgets 12.8,17.8 \
    --selectors teal,wina,cats,oracle,reader,reader-r16,reader-r0 --rules topk,threshold --out "$WORK/reader-eval"
mkdir -p "$RESULTS"
cp "$WORK"/reader-eval/{report.md,report.json,reads_vs_quality.png,retention.png,retention_by_position.png} "$RESULTS/"
$PY -m bench.reader_layers "${CKPT[@]}" --corpus "$WORK/corpus" --budget 17.8 --json "$RESULTS/layers.json"
$PY -m neuron_moe.eval.reader_report "$RESULTS"   # bench/results/reader-eval.md, from the files above
