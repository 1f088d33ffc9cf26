# The run as a background daemon that outlives the device call which started it (sourced by bench/quality_gpu.sh).
# A call's processes are killed when its command returns, except those of a new session (setsid), which run on until
# the machine goes back. So instead of one `run` per call, each stopping at its deadline and restarting every job in
# the next call (~25 s of restarts and a compile per call, and the GPU idle between calls), `bg` starts one `run`
# with a deadline that covers the whole run, and every call after it only watches:
#   bash bench/quality_gpu.sh bg      copies the repo (with this call's .gpucarry) to $Q/repo, starts
#                                     `run` there under setsid (OUT=$Q/bgout, QUALITY_DEADLINE_S=$QUALITY_BG_DEADLINE_S,
#                                     sourcing $QUALITY_ENV first), then watches like `watch`
#   bash bench/quality_gpu.sh watch   waits until the run ends or this call's QUALITY_DEADLINE_S is near, then copies
#                                     home what the run made: status, log tails, each finished drafter's parts (once),
#                                     while an eval runs, results.tar.gz with its per-prompt progress, and the rows
#                                     regen wrote since the last call (regen_*rows_<start>-<end>.tar, each row once),
#                                     and every QUALITY_PARTIAL_HOME_S (360) a running trainer's newest checkpoint,
#                                     exported, in $OUT/partial/ (bench/drafter_parts.py pack-checkpoint)
# Exit codes: 75 the run goes on (call `watch` again within 30 s), else the run's own (0 complete, 3 carry missing,
# 75 its deadline came with work left: `bg` again continues it, every job resumes). The machine still goes after 30 s
# without a call: what went home is what bench/quality_home.sh's recovery starts from.

bg_alive() { [ -f "$Q/bg.pid" ] && kill -0 "$(cat "$Q/bg.pid")" 2>/dev/null; }

bg_start() {
    if bg_alive; then say "bg: the run is already going (pid $(cat "$Q/bg.pid")): watching it"; return 0; fi
    rm -rf "$Q/repo" "$Q/bg.rc" && mkdir -p "$Q/repo" "$Q/bgout" || fail "bg: cannot make $Q/repo"
    # its own copy: the next call replaces this tree (and drops paths it does not carry) while the run reads it;
    # the tree and this call's .gpucarry, not what is ignored and big (a local .venv, wheels, runs)
    tar -C "$REPO" --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./runs --exclude=__pycache__ \
        -cf - . | tar -C "$Q/repo" -xf - || fail "bg: cannot copy the repo to $Q/repo"
    local env=${QUALITY_ENV:-} bgs=${QUALITY_BG_DEADLINE_S:-1400}
    [ -z "$env" ] || [ -f "$Q/repo/$env" ] || fail "bg: QUALITY_ENV=$env is not a file in the repo"
    case $PY in /*|"${PY##*/}") ;; *) export DFLASH_PYTHON=$REPO/$PY ;; esac   # a relative path: from the repo, not the copy
    # shellcheck disable=SC2016
    setsid bash -c 'q=$3; echo $$ > "$q/bg.pid"; cd "$q/repo" || exit 1
        if [ -n "$1" ]; then source "$1" || exit 1; fi
        QUALITY_DIR=$q OUT=$q/bgout QUALITY_DEADLINE_S=$2 bash bench/quality_gpu.sh run; echo $? > "$q/bg.rc.tmp"
        mv "$q/bg.rc.tmp" "$q/bg.rc"' _ "$env" "$bgs" "$Q" > "$Q/logs/bg.log" 2>&1 < /dev/null &
    local i; for i in 1 2 3 4 5 6 7 8 9 10; do [ -f "$Q/bg.pid" ] && break; sleep 0.2; done
    say "bg: started the run in the background (pid $(cat "$Q/bg.pid" 2>/dev/null), deadline ${bgs}s${env:+, $env})"
}

bg_watch() {
    local rc=75 f j
    [ -f "$Q/bg.pid" ] || { say "bg: no background run on this machine (fresh machine? start again at call A)"; exit 3; }
    while :; do
        if [ -f "$Q/bg.rc" ]; then rc=$(cat "$Q/bg.rc"); break; fi
        bg_alive || { sleep 1; [ -f "$Q/bg.rc" ] && continue; say "bg: the run died without an exit code"; rc=1; break; }
        [ "$(left)" -le "${QUALITY_WATCH_RESERVE_S:-20}" ] && break
        sleep 3
    done
    touch "$Q/bg.sent"
    for f in "$Q"/bgout/*; do
        [ -f "$f" ] || continue
        case $(basename "$f") in
            drafter_*.part-*|kernels_*.part-*|regen_*rows_*)   # big, made once: home in the first call that sees them
                grep -qxF "$(basename "$f")" "$Q/bg.sent" && continue
                cp "$f" "$OUT/" && basename "$f" >> "$Q/bg.sent" ;;
            *) cp "$f" "$OUT/" ;;
        esac
    done
    # while the run is still evaluating, its per-prompt records go home in results.tar.gz (EVAL_PROGRESS=...)
    if [ "$rc" = 75 ] && compgen -G "$Q/eval-*/eval_progress.jsonl" > /dev/null; then
        timeout 40 "$PY" bench/quality_report.py --dir "$Q" --out "$OUT" >> "$Q/logs/report.log" 2>&1 ||
            say "bg: bench/quality_report.py failed (logs/report.log)"
    fi
    # a running trainer's newest checkpoint, exported, every QUALITY_PARTIAL_HOME_S (one job a call: 3 of the 8 files)
    if [ "$rc" = 75 ]; then for j in "${TRAINS[@]}"; do partial_out "$j" && break; done; fi
    # regen's rows so far go home in every call (bench/regen_seed.py ship, each row once): a machine lost
    # mid-regen costs the rows of its last call, not the session's (session 19 lost a data session's at its end)
    for j in regen regen-more; do
        f=$(( 8 - $(find "$OUT" -maxdepth 3 -type f | wc -l) ))
        [ "$f" -gt 0 ] && regen_rows_out "$j" "$OUT" "$f"
    done
    trim_out
    cat "$OUT/status.txt" 2>/dev/null; tail -n 12 "$Q/logs/driver.log"
    ls -l "$OUT"
    [ "$rc" = 75 ] && ! [ -f "$Q/bg.rc" ] &&
        say "bg: the run goes on; call 'bash bench/quality_gpu.sh watch' within 30 s (carry nothing)"
    exit "$rc"
}
