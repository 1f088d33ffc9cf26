# What leaves the lent GPU machine for home in the call that made it, and what comes back from home to a fresh
# machine (sourced by bench/quality_gpu.sh after bench/quality_jobs.sh). The machine's disk lasts only while it
# stays warm, 30 s after a call; sessions 16 and 17 each lost a run when the next call found a new machine.
#   regen's new rows   -> $OUT/regen_rows_0.jsonl.xz (regen-more: regen_more_rows_0...), bench/regen_seed.py;
#                         `merge` at home makes them the next seed (QUALITY_REGEN_SEED / QUALITY_REGEN_MORE_SEED)
#   a finished drafter -> $OUT/drafter_<name>.tar.part-K-of-N, bench/drafter_parts.py; at home
#                         DRAFTER_PARTS=<dir> scripts/prepare_gpu_carry.sh puts them in .gpucarry/d0, d1, ..., the
#                         stash calls carry them, and setup restores the export and marks its train job done, so a
#                         fresh machine evaluates it without extracting or training again

regen_rows_out() {   # job: the rows after its seed's (regen: seed.rows; regen-more: seed-more.rows, or all)
    local skip; skip=$(cat "$Q/$( [ "$1" = regen ] && echo seed || echo seed-more ).rows" 2>/dev/null || echo 0)
    "$PY" bench/regen_seed.py out --file "$(regen_file "$1")" --skip "$skip" --out "$OUT" --name "${1//-/_}_rows" \
        2>&1 | while read -r line; do say "$line"; done
}

parts_name() { local n; n=$(drafter_name "$1"); echo "${n//-/_}"; }   # train job -> its parts' name

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

not_needed() {   # job: true for a data job (regen, extract) once every drafter is done (e.g. restored from home)
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
