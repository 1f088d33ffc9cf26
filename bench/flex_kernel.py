"""flex_attention tile-size benchmark for the DFlash mask at the seed's shape (GPU).

One attention call (32 query heads / 8 KV heads, head_dim 128, bf16), Q = 512 blocks x 16 = 8192,
KV = 8192 context + 8192 block tokens, mask from real-structure packed documents. Forward +
backward time (median of CUDA-event timings), peak memory, and the useful TFLOP/s counted on
the visible (q, kv) pairs only. Each variant's output is checked against the default's.

    python bench/flex_kernel.py --variants 128x128,128x64,64x128,64x64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.seed_shape import SeedShape, structure_batches  # noqa: E402
from dflash_pipe.drafter.attention import flex_attend, set_flex_tuning  # noqa: E402
from dflash_pipe.drafter.masks import AttentionMask  # noqa: E402


def time_fwd_bwd(q, k, v, mask, reps: int) -> float:
    def once():
        out = flex_attend(q, k, v, mask)
        out.backward(grad_out)
        q.grad = k.grad = v.grad = None

    grad_out = torch.randn_like(q)
    for _ in range(3):
        once()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        once()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="128x128,128x64,64x128,64x64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    shape = SeedShape()
    dev = torch.device("cuda")
    b = structure_batches(shape, 1, seed=3)[0]
    t = lambda x: torch.from_numpy(x).to(dev)  # noqa: E731
    g = torch.Generator(device=dev).manual_seed(0)
    Q, S = shape.anchors * shape.block, shape.context
    q = torch.randn(1, shape.heads, Q, shape.head_dim, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(1, shape.kv_heads, S + Q, shape.head_dim, device=dev, dtype=torch.bfloat16, generator=g,
                    requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dense = AttentionMask(t(b["ctx_doc"]), t(b["anchor_index"]), t(b["block_doc"]), t(b["block_valid"]),
                          shape.block).dense_bool()
    useful = int(dense.sum())
    del dense
    flops = 3.5 * 4 * shape.heads * useful * shape.head_dim  # fwd 2 GEMMs (x2 flops), bwd ~2.5x fwd
    ref = None
    results = []
    for name in args.variants.split(","):
        qb, kb = (int(x) for x in name.split("x"))
        res = {"variant": name}
        try:
            set_flex_tuning(qb, kb)
            mask = AttentionMask(t(b["ctx_doc"]), t(b["anchor_index"]), t(b["block_doc"]), t(b["block_valid"]),
                                 shape.block)
            out = flex_attend(q, k, v, mask).detach()
            if ref is None:
                ref = out
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            ms = time_fwd_bwd(q, k, v, mask, args.reps)
            res.update(ok=True, ms=ms, rel_err_vs_first=err, useful_tflops=flops / (ms / 1000) / 1e12,
                       peak_extra_gib=(torch.cuda.max_memory_allocated(dev) - base) / 2 ** 30,
                       density=useful / (Q * (S + Q)))
        except Exception as exc:  # noqa: BLE001
            res.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        results.append(res)
        print(json.dumps(res), flush=True)
    set_flex_tuning()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\n{'tiles QxKV':12s} {'fwd+bwd ms':>10s} {'useful TFLOP/s':>15s} {'peak +GiB':>10s} {'rel err':>8s}")
    for r in results:
        if r["ok"]:
            print(f"{r['variant']:12s} {r['ms']:10.2f} {r['useful_tflops']:15.1f} {r['peak_extra_gib']:10.2f} "
                  f"{r['rel_err_vs_first']:8.1e}")
        else:
            print(f"{r['variant']:12s} failed: {r['error'][:90]}")


if __name__ == "__main__":
    main()
