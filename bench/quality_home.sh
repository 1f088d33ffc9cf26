# What leaves the lent GPU machine for home in the call that made it, and what comes back from home to a fresh
# machine (sourced by bench/quality_gpu.sh after bench/quality_jobs.sh). The machine's disk lasts only while it
# stays warm, 30 s after a call; sessions 16 and 17 each lost a run when the next call found a new machine.
#   regen's new rows   -> $OUT/regen_rows_<start>-<end>.tar (regen-more: regen_more_rows_...), bench/regen_seed.py
#                         `ship`: in every `watch` while regen writes, and at its end, each row once, with the
#                         sidecar; `merge` at home makes them the next seed (QUALITY_REGEN_SEED / _MORE_SEED)
#   a finished drafter -> $OUT/drafter_<name>.tar.part-K-of-N, bench/drafter_parts.py; at home
#                         DRAFTER_PARTS=<dir> scripts/prepare_gpu_carry.sh puts them in .gpucarry/d0, d1, ..., the
#                         stash calls carry them, and setup restores the export and marks its train job done, so a
#                         fresh machine evaluates it without extracting or training again
#   a drafter to start from (train --init-from, e.g. a second pass over the same data in a later session): its parts
#                         from home, INIT_PARTS=<dir> scripts/prepare_gpu_carry.sh -> .gpucarry/i0, i1, ...; setup
#                         unpacks them to $Q/init/<name> (QUALITY_TRAIN_FLAGS="... --init-from $Q/init/<name>")
#   an unfinished eval -> its eval_progress.jsonl in results.tar.gz; at home EVAL_PROGRESS=<results.tar.gz>
#                         scripts/prepare_gpu_carry.sh puts them in .gpucarry/ev (carried with call T), and
#                         setup puts them back, so the eval continues where the lost machine left it

regen_rows_out() {   # job [out] [max files]: its rows written since the last ship (never its seed's) -> out
    local j=$1 out=${2:-$OUT} max=${3:-} seed
    [ -f "$(regen_file "$j")" ] || return 0
    seed=$(cat "$Q/$( [ "$j" = regen ] && echo seed || echo seed-more ).rows" 2>/dev/null || echo 0)
    [ -n "$max" ] || max=$( [ -n "${QUALITY_DATA_ONLY:-}" ] && echo 5 || echo 1 )
    "$PY" bench/regen_seed.py ship --file "$(regen_file "$j")" --seed-rows "$seed" --out "$out" \
        --name "${j//-/_}_rows" --max-files "$max" 2>&1 | while read -r line; do say "$line"; done
}

parts_name() { local n; n=$(drafter_name "$1"); echo "${n//-/_}"; }   # train job -> its parts' name

partial_out() {   # a running train job's newest checkpoint, exported -> $OUT/partial/ (PARTIAL.json inside), when
    # QUALITY_PARTIAL_HOME_S (360 s) have passed since its last send: a machine lost before the job ends costs the
    # steps after it (session 22 lost a pass 450 steps from its end), and the parts evaluate like a finished drafter's
    local j=$1 d stamp="$Q/partial-$1.step" every=${QUALITY_PARTIAL_HOME_S:-360}
    d=$(train_dir "$j")
    [ "$every" -gt 0 ] && [ -d "$d" ] && ! [ -f "$d/export/config.json" ] || return 1
    [ "$(find "$OUT" -maxdepth 3 -type f | wc -l)" -le 5 ] || return 1   # its 3 parts must fit the 8 files
    [ -f "$stamp" ] && [ $(( $(date +%s) - $(stat -c %Y "$stamp") )) -lt "$every" ] && return 1
    timeout 60 "$PY" bench/drafter_parts.py pack-checkpoint --train-dir "$d" --out "$OUT/partial" \
        --name "$(parts_name "$j")" --sent "$stamp" 2>&1 | while read -r line; do say "$line"; done
    compgen -G "$OUT/partial/drafter_*" > /dev/null
}

drafter_out() {   # train job: its export -> $OUT in parts
    "$PY" bench/drafter_parts.py pack --export "$(train_dir "$1")/export" --out "$OUT" --name "$(parts_name "$1")" \
        2>&1 | while read -r line; do say "$line"; done
}

