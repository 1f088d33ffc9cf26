"""One DFlash drafting step at inference: the context K/V cache against recomputing the context.

A decoding step drafts one block anchored at the last committed token p. Without the cache the
drafter runs fc + hidden_norm + every layer's k/v projections over all p context rows each step;
with it (eval/specdecode.py: DFlashProposer, the default) only over the rows committed since the
last step (`--new-rows`, ~tau), then attends to the cached rows. Random weights and features at a
drafter shape; the block's hidden states of the two paths are compared as well as timed.

    python bench/draft_step.py --shape smollm2 --contexts 256,1024,4096 [--device cuda] [--json out.json]

Times: median over --reps steps (CUDA events on a GPU, perf_counter on the CPU), in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cuda_timing import median_ms  # noqa: E402
from bench.seed_shape import SeedShape  # noqa: E402
from dflash_pipe.drafter import DFlashDrafter, DrafterModelConfig  # noqa: E402
from dflash_pipe.eval.specdecode import DFlashProposer  # noqa: E402

SEED = SeedShape()
SHAPES = {   # hidden, layers, heads, kv heads, head_dim, intermediate, captured target layers, vocab
    "smollm2": (576, 3, 9, 3, 64, 1536, 5, 49152),           # the issue-5 quality drafter
    "qwen27b": (SEED.hidden, SEED.layers, SEED.heads, SEED.kv_heads, SEED.head_dim, SEED.intermediate,
                SEED.target_layers, 4096),                   # the seed drafter (small vocab: no lm_head here)
}


def build(shape: str, block: int, device, dtype) -> tuple[DFlashDrafter, DrafterModelConfig, torch.Tensor]:
    h, layers, heads, kv, hd, inter, feats, vocab = SHAPES[shape]
    cfg = DrafterModelConfig(hidden_size=h, num_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                             head_dim=hd, intermediate_size=inter, rms_norm_eps=1e-6, rope_theta=1e6,
                             block_size=block, mask_token_id=vocab - 1, target_layer_ids=list(range(feats)),
                             num_target_layers=feats * 4, vocab_size=vocab)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, attention="sdpa").to(device=device, dtype=dtype)
    embed = torch.randn(vocab, h, device=device, dtype=dtype) * 0.02
    return drafter, cfg, embed


def measure(shape: str, context: int, new_rows: int, reps: int, block: int, device, dtype) -> dict:
    drafter, cfg, embed = build(shape, block, device, dtype)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).to(device=device, dtype=dtype)
    feats = torch.randn(context + block, cfg.num_target_features * cfg.hidden_size, device=device, dtype=dtype)
    tokens = torch.randint(0, cfg.vocab_size - 1, (context + 1,)).tolist()
    cached = DFlashProposer(drafter, cfg, embed, head)
    full = DFlashProposer(drafter, cfg, embed, head, context_cache=False)

    def cached_step():           # steady state: the cache holds all rows but the last new_rows
        cached._rows = context - new_rows
        return cached.block_hidden(tokens, feats)

    cached.block_hidden(tokens, feats)             # fills the cache (and warms up)
    full.block_hidden(tokens, feats)
    diff = (cached_step() - full.block_hidden(tokens, feats)).abs().max().item()
    ms_full = median_ms(lambda: full.block_hidden(tokens, feats), reps, warmup=1, device=device)
    ms_cached = median_ms(cached_step, reps, warmup=1, device=device)
    return {"shape": shape, "context": context, "new_rows": new_rows, "dtype": str(dtype).replace("torch.", ""),
            "device": str(device), "recompute_ms": ms_full, "cached_ms": ms_cached, "speedup": ms_full / ms_cached,
            "max_abs_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--contexts", default="256,1024,4096", help="comma-separated context lengths p")
    ap.add_argument("--new-rows", type=int, default=2, help="rows committed since the last step (~tau)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="", help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        rows.append(measure(args.shape, ctx, args.new_rows, args.reps, args.block, device, dtype))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nDFlash drafting step, shape {args.shape}, block {args.block}, {rows[0]['dtype']} on {device}, "
          f"{torch.get_num_threads()} threads, {args.new_rows} new rows per step, median of {args.reps}")
    print(f"{'context p':>10s} {'recompute ms':>13s} {'cached ms':>10s} {'speedup':>8s} {'max |diff|':>11s}")
    for r in rows:
        print(f"{r['context']:>10d} {r['recompute_ms']:>13.2f} {r['cached_ms']:>10.2f} {r['speedup']:>7.2f}x "
              f"{r['max_abs_diff']:>11.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                               "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
