# Drafters kept on main (bench/drafters/<name>/drafter_*.tar.part-*, ~37 MiB each: only main survives between
# sessions) would push every device call over its 64 MiB, so scripts/prepare_gpu_carry.sh moves bench/drafters
# out of the working tree into the git-ignored .drafters-aside/ (the device copies only files that exist) and
# `scripts/prepare_gpu_carry.sh --restore` puts it back. Sourced from the repository root; defines:
#   drafters_restore          .drafters-aside/drafters -> bench/drafters (refuses when both exist)
#   drafters_aside VAR...     bench/drafters -> .drafters-aside/drafters; each named variable holding a path under
#                             bench/drafters is rewritten to the same path under the aside copy

drafters_restore() {
    [ -d .drafters-aside/drafters ] || return 0
    if [ -e bench/drafters ]; then
        echo "error: both bench/drafters and .drafters-aside/drafters exist; keep one" >&2
        return 1
    fi
    mv .drafters-aside/drafters bench/drafters && rmdir .drafters-aside
}

drafters_aside() {
    [ -d bench/drafters ] || return 0
    mkdir -p .drafters-aside && mv bench/drafters .drafters-aside/drafters || return 1
    local v p
    for v in "$@"; do
        [ -n "${!v:-}" ] || continue
        p=$(realpath -m --relative-to=. "${!v}")
        case $p in bench/drafters|bench/drafters/*) printf -v "$v" '%s' ".drafters-aside/drafters${p#bench/drafters}" ;; esac
    done
    echo "bench/drafters moved to .drafters-aside/ for the device calls: scripts/prepare_gpu_carry.sh --restore puts it back"
}
