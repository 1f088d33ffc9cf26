"""GPU time of extraction's per-batch feature statistics: the batched `feature_stats` against the
per-document loop it replaced (sessions 1-3), on one 8192-token batch at the 27B capture width
(5 layers x 5120, bf16), for one document and for 40. Prints a table; --json writes it.

    python bench/sanity_stats_kernel.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cuda_timing import median_ms  # noqa: E402
from dflash_pipe.extract.sanity import feature_stats  # noqa: E402


def per_document_loop(hidden_TD: torch.Tensor, doc_lens: list[int], num_layers: int) -> torch.Tensor:
    """The former implementation: a Python loop over documents, fp32 copies, ~8 passes each."""
    out, start = [], 0
    for T in doc_lens:
        x = hidden_TD[start:start + T].float().view(T, num_layers, -1)
        start += T
        bad = (~torch.isfinite(x)).sum(dim=(0, 2)).float()
        rms = x.pow(2).mean(dim=(0, 2)).sqrt()
        dev = (x - x.mean(dim=0, keepdim=True)).pow(2).mean(dim=(0, 2)).sqrt()
        out.append(torch.stack([bad, rms, dev], dim=-1))
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    T, L = args.tokens, args.layers
    x = torch.randn(T, L * args.hidden, device="cuda", dtype=torch.bfloat16)
    rows = []
    for lens in ([T], [T // 40] * 39 + [T - (T // 40) * 39]):
        ref = per_document_loop(x, lens, L)
        for name, fn in (("per-document loop", per_document_loop), ("feature_stats (batched)", feature_stats)):
            ms = median_ms(lambda fn=fn: fn(x, lens, L), args.reps)
            err = ((fn(x, lens, L) - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
            rows.append({"docs": len(lens), "method": name, "ms": ms, "max_rel_diff_vs_loop": err})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n[{T}, {L} x {args.hidden}] bf16")
    print(f"{'docs':>5s} {'method':26s} {'ms':>8s} {'max rel diff':>13s}")
    for r in rows:
        print(f"{r['docs']:5d} {r['method']:26s} {r['ms']:8.3f} {r['max_rel_diff_vs_loop']:13.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
