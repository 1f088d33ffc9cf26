"""Where the grouped SDPA path's time goes: the drafter's attention alone, forward + backward, dense vs grouped.

Session 22 measured the 5-layer SmolLM2 drafter step on the H200 (8,192 context tokens): eager-sdpa 79.7 ms at 512
anchors, eager-grouped 207.3 ms at 512, 238.3 at 1,024, 269.3 at 2,048 (bench/results/2026-12-05-h200-session22/).
On the CPU grouped is 1.5-2x faster than dense; on the GPU it costs ~130 ms a step more, nearly flat in the
anchors. This driver times the pieces of one layer's attention on real packed rows (bench/seed_shape.py, documents
cut to 1,280 tokens as the quality runs extract):
  mask      AttentionMask + the grouped layout (host spans, device index and mask tensors)
  dense     sdpa_attend, forward + backward (the dense bool mask)
  grouped   grouped_attend, forward + backward, under each SDPA backend that accepts it (default / efficient /
            math / cudnn), cycling over --rows rows so that the key width W changes from call to call as in
            training, and once with one row repeated (the same W every call)
and prints a profiler table of one grouped call (top kernels and host ops).

    python bench/grouped_profile.py --device cuda --anchors 512,1024 --json out.json     # H200
    python bench/grouped_profile.py --device cpu --anchors 64 --context 1024 --iters 2    # CPU smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cuda_timing import call_times_ms  # noqa: E402
from bench.seed_shape import SeedShape, structure_batches  # noqa: E402
from dflash_pipe.drafter.attention import sdpa_attend  # noqa: E402
from dflash_pipe.drafter.grouped import grouped_attend  # noqa: E402
from dflash_pipe.drafter.masks import AttentionMask  # noqa: E402

BACKENDS = {"default": None, "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def masks_for(rows, device, block):
    """AttentionMasks on the device with the host tensors beside them (as the trainer builds them)."""
    out = []
    for r in rows:
        host = (torch.from_numpy(r["ctx_doc"]), torch.from_numpy(r["anchor_index"]).long(),
                torch.from_numpy(r["block_doc"]), torch.from_numpy(r["block_valid"]))
        out.append((host, AttentionMask(*(t.to(device) for t in host), block, host=host)))
    return out


def run(anchors: int, args, device) -> dict:
    shape = SeedShape(context=args.context, anchors=anchors)
    rows = structure_batches(shape, args.rows, seed=anchors, max_doc=args.max_doc)
    masks = masks_for(rows, device, shape.block)
    H, Hkv, D, S, Q = args.heads, args.kv_heads, args.head_dim, shape.context, anchors * shape.block
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, H, Q, D, generator=gen).to(device, torch.bfloat16).requires_grad_()
    k = torch.randn(1, Hkv, S + Q, D, generator=gen).to(device, torch.bfloat16).requires_grad_()
    v = torch.randn(1, Hkv, S + Q, D, generator=gen).to(device, torch.bfloat16).requires_grad_()
    grad = torch.randn(1, H, Q, D, generator=gen).to(device, torch.bfloat16)
    state = {"i": 0}

    def next_mask(same: bool = False):
        i = 0 if same else state["i"] % len(masks)
        state["i"] += 1
        host, m = masks[i]
        return AttentionMask(m.ctx_doc, m.anchor_index, m.block_doc, m.block_valid, shape.block, host=host)

    def step(path: str, backend=None, same=False):
        mask = next_mask(same)
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            if path == "dense":
                out = sdpa_attend(q, k, v, mask)
            else:
                out = grouped_attend(q, k, v, mask.grouped(args.group_blocks), D ** -0.5)
        out.backward(grad)

    res = {"anchors": anchors, "context": S, "rows": len(masks)}
    widths = [m.grouped(args.group_blocks).width for _, m in masks]
    res["grouped_widths"] = widths
    res["mask_ms"] = _median(call_times_ms(lambda: next_mask().grouped(args.group_blocks), args.iters, args.warmup,
                                           device))
    cases = [("dense", "dense", None, False)] + [(f"grouped-{b}", "grouped", BACKENDS[b], False) for b in args.backends]
    cases.append(("grouped-default-same-width", "grouped", None, True))
    for name, path, backend, same in cases:
        try:
            t = call_times_ms(lambda: step(path, backend, same), args.iters, args.warmup, device)
            res[name] = {"ms_median": _median(t), "ms_each": [round(x, 2) for x in t]}
        except Exception as e:  # a backend that refuses these inputs says so and the rest go on
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(f"anchors {anchors} {name:30s} {res[name]}", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            step("grouped")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        res["profile_device"] = prof.key_averages().table(sort_by=key, row_limit=18)
        res["profile_host"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        print(res["profile_device"]); print(res["profile_host"])
    return res


def _median(xs):
    s = sorted(xs)
    return round(s[len(s) // 2], 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--anchors", default="512,1024", help="comma-separated anchor counts")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--max-doc", type=int, default=1280)
    p.add_argument("--rows", type=int, default=8, help="distinct packed rows cycled over")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--group-blocks", type=int, default=32)
    p.add_argument("--backends", default="default,efficient,math,cudnn")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--json", default="")
    args = p.parse_args()
    args.backends = [b for b in args.backends.split(",") if b]
    device = torch.device(args.device)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "runs": [run(int(a), args, device) for a in args.anchors.split(",")]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
