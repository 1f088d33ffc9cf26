#!/usr/bin/env bash
# The GPU benchmarks of BENCHMARKS.md, one sub-command each, for a bare CUDA machine with no network
# (the lent H200): installs the carried wheels, runs each step under its own time limit, writes JSON and
# logs to $OUT (default bench/results/out). Steps run in the order given:
#   bench/gpu_bench.sh extract flex train gputests
#     extract   bench/extract_throughput.py: 27B-shaped hybrid, full path vs forward-only (+ profile)
#     flex      bench/flex_kernel.py: flex_attention tile sizes at the seed's mask
#     train     bench/train_step.py at the seed's config with the fastest flex tiles from `flex`
#     trainsmol the quality runs' 5-layer drafter step (SmolLM2 width, 8,192 context tokens): TRAINSMOL_RUNS, each
#               "anchors:variants" (default "512:eager-sdpa,eager-grouped 1024:eager-grouped 2048:eager-grouped"), after the
#               grouped path's GPU tests (random weights; zstandard from GPU_WHEELS: after the quality stash calls,
#               GPU_WHEELS=/tmp/quality/carry/whl; TRAINSMOL_FLAGS e.g. "--group-blocks 16")
#     topk      bench/topk_kernel.py: torch.topk vs the two-stage top-k on one logits block
#     stats     bench/sanity_stats_kernel.py: batched feature_stats vs the per-document loop
#     draft     bench/draft_step.py: one inference drafting step, context K/V cache vs recompute (both shapes)
#     hybrid    bench/hybrid_eval_step.py: speculative step time vs context (1k-8k), 27B-shaped hybrid, rollback mode
#     evaltests pytest -m gpu of the eval's GPU tests only (hybrid rollback on the 27B shape, graphed engine/drafter,
#               batched references)
#     loader    the loader's decode rate, 256 vs 64 MiB row groups interleaved (CPU side of the host)
#     evalspeed bench/eval_speed.py: eval on --per-set prompts of each set, projected to all 544 (needs smollm2)
#     window    bench/window_stream.py: extract + train --follow on one GPU within a 0.6 GiB budget (needs smollm2)
#     windowq   bench/window_quality.py: window over 1/4 of the data (K = 4) vs 4 epochs, held-out sim tau (needs smollm2)
#     smallgemm bench/small_gemm.py: batch-1 linear formulations (M 1 / 16) and SDPA vs explicit attention, fp32
#     evalprofile bench/eval_profile.py: ms/token of each eval method at batch 1 + a profiler table (needs smollm2)
#     objstore  bench/objstore_loader.py at the seed's shape, s3:// via loopback rclone vs local (GPU_WHEELS with .gpucarry/rclone)
#     gputests  pytest -m gpu (the whole GPU suite: 57 of its 77 tests took 540 s on the H100 in session 32, so it
#               no longer fits one 600 s call; gputests-a and gputests-b split it over two calls)
#     gputests-a  pytest -m gpu of everything but tests/test_target* and tests/test_train*
#     gputests-b  pytest -m gpu of tests/test_target* and tests/test_train* (FLA runner, trainer; carry .whl/gpu)
#     smollm2   (first) reassemble the carried SmolLM2 GGUF and data for the steps after it
#     regentests  pytest -m gpu of the static-KV engine (graphs == eager, no syncs), the per-row decode attention,
#               regenerate's overlap mode (staged prefills on a side stream == the direct path, no syncs) and the
#               chunked prefill (graphed == eager == padded) and the fused RoPE / SwiGLU kernels
#     attntune  bench/decode_attention_tune.py: the per-row attention kernel's launch configurations swept on the
#               decode and chunked-prefill shapes (no carry)
#     launchq   bench/launch_queue.py: how many decode steps the host queues ahead of a busy device before a
#               launch call blocks (random SmolLM2-shaped weights: needs no carry)
#     decodeprof  bench/decode_step_profile.py: the batch-1024 decode step and a prefill call, per-row vs padded SDPA
#               attention, with profiler tables (random SmolLM2-shaped weights: needs no carry)
#     prefill   bench/prefill_layouts.py: regenerate's prefills of the real prompt lengths, padded vs chunked
#               (random SmolLM2-shaped weights: needs no carry); PREFILL_FLAGS
#     overlap   bench/prefill_overlap.py: how much of a staged prefill on the side stream still costs the decode
#               (regenerate --overlap-prefill; random SmolLM2-shaped weights: needs no carry)
#     regen     bench/regen_throughput.py: regenerate vs the bare graphed decode loop vs HF generate (needs smollm2);
#               REGEN_FLAGS (default "--batch 1024,2048") e.g. "--batch 1024 --prompts 16384 --overlap off,on"
# Wheels: .whl/gpu holds flash-linear-attention + fla-core 0.6.0 and zstandard (the image has neither);
# carry it (device `carry: [".whl/gpu"]`). Limits per step: EXTRACT_S, FLEX_S, TRAIN_S, TESTS_S seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# GPU_WHEELS: the carried wheel folders (default .whl/gpu); a call short of carry room can split them,
# e.g. GPU_WHEELS=".whl/zstd" for flex/train (no FLA needed) and GPU_WHEELS=".whl/fla .gpucarry/whl" later
WHEELS=$(for d in ${GPU_WHEELS:-.whl/gpu}; do ls "$d"/*.whl 2>/dev/null; done)
if [ -n "$WHEELS" ]; then
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $WHEELS || exit 4
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)' | tee -a "$OUT/machine.txt"

step() {  # name limit command...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s) $(date -u +%T)"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0))s"
    tail -n 25 "$OUT/$name.log"
}

for what in "$@"; do
    case $what in
        # real SmolLM2 weights for the steps after it: calls A and T ran `bash bench/quality_gpu.sh stash` (GGUF
        # parts 0-1 + eval prompts, then the ShareGPT prompt files); this call carries parts 2-3 + .gpucarry/whl
        # (see scripts/prepare_gpu_carry.sh)
        smollm2) echo "=== smollm2 $(date -u +%T)"
                 bash bench/quality_gpu.sh setup || exit 3
                 export DFLASH_SMOLLM2_GGUF=/tmp/quality/smollm2.gguf DFLASH_PROMPTS_DIR=/tmp/quality/carry/data/prompts
                 export PYTHONPATH=/tmp/quality/site:$PYTHONPATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
                 export SHAREGPT_FIRST_TURNS=/tmp/quality/carry/data/sharegpt_first_turns.jsonl ;;
        extract) step extract "${EXTRACT_S:-300}" python3 bench/extract_throughput.py --batches 16 --warmup 1 \
                     --workers 8 --shards-per-pass 2 --profile 2 --json "$OUT/extract_throughput.json" ;;
        flex) step flex "${FLEX_S:-420}" python3 bench/flex_kernel.py --variants "${FLEX_VARIANTS:-all}" \
                  --json "$OUT/flex_kernel.json" ;;
        train) step train "${TRAIN_S:-330}" python3 bench/train_step.py --variants "${TRAIN_VARIANTS:-compiled-fused}" \
                   --steps 20 --warmup 2 --lock-steps 50 --loader-workers "${LOADER_WORKERS:-12}" \
                   $( [ -s "$OUT/flex_kernel.json" ] && echo --flex-from "$OUT/flex_kernel.json" ) \
                   --json "$OUT/train_step.json" ;;
        trainsmol) step trainsmol "${TRAINSMOL_S:-420}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_drafter_grouped_gpu.py || exit 1
                       for r in ${TRAINSMOL_RUNS:-512:eager-sdpa,eager-grouped 1024:eager-grouped 2048:eager-grouped}; do
                           python3 bench/train_step.py --shape smollm2 --layers 5 --context 8192 --anchors \${r%%:*} \
                           --variants \${r#*:} --steps 20 --warmup 3 --lock-steps 0 --no-loader ${TRAINSMOL_FLAGS:-} \
                           --json $OUT/train_step_smollm2_\${r%%:*}.json || exit 1; done" ;;
        topk) step topk "${TOPK_S:-120}" python3 bench/topk_kernel.py --json "$OUT/topk_kernel.json" ;;
        stats) step stats "${STATS_S:-60}" python3 bench/sanity_stats_kernel.py --json "$OUT/sanity_stats_kernel.json" ;;
        draft) step draft "${DRAFT_S:-120}" bash -c "python3 bench/draft_step.py --shape smollm2 --device cuda \
                   --contexts 256,1024,4096,8192 --json $OUT/draft_step-smollm2.json && python3 bench/draft_step.py \
                   --shape qwen27b --device cuda --contexts 256,1024,4096,8192 --json $OUT/draft_step-qwen27b.json" ;;
        loader) step loader "${LOADER_S:-150}" python3 -c "import json, sys; sys.path.insert(0, '.')
from bench.train_step import loader_rate; from bench.seed_shape import SeedShape
rows = [dict(loader_rate(SeedShape(), ${LOADER_WORKERS:-12}, 8, row_group_mb=mb), row_group_mb=mb) for mb in (256, 64, 256, 64)]
print(json.dumps(rows, indent=1)); open('$OUT/loader_rate.json', 'w').write(json.dumps(rows, indent=1))" ;;
        regentests) step regentests "${REGEN_TESTS_S:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider \
                        tests/test_static_forward_gpu.py tests/test_decode_attention_gpu.py tests/test_regen_overlap_gpu.py \
                        tests/test_chunked_prefill_gpu.py tests/test_fused_elementwise_gpu.py tests/test_regen_lookup_gpu.py ;;
        launchq) step launchq "${LAUNCHQ_S:-180}" python3 bench/launch_queue.py --json "$OUT/launch_queue.json" ;;
        attntune) step attntune "${ATTNTUNE_S:-240}" python3 bench/decode_attention_tune.py \
                      --json "$OUT/decode_attention_tune.json" ${ATTNTUNE_FLAGS:-} ;;
        decodeprof) step decodeprof "${DECODEPROF_S:-180}" python3 bench/decode_step_profile.py \
                        --json "$OUT/decode_step_profile.json" ${DECODEPROF_FLAGS:-} ;;
        prefill) step prefill "${PREFILL_S:-240}" python3 bench/prefill_layouts.py --json "$OUT/prefill_layouts.json" \
                     ${PREFILL_FLAGS:-} ;;
        overlap) step overlap "${OVERLAP_S:-150}" python3 bench/prefill_overlap.py --json "$OUT/prefill_overlap.json" ;;
        regen) step regen "${REGEN_S:-240}" python3 bench/regen_throughput.py \
                   --data "${SHAREGPT_FIRST_TURNS:?run the smollm2 step first}" --model-cache /tmp/quality/models \
                   --json "$OUT/regen_throughput.json" ${REGEN_FLAGS:---batch 1024,2048} ;;
        hybrid) step hybrid "${HYBRID_S:-300}" python3 bench/hybrid_eval_step.py --contexts 1024,2048,4096,8192 \
                    --json "$OUT/hybrid_eval_step.json" ;;
        evaltests) step evaltests "${EVALTESTS_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
                       tests/test_eval_hybrid_gpu.py tests/test_eval_engine_gpu.py tests/test_eval_specdecode.py \
                       tests/test_eval_fast_gpu.py tests/test_eval_reference_batch_gpu.py ;;
        window) step window "${WINDOW_S:-300}" python3 bench/window_stream.py --data /tmp/quality/regenerated.jsonl \
                    --limit-s "$(( ${WINDOW_S:-300} - 30 ))" --json "$OUT/window_stream.json" ${WINDOW_FLAGS:-} ;;
        windowq) step windowq "${WINDOWQ_S:-500}" python3 bench/window_quality.py --data /tmp/quality/regenerated.jsonl \
                     --work /tmp/window_quality --json "$OUT/window_quality.json" ${WINDOWQ_FLAGS:-} ;;
        evalspeed) step evalspeed "${EVALSPEED_S:-300}" python3 bench/eval_speed.py --per-set "${EVALSPEED_PER_SET:-40}" \
                       --heldout-source /tmp/quality/carry/data/sharegpt_first_turns.jsonl \
                       --model-cache-dir /tmp/quality/models --json "$OUT/eval_speed.json" ;;
        smallgemm) step smallgemm "${SMALLGEMM_S:-120}" python3 bench/small_gemm.py --json "$OUT/small_gemm.json" ;;
        evalprofile) step evalprofile "${EVALPROFILE_S:-200}" python3 bench/eval_profile.py --model-cache-dir /tmp/quality/models ;;
        # the loader from s3:// (loopback `rclone serve s3`) vs local disk at the seed's shape (issue #17); carry
        # .gpucarry/rclone + .gpucarry/whl and pass them in GPU_WHEELS (pip --target puts rclone in /tmp/site/bin)
        objstore) step objstore "${OBJSTORE_S:-400}" env PATH="/tmp/site/bin:$PATH" python3 bench/objstore_loader.py \
                      --batches "${OBJSTORE_BATCHES:-24}" --workers 12 --server rclone --json "$OUT/objstore_loader.json" ${OBJSTORE_FLAGS:-} ;;
        gputests) step gputests "${TESTS_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider tests ;;
        gputests-a) step gputests-a "${TESTS_S:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider tests \
                        --ignore-glob='tests/test_target*' --ignore-glob='tests/test_train*' ;;
        gputests-b) step gputests-b "${TESTS_S:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider \
                        tests/test_target*.py tests/test_train*.py ;;
        *) echo "unknown step $what (smollm2 extract flex train trainsmol topk stats draft loader regentests launchq attntune decodeprof prefill regen hybrid evaltests window windowq smallgemm evalprofile evalspeed objstore gputests gputests-a gputests-b)"; exit 2 ;;
    esac
done
