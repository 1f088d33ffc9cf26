#!/usr/bin/env bash
# Stage 2 launcher: stages/train.sh MANIFEST [train flags...]
# DDP over TRAIN_GPUS (default 2,3), or the CPU when TRAIN_GPUS=cpu.
source "$(dirname "$0")/common.sh"
manifest="$1"; shift
launch train "${TRAIN_GPUS:-2,3}" -m "$manifest" "$@"
