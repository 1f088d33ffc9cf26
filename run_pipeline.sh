#!/usr/bin/env bash
# dflash-pipe end to end: stage 1 (extract) -> stage 2 (train) -> eval.
#
#   ./run_pipeline.sh [MANIFEST] [--dry-run] [--overwrite] [--follow] [--no-eval]
#
# MANIFEST defaults to manifests/default.toml (SmolLM2-135M-Instruct + ShareGPT, CPU-sized).
# GPUs: stage 1 on EXTRACT_GPUS (default 0,1, one process per GPU), stage 2 on TRAIN_GPUS
# (default 2,3, DDP). Without any GPU both stages run on the CPU. With fewer GPUs than named the
# documented fallback is to run the stages one after the other on all visible GPUs (STRICT_GPUS=1
# makes that an error instead).
# Stage 1 is skipped when the cache is complete and its fingerprint equals this manifest's; a
# cache built from other target/data/extraction settings is refused (exit 3) unless --overwrite.
# --follow trains while extraction is still writing: on disjoint GPUs, or on the same GPU(s) only with
# SHARE_GPU=1 (e.g. EXTRACT_GPUS=0 TRAIN_GPUS=0 SHARE_GPU=1 on a one-GPU machine). With [train]
# passes_per_shard K > 0 in the manifest the cache is a bounded window ([extract] max_cache_gib).
# Exit status: the failing stage's (2 usage, 3 validation, 4 runtime, 130 interrupted). With --follow the first
# stage to fail stops the other and its status is the pipeline's. SIGINT/SIGTERM/SIGHUP: forwarded as SIGTERM to
# each running stage's process group (extract keeps committed shards, train checkpoints), then exit 130.
set -euo pipefail
if [ "${BASH_VERSINFO[0]}" -lt 4 ] || { [ "${BASH_VERSINFO[0]}" = 4 ] && [ "${BASH_VERSINFO[1]}" -lt 4 ]; }; then
  echo "run_pipeline: needs bash >= 4.4 (wait -n, empty arrays under set -u); this is bash $BASH_VERSION" >&2; exit 2
fi
cd "$(dirname "$0")"

MANIFEST=manifests/default.toml
DRY=0 OVERWRITE=0 FOLLOW=0 EVAL=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --overwrite) OVERWRITE=1 ;;
    --follow) FOLLOW=1 ;;
    --no-eval) EVAL=0 ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    -*) echo "run_pipeline: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) MANIFEST="$arg" ;;
  esac
done
[ -f "$MANIFEST" ] || { echo "run_pipeline: manifest $MANIFEST not found" >&2; exit 2; }

source stages/common.sh
NGPU=$(gpu_count)
if [ "$NGPU" = 0 ]; then
  for v in EXTRACT_GPUS TRAIN_GPUS; do
    if [ -n "${!v:-}" ] && [ "${!v}" != cpu ]; then
      echo "run_pipeline: $v=${!v} but no CUDA GPU is visible; unset it to run on the CPU" >&2; exit 2
    fi
  done
  export EXTRACT_GPUS=cpu TRAIN_GPUS=cpu
  DEVICE=cpu
else
  export EXTRACT_GPUS="${EXTRACT_GPUS:-0,1}" TRAIN_GPUS="${TRAIN_GPUS:-2,3}"
  DEVICE=cuda
  missing=$(tr ',' '\n' <<<"$EXTRACT_GPUS,$TRAIN_GPUS" | awk -v n="$NGPU" '$1 >= n' | sort -u | paste -sd, -)
  if [ -n "$missing" ]; then
    if [ "${STRICT_GPUS:-0}" = 1 ]; then
      echo "run_pipeline: GPU(s) $missing named in EXTRACT_GPUS/TRAIN_GPUS, but only $NGPU visible" >&2; exit 2
    fi
    all=$(seq -s, 0 $((NGPU - 1)))
    echo "run_pipeline: only $NGPU GPU(s) visible (asked for extract=$EXTRACT_GPUS train=$TRAIN_GPUS);" \
         "falling back to both stages one after the other on GPUs $all" >&2
    export EXTRACT_GPUS="$all" TRAIN_GPUS="$all"
    FOLLOW=0
  elif [ "$FOLLOW" = 1 ] && [ -n "$(comm -12 <(tr ',' '\n' <<<"$EXTRACT_GPUS" | sort) <(tr ',' '\n' <<<"$TRAIN_GPUS" | sort))" ]; then
    if [ "${SHARE_GPU:-0}" != 1 ]; then
      echo "run_pipeline: --follow needs disjoint EXTRACT_GPUS and TRAIN_GPUS (or SHARE_GPU=1 to run both" \
           "stages on the same GPU at once)" >&2; exit 2
    fi
    echo "run_pipeline: SHARE_GPU=1: extraction and training share GPU(s)" \
         "$(comm -12 <(tr ',' '\n' <<<"$EXTRACT_GPUS" | sort) <(tr ',' '\n' <<<"$TRAIN_GPUS" | sort) | paste -sd,)" >&2
  fi
fi

