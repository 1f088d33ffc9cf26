# The jobs of bench/quality_gpu.sh (sourced by it, after its settings): the job list, each job's dependencies,
# command, output check and progress line. A job name says what it is: regen, extract-<codec>, extract-val,
# train-<codec>, train-seed<N>, scale-<subset>, var-<name>, eval-<set> (see the header of quality_gpu.sh).
JOBS=(regen)
[ ${#REGEN_MORE_FLAGS[@]} -gt 0 ] && JOBS+=(regen-more)
for c in "${CODECS[@]}"; do JOBS+=("extract-$c"); done
JOBS+=(extract-val)
for c in "${CODECS[@]}"; do JOBS+=("train-$c"); done
# training-noise control (opt-in): QUALITY_SEEDS="1" trains one more lossless drafter per seed; lossless vs fp8 is
# a real difference only where it exceeds lossless vs lossless-with-another-seed
read -r -a SEEDS <<< "${QUALITY_SEEDS:-}"
for n in "${SEEDS[@]}"; do JOBS+=("train-seed$n"); done
# data scaling (opt-in): QUALITY_SCALING="0-3 0-7" trains one more lossless drafter per shard subset (train
# --shards; 4 and 8 of the 16 shards = 25 % and 50 % of the data), same max_steps (more passes over less data);
# evaluated on heldout only; bench/quality_report.py tabulates held-out tau against unique training tokens
read -r -a SCALING <<< "${QUALITY_SCALING:-}"
for sub in "${SCALING[@]}"; do sub=${sub//-/_}; JOBS+=("scale-${sub//,/.}"); done
# training-recipe variants (opt-in): QUALITY_VARIANTS="kd5=--kd-weight 0.5;l5=--drafter-num-layers 5" trains one
# more lossless drafter per entry with those extra train flags (same data, steps and seed as lossless), evaluated on
# every set and compared with lossless like seed<N>, whose gap is the noise floor a variant has to clear
declare -A VARIANT_FLAGS=()
IFS=';' read -r -a _variants <<< "${QUALITY_VARIANTS:-}"
for v in "${_variants[@]}"; do
    [ -n "${v// /}" ] || continue
    name=${v%%=*}; name=${name// /}
    if [[ "$v" != *=* || ! "$name" =~ ^[A-Za-z0-9_]+$ || -n "${VARIANT_FLAGS[$name]+x}" ]]; then
        echo "error: QUALITY_VARIANTS entry '$v': want name=flags, name of letters, digits and _ (unique)," \
             "entries separated by ';'" >&2
        exit 2
    fi
    VARIANT_FLAGS[$name]=${v#*=}; JOBS+=("var-$name")
done
unset _variants v name
if [ -n "$WINDOW_GIB" ] && [ ${#SCALING[@]} -gt 0 ]; then
    # scale-<subset> trains on a shard subset (--shards), which window mode cannot combine with
    echo "error: QUALITY_WINDOW_GIB streams the caches; QUALITY_SCALING trains on shard subsets of a whole cache" \
         "(unset one of them)" >&2
    exit 2
fi
TRAINS=(); for j in "${JOBS[@]}"; do case $j in train-*|scale-*|var-*) TRAINS+=("$j") ;; esac; done
for s in "${SETS[@]}"; do JOBS+=("eval-$s"); done

deps() {   # job -> jobs it needs
    case $1 in
        regen) ;;
        regen-more) echo regen ;;
        extract-val) [ -f "$Q/heldout.jsonl" ] || echo regen ;;   # a seed's held-out rows: beside regen
        extract-*) if [ ${#REGEN_MORE_FLAGS[@]} -gt 0 ]; then echo regen regen-more; else echo regen; fi ;;
        scale-*) echo "extract-lossless extract-val" ;;
        # a window trainer streams while extract-<codec> runs (ready) and starts beside extract-val: it opens the
        # validation cache at its first validation pass (session 19's trainer waited ~80 s for extract-val)
        train-seed*|var-*) [ -n "$WINDOW_GIB" ] || echo "extract-lossless extract-val" ;;
        train-*) [ -n "$WINDOW_GIB" ] || echo "extract-${1#train-} extract-val" ;;
        eval-*) echo "${TRAINS[*]}" ;;
    esac
}
ready() {   # job -> true once it can start beyond its deps: a window trainer once its cache has a spec
    [ -n "$WINDOW_GIB" ] || return 0
    case $1 in
        train-seed*|var-*) [ -f "$Q/cache-lossless/cache_spec.json" ] || return 1 ;;
        train-*) [ -f "$Q/cache-${1#train-}/cache_spec.json" ] || return 1 ;;
    esac
    return 0
}
window_group() {   # codec -> the output dirs of every trainer streaming cache-<codec> (comma list)
    local c=$1 j list=()
    for j in "${TRAINS[@]}"; do
        case $j in
            train-seed*|var-*) [ "$c" = lossless ] && list+=("$(train_dir "$j")") ;;
            train-*) [ "${j#train-}" = "$c" ] && list+=("$(train_dir "$j")") ;;
        esac
    done
    (IFS=,; echo "${list[*]}")
}
is_regen() { [ "$1" = regen ] || [ "$1" = regen-more ]; }
regen_file() { case $1 in regen) echo "$Q/regenerated.jsonl" ;; regen-more) echo "$Q/regenerated-more.jsonl" ;; esac; }
held_conversations() {   # source conversations up to the last held-out one (regen-more's --skip-samples)
    "$PY" - "$REGEN_SOURCE" "$Q/regenerated.jsonl" "$HELDOUT" <<'PY'
import itertools, json, sys
with open(sys.argv[2]) as f:
    held = {json.loads(line)["id"].rsplit("#", 1)[0] for line in itertools.islice(f, int(sys.argv[3]))}
with open(sys.argv[1]) as f:
    last = max(i for i, line in enumerate(f) if json.loads(line).get("id") in held)
print(last + 1)
PY
}
kind() { case $1 in regen|regen-more) echo regen ;; extract-*) echo extract ;; train-*|scale-*|var-*) echo train ;; eval-*) echo eval ;; esac; }
train_dir() { case $1 in train-*|scale-*|var-*) echo "$Q/$1" ;; esac; }   # a train job's output dir
drafter_name() { case $1 in train-*) echo "${1#train-}" ;; *) echo "$1" ;; esac; }   # its name in the eval

