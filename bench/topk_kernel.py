"""Top-k of one extraction logits block on the GPU: torch.topk against the two-stage segmented_topk.

One [chunk, V] bf16 block at the 27B shape (2048 x 248,320, 1 GB), logits drawn like a trained
LM head's (a few large values over a heavy-tailed bulk). Per method: the median of CUDA-event
timings, and whether its values equal torch.topk's bitwise. Also the compiled fp32 logsumexp,
the other per-block cost of extraction. A batch of 8192 tokens runs four blocks.

    python bench/topk_kernel.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cuda_timing import median_ms  # noqa: E402
from dflash_pipe.target.topk import row_logsumexp, segmented_topk, topk_logprobs_block  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device="cuda", generator=g) * 2.5)
    logits[:, :: 997] += 8.0                      # a few strong candidates per row
    logits = logits.to(torch.bfloat16)
    ref = torch.topk(logits, args.k, dim=-1).values
    methods = {"torch.topk": lambda: torch.topk(logits, args.k, dim=-1)}
    for seg in (256, 512, 1024, 2048):
        methods[f"segmented/{seg}"] = lambda seg=seg: segmented_topk(logits, args.k, seg)
    methods["logsumexp (compiled fp32)"] = lambda: row_logsumexp(logits)
    methods["topk_logprobs_block (lse + segmented/512)"] = lambda: topk_logprobs_block(logits, args.k)
    rows = []
    for name, fn in methods.items():
        ms = median_ms(fn, args.reps)
        out = fn()
        same = bool(torch.equal(out[0], ref)) if name.startswith(("torch", "segmented")) else None
        rows.append({"method": name, "ms": ms, "values_equal_torch_topk": same})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n[{args.rows}, {args.vocab}] bf16, k = {args.k}")
    print(f"{'method':45s} {'ms':>8s}  values == torch.topk")
    for r in rows:
        print(f"{r['method']:45s} {r['ms']:8.3f}  {r['values_equal_torch_topk']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": [args.rows, args.vocab], "k": args.k, "rows": rows},
                                              indent=2))


if __name__ == "__main__":
    main()