restore_drafters() {   # drafters carried from home: unpacked where their train job leaves its export; job done
    local j
    [ -d "$CARRY/drafter" ] || return 0
    for j in "${TRAINS[@]}"; do
        is_done "$j" && continue
        compgen -G "$CARRY/drafter/drafter_$(parts_name "$j").tar.part-*" > /dev/null || continue
        "$PY" bench/drafter_parts.py unpack --parts "$CARRY/drafter" --name "$(parts_name "$j")" \
            --dest "$(train_dir "$j")/export" >> "$Q/logs/setup.log" 2>&1 && job_ok "$j" ||
            fail "the drafter of $j carried from home does not unpack (logs/setup.log): carry all its parts again"
        date -u +%FT%TZ > "$Q/done/$j"; echo restored > "$Q/done/$j.restored"
        say "setup: $j restored from its parts carried from home (trained in an earlier call)"
    done
}

unpack_bundles() {   # kind dir dest_root what: each complete <kind>_<name>.tar.part-* set in dir -> dest_root/<name>/
    local kind=$1 dir=$2 root=$3 what=$4 part name
    for part in "$dir/${kind}"_*.tar.part-0-of-*; do
        [ -f "$part" ] || continue
        name=${part##*/"${kind}"_}; name=${name%%.tar.part-*}
        [ -d "$root/$name" ] && continue   # unpacked by an earlier call (unpack renames a complete directory in)
        "$PY" bench/drafter_parts.py unpack --kind "$kind" --parts "$dir" --name "$name" --dest "$root/$name" \
            >> "$Q/logs/setup.log" 2>&1 || fail "the $what $name does not unpack (logs/setup.log): carry all its parts again"
        say "setup: $what $name unpacked to $root/$name: $(ls "$root/$name" | tr '\n' ' ')"
    done
}
restore_init() { unpack_bundles drafter "$CARRY/init" "$Q/init" "--init-from drafter"; }   # INIT_PARTS

# The trainer's compiled kernels (Triton + Inductor caches, DFLASH_LOCAL_CACHE=$Q/kernels, train-rank0/): a compiled
# trainer's first step costs ~190 s cold on the H200 and ~21 s warm (session 17), so a run that compiles sends its
# cache home once, after its first train job (kernels_train_rank0.tar.part-K-of-N, at most QUALITY_KERNELS_MAX_MIB),
# and KERNEL_PARTS=<dir> scripts/prepare_gpu_carry.sh carries it back; setup puts it where the trainer looks.
compiles() { [[ " ${TRAIN_FLAGS[*]} " == *" --compile on "* ]] || [ -n "${QUALITY_KERNELS_OUT:-}" ]; }
kernels_out() {   # after a train job: the cache -> $OUT in parts, once, unless it came from home or is too big
    local dir=$Q/kernels/train-rank0 rc
    compiles && [ -d "$dir" ] && [ ! -f "$Q/done/kernels.sent" ] && [ ! -f "$Q/kernels/restored" ] || return 0
    [ -n "$(find "$dir" -type f -print -quit)" ] || return 0      # nothing compiled (an eager trainer's empty dirs)
    # the cap is on the zstd-compressed bundle (session 24's cache: 109 MiB raw); 30 MiB = 2 parts, which with the
    # drafter's 3 keeps the call within the 8 files the device returns (trim_out)
    "$PY" bench/drafter_parts.py pack --kind kernels --export "$dir" --out "$OUT" --name train_rank0 \
        --max-mib "${QUALITY_KERNELS_MAX_MIB:-30}" > "$Q/logs/kernels_pack.log" 2>&1
    rc=$?
    while read -r line; do say "$line"; done < "$Q/logs/kernels_pack.log"
    [ "$rc" -eq 0 ] || say "kernels: the compile cache ($(du -sm "$dir" | cut -f1) MiB raw) is over QUALITY_KERNELS_MAX_MIB=${QUALITY_KERNELS_MAX_MIB:-30} packed: not sent"
    date -u +%FT%TZ > "$Q/done/kernels.sent"
}
restore_kernels() {   # KERNEL_PARTS: a compile cache from an earlier machine, before any trainer starts
    local dest=$Q/kernels/train-rank0
    compgen -G "$CARRY/kernels/kernels_train_rank0.tar.part-*" > /dev/null && [ ! -f "$Q/kernels/restored" ] || return 0
    "$PY" bench/drafter_parts.py unpack --kind kernels --parts "$CARRY/kernels" --name train_rank0 --dest "$dest" \
        >> "$Q/logs/setup.log" 2>&1 || fail "the compile cache carried from home does not unpack (logs/setup.log)"
    date -u +%FT%TZ > "$Q/kernels/restored"
    say "setup: the trainer's compile cache restored to $dest ($(du -sm "$dest" | cut -f1) MiB)"
}
restore_data_bundles() { unpack_bundles data "$CARRY/databundle" "$CARRY/files" "data bundle"; }   # DATA_PARTS

uses_data_dir() { [ ${#REGEN_MORE_FLAGS[@]} -gt 0 ] || [ -n "${QUALITY_EXTRA_DATA:-}" ]; }

# QUALITY_EXTRA_DATA="<file> ...": regenerated rows beyond regen's and regen-more's files (.jsonl, .jsonl.gz or
# .jsonl.xz; e.g. a data bundle's file, /tmp/quality/carry/files/<name>/<file>), read by extraction after them.
# None may hold a held-out conversation (the first QUALITY_HELDOUT rows of regen's file): refused if one does.
link_data() {
    uses_data_dir || return 0
    mkdir -p "$Q/data" && ln -sfn ../regenerated.jsonl "$Q/data/0-regenerated.jsonl" || fail "cannot make $Q/data"
    if [ ${#REGEN_MORE_FLAGS[@]} -gt 0 ]; then
        touch "$Q/regenerated-more.jsonl" && ln -sfn ../regenerated-more.jsonl "$Q/data/1-regenerated-more.jsonl"
    fi
    local i=2 f
    for f in ${QUALITY_EXTRA_DATA:-}; do
        [ -f "$f" ] || fail "QUALITY_EXTRA_DATA: $f is not a file (a data bundle not carried? DATA_PARTS=<dir> scripts/prepare_gpu_carry.sh)"
        if [ ! -s "$Q/extra-$i.jsonl" ]; then
            local tmp=$Q/extra-$i.jsonl.tmp   # (the heredoc's line must end the command: the || stays on it)
            "$PY" - "$f" "$tmp" "$Q/regenerated.jsonl" "$HELDOUT" <<'PY' || { rm -f "$tmp"; fail "QUALITY_EXTRA_DATA: $f refused (above)"; }
import gzip, itertools, json, lzma, sys
src, dest, regen, heldout = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
base = lambda i: i.split("#")[0]  # a sample id's conversation
with open(regen, encoding="utf-8") as f:
    held = {base(json.loads(line)["id"]) for line in itertools.islice(f, heldout)}
opener = lzma.open if src.endswith(".xz") else gzip.open if src.endswith(".gz") else open
n = 0
with opener(src, "rt", encoding="utf-8") as f, open(dest, "w", encoding="utf-8") as o:
    for n, line in enumerate(f, 1):
        if base(json.loads(line)["id"]) in held:
            sys.exit(f"{src} row {n}: conversation {json.loads(line)['id']!r} is held out (one of the first {heldout} "
                     "of regen's file): regenerate it without the held-out conversations")
        o.write(line)
print(f"{n} rows", file=sys.stderr)
PY
            mv "$tmp" "$Q/extra-$i.jsonl"
            say "setup: extra data $((i - 1)): $(wc -l < "$Q/extra-$i.jsonl") rows from $f"
        fi
        ln -sfn "../extra-$i.jsonl" "$Q/data/$i-extra.jsonl"
        i=$((i + 1))
    done
}

restore_eval_progress() {   # an unfinished eval's per-prompt records carried from home: the eval resumes from them
    local s f                   # (its run key names the drafter by content, so the restored export matches)
    for s in "${SETS[@]}"; do
        f=$CARRY/eval/eval-$s.eval_progress.jsonl
        [ -f "$f" ] && ! is_done "eval-$s" && [ ! -s "$Q/eval-$s/eval_progress.jsonl" ] || continue
        mkdir -p "$Q/eval-$s" && cp "$f" "$Q/eval-$s/eval_progress.jsonl" &&
            say "setup: eval-$s resumes from $(wc -l < "$f") prompt records carried from home"
    done
}

not_needed() {   # job: true for a data job (regen, extract) once every drafter is done (e.g. restored from home),
    # and for every job after regen in a data session (QUALITY_DATA_ONLY=1: regenerate, bring the rows home, stop)
    [ -n "${QUALITY_DATA_ONLY:-}" ] && [ "$(kind "$1")" != regen ] && return 0
    case $(kind "$1") in regen|extract) ;; *) return 1 ;; esac
    local t; for t in "${TRAINS[@]}"; do is_done "$t" || return 1; done
}

trim_out() {   # the device returns at most 8 files of $OUT: drop, in this order, what a later call makes again
    local f n
    for f in quality.png summary.json logs_tail.txt; do
        n=$(find "$OUT" -maxdepth 3 -type f | wc -l); [ "$n" -le 8 ] && return 0
        rm -f "$OUT/$f" && say "\$OUT held $n files (the device returns 8): left out $f"
    done
}

stash_into() {   # dest files...: the files that exist (an unmatched glob stays a pattern) copied into dest
    local dest=$1 f; shift
    for f in "$@"; do [ -f "$f" ] && mkdir -p "$dest" && cp "$f" "$dest/"; done
    return 0
}

# the carried paths of this call (.gpucarry/...) -> $CARRY, which stays on the machine while it is warm
stash() {
    mkdir -p "$CARRY/data"
    local n=0 f
    for f in "$SRC"/p[0-9]/smollm2.gguf.part-[0-9]; do
        if [ -f "$f" ] && [ ! -f "$Q/smollm2.gguf" ]; then cp "$f" "$CARRY/"; n=$((n + 1)); fi
    done
    if [ -d "$SRC/data" ]; then cp -r "$SRC/data/." "$CARRY/data/"; fi
    if [ -d "$SRC/whl" ]; then mkdir -p "$CARRY/whl" && cp "$SRC/whl/"*.whl "$CARRY/whl/"; fi   # setup installs them
    # parts and records carried from home by prepare_gpu_carry.sh: drafters trained earlier (DRAFTER_PARTS, d*),
    # data bundles (DATA_PARTS, x*), drafters to start from (INIT_PARTS, i*), an eval's records (EVAL_PROGRESS, ev)
    stash_into "$CARRY/drafter" "$SRC"/d*/drafter_*.tar.part-*
    stash_into "$CARRY/databundle" "$SRC"/x*/data_*.tar.part-*
    stash_into "$CARRY/init" "$SRC"/i*/drafter_*.tar.part-*
    stash_into "$CARRY/kernels" "$SRC"/k*/kernels_*.tar.part-*
    stash_into "$CARRY/eval" "$SRC"/ev/eval-*.eval_progress.jsonl
    # the ShareGPT prompt files travel in the turns call (.gpucarry/turns; in data/ before session 13) and are
    # decompressed here: first turns (regen's default source) and every user turn (QUALITY_REGEN_SOURCE=all_turns)
    local kind gz
    for kind in first_turns all_turns; do
        [ -f "$CARRY/data/sharegpt_$kind.jsonl" ] && continue
        for gz in "$SRC/turns/sharegpt_$kind.jsonl.gz" "$CARRY/data/sharegpt_$kind.jsonl.gz"; do
            [ -f "$gz" ] || continue
            gzip -dc "$gz" > "$CARRY/data/sharegpt_$kind.jsonl.tmp" &&
                mv "$CARRY/data/sharegpt_$kind.jsonl.tmp" "$CARRY/data/sharegpt_$kind.jsonl"
            break
        done
    done
    say "stash: $n GGUF part(s) and $(ls "$CARRY/data" 2>/dev/null | wc -l) data entries in $CARRY"
    ls -la "$CARRY" "$CARRY/data" | tee "$OUT/status.txt"
}

# A regenerated file kept from an earlier run (bench/data/, with its progress sidecar) seeds regen: the regen
# job then only answers the prompts beyond it (a larger QUALITY_N_PROMPTS extends it, `dflash-pipe regenerate`
# resumes by id). Used only if it was made from this same source path; QUALITY_REGEN_SEED="" disables it.
# bench/data/smollm2_all_turns_greedy4.jsonl.xz is the every-turn data of sessions 14-17 (bench/runs/quality19c.env's
# regen settings; 65,520 rows, 38.3 M generated tokens after session 17); bench/runs/quality19i.env continues from it.
seed_regenerated() {
    local seed=${QUALITY_REGEN_SEED-$REPO/bench/data/smollm2_regenerated_sharegpt.jsonl.gz} rows
    # a regen file seeded under another env (e.g. a tool that ran setup without this run's QUALITY_ENV) would be
    # continued as if it were this run's: stop here instead of training on the wrong data
    if [ -n "$seed" ] && [ -s "$Q/regenerated.jsonl" ] && [ -f "$Q/seed.from" ] &&
            [ "$(cat "$Q/seed.from")" != "$(basename "$seed")" ]; then
        fail "setup: $Q/regenerated.jsonl was seeded from $(cat "$Q/seed.from"), this run's seed is" \
             "$(basename "$seed"): run with the env that made it, or in another QUALITY_DIR"
    fi
    seed_file "$seed" "$Q/regenerated.jsonl" regen || return 0
    basename "$seed" > "$Q/seed.from"
    rows=$(wc -l < "$Q/regenerated.jsonl"); echo "$rows" > "$Q/seed.rows"   # regen_rows_out skips these
    say "setup: regen seeded with $rows conversations from ${seed#$REPO/}"
    # the held-out rows are the seed's first $HELDOUT: in a file of their own, extract-val needs no regen and
    # runs beside it (the file only grows at its end, so they are the same rows regen's output starts with)
    if [ "$rows" -gt "$HELDOUT" ]; then
        head -n "$HELDOUT" "$Q/regenerated.jsonl" > "$Q/heldout.jsonl.tmp" && mv "$Q/heldout.jsonl.tmp" "$Q/heldout.jsonl"
    fi
    # regen-more's own seed (QUALITY_REGEN_MORE_SEED, e.g. bench/data/smollm2_all_turns_sample4.jsonl.xz: session
    # 17's answers #4), resumed the same way; its sidecar must carry the settings regen-more runs with
    if [ ${#REGEN_MORE_FLAGS[@]} -gt 0 ] && [ -n "${QUALITY_REGEN_MORE_SEED:-}" ] &&
            seed_file "$QUALITY_REGEN_MORE_SEED" "$Q/regenerated-more.jsonl" regen-more; then
        rows=$(wc -l < "$Q/regenerated-more.jsonl"); echo "$rows" > "$Q/seed-more.rows"
        say "setup: regen-more seeded with $rows rows from ${QUALITY_REGEN_MORE_SEED#$REPO/}"
    fi
}

seed_file() {   # seed dest label: decompress a kept regenerated file (.jsonl.gz/.xz + its .progress.json) to dest
    local seed=$1 dest=$2 side=${1%.jsonl.*}.progress.json    # (python's lzma: the image has no xz)
    [ -n "$seed" ] && [ -f "$seed" ] && [ -f "$side" ] && [ ! -s "$dest" ] || return 1
    if ! "$PY" - "$side" "$REGEN_SOURCE" <<'PY'
import json, sys
sys.exit(0 if json.load(open(sys.argv[1]))["settings"].get("source") == sys.argv[2] else 1)
PY
    then
        say "setup: not seeding $3 from ${seed#$REPO/} (made from another source path)"; return 1
    fi
    "$PY" -c 'import gzip, lzma, shutil, sys
with (lzma.open if sys.argv[1].endswith(".xz") else gzip.open)(sys.argv[1]) as f, open(sys.argv[2], "wb") as o:
    shutil.copyfileobj(f, o)' "$seed" "$dest.tmp" && cp "$side" "$dest.progress.json" && mv "$dest.tmp" "$dest"
}

# QUALITY_SHARE_FROM=<an earlier run's QUALITY_DIR on this machine>: a second run in its own QUALITY_DIR (e.g. a data
# session after a training run, bench/runs/quality19k.env) starts from what the first one stashed and built, without
# the stash calls again: reads that run's carry, links its GGUF and model cache (done/, logs and data stay apart)
share_from_earlier_run() {
    local from=${QUALITY_SHARE_FROM:-} p
    [ -n "$from" ] || return 0
    [ "$(cd "$from" 2>/dev/null && pwd -P)" != "$(cd "$Q" && pwd -P)" ] || fail "QUALITY_SHARE_FROM=$from is this run's own QUALITY_DIR"
    [ -d "$from/carry" ] || { say "QUALITY_SHARE_FROM=$from has no carry/ (fresh machine? start again at call A)"; finish 3; }
    # the carry by its own path, not a link: regen's seeds name their source file, and resume only from that path
    CARRY=$(cd "$from/carry" && pwd -P); REGEN_SOURCE=$CARRY/${REGEN_SOURCE#"$Q/carry/"}
    for p in smollm2.gguf models; do
        [ -e "$from/$p" ] && [ ! -e "$Q/$p" ] && ln -s "$(cd "$from" && pwd -P)/$p" "$Q/$p"
    done
    say "setup: shares $from's carry ($CARRY), GGUF and model cache"
}
