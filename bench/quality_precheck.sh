# Call T's checks for bench/quality_gpu.sh (sourced by it): `bash bench/quality_gpu.sh precheck`.

# call T's checks (`precheck`, after its stash; no GGUF needed): the GPU tests of what the run uses
# (PRECHECK_FILES, PRECHECK_TESTS as a pytest -k expression, within PRECHECK_TESTS_S, 150) and the quality drafter's training step at PRECHECK_CONTEXTS tokens
# (bench/train_step.py --variants PRECHECK_VARIANTS, default eager-sdpa, the quality runs' setting; e.g.
# "eager-sdpa,compiled-fused" also times the compiled flex step and its first-step compile, each context within
# PRECHECK_STEP_S, 80; PRECHECK_LAYERS drafter layers, 5 = the recipe's); results in $OUT (precheck_tests.txt, step_<tokens>.json / .log) and a summary on stdout
precheck() {
    stash >/dev/null
    install_wheels
    local rc
    local files=(${PRECHECK_FILES:-tests/test_static_forward_gpu.py tests/test_eval_replay_gpu.py tests/test_train_feature_codec.py
                 tests/test_train_step_stats.py})
    timeout "${PRECHECK_TESTS_S:-150}" "$PY" -m pytest -q -m gpu -p no:cacheprovider "${files[@]}" -k "${PRECHECK_TESTS:-history or replay or feature_codec or push_does_not_wait}" > "$OUT/precheck_tests.txt" 2>&1
    rc=$?
    say "precheck: GPU tests rc $rc: $(tail -n 1 "$OUT/precheck_tests.txt")"
    # e.g. packed,padded: extraction's two attention layouts, timed only when the padded layout's GPU test (its
    # features == the packed row's on CUDA) passed, so that the run's QUALITY_EXTRACT_LAYOUT=auto never picks an
    # unchecked layout
    if [ -n "${PRECHECK_EXTRACT_LAYOUTS:-}" ] && timeout 90 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
            tests/test_target_gpu.py -k padded_layout > "$OUT/precheck_layout_test.txt" 2>&1; then
        timeout "${PRECHECK_EXTRACT_S:-120}" "$PY" bench/extract_throughput.py --model random:smollm2-135m-shape \
            --layers 1,8,14,20,27 --layouts "$PRECHECK_EXTRACT_LAYOUTS" --workers 4 \
            --json "$OUT/extract_layouts.json" > "$OUT/extract_layouts.log" 2>&1
        # the run's QUALITY_EXTRACT_LAYOUT=auto takes 'padded' only where its gpu-side rate is >= 1.2x packed's
        "$PY" - "$OUT/extract_layouts.json" "$Q/extract_layout.choice" <<'PY' && say "precheck: extraction layouts: $(cat "$Q/extract_layout.choice.why" 2>/dev/null)"
import json, sys
r = json.load(open(sys.argv[1]))["layouts"]
pick = "padded" if "padded" in r and "packed" in r and r["padded"]["gpu_side_tok_s"] >= 1.2 * r["packed"]["gpu_side_tok_s"] else "packed"
open(sys.argv[2], "w").write(pick + "\n")
open(sys.argv[2] + ".why", "w").write(", ".join(f"{k} {v['gpu_side_tok_s']:,.0f} tok/s" for k, v in r.items()) + f": {pick}")
PY
    fi
    local c
    for c in ${PRECHECK_CONTEXTS:-8192 16384}; do
        timeout "${PRECHECK_STEP_S:-80}" "$PY" bench/train_step.py --shape smollm2 --layers "${PRECHECK_LAYERS:-5}" \
            --variants "${PRECHECK_VARIANTS:-eager-sdpa}" --context "$c" --anchors $((c / 16)) \
            --steps 20 --warmup 3 --lock-steps 0 --no-loader --json "$OUT/step_$c.json" > "$OUT/step_$c.log" 2>&1
        say "precheck: step at $c context tokens: $(grep -E '^(eager|compiled)' "$OUT/step_$c.log" | tr '\n' ';' || echo failed)"
    done
    return "$rc"
}
