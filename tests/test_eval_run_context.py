"""The eval report says what the run shows: its size, whether it stayed lossless, and the GPU recipe's tau."""

import json

from dflash_pipe.eval.report import method_summary, training_tau
from dflash_pipe.eval.run_context import GPU_RECIPE, SMALL_RUN_STEPS, run_context
from dflash_pipe.eval.specdecode import SpecResult

REF = [[5, 6, 7, 8]]


def _report(model, steps, outputs=REF, layers=1):
    r = SpecResult(list(outputs[0]), block_size=4, target_forwards=3, proposed=[3, 3], accepted=[0, 1],
                   slot_limit=[3, 2], committed=[1, 2], wall_s=1.0, draft_s=0.1)
    s = {"prompts": 1, "target_only": {"tokens_per_s": 4.0}, "dflash": method_summary([r], REF, 4.0, True),
         "ngram": method_summary([r], REF, 4.0, True)}
    return {"target": {"model": model, "dtype": "float32"}, "device": "cpu",
            "drafters": {"dflash": {"num_layers": layers}}, "training": {"dflash": {"steps": steps}},
            "sets": {"mtbench": s}}


def test_main_job_sized_run_is_put_in_context_with_the_gpu_recipe():
    text = run_context(_report("embedded:smollm2-135m-instruct", 107))
    assert text.startswith("## What this run shows")
    assert "cpu with a 1-layer drafter after 107 training steps" in text
    assert "identical to target-only" in text and "pipeline end to end" in text
    for k, v in GPU_RECIPE["dflash_tau"].items():
        assert f"{k} {v:.2f} (prompt lookup {GPU_RECIPE['lookup_tau'][k]:.2f})" in text
    assert "bench/quality_gpu.sh" in text and "45.3 M supervised tokens" in text and "every prompt" in text


def test_a_long_run_on_another_target_gets_neither_caveat_nor_recipe():
    text = run_context(_report("random:tiny-llama", SMALL_RUN_STEPS * 5, layers=3))
    assert "3-layer drafter after 5,000 training steps" in text
    assert "barely learned" not in text and "GPU recipe" not in text


def test_a_lossy_run_does_not_claim_identity():
    text = run_context(_report("embedded:smollm2-135m-instruct", 107, outputs=[[5, 6, 0, 8]]))
    assert "identical to target-only" not in text


def test_training_tau_reports_the_number_of_steps(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tau": 1.0}) + "\n" for i in range(0, 107, 5))
                                            + json.dumps({"step": 106, "tau": 1.1}) + "\n")
    assert training_tau(tmp_path)["steps"] == 107
