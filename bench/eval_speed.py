"""Wall-clock of `dflash-pipe eval` on a subset of every prompt set, extrapolated to the whole sets.

Issue-18 goal: SmolLM2, MT-Bench 80 (both turns) + HumanEval 164 + 300 held-out, 256 new tokens,
target-only + prompt lookup + one drafter, in <= 10 minutes on the H200. This driver runs the real
eval (dflash_pipe.eval.runner.run_eval: same harness, same report) on the first --per-set prompts
of each set, then scales each set's decode time by (prompts in the whole set / prompts run) and adds
the one-time costs (target load, warm-up, graph captures) once. It prints, per set and method, the
decode seconds with their split (target forwards / draft / other) and tau, and the projection.

With --reference batched (the default on CUDA: `[eval] reference`, eval/reference_batch.py) the
target-only time is two parts: the batched reference passes and the batch-1 baseline sample
(one generation in --baseline-every, scaled by the sample size the whole set would have:
ceil(generations / k) over the generations timed here). A reference pass does not scale with the
prompts (300 prompts take about as many decode steps as 12), so after the eval the driver times the
reference pass over the whole sets too (`--full-reference-pass`, default on with batched references:
reference_batch.plan_set on every prompt, a fresh engine) and the projection uses that; without it,
the subset's passes scaled by the prompts (an upper bound).

The drafter is --drafter DIR, or a random-init export of --drafter-layers layers at the target's
shape (tau ~ 1, the slowest case for DFlash: every step commits one token; a trained drafter's
steps are fewer by its tau, so the projection is an upper bound for it).

    # H200, inside bench/quality_gpu.sh's environment (GGUF, prompt files, wheels; see its header):
    # (there, --heldout-source defaults to $QUALITY_CARRY/data/sharegpt_first_turns.jsonl, --json to $OUT/eval_speed.json)
    bash bench/quality_gpu.sh exec python3 bench/eval_speed.py --per-set 40
    python bench/eval_speed.py --smoke          # CPU: tiny random Llama, 2 prompts per set, 12 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_pipe.config import RunConfig  # noqa: E402
from dflash_pipe.drafter import DFlashDrafter, derive_drafter_config, export_drafter  # noqa: E402
from dflash_pipe.eval.runner import resolve_device, run_eval  # noqa: E402
from dflash_pipe.target import load_target  # noqa: E402
from dflash_pipe.target.layers import default_target_layer_ids  # noqa: E402

FULL = {"mtbench": 80, "humaneval": 164, "heldout": 300}


def random_drafter(bundle, out: Path, layers: int, block: int) -> Path:
    cfg = derive_drafter_config({"family": bundle.family, "hidden_size": bundle.hidden_size,
                                 "num_attention_heads": bundle.config.num_attention_heads,
                                 "num_key_value_heads": bundle.config.num_key_value_heads,
                                 "intermediate_size": bundle.config.intermediate_size,
                                 "vocab_size": bundle.vocab_size, "num_layers": bundle.num_layers},
                                target_layer_ids=default_target_layer_ids(min(5, bundle.num_layers), bundle.num_layers),
                                num_layers=layers,
                                block_size=block, mask_token_id=bundle.vocab_size - 1, attention="sdpa")
    torch.manual_seed(0)
    export_drafter(DFlashDrafter(cfg, attention="sdpa"), cfg, out)
    return out


def per_step(r: dict) -> dict:
    """ms per generated token and per step of one method's set totals, with the step split (target-only: a step
    is one token, all of it target time; the prefill counts in the verify share)."""
    tokens = r.get("timed_tokens", r.get("generated_tokens")) or 0      # batched references: the timed sample
    steps = r.get("steps") or tokens
    wall = r.get("wall_s") or 0.0
    ms = (lambda x: 1e3 * x / steps) if steps else (lambda x: 0.0)
    verify = wall if "verify_s" not in r else r["verify_s"] + r.get("prefill_s", 0.0)
    return {"ms_per_token": 1e3 * wall / tokens if tokens else 0.0, "ms_per_step": ms(wall), "steps": steps,
            "verify_ms_per_step": ms(verify), "draft_ms_per_step": ms(r.get("draft_s", 0.0)),
            "other_ms_per_step": ms(r.get("other_s", 0.0))}


def linear_choice(bundle) -> list[dict]:
    """The engine's per-shape linear choices made in this process (empty off CUDA)."""
    from dflash_pipe.target.linear_choice import _CACHE

    return [{"M": k[4], "N": k[2], "K": k[3], "bias": k[5], "choice": name, "us": {n: round(t, 2) for n, t in us.items()}}
            for k, (name, us) in _CACHE.items()]


