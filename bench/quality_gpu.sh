#!/usr/bin/env bash
# Quality report (issues 5, 19) on one lent H200, in three or more consecutive device calls (each one shell
# command of at most 600 s; the machine stays warm 30 s after a call returns and only then keeps /tmp/quality).
#
# Before the calls, on this machine:  scripts/prepare_gpu_carry.sh   (writes .gpucarry/, prints the sizes)
#
#   call A (fresh machine; copies GGUF part 0, the GGUF hash, the eval prompt files and the wheels to /tmp/quality/carry):
#     carry   [".gpucarry/p0", ".gpucarry/data", ".gpucarry/whl"]                       (58.3 MiB with the tree)
#     command bash bench/quality_gpu.sh stash
#   calls T, U and V (within 30 s each; GGUF parts 1, 2 and 3):
#     carry   [".gpucarry/p1"], then [".gpucarry/p2"], then [".gpucarry/p3"]             (52.8 MiB each)
#     command bash bench/quality_gpu.sh stash
#     (`bash bench/quality_gpu.sh precheck` in call T's place stashes too, then runs the GPU tests of history reuse,
#     replay, the fp8 codec and the trainer's deferred step statistics, and times the drafter's step at two sizes)
#   call B (within 30 s of V returning; the ShareGPT prompt files and GGUF part 4; reassembles + sha256-checks the
#   GGUF, installs the wheels, runs stages):
#     carry   [".gpucarry/turns", ".gpucarry/p4"]                                       (57.7 MiB with the tree)
#     command QUALITY_ENV=<env file> QUALITY_BG_DEADLINE_S=<s> QUALITY_DEADLINE_S=200 bash bench/quality_gpu.sh bg
#     (session 18: the whole run as a daemon that outlives the call, bench/quality_bg.sh)
#   calls W1, W2, ... (within 30 s of the last returning, while it exits 75):
#     carry   []
#     command QUALITY_DEADLINE_S=200 bash bench/quality_gpu.sh watch   (waits, then brings the run's outputs home)
#   (scripts/prepare_gpu_carry.sh prints each call's size; the tree, 33 MiB in session 18, grows with the results.
#   Before session 18 call B ran `source <env file> && bash bench/quality_gpu.sh run`, and call C, ... the same
#   while it exited 75: every job stopped at the call's deadline and restarted in the next call; that still works.
#   `bash bench/quality_gpu.sh status` prints what is done without running anything;
#   `bash bench/quality_gpu.sh setup` in call B's place only reassembles the GGUF and installs the wheels, for
#   bench/gpu_bench.sh's `smollm2` step)
#   issue 18 after a run (or after call U): `REGEN_AB_PROMPTS=2000 bash bench/quality_gpu.sh regen-ab` times regen
#   on every turn of the first N conversations (issue 19's decoding) with and without --reuse-history
#   (bench/regen_throughput.py --reuse-history-ab; $OUT/regen_ab.json, .log; REGEN_AB_S caps it, 420 s)
#   issue 16 instead of call B: same carry, command `bash bench/quality_gpu.sh window` runs bench/window_stream.py
#   (extract + train --follow on the one GPU within a 0.6 GiB budget; $OUT/window_stream.json; WINDOW_FLAGS adds flags)
#
# Exit codes: 0 report complete; 75 stopped cleanly at the deadline, work left (printed; run again within
# 30 s); 3 carry missing (machine went cold: start again at call A); other = a stage failed (log tails in $OUT).
# A machine that goes cold between calls loses /tmp/quality (sessions 16 and 17: a long call's answer came back
# minutes after its command ended). What each call finished leaves in its $OUT (bench/quality_home.sh): regen's
# new rows (bench/regen_seed.py merge -> the next QUALITY_REGEN_SEED / QUALITY_REGEN_MORE_SEED) and each finished
# drafter in parts (drafter_<name>.tar.part-K-of-N, bench/drafter_parts.py). With those parts carried back
# (DRAFTER_PARTS=<dir> scripts/prepare_gpu_carry.sh adds stash calls D0, D1, ...), setup restores the drafter and
# marks its training done; regen and extraction are then skipped, and the run goes straight to the eval.
#
# Stages (each marks completion in /tmp/quality/done/<job>; a rerun skips finished jobs, and the pipeline's
# own resume continues unfinished ones: regenerate skips written ids, extract skips committed shards,
# train --resume auto continues from the last checkpoint, which a deadline's SIGINT writes first):
#   regen           SmolLM2 answers QUALITY_N_PROMPTS ShareGPT first turns itself (greedy, batched HF generate);
#                   seeded from bench/data/smollm2_regenerated_sharegpt.jsonl.gz (kept from earlier runs), so only
#                   prompts beyond those are generated
#   extract-lossless, extract-fp8, extract-val          three processes at once; the first QUALITY_HELDOUT (300)
#                   conversations are held out of training and extracted as cache-val (training's --val-cache-dir)
#   train-lossless, train-fp8                           at once, each as soon as its cache is done
#   train-seed<N>   only with QUALITY_SEEDS (e.g. "1"): lossless drafters with another --seed, the training-noise
#                   control for lossless vs fp8 (both of those use seed 0)
#   scale-<subset>  only with QUALITY_SCALING (e.g. "0-3 0-7"): lossless drafters on shard subsets (data scaling)
#   var-<name>      only with QUALITY_VARIANTS (e.g. "kd5=--kd-weight 0.5;l5=--drafter-num-layers 5"): lossless
#                   drafters with other train flags (recipe changes), compared with lossless on every set
#   eval-{mtbench,humaneval,heldout}   one process per set, all drafters in it (`eval --drafter name=dir,...`:
#                   target-only and prompt lookup once per prompt, so drafters are compared on identical prompts
#                   and references); the scale-* drafters only on heldout, which decodes the held-out prompts
#   report          bench/quality_report.py -> $OUT (every call, with whatever is finished)
# Deadline (QUALITY_DEADLINE_S, default 540 s from the script's start): a resumable job is started only with at
# least its minimum useful time left and runs under `timeout -s INT` until the deadline minus a reserve. Every
# job is resumable: eval keeps its finished prompts in <eval dir>/eval_progress.jsonl until its report exists.
# $OUT (at most 8 files) is refreshed every 30 s and at the end: status.txt, logs_tail.txt, summary.json,
# summary.md, quality.png, results.tar.gz (eval reports + PNGs, metrics.jsonl, configs, full logs); the rows regen
# and regen-more wrote beyond their seeds as regen_rows_<start>-<end>.tar / regen_more_rows_...tar, each row once,
# with the sidecar (`bench/regen_seed.py ship`; `merge` at home): at each regen job's end, and in every `watch`.
#
# Measured in session 3 (H200, driver.log in bench/results/2026-12-01-h200-quality-session3/): regen of 8,000
# prompts 239 s; the three extracts at once 69 s (1.7 M tokens); two 5,000-step trainers at once 223 s
# (45 ms/step each); six single-drafter evals of 16 prompts at once 244-304 s. Wall time grows with the number
# of processes sharing the GPU (time-sliced), so plan device time as the sum of these, not their maximum.
#
# Knobs (environment; defaults are the GPU run): QUALITY_DIR (/tmp/quality), QUALITY_DEADLINE_S (540),
# QUALITY_RESERVE_S (30), QUALITY_DEVICE (cuda), QUALITY_MANIFEST (manifests/quality-smollm2-gpu.toml),
# QUALITY_N_PROMPTS (8000), QUALITY_GEN_TOKENS (256), QUALITY_GEN_BATCH (1024), QUALITY_TRAIN_STEPS (8000),
# QUALITY_EVAL_PROMPTS (20), QUALITY_EVAL_TOKENS (256), QUALITY_EVAL_STEP_S (0.015, one target forward),
# QUALITY_EVAL_CONC (1.3, slow-down of sharing the GPU), QUALITY_{REGEN,EXTRACT,TRAIN,EVAL}_FLAGS (extra flags),
# QUALITY_CARRY_SRC (.gpucarry: where the carried paths are), QUALITY_GGUF (use this GGUF, skip the parts),
# QUALITY_MODEL_CACHE ($QUALITY_DIR/models), OUT ($QUALITY_DIR/out when unset), DFLASH_PYTHON (python3),
# QUALITY_SEEDS (empty; e.g. "1"), QUALITY_SCALING (empty; e.g. "0-3 0-7"), QUALITY_VARIANTS (empty; e.g.
# "kd5=--kd-weight 0.5"), QUALITY_VAL_BATCHES (32: all of
# cache-val), QUALITY_REGEN_SEED (bench/data/...), QUALITY_REGEN_SOURCE (first_turns; all_turns = every user turn),
# QUALITY_REGEN_MORE_SEED (empty; regen-more's kept file, resumed like QUALITY_REGEN_SEED), QUALITY_EXTRA_DATA
# (empty; more regenerated files for extraction after both regen files, e.g. a carried data bundle's: link_data),
# QUALITY_DATA_ONLY (empty; 1 = a data session: only the regen jobs run, their rows go home; bench/runs/quality19k.env),
# QUALITY_SHARE_FROM (empty; an earlier run's QUALITY_DIR on this warm machine: its carry, GGUF and models are reused),
# QUALITY_CODECS ("lossless fp8"), QUALITY_WINDOW_GIB (empty = whole caches; B = stream each cache through a
# B GiB window: extract-<codec> and train-<codec> run at once, the trainer reading every shard QUALITY_PASSES
# (1) times and deleting it; with QUALITY_TRAIN_STEPS=0 the run ends when every shard has been read; the
# QUALITY_SEEDS / QUALITY_VARIANTS trainers stream cache-lossless with it as one --window-group),
# QUALITY_EXTRACT_JOBS (1; J = J extract processes per cache over disjoint shards, bench/extract_parallel.py),
# QUALITY_REGEN_MAX_S (empty; S = regen stops after S s of wall time summed over calls and the rows it wrote are the
# data: the file is prefix-stable, so a later run with a larger cap or none continues it; when the cap is what ends a
# call's regen, it stops admitting QUALITY_REGEN_DRAIN_S (45) s before it and finishes the conversations in flight).
#
# Issue 19 (every ShareGPT turn x 4 sampled answers, conversations up to 1,280 tokens, streamed through a
# disk window): bench/runs/quality19.env holds session 13's settings, bench/runs/quality19b.env the next run's. Calls A, T,
# then B, C, ... as above with the command `source bench/runs/quality19b.env && bash bench/quality_gpu.sh run`.
#
# CPU smoke test at toy size (run before each GPU use; session 5: ~15 min on 2 cores, exits 75, 75, then 0;
# session 6, with QUALITY_VARIANTS="kd5=--kd-weight 0.5;l2=--drafter-num-layers 2" and one long deadline: 665 s, 0):
#   export DFLASH_PYTHON=python QUALITY_DIR=/tmp/qsmoke OUT=/tmp/qsmoke-out QUALITY_DEVICE=cpu QUALITY_N_PROMPTS=24 \
#     QUALITY_GEN_TOKENS=32 QUALITY_GEN_BATCH=8 QUALITY_TRAIN_STEPS=40 QUALITY_EVAL_PROMPTS=2 QUALITY_EVAL_TOKENS=16 \
#     QUALITY_EVAL_STEP_S=0.1 QUALITY_EVAL_CONC=2 QUALITY_EXTRACT_FLAGS="--compress-workers 1 --num-shards 4" \
#     QUALITY_REGEN_SEED= QUALITY_HELDOUT=4 QUALITY_SEEDS=1 QUALITY_SCALING=0-1 QUALITY_VAL_EVERY=20 \
#     QUALITY_TRAIN_FLAGS="--context-tokens 1024 --num-anchors 32 --drafter-num-layers 1 --checkpoint-every 10"
#   QUALITY_CARRY_SRC=/tmp/carryA bash bench/quality_gpu.sh stash                # copies of p0, p1, data
#   QUALITY_CARRY_SRC=/tmp/carryB QUALITY_DEADLINE_S=200 bash bench/quality_gpu.sh run   # p2, p3: exits 75
#   QUALITY_CARRY_SRC=/nonexistent bash bench/quality_gpu.sh run                    # resumes; again while 75
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
T0=$(date +%s)
MODE=${1:-run}
Q=${QUALITY_DIR:-/tmp/quality}
OUT=${OUT:-$Q/out}
PY=${DFLASH_PYTHON:-python3}
SRC=${QUALITY_CARRY_SRC:-.gpucarry}
CARRY=$Q/carry
DEADLINE=$((T0 + ${QUALITY_DEADLINE_S:-540}))
RESERVE=${QUALITY_RESERVE_S:-30}
DEVICE=${QUALITY_DEVICE:-cuda}
M=${QUALITY_MANIFEST:-manifests/quality-smollm2-gpu.toml}
N_PROMPTS=${QUALITY_N_PROMPTS:-8000}
GEN_TOKENS=${QUALITY_GEN_TOKENS:-256}
GEN_BATCH=${QUALITY_GEN_BATCH:-1024}
TRAIN_STEPS=${QUALITY_TRAIN_STEPS:-8000}
EVAL_PROMPTS=${QUALITY_EVAL_PROMPTS:-20}
EVAL_TOKENS=${QUALITY_EVAL_TOKENS:-256}
EVAL_STEP_S=${QUALITY_EVAL_STEP_S:-0.015}
EVAL_CONC=${QUALITY_EVAL_CONC:-1.3}
MODELS=${QUALITY_MODEL_CACHE:-$Q/models}
REGEN_MAX_S=${QUALITY_REGEN_MAX_S:-}   # empty: regen runs until every prompt is answered
REGEN_DRAIN_S=${QUALITY_REGEN_DRAIN_S:-45}   # with the cap: regen stops admitting this long before it
# what regen answers: ShareGPT first turns (one turn each), or every user turn of the same conversations
# (all_turns: stashed from .gpucarry/turns; pass --max-turns 0 in QUALITY_REGEN_FLAGS)
REGEN_SOURCE=$CARRY/data/sharegpt_${QUALITY_REGEN_SOURCE:-first_turns}.jsonl
read -r -a REGEN_FLAGS <<< "${QUALITY_REGEN_FLAGS:-}"
# more answers per prompt once the source's prompts are all answered: a second regen job (regen-more) writes
# regenerated-more.jsonl with these flags added (e.g. "--samples 1 --first-sample 4": every conversation's answer
# #4), skipping the held-out conversations; extraction and eval then read both files ($Q/data). Empty = off.
read -r -a REGEN_MORE_FLAGS <<< "${QUALITY_REGEN_MORE_FLAGS:-}"
read -r -a EXTRACT_FLAGS <<< "${QUALITY_EXTRACT_FLAGS:-}"
# extraction's attention layout (packed / padded; extract --attention-layout); auto = what the precheck measured
# faster (PRECHECK_EXTRACT_LAYOUTS=packed,padded writes $Q/extract_layout.choice), else the default
EXTRACT_LAYOUT=${QUALITY_EXTRACT_LAYOUT:-}
read -r -a TRAIN_FLAGS <<< "${QUALITY_TRAIN_FLAGS:-}"
# fp32 target in eval: bf16 verification of a 16-token block rounds differently from one-token decoding, so
# "identical to target-only" and lossless-vs-fp8 differences below ~1 % need the fp32 target (cheap at 135 M)
read -r -a EVAL_FLAGS <<< "${QUALITY_EVAL_FLAGS:---target-dtype float32}"
VAL_EVERY=${QUALITY_VAL_EVERY:-1000}
VAL_BATCHES=${QUALITY_VAL_BATCHES:-32}
HELDOUT=${QUALITY_HELDOUT:-300}
read -r -a CODECS <<< "${QUALITY_CODECS:-lossless fp8}"
# issue 19: stream each codec's cache through a disk-budget window instead of keeping it whole (a cache of
# tens of M tokens is ~4 KB/token, more than the GPU machine's 64 GiB disk): extract-<codec> runs with
# --max-cache-gib $WINDOW_GIB and train-<codec> with --follow --passes-per-shard $PASSES at the same time
WINDOW_GIB=${QUALITY_WINDOW_GIB:-}
PASSES=${QUALITY_PASSES:-1}
EXTRACT_JOBS=${QUALITY_EXTRACT_JOBS:-1}   # processes per extract-<codec> job (bench/extract_parallel.py; needs --num-shards)
# the eval sets (QUALITY_EVAL_SETS; empty = a training-only run: its drafter goes home and a later session evaluates
# it, DRAFTER_PARTS, or trains on from it, INIT_PARTS)
read -r -a SETS <<< "${QUALITY_EVAL_SETS-mtbench humaneval heldout}"
# minimum useful seconds for a resumable job (start-up + some progress worth keeping)
declare -A MIN_S=([regen]=60 [extract]=45 [train]=60 [eval]=60)
mkdir -p "$Q/logs" "$Q/done" "$OUT"
CALL=$(( $(cat "$Q/calls" 2>/dev/null || echo 0) + 1 ))

