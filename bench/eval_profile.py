"""Where a batch-1 eval generation spends its time: per-token wall of each method, then a torch.profiler table.

`bench/eval_speed.py` measures the whole eval; this driver explains one generation of each method on the same
engine the eval builds (`dflash_pipe.eval.runner._targets`): target-only greedy on the static-KV engine, prompt
lookup, and DFlash (random drafter unless --drafter). For each it prints ms per generated token and per step,
then profiles one generation and prints the top operators by self CPU time and by device time, plus the counts
of graph launches, kernel launches and host syncs per step.

    bash bench/quality_gpu.sh exec python3 bench/eval_profile.py        # H200, with the SmolLM2 GGUF set up
    python bench/eval_profile.py --smoke                                # CPU, tiny random Llama
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
from bench.eval_speed import linear_choice, random_drafter  # noqa: E402
from dflash_pipe.config import RunConfig  # noqa: E402
from dflash_pipe.data.prompts import load_prompt_sets  # noqa: E402
from dflash_pipe.eval.ngram import NgramProposer  # noqa: E402
from dflash_pipe.eval.runner import DrafterSpec, _load_drafters, _targets, encode_prompt, resolve_device  # noqa: E402
from dflash_pipe.eval.specdecode import eos_token_ids, speculative_generate  # noqa: E402
from dflash_pipe.target import load_target  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_table(fn, device, steps: int, rows: int) -> dict:
    """Run fn under torch.profiler; print the top operators; return launch / sync counts per step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows))
    if device.type == "cuda":
        print(ka.table(sort_by="self_cuda_time_total" if hasattr(ka[0], "self_cuda_time_total") else
                       "self_device_time_total", row_limit=rows))
    counts = {}
    for e in ka:
        for key in ("cudaGraphLaunch", "cudaLaunchKernel", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                    "cudaMemcpyAsync", "cudaEventSynchronize", "aten::item", "aten::_local_scalar_dense"):
            if e.key == key:
                counts[key] = round(e.count / max(1, steps), 2)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--target-dtype", default="float32")
    ap.add_argument("--model-cache-dir", default="")
    ap.add_argument("--drafter", default="")
    ap.add_argument("--drafter-layers", type=int, default=3)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=3, help="MT-Bench prompts timed per method")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rows", type=int, default=25, help="profiler table rows")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=f"{os.environ['OUT']}/eval_profile.json" if os.environ.get("OUT") else "")
    args = ap.parse_args()
    if args.smoke:
        args.target, args.prompts, args.max_new_tokens, args.device = "random:tiny-llama", 1, 12, "cpu"
        args.drafter_layers, args.block, args.rows = 1, 4, 8
    cache_dir = args.model_cache_dir or (str(Path(os.environ["QUALITY_DIR"]) / "models") if os.environ.get("QUALITY_DIR")
                                         else "~/.cache/dflash-pipe/models")
    device = resolve_device(args.device)
    bundle = load_target(args.target, device=device, dtype=args.target_dtype, model_cache_dir=Path(cache_dir).expanduser())
    work = Path(tempfile.mkdtemp(prefix="eval_profile-"))
    drafter = Path(args.drafter) if args.drafter else random_drafter(bundle, work / "drafter", args.drafter_layers,
                                                                     args.block)
    cfg = RunConfig()
    ev = cfg.eval
    ev.device = str(device)
    spec = DrafterSpec("dflash", drafter, work)
    dcfgs, proposers = _load_drafters([spec], bundle, ev.draft_graphs)
    max_pos = int(getattr(bundle.config, "max_position_embeddings", 8192) or 8192)
    verifiers, plain, greedy, note = _targets(bundle.model, bundle, dcfgs, ev, device, max_pos, args.block)
    eos = eos_token_ids(bundle.model, bundle.tokenizer)
    prompts = load_prompt_sets("mtbench", args.prompts)["mtbench"]
    ids_list = [encode_prompt(bundle.tokenizer, p.messages) for p in prompts]
    methods = {"target_only": None, "ngram": (plain, NgramProposer()), "dflash": (verifiers["dflash"], proposers["dflash"])}
    print(f"eval_profile: {args.target} ({args.target_dtype}) on {device}, {note}, B={args.block}, "
          f"{len(ids_list)} prompts of {[len(i) for i in ids_list]} tokens, {args.max_new_tokens} new", flush=True)

    def run(name, ids):
        if methods[name] is None:
            toks = greedy(ids, args.max_new_tokens, eos)
            return len(toks), len(toks), None
        v, p = methods[name]
        r = speculative_generate(v, p, ids, block_size=args.block, max_new_tokens=args.max_new_tokens, eos_ids=eos)
        return len(r.tokens), r.steps, r

    result = {"target": args.target, "dtype": args.target_dtype, "device": str(device), "note": note, "methods": {}}
    for name in methods:
        for ids in ids_list[:1]:                       # warm-up: graphs captured, kernels loaded
            run(name, ids)
        sync(device)
        tok = steps = 0
        split = {"draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0}
        t0 = time.perf_counter()
        for ids in ids_list:
            n, s, r = run(name, ids)
            tok, steps = tok + n, steps + s
            if r is not None:
                for k in split:
                    split[k] += getattr(r, k)
        sync(device)
        wall = time.perf_counter() - t0
        row = {"tokens": tok, "steps": steps, "wall_s": round(wall, 3), "ms_per_token": round(1e3 * wall / tok, 3),
               "ms_per_step": round(1e3 * wall / steps, 3), **{k: round(v, 3) for k, v in split.items()}}
        print(f"\n=== {name}: {tok} tokens in {steps} steps, {wall:.2f} s: {row['ms_per_token']} ms/token, "
              f"{row['ms_per_step']} ms/step; split {split}", flush=True)
        n, s, _ = run(name, ids_list[0])
        row["profile_counts_per_step"] = profile_table(lambda: run(name, ids_list[0]), device, s, args.rows)
        print(f"per step: {row['profile_counts_per_step']}", flush=True)
        result["methods"][name] = row
    result["linear_choice"] = linear_choice(bundle)
    result["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    for row in result["linear_choice"]:
        print(f"linear M={row['M']} N={row['N']} K={row['K']}: {row['choice']} {row['us']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
