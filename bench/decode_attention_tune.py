"""The per-row decode attention kernel's launch configuration, swept on the shapes regenerate runs.

For each (keys per block, warps, stages) the kernel (target/decode_attention.py) is timed on:
  decode   one token per row: batch 1,024 x 3 KV heads x 3 query heads of 64 (SmolLM2-135M), row lengths uniform in
           [60, 450] (as under continuous batching, mean ~255), a 513-key cache row;
  chunks   the chunked prefill's shape: 512 chunks of 16 tokens at positions 0 .. 112 of their rows.
Median ms of `--reps` calls (CUDA events), the K/V bytes each row's visible keys take and the GB/s that implies,
and whether the output equals the default configuration's (bf16, to the last bit: the same math in another order
may round differently, so "max diff" is printed too). The fastest decode configuration is printed last.

    python bench/decode_attention_tune.py --json out.json       # H100 / H200
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cuda_timing import median_ms  # noqa: E402
from dflash_pipe.target import decode_attention as da  # noqa: E402


def shapes(g: torch.Generator) -> dict:
    """(q, k_layer, v_layer, rows, old, T, visible K/V bytes) of each shape, on the GPU."""
    KVH, G, D, size = 3, 3, 64, 513
    out = {}
    for name, B, T in (("decode", 1024, 1), ("chunks", 512, 16)):
        k = torch.randn(B + 1, KVH, size, D, generator=g).to("cuda", torch.bfloat16)
        v = torch.randn(B + 1, KVH, size, D, generator=g).to("cuda", torch.bfloat16)
        q = torch.randn(B, KVH, G * T, D, generator=g).to("cuda", torch.bfloat16)
        if T == 1:
            old = torch.randint(60, 451, (B,), generator=g)
        else:
            old = torch.randint(0, 8, (B,), generator=g) * 16
        rows = torch.arange(B)
        seen = int((old + T).sum()) * KVH * D * 2 * 2
        out[name] = (q, k, v, rows.cuda(), old.cuda(), T, seen)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    cases = shapes(g)
    default = da.CONFIG
    res = {"device": torch.cuda.get_device_name(), "default": default, "runs": []}
    ref = {n: da.decode_attention(q, k, v, r, o, T, k.shape[2], 0.125) for n, (q, k, v, r, o, T, _) in cases.items()}
    for cfg in itertools.product(*(map(int, a.split(",")) for a in (args.blocks, args.warps, args.stages))):
        row = {"config": cfg}
        for name, (q, k, v, rows, old, T, seen) in cases.items():
            try:
                fn = lambda: da.decode_attention(q, k, v, rows, old, T, k.shape[2], 0.125, config=cfg)  # noqa: E731
                out = fn()
                ms = median_ms(fn, args.reps, warmup=3)
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses (shared memory) is skipped
                row[name] = {"error": repr(exc)[:120]}
                continue
            diff = float((out.float() - ref[name].float()).abs().max())
            row[name] = {"ms": round(ms, 4), "gb_s": round(seen / ms / 1e6, 1), "max_diff": diff}
        res["runs"].append(row)
        print(cfg, {n: row[n] for n in cases}, flush=True)
    ok = [r for r in res["runs"] if "ms" in r["decode"]]
    best = min(ok, key=lambda r: r["decode"]["ms"])
    base = next(r for r in ok if tuple(r["config"]) == default)
    res["best_decode"] = best
    print(f"SUMMARY decode default {default}: decode {base['decode']['ms']} ms ({base['decode']['gb_s']} GB/s), chunks "
          f"{base['chunks'].get('ms')} ms; best decode {best['config']}: {best['decode']['ms']} ms "
          f"({best['decode']['gb_s']} GB/s), chunks {best['chunks'].get('ms')} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