say() { echo "[quality +$(( $(date +%s) - T0 ))s] $*" | tee -a "$Q/logs/driver.log"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
is_done() { [ -f "$Q/done/$1" ]; }
fail() { say "ERROR: $*"; finish 1; }

# ------------------------------------------------------------------------------------------- setup
setup() {
    share_from_earlier_run
    stash >/dev/null                         # parts / data carried in this call, if any
    local need=(data/gguf.sha256 "${REGEN_SOURCE#$CARRY/}" data/prompts/mt_bench_question.jsonl
                data/prompts/HumanEval.jsonl.gz)
    for f in "${need[@]}"; do
        [ -f "$CARRY/$f" ] || { say "carry missing: $CARRY/$f (machine went cold? start again at call A)"; finish 3; }
    done
    if [ -n "${QUALITY_GGUF:-}" ]; then
        export DFLASH_SMOLLM2_GGUF=$QUALITY_GGUF
    else
        export DFLASH_SMOLLM2_GGUF=$Q/smollm2.gguf
        if [ ! -f "$Q/smollm2.gguf" ]; then
            local parts=() n i   # how many: data/gguf.parts (scripts/prepare_gpu_carry.sh; 4 before session 18)
            n=$(cat "$CARRY/data/gguf.parts" 2>/dev/null || echo 4)
            for ((i = 0; i < n; i++)); do
                [ -f "$CARRY/smollm2.gguf.part-$i" ] || { say "GGUF part $i of $n missing in $CARRY (each stash call carries one: .gpucarry/p$i)"; finish 3; }
                parts+=("$CARRY/smollm2.gguf.part-$i")
            done
            cat "${parts[@]}" > "$Q/smollm2.gguf.tmp"
            if ! (cd "$Q" && sed 's/  .*/  smollm2.gguf.tmp/' "$CARRY/data/gguf.sha256" | sha256sum -c --quiet -); then
                rm -f "$Q/smollm2.gguf.tmp"; fail "reassembled GGUF fails its sha256 (parts from two different prepares?)"
            fi
            mv "$Q/smollm2.gguf.tmp" "$Q/smollm2.gguf"
            say "setup: GGUF reassembled and sha256-checked ($(du -m "$Q/smollm2.gguf" | cut -f1) MB)"
        fi
    fi
    install_wheels
    seed_regenerated
    restore_drafters
    restore_init
    export DFLASH_LOCAL_CACHE=$Q/kernels   # the jobs' compile caches (dflash_pipe.dist), sent home by kernels_out
    restore_kernels
    restore_eval_progress
    restore_data_bundles
    link_data   # regen's file, regen-more's and QUALITY_EXTRA_DATA's, in this order, as one data source ($Q/data)
    export DFLASH_PROMPTS_DIR=$CARRY/data/prompts
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false
    export DFLASH_LOG=${DFLASH_LOG:-WARNING}
    echo "$CALL" > "$Q/calls"
    # the gap since the last call's command ended: the machine goes after 30 s idle, and a long call's answer can
    # arrive minutes after its end (session 17: 3.4 min), so this says how close the last hand-over came
    [ -f "$Q/call_end" ] && say "setup: $(( $(date +%s) - $(cat "$Q/call_end") )) s since call $((CALL - 1))'s command ended"
}

# wheels only for modules this python lacks (the GPU image has neither zstandard nor gguf)
install_wheels() {
    mkdir -p "$Q/site"
    export PYTHONPATH=$Q/site:$REPO${PYTHONPATH:+:$PYTHONPATH}
    local mod whl
    for mod in zstandard gguf; do
        "$PY" -c "import $mod" 2>/dev/null && continue
        whl=$(ls "$SRC/whl/$mod"-*.whl "$CARRY/whl/$mod"-*.whl 2>/dev/null | head -1)
        [ -n "$whl" ] || { say "no wheel for $mod in $SRC/whl (call A stashes .gpucarry/whl)"; finish 3; }
        "$PY" -m pip install -q --no-index --no-deps --target "$Q/site" "$whl" >> "$Q/logs/setup.log" 2>&1 ||
            "$PY" -m zipfile -e "$whl" "$Q/site" >> "$Q/logs/setup.log" 2>&1 ||    # no pip: a wheel is a zip
            fail "cannot install $whl (logs/setup.log)"
        "$PY" -c "import $mod" 2>> "$Q/logs/setup.log" || fail "$mod does not import after installing $whl (logs/setup.log)"
        mkdir -p "$CARRY/whl" && cp -n "$whl" "$CARRY/whl/" 2>/dev/null
        say "setup: installed $(basename "$whl")"
    done
}


# ------------------------------------------------------------------------------------------- jobs
source bench/quality_jobs.sh   # JOBS, TRAINS, deps, kind, job_cmd, job_ok, job_progress, eval_estimate
source bench/quality_home.sh   # stash, seeds, regen_rows_out, drafter_out, restore_drafters, restore_eval_progress, ...
source bench/quality_bg.sh     # bg, watch: the run as a daemon across calls
source bench/quality_precheck.sh   # precheck: call T's GPU tests and timings

declare -A PID STARTED RC
RUNNING=()
launch() {   # job budget_s
    local j=$1 budget=$2
    local capped=""
    if is_regen "$j" && [ -n "$REGEN_MAX_S" ] && [ "$(regen_left)" -le "$budget" ]; then
        budget=$(regen_left); capped=1
    fi
    job_cmd "$j"
    # the cap binds: regen stops admitting conversations REGEN_DRAIN_S before it and finishes the ones in flight
    # (a kill would lose them, and every finished one behind the oldest unfinished); the timeout stays a backstop
    [ -n "$capped" ] && JOB_CMD+=(--max-seconds "$(( budget > 2 * REGEN_DRAIN_S ? budget - REGEN_DRAIN_S : budget / 2 ))")
    echo "=== call $CALL $(date -u +%FT%TZ) budget ${budget}s: ${JOB_CMD[*]}" >> "$Q/logs/$j.log"
    timeout --signal=INT --kill-after=20 "$budget" "${JOB_CMD[@]}" >> "$Q/logs/$j.log" 2>&1 &
    PID[$j]=$!; STARTED[$j]=$(date +%s); RUNNING+=("$j")
    say "start $j (budget ${budget}s, pid ${PID[$j]})"
}

reap() {   # collect finished jobs; sets RC[job]
    local still=() j rc
    for j in "${RUNNING[@]}"; do
        if kill -0 "${PID[$j]}" 2>/dev/null; then still+=("$j"); continue; fi
        wait "${PID[$j]}"; rc=$?
        RC[$j]=$rc
        local dt=$(( $(date +%s) - STARTED[$j] ))
        # (a failed regen's time does not count towards QUALITY_REGEN_MAX_S: after the fix, it starts afresh)
        if ! is_regen "$j" || [[ " 0 124 130 137 " == *" $rc "* ]]; then
            echo "$(( $(cat "$Q/done/$j.seconds" 2>/dev/null || echo 0) + dt ))" > "$Q/done/$j.seconds"
        fi
        if [ "$rc" = 0 ] && is_regen "$j" && regen_stopped_early "$j" && job_ok "$j"; then
            regen_cap_done "$j" "stopped admitting at its time cap (--max-seconds), finished in ${dt}s"
        elif [ "$rc" = 0 ] && job_ok "$j"; then
            date -u +%FT%TZ > "$Q/done/$j"; say "done  $j in ${dt}s"
            is_regen "$j" && regen_rows_out "$j"
            [ "$(kind "$j")" = train ] && drafter_out "$j" && kernels_out
        elif is_regen "$j" && { [ "$rc" = 124 ] || [ "$rc" = 130 ] || [ "$rc" = 137 ]; } && regen_capped && job_ok "$j"; then
            regen_cap_done "$j" "stopped at its time cap after ${dt}s (rc $rc)"
        elif [ "$rc" = 124 ] || [ "$rc" = 130 ] || [ "$rc" = 137 ]; then
            say "stopped $j at the deadline after ${dt}s (rc $rc): $(job_progress "$j")"
        else
            say "FAILED $j (rc $rc) after ${dt}s; tail of logs/$j.log:"; tail -n 15 "$Q/logs/$j.log" | sed 's/^/    /'
        fi
    done
    RUNNING=("${still[@]}")
}

can_start() {   # job -> prints the budget if it may start now, else nothing
    local j=$1 l k; l=$(( $(left) - RESERVE )); k=$(kind "$j")
    # every kind is resumable (eval keeps finished prompts in eval_progress.jsonl)
    if [ "$l" -ge "${MIN_S[$k]}" ]; then echo "$l"; fi
}

snapshot() {   # small files to $OUT (called every 30 s in the background and at the end)
    {
        echo "# quality_gpu.sh status, call $CALL, $(date -u +%FT%TZ), +$(( $(date +%s) - T0 ))s of ${QUALITY_DEADLINE_S:-540}s"
        for j in "${JOBS[@]}"; do
            if [ -f "$Q/done/$j.restored" ]; then echo "done     $j (restored from parts carried from home)"
            elif is_done "$j"; then echo "done     $j ($(cat "$Q/done/$j.seconds" 2>/dev/null)s)"
            elif not_needed "$j"; then echo "skipped  $j ($( [ -n "${QUALITY_DATA_ONLY:-}" ] && echo "a data session: QUALITY_DATA_ONLY" || echo "every drafter is done"))"
            else echo "pending  $j: $(job_progress "$j")"; fi
        done
    } > "$OUT/status.txt.tmp" 2>/dev/null && mv "$OUT/status.txt.tmp" "$OUT/status.txt"
    {
        for f in "$Q"/logs/driver.log "$Q"/logs/*.log; do
            [ -f "$f" ] || continue
            echo "===== ${f#$Q/} (last 25 lines)"; tail -n 25 "$f" | cut -c1-400
        done
    } > "$OUT/logs_tail.txt.tmp" 2>/dev/null && mv "$OUT/logs_tail.txt.tmp" "$OUT/logs_tail.txt"
}

# QUALITY_REGEN_MAX_S caps regen's wall time summed over calls: at the cap, what regenerated.jsonl holds (a prefix
# of the prompts, complete rows only) is the data, and the stages after it start
regen_left() {   # the cap covers regen and regen-more together
    echo $(( REGEN_MAX_S - $(cat "$Q/done/regen.seconds" 2>/dev/null || echo 0)
                         - $(cat "$Q/done/regen-more.seconds" 2>/dev/null || echo 0) ))
}
regen_capped() { [ -n "$REGEN_MAX_S" ] && [ "$(regen_left)" -lt "${MIN_S[regen]}" ]; }
regen_stopped_early() {   # job: its last run stopped admitting at --max-seconds (its sidecar says so)
    "$PY" -c 'import json, sys; sys.exit(0 if "stopped_early" in json.load(open(sys.argv[1])) else 1)' \
        "$(regen_file "$1").progress.json" 2>/dev/null
}
regen_cap_done() {   # job why
    date -u +%FT%TZ > "$Q/done/$1"; echo "$REGEN_MAX_S" > "$Q/done/$1.capped"
    regen_rows_out "$1"
    say "done  $1: $2, QUALITY_REGEN_MAX_S=$REGEN_MAX_S reached; the data is what it wrote: $(job_progress "$1")"
}

SNAP=""
finish() {   # rc
    local rc=$1 j
    for j in "${RUNNING[@]}"; do kill -INT "${PID[$j]}" 2>/dev/null; done
    for j in "${RUNNING[@]}"; do wait "${PID[$j]}" 2>/dev/null; done
    [ -n "$SNAP" ] && kill "$SNAP" 2>/dev/null && wait "$SNAP" 2>/dev/null
    if [ -d "$Q/logs" ] && [ "$MODE" = run ]; then
        timeout 40 "$PY" bench/quality_report.py --dir "$Q" --out "$OUT" >> "$Q/logs/report.log" 2>&1 ||
            say "report: bench/quality_report.py failed (logs/report.log)"
        tail -n 60 "$OUT/summary.md" 2>/dev/null
    fi
    snapshot
    trim_out
    local leftover=()
    for j in "${JOBS[@]}"; do is_done "$j" || not_needed "$j" || leftover+=("$j"); done
    cat "$OUT/status.txt"
    date +%s > "$Q/call_end"
    if [ "$rc" = 0 ] && [ ${#leftover[@]} -gt 0 ]; then
        rc=75
        say "LEFT: ${leftover[*]}; run 'bash bench/quality_gpu.sh run' again within 30 s (carry nothing)"
    elif [ "$rc" = 0 ]; then
        say "COMPLETE: report in \$OUT (summary.md, summary.json, quality.png, results.tar.gz)"
    fi
    exit "$rc"
}
trap 'say "interrupted"; finish 130' INT TERM

case $MODE in
    stash) stash; exit 0 ;;
    precheck) precheck; exit $? ;;
    status) snapshot; cat "$OUT/status.txt"; exit 0 ;;
    setup) setup; say "setup: done (GGUF $DFLASH_SMOLLM2_GGUF, site $Q/site, prompts $DFLASH_PROMPTS_DIR)"; exit 0 ;;
    window)  # issue 16: bench/window_stream.py on the one GPU (after call A's stash; GGUF + wheels as for run)
        setup
        "$PY" bench/window_stream.py --model-cache-dir "$MODELS" --work "$Q/window" --limit-s "${WINDOW_LIMIT_S:-420}" \
            --json "$OUT/window_stream.json" ${WINDOW_FLAGS:-} > "$OUT/window_stream.log" 2>&1
        rc=$?; tail -n 40 "$OUT/window_stream.log"; cp "$Q/window/"{extract,train}.log "$OUT/" 2>/dev/null; exit $rc ;;
    regen-ab)  # issue 18: regen with and without --reuse-history on the same all-turns prompts (after call A-U's stashes)
        setup
        timeout "${REGEN_AB_S:-420}" "$PY" bench/regen_throughput.py --data "$CARRY/data/sharegpt_all_turns.jsonl" \
            --model-cache "$MODELS" --device "$DEVICE" --max-turns 0 --samples 4 --temperature 1.0 --top-p 0.95 --greedy-after 4 \
            --max-length 1280 --prompts "${REGEN_AB_PROMPTS:-2000}" --batch "${REGEN_AB_BATCH:-1024}" --hf-prompts 0 --reuse-history \
            --reuse-history-ab --json "$OUT/regen_ab.json" > "$OUT/regen_ab.log" 2>&1
        rc=$?; say "regen-ab: rc $rc"; tail -n 30 "$OUT/regen_ab.log"; exit $rc ;;
    bg) bg_start; bg_watch ;;
    watch) bg_watch ;;
    run) ;;
    *) echo "usage: bench/quality_gpu.sh stash|precheck|setup|run|bg|watch|status|window|regen-ab" >&2; exit 2 ;;
esac

setup
say "call $CALL: deadline ${QUALITY_DEADLINE_S:-540}s, device $DEVICE, $N_PROMPTS prompts x $GEN_TOKENS tokens," \
    "$TRAIN_STEPS train steps (${TRAINS[*]}), eval $EVAL_PROMPTS prompts x $EVAL_TOKENS tokens per set"
( trap 'kill "$s" 2>/dev/null; exit 0' TERM; while :; do sleep 30 & s=$!; wait "$s"; snapshot; done ) >/dev/null 2>&1 &
SNAP=$!
failed=0
while :; do
    reap
    for j in "${!RC[@]}"; do
        case ${RC[$j]} in 0|124|130|137|deferred) ;; *) failed=1 ;; esac
    done
    [ "$failed" = 1 ] && { say "a job failed: stopping"; finish 1; }
    started=0
    for j in "${JOBS[@]}"; do
        is_regen "$j" && ! is_done "$j" && regen_capped && job_ok "$j" && regen_cap_done "$j" "cap reached before it ran on"
        is_done "$j" && continue
        not_needed "$j" && continue
        [[ " ${RUNNING[*]} " == *" $j "* ]] && continue
        [ -n "${RC[$j]:-}" ] && continue                 # stopped at the deadline in this call
        ok=1; for d in $(deps "$j"); do is_done "$d" || ok=0; done
        ready "$j" || ok=0
        [ "$ok" = 1 ] || continue
        budget=$(can_start "$j")
        if [ -n "$budget" ]; then launch "$j" "$budget"; started=1
        else say "not starting $j: $(( $(left) - RESERVE ))s left before the reserve, needs ${MIN_S[$(kind "$j")]}s"
             RC[$j]=deferred; fi
    done
    [ ${#RUNNING[@]} -eq 0 ] && [ "$started" = 0 ] && break
    sleep 2
done
finish 0