plan_json=$("$PY" -m dflash_pipe plan -m "$MANIFEST" --json --extract-device "$DEVICE") || exit $?
stage1=$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["stage1"])' "$plan_json")
# the plan's text, from the same JSON (`plan` again would load the target's config and tokenizer again)
plan_text() { "$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["summary"])' "$plan_json"; }
echo "run_pipeline: manifest $MANIFEST; extract on ${EXTRACT_GPUS}, train on ${TRAIN_GPUS}; stage 1: $stage1"
if [ "$DRY" = 1 ]; then
  plan_text
  exit 0
fi

extract_args=()
case "$stage1" in
  skip) echo "run_pipeline: stage 1 skipped: the cache is complete and matches this manifest" ;;
  refuse)
    if [ "$OVERWRITE" = 1 ]; then extract_args+=(--overwrite); stage1=run
    else
      plan_text >&2
      echo "run_pipeline: refusing to mix caches: use a new [extract].cache_dir or pass --overwrite" >&2; exit 3
    fi ;;
esac

# Each stage runs in the background as a process group of its own (job control on for that one command).
# Without job control bash starts a script's background commands with SIGINT and SIGQUIT ignored, which the
# stage's processes inherit (Python then never sees Ctrl-C), and `kill -INT PID` reached only the stage's bash
# launcher. INT, TERM or HUP to this script is forwarded as SIGTERM to the whole group of each running stage
# (python, exec'd by stages/common.sh, or torchrun, which forwards it to its workers): every stage stops on
# SIGTERM as on Ctrl-C (extract keeps its committed shards, train writes a checkpoint) and exits; the script
# waits for them, then exits 130. SIGTERM, not SIGINT: a pipeline started with SIGINT ignored (nohup, `&` in
# a script) passes that on to its stages, where no handler can undo it. Another signal is forwarded too: the
# stages then stop at once.
running=()                # pids of the running stages, each the leader of its process group
declare -A stage_name=()  # pid -> the stage's name in messages
interrupted=0

signal_stages() { local p; for p in "${running[@]}"; do kill -"$1" -- "-$p" 2>/dev/null || true; done; }
on_signal() {
  if [ "$interrupted" = 0 ]; then
    echo "run_pipeline: interrupted; stopping stages (committed shards and checkpoints are kept)" >&2 || true
  fi
  interrupted=1
  signal_stages TERM
}
trap on_signal INT TERM HUP

# start_stage NAME CMD...: start CMD in the background in a process group of its own (sets $!)
start_stage() {
  [ "$interrupted" = 0 ] || exit 130
  local name="$1"; shift
  set -m
  "$@" </dev/null &
  set +m
  running+=("$!"); stage_name[$!]="$name"
  [ "$interrupted" = 0 ] || kill -TERM -- "-$!" 2>/dev/null || true  # a signal between the fork and here
}

# wait_stages: wait for the running stages, in whichever order they end (a trapped signal ends `wait -n` early;
# bash keeps an ended job's status for `wait PID`). The first to fail has the others stopped (SIGTERM to their
# groups) and, once none runs, ends the pipeline with its exit status. Interrupted: exit 130 once none runs.
wait_stages() {
  local p rc keep failed="" failed_rc=0 stopped=0
  while [ "${#running[@]}" -gt 0 ]; do
    wait -n 2>/dev/null || true
    keep=()
    for p in "${running[@]}"; do
      if kill -0 "$p" 2>/dev/null; then keep+=("$p"); continue; fi  # running (or ended, not yet reaped)
      rc=0; wait "$p" || rc=$?
      if [ "$rc" != 0 ] && [ -z "$failed" ] && [ "$interrupted" = 0 ]; then failed="${stage_name[$p]}" failed_rc=$rc; fi
    done
    running=("${keep[@]}")
    if [ -n "$failed" ] && [ "$stopped" = 0 ] && [ "${#running[@]}" -gt 0 ]; then
      echo "run_pipeline: $failed failed first (exit $failed_rc); stopping" \
           "$(for p in "${running[@]}"; do echo "${stage_name[$p]}"; done | paste -sd, -)" >&2
      signal_stages TERM; stopped=1
    fi
  done
  [ -z "$failed" ] || fail "$failed" "$failed_rc"
  [ "$interrupted" = 0 ] || exit 130
}

fail() { echo "run_pipeline: $1 failed (exit $2)" >&2; exit "$2"; }

if [ "$stage1" != skip ] && [ "$FOLLOW" = 1 ]; then
  # both at once; extract done first: train reads the rest and runs to its end
  start_stage "stage 1 (extract)" stages/extract.sh "$MANIFEST" "${extract_args[@]}"
  start_stage "stage 2 (train --follow)" stages/train.sh "$MANIFEST" --follow
  wait_stages
else
  if [ "$stage1" != skip ]; then
    start_stage "stage 1 (extract)" stages/extract.sh "$MANIFEST" "${extract_args[@]}"
    wait_stages
  fi
  start_stage "stage 2 (train)" stages/train.sh "$MANIFEST"
  wait_stages
fi

if [ "$EVAL" = 1 ]; then
  first_gpu=$( [ "$DEVICE" = cpu ] && echo "" || cut -d, -f1 <<<"$TRAIN_GPUS")
  start_stage eval env CUDA_VISIBLE_DEVICES="${first_gpu}" "$PY" -m dflash_pipe eval -m "$MANIFEST" --device "$DEVICE"
  wait_stages
fi
echo "run_pipeline: done"