eval_drafters() {   # set -> the --drafter list of its eval job
    local s=$1 j list=()
    for j in "${TRAINS[@]}"; do
        [ "${j%%-*}" = scale ] && [ "$s" != heldout ] && continue
        list+=("$(drafter_name "$j")=$(train_dir "$j")/export")
    done
    (IFS=,; echo "${list[*]}")
}

eval_estimate() {   # seconds one eval job needs: target-only + lookup (~0.45 T forwards) + ~0.6 T per drafter
    # (a model of decoding every prompt in full; with QUALITY_EVAL_PROMPTS=0, every prompt, there is no count
    # to multiply: session 15 took 318-438 s a set with three drafters and --replay, session 18 149-213 s with one)
    [ "$EVAL_PROMPTS" = 0 ] && { echo "every prompt: session 18, one drafter, 149-213 s a set, three sets at once;" \
                                      "session 15, three drafters, 318-438 s"; return; }
    local n; n=$(eval_drafters "${1#eval-}" | tr ',' '\n' | wc -l)
    awk -v p="$EVAL_PROMPTS" -v t="$EVAL_TOKENS" -v n="$n" -v st="$EVAL_STEP_S" -v c="$EVAL_CONC" \
        'BEGIN { printf "%d s for all", 30 + p * t * (1.45 + 0.6 * n) * st * c }'
}

