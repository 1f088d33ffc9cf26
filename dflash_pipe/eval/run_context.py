"""The eval report's "What this run shows" section: the run's size, and the GPU recipe's result for scale.

A tau table alone invites the wrong reading. The main job (manifests/default.toml) trains a
1-layer drafter for ~107 CPU steps, and its DFlash tau of ~1.05 sits below prompt lookup's. That
shows the pipeline working end to end on real weights and prompts. It does not show what a
trained drafter accepts. So the report says how big the run was (drafter layers, training steps,
device), whether the outputs stayed lossless, and, for the SmolLM2 target, what the GPU recipe
reaches and how to run it. The recipe numbers are quoted from BENCHMARKS.md (session 28, H100,
2026-12-05: `bench/quality_gpu.sh` with `bench/runs/quality19q.env`, then `quality19s.env`, `quality19t.env`,
`quality19v.env` and `quality19w.env`), which holds the full table and its provenance.
"""

from __future__ import annotations

from .report import methods_of

# Below this many optimizer steps a drafter is still learning its first slot (the session-6
# lossless drafter reached a held-out simulated tau of 1.78 after 1,000 GPU steps): its tau
# measures the run's size, not the method.
SMALL_RUN_STEPS = 1000

# BENCHMARKS.md, "Session 28", the 5-layer KD drafter after six passes, every prompt of each set.
GPU_RECIPE = {
    "target": "smollm2",
    "what": "a 5-layer drafter trained six passes (KD 0.5) over 45.3 M supervised tokens of SmolLM2's own answers "
            "to every ShareGPT turn (in five runs, each from the last one's weights), evaluated on every prompt",
    "dflash_tau": {"MT-Bench": 3.41, "HumanEval": 3.16, "held-out ShareGPT": 3.40},
    "lookup_tau": {"MT-Bench": 2.62, "HumanEval": 2.32, "held-out ShareGPT": 2.23},
    "command": "scripts/prepare_gpu_carry.sh, then on the GPU the calls in bench/runs/quality19q.env's header "
               "(`QUALITY_ENV=bench/runs/quality19q.env bash bench/quality_gpu.sh bg`, then `watch`), then from its "
               "drafter bench/runs/quality19s.env (pass 2), bench/runs/quality19t.env (passes 3-4) and "
               "bench/runs/quality19v.env with QUALITY_PASSES=1 (pass 5) and bench/runs/quality19w.env (pass 6) "
               "(BENCHMARKS.md, \"Session 28\")",
    "source": "BENCHMARKS.md, session 28, H100, 2026-12-05",
}


def _steps(report: dict) -> dict[str, int | None]:
    return {m: (tr or {}).get("steps") for m, tr in (report.get("training") or {}).items()}


def run_context(report: dict) -> str:
    """Markdown for the report's context section (always starts with a '## ' heading)."""
    drafters = report.get("drafters") or {}
    steps = _steps(report)
    device = report.get("device", "?")
    sizes = []
    for m, d in drafters.items():
        s = steps.get(m)
        sizes.append(f"{d.get('num_layers', '?')}-layer drafter" + (f" after {s:,} training steps" if s else ""))
    lines = ["## What this run shows", ""]
    lossless = [s[m].get("identical_to_target") for s in report.get("sets", {}).values() for m in methods_of(s)]
    exact = bool(lossless) and all(x == 1 for x in lossless)
    lines.append(f"This eval ran on {device} with a " + (", ".join(sizes) or "drafter") + ". "
                 + ("Every output is identical to target-only greedy decoding, so the speculative decoding is "
                    "lossless here. " if exact else ""))
    known = [s for s in steps.values() if s]
    if known and max(known) < SMALL_RUN_STEPS:
        lines[-1] += (f"Under {SMALL_RUN_STEPS:,} steps the drafter has barely learned its first block slot. Its "
                      "tau (1 = every draft rejected at slot 1) measures the size of this run, not what DFlash "
                      "reaches. Prompt lookup needs no training and copies spans of the prompt, which is why it "
                      "leads on code. This run shows the pipeline end to end: real target weights and prompts, "
                      "extraction, training, export and decoding.")
    model = str((report.get("target") or {}).get("model") or "").lower()
    if GPU_RECIPE["target"] in model:
        r = GPU_RECIPE
        taus = "; ".join(f"{k} {r['dflash_tau'][k]:.2f} (prompt lookup {r['lookup_tau'][k]:.2f})"
                         for k in r["dflash_tau"])
        lines += ["", f"What the GPU recipe reaches on this target ({r['source']}): {r['what']} decodes at "
                      f"tau {taus}. To run it: {r['command']}."]
    return "\n".join(lines) + "\n"
