#!/usr/bin/env bash
# Stage 1 launcher: stages/extract.sh MANIFEST [extract flags...]
# One process per GPU in EXTRACT_GPUS (default 0,1), or the CPU when EXTRACT_GPUS=cpu.
source "$(dirname "$0")/common.sh"
manifest="$1"; shift
launch extract "${EXTRACT_GPUS:-0,1}" -m "$manifest" "$@"