job_cmd() {   # the command of a job (array JOB_CMD)
    local j=$1 c s
    local common=(-m "$M" --target-model-cache-dir "$MODELS")
    # the first $HELDOUT regenerated conversations are held out: never trained on, extracted into cache-val
    # (training's --val-cache-dir) and decoded by the 'heldout' eval set
    local src=$Q/regenerated.jsonl; uses_data_dir && src=$Q/data   # regen's file and more (link_data)
    local data=(--data-source "$src" --data-skip-samples "$HELDOUT")
    local layout=$EXTRACT_LAYOUT
    [ "$layout" = auto ] && layout=$(cat "$Q/extract_layout.choice" 2>/dev/null)
    local xflags=("${EXTRACT_FLAGS[@]}"); [ -n "$layout" ] && [ "$layout" != auto ] && xflags+=(--attention-layout "$layout")
    case $j in
        regen)
            JOB_CMD=("$PY" -m dflash_pipe regenerate "${common[@]}" --source "$REGEN_SOURCE"
                     --skip-samples 0 --max-samples "$N_PROMPTS" -o "$Q/regenerated.jsonl" --max-turns 1
                     --max-new-tokens "$GEN_TOKENS" --batch-size "$GEN_BATCH" --device "$DEVICE" "${REGEN_FLAGS[@]}") ;;
        regen-more)   # the same decoding, more samples, never the held-out conversations (flags: last one wins)
            JOB_CMD=("$PY" -m dflash_pipe regenerate "${common[@]}" --source "$REGEN_SOURCE"
                     --max-samples 0 -o "$(regen_file regen-more)" --max-turns 1
                     --max-new-tokens "$GEN_TOKENS" --batch-size "$GEN_BATCH" --device "$DEVICE" "${REGEN_FLAGS[@]}"
                     --skip-samples "$(held_conversations)" "${REGEN_MORE_FLAGS[@]}") ;;
        extract-val)
            local held=$Q/regenerated.jsonl; [ -f "$Q/heldout.jsonl" ] && held=$Q/heldout.jsonl
            JOB_CMD=("$PY" -m dflash_pipe extract "${common[@]}" --data-source "$held"
                     --data-skip-samples 0 --data-max-samples "$HELDOUT" --codec lossless --cache-dir "$Q/cache-val"
                     --device "$DEVICE" "${xflags[@]}" --num-shards 2) ;;
        extract-*)
            c=${j#extract-}
            local window=()
            [ -n "$WINDOW_GIB" ] && window=(--max-cache-gib "$WINDOW_GIB")
            JOB_CMD=("$PY" -m dflash_pipe extract "${common[@]}" "${data[@]}" --codec "$c"
                     --cache-dir "$Q/cache-$c" --device "$DEVICE" "${window[@]}" "${xflags[@]}")
            # a 135 M target is host-bound (one writer thread per process): J processes over disjoint shards
            [ "$EXTRACT_JOBS" -gt 1 ] && JOB_CMD=("$PY" bench/extract_parallel.py --jobs "$EXTRACT_JOBS" -- "${JOB_CMD[@]}") ;;
        train-*|scale-*|var-*)
            local extra=()
            case $j in
                scale-*) c=lossless; s=${j#scale-}; s=${s//_/-}; extra=(--shards "${s//./,}" --epochs 200) ;;  # enough passes
                train-seed*) c=lossless; extra=(--seed "${j#train-seed}") ;;
                var-*) c=lossless; read -r -a extra <<< "${VARIANT_FLAGS[${j#var-}]}" ;;
                *) c=${j#train-} ;;
            esac
            # window: every trainer of cache-<codec> streams it as one group (a shard goes once all read it)
            [ -n "$WINDOW_GIB" ] && [ "${j%%-*}" != scale ] &&
                extra=(--follow --passes-per-shard "$PASSES" --window-group "$(window_group "$c")" "${extra[@]}")
            JOB_CMD=("$PY" -m dflash_pipe train -m "$M" --cache-dir "$Q/cache-$c" --output-dir "$(train_dir "$j")"
                     --max-steps "$TRAIN_STEPS" --resume auto --device "$DEVICE" --val-cache-dir "$Q/cache-val"
                     --val-every "$VAL_EVERY" --val-batches "$VAL_BATCHES" "${TRAIN_FLAGS[@]}" "${extra[@]}") ;;  # extra wins
        eval-*)
            s=${j#eval-}
            JOB_CMD=("$PY" -m dflash_pipe eval "${common[@]}" "${data[@]}" --drafter "$(eval_drafters "$s")"
                     --prompts "$s" --max-prompts "$EVAL_PROMPTS" --max-new-tokens "$EVAL_TOKENS"
                     --output-dir "$Q/$j" --train-output-dir "$Q/train-lossless" --device "$DEVICE" "${EVAL_FLAGS[@]}") ;;
    esac
}

job_ok() {   # the job's output really exists
    case $1 in
        regen) [ -s "$Q/regenerated.jsonl" ] ;;
        regen-more) [ -f "$Q/regenerated-more.jsonl" ] ;;   # may be empty: the cap came before it
        extract-*) [ -f "$Q/cache-${1#extract-}/manifest.json" ] ;;
        train-*|scale-*|var-*) [ -f "$(train_dir "$1")/export/config.json" ] ;;
        eval-*) [ -f "$Q/$1/eval_report.json" ] ;;
    esac
}

job_progress() {   # one line: how far an unfinished job got
    local j=$1
    case $j in
        regen|regen-more) "$PY" - "$(regen_file "$j").progress.json" "$N_PROMPTS" <<'PY' 2>/dev/null || echo "not started" ;;
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{s['rows_written'] + len(s['skipped'])}/{sys.argv[2]} prompts done ({s['rows_written']} written, "
      f"{len(s['skipped'])} skipped), {s['generated_tokens']:,} tokens in {s['seconds']:.0f} s")
PY
        extract-*) echo "$(ls "$Q/cache-${j#extract-}" 2>/dev/null | grep -c '^shard-.*\.json$') shards committed" ;;
        train-*|scale-*|var-*) local d last; d=$(train_dir "$j")
                 last=$(tail -n 1 "$d/metrics.jsonl" 2>/dev/null | sed -n 's/.*"step": \([0-9]*\).*/\1/p')
                 echo "step $(( ${last:--1} + 1 ))/$TRAIN_STEPS logged, checkpoints: $(cd "$d" 2>/dev/null && ls -d ckpt-* 2>/dev/null | tr '\n' ' ')" ;;
        eval-*) echo "$(wc -l < "$Q/$j/eval_progress.jsonl" 2>/dev/null || echo 0) prompts done (estimate: $(eval_estimate "$j"))" ;;
    esac
}
