#!/usr/bin/env bash
# bench/results/reader-int8.md's numbers: the reader over the int8 experts on the committed default
# model, at equal bytes with the bf16 reader and the int8 experts read whole (the budgets are shares
# of the bf16 full read; 52.1 % is the int8 experts' whole read on this geometry), the sketch made
# from the bf16 weights (-int8) or the dequantised int8 (-int8dq), 10 items per task (the machine was
# shared four ways: ~30 min a cell at 20); and the reads breakdown at 17.8 %
# on the Gemma-4 and Qwen3-30B-A3B geometries. Resumable (a rerun skips finished cells). Needs the
# corpus (neuron-moe build-corpus; the Debian package `fortunes`).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-build/tiny}
PY=${PY:-.venv/bin/python}
RESULTS=bench/results/reader-int8
mkdir -p "$RESULTS"

[ -f "$WORK/corpus/eval_text.jsonl" ] || $PY -m neuron_moe build-corpus --out "$WORK/corpus"
$PY -m neuron_moe eval-reader --corpus "$WORK/corpus" --items 10 --budgets 17.8,52.1 --rules topk \
    --selectors reader-r0,reader-r0-int8,reader-r0-int8dq --out "$WORK/reader-int8"
$PY -m neuron_moe eval-reader --corpus "$WORK/corpus" --items 10 --budgets 25 --rules topk \
    --selectors reader,reader-int8,reader-int8dq --out "$WORK/reader-int8-r32"
cp "$WORK/reader-int8/report.md" "$RESULTS/report-r0.md"
cp "$WORK/reader-int8/report.json" "$RESULTS/report-r0.json"
cp "$WORK/reader-int8-r32/report.md" "$RESULTS/report-r32.md"
cp "$WORK/reader-int8-r32/report.json" "$RESULTS/report-r32.json"
# the experts' format: none (bf16 experts) or int8; the files are named by the experts' dtype
for quantization in none int8; do
    name=$([ $quantization = none ] && echo bf16 || echo int8)
    $PY -m neuron_moe reads --model gemma4-26b-a4b --quantization $quantization --budget 17.8 \
        --json "$RESULTS/reads-gemma4-26b-a4b-$name.json"
    $PY -m neuron_moe reads --hidden 2048 --experts 128 --top-k 8 --intermediate 768 --quantization $quantization \
        --budget 17.8 --json "$RESULTS/reads-qwen3-30b-a3b-$name.json"
done
