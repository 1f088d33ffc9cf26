"""flex_attention tile / kernel-option sweep for the DFlash mask at the seed's shape (GPU).

One attention call (32 query heads / 8 KV heads, head_dim 128, bf16), Q = 512 blocks x 16 = 8192,
KV = 8192 context + 8192 block tokens, mask from real-structure packed documents. Per variant:
forward + backward time (median of CUDA-event timings), peak extra memory, useful TFLOP/s counted
on the visible (q, kv) pairs only, and the output's and gradients' relative error against the
first variant. Variants name a BlockMask tile, Triton kernel options and the mask_mod form:
"ranges" (what training uses: per-block [doc start, anchor) bounds) or "gather" (the rule as
written, a per-entry document gather; session-1's kernel). Each result line is printed as soon
as it is measured, so a run cut short by its time limit still reports what it finished.

    python bench/flex_kernel.py --variants all --json out.json

Compiling one variant (flex forward + backward) takes 1-2 minutes on the lent H200 host. With
`--compile-jobs N` all variants are first compiled in N child processes (Triton and inductor write
their on-disk caches) and then timed one after another in this process, which finds them compiled.
On the 16-core host that was no faster than compiling in turn (session 4: 7 variants in 246 s), but
a second run on the same machine times all of them in ~30 s (`--compile-jobs 0`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cuda_timing import median_ms  # noqa: E402
from bench.seed_shape import SeedShape, structure_batches  # noqa: E402
from dflash_pipe.drafter.attention import flex_attend, set_flex_tuning  # noqa: E402
from dflash_pipe.drafter.masks import AttentionMask, _visible  # noqa: E402

_BWD_64 = {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64}
# name -> (BlockMask tile (q, kv), kernel_options or None for flex's defaults, mask_mod form)
VARIANTS: dict[str, tuple[tuple[int, int], dict | None, str]] = {
    "gather-128": ((128, 128), None, "gather"),
    "ranges-128": ((128, 128), None, "ranges"),
    "ranges-128-safe": ((128, 128), {"ROWS_GUARANTEED_SAFE": True}, "ranges"),
    "ranges-128-fwd128": ((128, 128), {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}, "ranges"),
    "ranges-128-bwd64": ((128, 128), dict(_BWD_64, num_warps=4, num_stages=3), "ranges"),
    # session 4: with BLOCK_* sizes alone these three failed inductor's backward lowering
    # (NoValidChoicesError); the bwd64 variant, which also sets warps and stages, compiled
    "ranges-64": ((64, 64), dict(_BWD_64, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3), "ranges"),
    "ranges-128x64": ((128, 64), {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 64,
                                  "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 4, "num_stages": 3}, "ranges"),
    "ranges-64x128": ((64, 128), {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_M1": 64, "BLOCK_N1": 128,
                                  "BLOCK_M2": 64, "BLOCK_N2": 64, "num_warps": 4, "num_stages": 3}, "ranges"),
}


def time_fwd_bwd(run, q, k, v, reps: int) -> tuple[float, list[torch.Tensor]]:
    grad_out = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=torch.Generator(q.device).manual_seed(1))

    def once():
        out = run()
        out.backward(grad_out)
        grads = [q.grad, k.grad, v.grad]
        q.grad = k.grad = v.grad = None
        return grads

    grads = once()
    return median_ms(once, reps, warmup=2), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gather_block_mask(mask: AttentionMask, tile: tuple[int, int]):
    """A BlockMask from the per-entry rule (`_visible`), compiled like training's builder."""
    ctx_doc, anchor, bdoc, valid, S, B = (mask.ctx_doc, mask.anchor_index, mask.block_doc, mask.block_valid,
                                          mask.ctx_len, mask.block_size)

    def mod(b, h, q_idx, kv_idx):
        return _visible(q_idx // B, kv_idx, ctx_doc, anchor, bdoc, valid, S, B)

    return torch.compile(create_block_mask)(mod, None, None, mask.q_len, mask.kv_len, device=mask.device,
                                            BLOCK_SIZE=tile)


def precompile(names: list[str], jobs: int) -> None:
    """Compile every variant in child processes, `jobs` at a time, so the timed pass hits the caches."""
    import os
    import subprocess
    import time

    # each child would start a compile-worker pool of one process per core; 2 apiece keeps the
    # 16-core host from running 8 x 16 compile workers at once
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "2"))

    t0 = time.perf_counter()
    pending, running = list(names), []
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            running.append((name, subprocess.Popen([sys.executable, __file__, "--variants", name, "--compile-only"],
                                                   stdout=subprocess.DEVNULL, env=env)))
        for item in list(running):
            if item[1].poll() is not None:
                running.remove(item)
                print(f"compiled {item[0]} (rc {item[1].returncode}) at +{time.perf_counter() - t0:.0f}s", flush=True)
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="all", help=f"comma list or 'all' of: {', '.join(VARIANTS)}")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="")
    ap.add_argument("--compile-jobs", type=int, default=8, help="child processes compiling variants in parallel "
                                                                 "before the timed pass (0 = compile while timing)")
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)  # a child of --compile-jobs
    args = ap.parse_args()
    for knob in ("recompile_limit", "cache_size_limit"):  # one compile per variant; keep them all compiled
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    if args.compile_jobs > 0 and not args.compile_only and len(names) > 1:
        precompile(names, args.compile_jobs)
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
    mask_of = lambda: AttentionMask(t(b["ctx_doc"]), t(b["anchor_index"]), t(b["block_doc"]),  # noqa: E731
                                    t(b["block_valid"]), shape.block)
    useful = int(mask_of().dense_bool().sum())
    flops = 3.5 * 4 * shape.heads * useful * shape.head_dim  # fwd 2 GEMMs (x2 flops), bwd ~2.5x fwd
    ref = None
    results = []
    for name in names:
        tile, opts, form = VARIANTS[name]
        res = {"variant": name, "block": list(tile), "kernel_options": opts, "mask_mod": form}
        try:
            set_flex_tuning(*tile, kernel_options=opts)
            mask = mask_of()
            if form == "gather":
                mask._block_mask = gather_block_mask(mask, tile)
            run = lambda: flex_attend(q, k, v, mask)  # noqa: E731
            if args.compile_only:
                run().backward(torch.ones_like(q))
                torch.cuda.synchronize()
                print(json.dumps({"variant": name, "compiled": True}), flush=True)
                continue
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            ms, grads = time_fwd_bwd(run, q, k, v, args.reps)
            out = run().detach()
            if ref is None:
                ref = (out, grads)
            res.update(ok=True, ms=ms, useful_tflops=flops / (ms / 1000) / 1e12,
                       peak_extra_gib=(torch.cuda.max_memory_allocated(dev) - base) / 2 ** 30,
                       density=useful / (Q * (S + Q)), rel_err_vs_first=rel(out, ref[0]),
                       grad_rel_err_vs_first=max(rel(a, r) for a, r in zip(grads, ref[1])))
        except Exception as exc:  # noqa: BLE001
            res.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        results.append(res)
        print(json.dumps(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    set_flex_tuning()
    print(f"\n{'variant':20s} {'fwd+bwd ms':>10s} {'useful TFLOP/s':>15s} {'peak +GiB':>10s} {'out err':>8s} "
          f"{'grad err':>8s}")
    for r in results:
        if r["ok"]:
            print(f"{r['variant']:20s} {r['ms']:10.2f} {r['useful_tflops']:15.1f} {r['peak_extra_gib']:10.2f} "
                  f"{r['rel_err_vs_first']:8.1e} {r['grad_rel_err_vs_first']:8.1e}")
        else:
            print(f"{r['variant']:20s} failed: {r['error'][:90]}")


if __name__ == "__main__":
    main()
