"""Time per speculative step of a hybrid (Gated DeltaNet + attention) target against context length.

Goal (issue 18): on the 27B-shaped random hybrid, bf16, FLA kernels, the step costs O(block), not
O(sequence): time per step at context 8 k <= 1.2x the time at 1 k. A step is what eval runs: the
'rollback' verifier (eval/target_step.py) snapshots the recurrent state, verifies B tokens in one
forward, and commits `--accept` drafts (restore + attention crop + re-feed of accept + 1 tokens when
a draft is rejected). Three timings per context, median over --reps steps, each synchronised:
  * step_reject: verify + commit with `--accept` of B-1 drafts accepted (the common case);
  * step_full:   verify + commit with every draft accepted (no re-feed);
  * decode:      one target-only T=1 decode step with the same cache (the baseline's unit);
and, with --recompute-at, the 'recompute' reference mode's step (the whole sequence per verify) at
those contexts, to show what rollback replaces. Drafts are random tokens: which tokens are
committed does not change the work of a step.

    python bench/hybrid_eval_step.py --contexts 1024,2048,4096,8192 --json out.json     # H200, ~3 min
    python bench/hybrid_eval_step.py --smoke                                            # CPU, tiny preset
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cuda_timing import median_ms  # noqa: E402
from dflash_pipe.eval.target_step import TargetVerifier, cache_kwarg_name  # noqa: E402
from dflash_pipe.target.loading import build_random_model  # noqa: E402


def _steps(verifier: TargetVerifier, block: int, accept: int, vocab: int, gen: torch.Generator):
    """A callable doing one verify + commit of `block - 1` random drafts, `accept` of them kept."""
    def step():
        drafts = torch.randint(3, vocab, (block - 1,), generator=gen).tolist()
        target = verifier.verify(drafts)
        verifier.commit(accept, target[accept])
    return step


def measure(model, context: int, block: int, accept: int, reps: int, device, recompute: bool) -> dict:
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(context)
    prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
    out = {"context": context}
    verifier = TargetVerifier(model)
    t0 = time.perf_counter()
    verifier.prefill(prompt)
    if device.type == "cuda":
        torch.cuda.synchronize()
    out["prefill_s"] = time.perf_counter() - t0
    out["step_reject_ms"] = median_ms(_steps(verifier, block, accept, vocab, gen), reps, device=device)
    out["step_full_ms"] = median_ms(_steps(verifier, block, block - 1, vocab, gen), reps, device=device)
    kw = cache_kwarg_name(model)
    x = torch.tensor([[5]], device=device)

    def decode():
        with torch.inference_mode():
            model(input_ids=x, use_cache=True, logits_to_keep=1, **{kw: verifier.cache})
    out["decode_ms"] = median_ms(decode, reps, device=device)
    out["cache_tokens"] = int(verifier.cache.get_seq_length())
    verifier.close()
    if recompute:
        ref = TargetVerifier(model, cache_mode="recompute")
        ref.prefill(prompt)
        out["recompute_step_ms"] = median_ms(_steps(ref, block, accept, vocab, gen), max(3, reps // 4),
                                             warmup=1, device=device)
        ref.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3.5-27b-shape")
    ap.add_argument("--contexts", default="1024,2048,4096,8192")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--accept", type=int, default=5, help="drafts accepted per step in step_reject")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--recompute-at", default="1024", help="contexts that also time the recompute mode ('' = none)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny-qwen3.5, contexts 64,256, fp32, 3 reps")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.contexts, args.dtype, args.reps, args.recompute_at = "tiny-qwen3.5", "64,256", "float32", 3, "64"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = build_random_model(args.preset, seed=0, device=device, dtype=dtype).eval()
    print(f"{args.preset} {args.dtype} on {device}: built in {time.perf_counter() - t0:.1f}s, B={args.block}, "
          f"accept {args.accept} of {args.block - 1} in step_reject", flush=True)
    recompute_at = {int(c) for c in args.recompute_at.split(",") if c.strip()}
    rows = []
    print(f"{'context':>8s} {'prefill s':>9s} {'step reject ms':>15s} {'step full ms':>13s} {'decode ms':>10s} "
          f"{'recompute ms':>13s}", flush=True)
    for c in (int(x) for x in args.contexts.split(",")):
        r = measure(model, c, args.block, args.accept, args.reps, device, c in recompute_at)
        rows.append(r)
        rc = r.get("recompute_step_ms")
        print(f"{c:>8d} {r['prefill_s']:>9.2f} {r['step_reject_ms']:>15.2f} {r['step_full_ms']:>13.2f} "
              f"{r['decode_ms']:>10.2f} {'-' if rc is None else f'{rc:.2f}':>13s}", flush=True)
    first, last = rows[0], rows[-1]
    ratio = last["step_reject_ms"] / first["step_reject_ms"]
    print(f"step_reject at {last['context']} / at {first['context']}: {ratio:.2f}x (goal <= 1.2x); "
          f"step_full {last['step_full_ms'] / first['step_full_ms']:.2f}x; decode "
          f"{last['decode_ms'] / first['decode_ms']:.2f}x", flush=True)
    result = {"preset": args.preset, "dtype": args.dtype, "device": str(device), "block": args.block,
              "accept": args.accept, "reps": args.reps, "rows": rows, "ratio_last_first": ratio,
              "torch": torch.__version__}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
