"""Microbench of the engine's batch-1 ops on the GPU: every small-M linear formulation, SDPA vs explicit attention.

Shapes are SmolLM2-135M's (hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, vocab 49152) unless --hidden etc.
say otherwise; M = 1 (a decode step) and 16 (a verify block); fp32 unless --dtype. Each op is timed as a CUDA
graph of `linear_choice.REPS` calls (what the engine replays), us per call. The linear candidates are the
ones `LinearChooser` picks from (dflash_pipe/target/linear_choice.py), so this table is the engine's build-time
choice made visible. TF32 stays off (checked): every formulation is plain fp32.

    python3 bench/small_gemm.py --json $OUT/small_gemm.json        # H200, ~20 s
    python3 bench/small_gemm.py --smoke                            # CPU: checks the formulations run, no timing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_pipe.target.linear_choice import CANDIDATES, _graph_time_us, extra_for, tf32_on  # noqa: E402
from dflash_pipe.target.small_batch_ops import few_query_attention, few_query_bias  # noqa: E402


def shapes(a) -> dict[str, tuple[int, int]]:
    return {"qkv": ((a.heads + 2 * a.kv_heads) * a.head_dim, a.hidden), "o": (a.hidden, a.heads * a.head_dim),
            "gate_up": (2 * a.intermediate, a.hidden), "down": (a.hidden, a.intermediate), "lm_head": (a.vocab, a.hidden)}


def time_fn(fn, device) -> float | None:
    if device.type != "cuda":
        fn()
        return None
    return _graph_time_us(lambda *_: fn(), None, None, None, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("hidden", 576), ("heads", 9), ("kv-heads", 3), ("head-dim", 64), ("intermediate", 1536),
                          ("vocab", 49152)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--kv-lens", default="128,512,1024")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    dtype = getattr(torch, a.dtype)
    if tf32_on():
        print("TF32 is on: the fp32 numbers below are not exact fp32", file=sys.stderr)
    g = torch.Generator(device=device).manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": a.dtype,
              "torch": torch.__version__, "tf32": tf32_on(), "linear": [], "attention": []}
    rows = [int(r) for r in a.rows.split(",")]
    print(f"{'op':>8s} {'M':>3s} {'N':>6s} {'K':>5s}  us per call (fastest first)")
    for name, (N, K) in shapes(a).items():
        W = torch.randn((N, K), generator=g, device=device, dtype=dtype) * K ** -0.5
        for M in rows:
            x = torch.randn((M, K), generator=g, device=device, dtype=dtype)
            ref = F.linear(x.double(), W.double())
            us = {}
            for cand, (fn, applies, _) in CANDIDATES.items():
                if not applies(N, K, device):
                    continue
                extra = extra_for(cand, W, None)
                try:
                    err = float((fn(x, W, None, extra).double() - ref).abs().max() / ref.abs().max())
                    us[cand] = time_fn(lambda: fn(x, W, None, extra), device)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"  {cand}: {exc}", file=sys.stderr)
                    continue
                assert err < 1e-4, (name, M, cand, err)
            order = sorted(us, key=lambda c: us[c] or 0.0)
            print(f"{name:>8s} {M:>3d} {N:>6d} {K:>5d}  " + ", ".join(
                f"{c} {us[c]:.1f}" if us[c] is not None else c for c in order), flush=True)
            result["linear"].append({"op": name, "M": M, "N": N, "K": K, "us": us,
                                     "fastest": order[0], "speedup_vs_linear": (us["linear"] / us[order[0]])
                                     if device.type == "cuda" else None})
    H, KVH, D = a.heads, a.kv_heads, a.head_dim
    G = H // KVH
    for T in rows:
        for S in (int(s) for s in a.kv_lens.split(",")):
            q = torch.randn((1, KVH, G * T, D), generator=g, device=device, dtype=dtype)
            k, v = (torch.randn((1, KVH, S, D), generator=g, device=device, dtype=dtype) for _ in range(2))
            vis = torch.ones((1, 1, G * T, S), dtype=torch.bool, device=device).tril(S - T)   # causal tail
            bias = few_query_bias(vis, KVH, dtype)
            sdpa = time_fn(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=vis, scale=D ** -0.5), device)
            expl = time_fn(lambda: few_query_attention(q, k, v, bias, D ** -0.5), device)
            print(f"attention T={T:>2d} kv={S:>5d}: sdpa {sdpa}, explicit {expl} us" if sdpa is None else
                  f"attention T={T:>2d} kv={S:>5d}: sdpa {sdpa:.1f}, explicit {expl:.1f} us", flush=True)
            result["attention"].append({"T": T, "kv": S, "sdpa_us": sdpa, "explicit_us": expl})
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
