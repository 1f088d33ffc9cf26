#!/usr/bin/env bash
# Reduced CPU version of the issue-5 quality report (the GPU version is manifests/quality-smollm2.toml
# at full size). SmolLM2-135M-Instruct answers ShareGPT prompts itself (first turn, 128 tokens), then
# lossless and fp8 caches are extracted and a drafter is trained on each and evaluated.
#   bench/quality_cpu.sh            (expects runs/quality/regenerated.jsonl from `dflash-pipe regenerate`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DFLASH_PYTHON:-python}
M=manifests/quality-smollm2.toml
# the manifest's 5-layer recipe is GPU-sized: the CPU run trains CPU_DRAFTER_LAYERS (1)
T=(--epochs "${EPOCHS:-5}" --keep-checkpoints 20 --checkpoint-every 100 --drafter-num-layers "${CPU_DRAFTER_LAYERS:-1}")
$PY -m dflash_pipe extract -m "$M" --device cpu
$PY -m dflash_pipe extract -m "$M" --device cpu --codec fp8 --cache-dir runs/quality/cache-fp8
$PY -m dflash_pipe train -m "$M" --device cpu "${T[@]}"
$PY -m dflash_pipe train -m "$M" --device cpu "${T[@]}" --cache-dir runs/quality/cache-fp8 \
    --output-dir runs/quality/train-fp8
$PY -m dflash_pipe eval -m "$M" --device cpu
$PY -m dflash_pipe eval -m "$M" --device cpu --train-output-dir runs/quality/train-fp8
