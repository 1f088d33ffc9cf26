"""Where a batched decode step of the static-KV engine spends its time: per-row vs padded (SDPA) attention.

Random weights in SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocab
49,152, tied), bf16 on CUDA, `--batch` rows whose lengths are spread as under regenerate's continuous
batching (uniform in [--min-len, --max-row-len], max_len 512, so the padded attended length is the
buffer's). For each `--attention` mode, in the same process:
  step    the graphed one-token decode step, median ms over `--steps` steps (lengths reset every 32 steps,
          so the rows stay in their spread), and the tokens/s it implies (batch / step);
  profile torch.profiler over 8 graphed steps: the top kernels by device time (graph replays are profiled
          kernel by kernel with CUPTI), grouped by name;
  prefill one bucketed prefill call of `--prefill-rows` x `--prefill-tokens` (graphed, after its warm-up
          and capture), median ms, and its profile.
With --elementwise fused,torch each run is timed with the fused RoPE / SwiGLU / cache-write kernels
(target/fused_elementwise.py) and with the PyTorch ops they replace, in the same process. With --norm hf,fused each
attention mode runs with HF's RMSNorm module and with the fused `F.rms_norm` (the engine's CUDA default since
session 20; small_batch_ops.py), so the saving is measured in the same process.
Also the K/V bytes a step must read (each row's own keys) and the time that takes at 4.0 TB/s, the floor of
per-row attention.

    python bench/decode_step_profile.py --json out.json              # H200
    python bench/decode_step_profile.py --smoke                      # CPU: tiny sizes, SDPA only, no profile
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cuda_timing import median_ms  # noqa: E402
from dflash_pipe.target import fused_elementwise  # noqa: E402
from dflash_pipe.target.static_forward import StaticKVEngine  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def build_model(device: torch.device, dtype: torch.dtype, smoke: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    values = dict(SMOLLM2)
    if smoke:
        values.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**values)).to(dtype)
    return model.eval().requires_grad_(False)


def top_kernels(prof, n: int = 15) -> list[dict]:
    """Device time per kernel name over the profiled window, largest first."""
    agg = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        t = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)
        if ev.device_type == torch.autograd.DeviceType.CUDA and t:
            agg[ev.name][0] += t
            agg[ev.name][1] += 1
    total = sum(v[0] for v in agg.values()) or 1.0
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"kernel": k[:110], "ms": round(v[0] / 1e3, 3), "calls": v[1], "share": round(v[0] / total, 3)}
            for k, v in rows] + [{"kernel": "(all)", "ms": round(total / 1e3, 3)}]


def profile(fn, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return top_kernels(prof)


@torch.inference_mode()
def measure(model, args, attention: str, lengths: list[int], norm: str = "auto") -> dict:
    cuda = args.device == "cuda"
    eng = StaticKVEngine(model, args.batch, args.max_len, attention=attention, bucketed_prefill=True, norm=norm)
    eng.k_cache.normal_()
    eng.v_cache.normal_()
    cur = torch.randint(0, 49152, (args.batch, 1), device=args.device)
    state = {"n": 0}

    def reset():
        for r, n in enumerate(lengths):
            eng.truncate(r, n)

    def step():
        if state["n"] % 32 == 0:
            reset()
        state["n"] += 1
        eng.forward(cur)

    reset()
    for _ in range(40):                       # captures the graphs of every attended length the timing sees
        step()
    res = {"attention": attention, "mode": "per-row" if eng.row_attention(args.batch) else "padded SDPA",
           "norm": "fused" if eng.ops.fused_norm else "hf"}
    ms = median_ms(step, args.steps, warmup=2, device=args.device)
    res.update(step_ms=round(ms, 3), tok_s=round(args.batch / ms * 1e3, 1), graphs=eng.graph_count)
    if cuda and args.profile:
        res["step_profile"] = profile(step, 8)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (args.prefill_tokens,), generator=g).tolist()
               for _ in range(args.prefill_rows)]
    rows = list(range(args.prefill_rows))

    def prefill():
        eng.reset(rows)
        eng.prefill(prompts, rows)

    for _ in range(3):                       # eager warm-up, capture, replay
        prefill()
    res["prefill_ms"] = round(median_ms(prefill, max(3, args.steps // 8), warmup=1, device=args.device), 3)
    res["prefill_tok_s"] = round(args.prefill_rows * args.prefill_tokens / res["prefill_ms"] * 1e3, 1)
    if cuda and args.profile:
        res["prefill_profile"] = profile(prefill, 4)
    del eng
    if cuda:
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=60)
    ap.add_argument("--max-row-len", type=int, default=450)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--attention", default="sdpa,rows", help="comma list of engine attention modes")
    ap.add_argument("--norm", default="auto", help="comma list of the engine's RMSNorm modes (auto, fused, hf)")
    ap.add_argument("--elementwise", default="fused", help="comma list: fused (target/fused_elementwise.py's RoPE "
                                                           "and SwiGLU kernels, CUDA's default) and / or torch")
    ap.add_argument("--prefill-rows", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=128)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model and batch, SDPA only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.smoke:
        args.device, args.batch, args.max_len, args.min_len, args.max_row_len = "cpu", 8, 64, 4, 40
        args.steps, args.attention, args.prefill_rows, args.prefill_tokens, args.profile = 6, "sdpa", 4, 16, False
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(torch.device(args.device), dtype, args.smoke)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_row_len + 1, (args.batch,), generator=g).tolist()
    cfg = model.config
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * sum(lengths)
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "batch": args.batch, "max_len": args.max_len, "mean_row_len": round(sum(lengths) / len(lengths), 1),
           "row_kv_gb_per_step": round(kv_bytes / 1e9, 3),
           "row_kv_floor_ms_at_4tbs": round(kv_bytes / 4.0e12 * 1e3, 3), "runs": []}
    for attention, norm, elementwise in ((a, n, e) for a in args.attention.split(",") for n in args.norm.split(",")
                                         for e in args.elementwise.split(",")):
        fused_elementwise.ENABLED = elementwise == "fused"
        r = measure(model, args, attention, lengths, norm)
        r["elementwise"] = elementwise
        out["runs"].append(r)
        print(f"SUMMARY attention {attention} ({r['mode']}), norm {r['norm']}, elementwise {elementwise}: decode "
              f"step {r['step_ms']} ms = "
              f"{r['tok_s']:,.0f} tok/s at batch {args.batch}; prefill {args.prefill_rows}x{args.prefill_tokens} "
              f"{r['prefill_ms']} ms ({r['prefill_tok_s']:,.0f} tok/s)", flush=True)
        for key in ("step_profile", "prefill_profile"):
            for row in r.get(key, [])[:10]:
                print(f"  {key} {row}", flush=True)
    print(f"SUMMARY own-keys K/V per step {out['row_kv_gb_per_step']} GB (floor {out['row_kv_floor_ms_at_4tbs']} ms "
          f"at 4 TB/s), mean row length {out['mean_row_len']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