def full_reference_pass(cfg: RunConfig, bundle, report: dict) -> dict:
    """Wall seconds of the batched reference passes over every prompt of the sets (module docstring)."""
    from dflash_pipe.data.prompts import load_prompt_sets
    from dflash_pipe.eval.reference_batch import ReferenceBatcher, plan_set
    from dflash_pipe.eval.runner import encode_prompt
    from dflash_pipe.eval.specdecode import sync_fn

    ev, tok = cfg.eval, bundle.tokenizer
    sets = load_prompt_sets(ev.prompts, 0, skip_samples=cfg.data.skip_samples, source=cfg.data.source,
                            format=cfg.data.format, mtbench_turns=ev.mtbench_turns)
    block = next(iter(report["drafters"].values()))["block_size"]
    limit = report["max_prompt_tokens"] + ev.max_new_tokens + block
    batcher = ReferenceBatcher(bundle.model, report["eos_token_ids"], ev.max_new_tokens, limit)
    sync, out, t0 = sync_fn(bundle.device), {}, time.perf_counter()
    for name, prompts in sets.items():
        t1 = time.perf_counter()
        plan = plan_set(name, prompts, lambda m: encode_prompt(tok, m),
                        lambda r: tok.decode(r, skip_special_tokens=True), report["max_prompt_tokens"], batcher,
                        lambda gen_id, ids: None)
        sync()
        out[name] = {"prompts": len(prompts), "generations": len(plan.generations), "pass_s": time.perf_counter() - t1,
                     "tokens": sum(len(g.ref) for g in plan.generations), "skipped": len(plan.skipped)}
    out["total_s"] = time.perf_counter() - t0
    out["engine"] = batcher.describe
    batcher.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--target-dtype", default="float32", help="float32: outputs identical to target-only")
    ap.add_argument("--model-cache-dir", default="", help="default: $QUALITY_DIR/models or ~/.cache/dflash-pipe/models")
    ap.add_argument("--drafter", default="", help="exported drafter dir (default: a random-init export)")
    ap.add_argument("--drafter-layers", type=int, default=3)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--sets", default="mtbench,humaneval,heldout")
    ap.add_argument("--per-set", type=int, default=40, help="prompts run per set (the projection scales up)")
    carry = os.environ.get("QUALITY_CARRY", "")
    ap.add_argument("--heldout-source", default=f"{carry}/data/sharegpt_first_turns.jsonl" if carry else "embedded:sharegpt",
                    help="conversations whose first 300 are the heldout set")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--engine", default="auto", choices=("auto", "static", "hf"))
    ap.add_argument("--draft-graphs", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--reference", default="auto", choices=("auto", "batched", "sequential"))
    ap.add_argument("--baseline-every", type=int, default=8, help="batched references: batch-1 target-only on 1 in k")
    ap.add_argument("--replay", action="store_true", help="batched references: replay the methods outside the timed "
                                                          "sample (eval --replay; their time counts in 'methods')")
    ap.add_argument("--full-reference-pass", default="auto", choices=("auto", "on", "off"),
                    help="time the batched reference pass over the whole sets (auto: with batched references)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out-dir", default="", help="eval output (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="CPU, random:tiny-llama, 2 prompts per set, 12 tokens")
    ap.add_argument("--json", default=f"{os.environ['OUT']}/eval_speed.json" if os.environ.get("OUT") else "")
    args = ap.parse_args()
    if args.smoke:
        args.target, args.per_set, args.max_new_tokens, args.device = "random:tiny-llama", 2, 12, "cpu"
        args.drafter_layers, args.block = 1, 4

    cache_dir = args.model_cache_dir or (str(Path(os.environ["QUALITY_DIR"]) / "models") if os.environ.get("QUALITY_DIR")
                                         else "~/.cache/dflash-pipe/models")
    t_start = time.perf_counter()
    device = resolve_device(args.device)
    bundle = load_target(args.target, device=device, dtype=args.target_dtype, model_cache_dir=Path(cache_dir).expanduser())
    t_loaded = time.perf_counter()
    work = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="eval_speed-"))
    drafter = Path(args.drafter) if args.drafter else random_drafter(bundle, work / "drafter", args.drafter_layers,
                                                                     args.block)
    cfg = RunConfig()
    cfg.target.model, cfg.target.dtype = args.target, args.target_dtype
    cfg.data.source, cfg.data.skip_samples = args.heldout_source, FULL["heldout"]
    ev = cfg.eval
    ev.drafter, ev.prompts, ev.max_prompts = str(drafter), args.sets, args.per_set
    ev.max_new_tokens, ev.output_dir, ev.device = args.max_new_tokens, str(work / "eval"), str(device)
    ev.engine, ev.draft_graphs = args.engine, args.draft_graphs
    ev.reference, ev.baseline_every, ev.replay = args.reference, args.baseline_every, args.replay
    t0 = time.perf_counter()
    report = run_eval(cfg, bundle=bundle)
    eval_wall = time.perf_counter() - t0
    full = None
    if args.full_reference_pass == "on" or (args.full_reference_pass == "auto" and report.get("reference") == "batched"):
        full = full_reference_pass(cfg, bundle, report)
        print("full reference pass: " + ", ".join(f"{k} {v['generations']} generations {v['tokens']:,} tokens "
                                                  f"{v['pass_s']:.1f}s" for k, v in full.items() if isinstance(v, dict))
              + f"; total {full['total_s']:.1f}s ({full['engine']})", flush=True)
    decode_measured, decode_projected, sets = 0.0, 0.0, {}
    methods = ["target_only"] + [m for m in next(iter(report["sets"].values())) if m.startswith("dflash") or m == "ngram"]
    print(f"\n{'set':>10s} {'prompts':>8s} {'method':>12s} {'tau':>5s} {'decode s':>9s} {'target s':>9s} {'draft s':>8s} "
          f"{'other s':>8s} {'projected s':>12s} {'ms/tok':>7s} {'ms/step':>8s} {'verify':>7s} {'draft':>6s} {'other':>6s}")
    split = {"reference_pass_s": 0.0, "baseline_sample_s": 0.0, "methods_s": 0.0}
    for name, s in report["sets"].items():
        n = s["prompts"]
        scale = FULL.get(name, n) / n if n else 0.0
        t = s["target_only"]
        gens = s.get("generations", n)
        ref_s = t.get("reference_pass_s", 0.0)
        timed = t.get("timed_generations", gens)
        full_timed = -(-round(gens * scale) // t["baseline_every"]) if "baseline_every" in t else round(gens * scale)
        base_scale = full_timed / timed if timed else 0.0
        spec_s = sum(s[m]["wall_s"] + s[m].get("replay_s", 0.0) for m in methods if m != "target_only")
        measured = spec_s + t["wall_s"] + ref_s
        ref_proj = full[name]["pass_s"] if full and name in full else ref_s * scale
        projected = spec_s * scale + t["wall_s"] * base_scale + ref_proj
        decode_measured += measured
        decode_projected += projected
        for k, v in (("reference_pass_s", ref_proj), ("baseline_sample_s", t["wall_s"] * base_scale),
                     ("methods_s", spec_s * scale)):
            split[k] += v
        sets[name] = {"prompts": n, "generations": gens, "scale": scale, "decode_s": measured,
                      "projected_s": projected, "reference": t.get("reference", "sequential"),
                      "reference_pass_s": ref_s, "baseline_sample_s": t["wall_s"], "timed_generations": timed,
                      "baseline_scale": base_scale, "batch1_mismatches": t.get("batch1_mismatches"),
                      "methods": {m: {k: s[m].get(k) for k in ("tau", "wall_s", "verify_s", "prefill_s", "draft_s",
                                                               "other_s", "tokens_per_s", "speedup", "identical_to_target")}
                                  for m in methods}}
        for m in methods:
            r = s[m]
            per = per_step(r)
            sets[name]["methods"][m].update(per)
            target_s = r["wall_s"] if m == "target_only" else r["verify_s"] + r["prefill_s"]
            proj = r["wall_s"] * (base_scale if m == "target_only" else scale)
            print(f"{name:>10s} {n:>8d} {m:>12s} {r.get('tau') or 1.0:>5.2f} {r['wall_s']:>9.2f} {target_s:>9.2f} "
                  f"{r.get('draft_s', 0.0):>8.2f} {r.get('other_s', 0.0):>8.2f} {proj:>12.1f} "
                  f"{per['ms_per_token']:>7.2f} {per['ms_per_step']:>8.2f} {per['verify_ms_per_step']:>7.2f} "
                  f"{per['draft_ms_per_step']:>6.2f} {per['other_ms_per_step']:>6.2f}")
        if t.get("reference") == "batched":
            print(f"{name:>10s} {'':>8s} {'references':>12s} {'':>5s} {ref_s:>9.2f} {'':>9s} {'':>8s} {'':>8s} "
                  f"{ref_proj:>12.1f}   (batched pass, {gens} generations; batch-1 target-only timed on "
                  f"{timed} of them, {t['batch1_mismatches']} differ from the batched reference)")
    overhead = eval_wall - decode_measured + (t_loaded - t_start)
    total = decode_projected + overhead
    print(f"\nprojected split: batched reference passes {split['reference_pass_s']:.0f}s"
          f" ({'measured on the whole sets' if full else 'scaled from the subset'}), batch-1 target-only "
          f"{split['baseline_sample_s']:.0f}s, speculative methods {split['methods_s']:.0f}s")
    print(f"\nmeasured: eval {eval_wall:.1f}s (decode {decode_measured:.1f}s), target load {t_loaded - t_start:.1f}s; "
          f"projected for the whole sets ({', '.join(f'{k} {FULL.get(k)}' for k in report['sets'])}): "
          f"{total:.0f}s = decode {decode_projected:.0f}s + one-time {overhead:.0f}s (goal <= 600 s)")
    result = {"target": args.target, "dtype": args.target_dtype, "device": str(device), "engine": args.engine,
              "draft_graphs": args.draft_graphs,
              "target_forward": report.get("target_forward"), "cache_mode": report.get("cache_mode"),
              "per_set": args.per_set, "max_new_tokens": args.max_new_tokens, "drafter": str(drafter),
              "random_drafter": not args.drafter, "eval_wall_s": eval_wall, "load_s": t_loaded - t_start,
              "decode_measured_s": decode_measured, "projected_total_s": total, "projected_split_s": split,
              "reference": report.get("reference"), "baseline_every": args.baseline_every,
              "full_reference_pass": full, "sets": sets,
              "torch": torch.__version__, "linear_choice": linear_choice(bundle),
              "tf32": bool(torch.backends.cuda.matmul.allow_tf32)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
