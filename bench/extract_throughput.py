"""Stage-1 throughput on the GPU: the full extraction path vs a forward-only run, same model, same batches.

Target: the Qwen3.5-27B-shaped hybrid (64 layers = 16 x (3 Gated DeltaNet + 1 full attention),
hidden 5120, vocab 248,320), random bf16 weights, FLA kernels. Batches: real-structure documents
(bench/data/sharegpt_structure.npz) packed to --token-budget tokens.

  forward-only  the packed target forward + the LM head over every token (what `model(ids)` does),
                no capture, no top-k, nothing leaves the GPU
  full          the extract path: 5-layer hook capture, chunked top-k (k=32), channel-major
                encode on the GPU, pinned D2H, zstd in a worker pool, Parquet shard writes

Both are timed over the same batches after a warm-up (FLA autotuning). MFU counts 2 x params per
token over 790 TFLOP/s. Host-side MB/s = raw bf16 feature bytes / s and bytes written / s.

    python bench/extract_throughput.py --batches 12 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.seed_shape import load_structure  # noqa: E402
from dflash_pipe.cache import make_spec, shard_name  # noqa: E402
from dflash_pipe.cache.codec import LOSSLESS  # noqa: E402
from dflash_pipe.cache.schema import shard_meta  # noqa: E402
from dflash_pipe.cache.writer import ShardWriter  # noqa: E402
from dflash_pipe.extract.host_pipeline import DocMeta, HostPipeline  # noqa: E402
from dflash_pipe.extract.sanity import feature_stats  # noqa: E402


def packed_batches(budget: int, count: int, seed: int = 0):
    docs = load_structure()
    rng = np.random.default_rng(seed)
    out, cur, cur_t = [], [], 0
    for i in rng.permutation(len(docs)):
        ids, mask = docs[i]
        ids, mask = ids[:budget], mask[:budget]
        if cur and cur_t + len(ids) > budget:
            out.append(cur)
            cur, cur_t = [], 0
            if len(out) == count:
                break
        cur.append((ids, mask))
        cur_t += len(ids)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3.5-27b-shape")
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--layers", default="1,16,31,46,61")
    ap.add_argument("--out-dir", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (checks the script only)")
    args = ap.parse_args()
    from dflash_pipe.target.loading import load_target
    from dflash_pipe.target.runner import TargetRunner

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    t0 = time.perf_counter()
    bundle = load_target(args.model, device=device, dtype=dtype, with_tokenizer=False)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in bundle.model.parameters())
    layer_ids = [int(x) for x in args.layers.split(",")]
    runner = TargetRunner(bundle, layer_ids, topk=args.topk, linear_attn_kernels="torch" if args.cpu_smoke else "fla")
    print(f"target {args.model}: {params / 1e9:.2f}B params, built in {build_s:.0f}s; kernels {runner.kernel_paths}",
          flush=True)
    batches = packed_batches(args.token_budget, args.batches + args.warmup)
    tokens_per = [sum(len(i) for i, _ in b) for b in batches]
    n_layers, H = len(layer_ids), bundle.hidden_size

    def as_ids(b):
        ids = torch.from_numpy(np.concatenate([i for i, _ in b]).astype(np.int64))
        return ids.pin_memory() if device.type == "cuda" else ids

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # ---------------------------------------------------------------- warm-up
    # FLA autotunes per shape and every packed batch has its own length: run every batch through
    # both paths once before timing anything, so neither timed pass pays for tuning.
    for b in batches:
        runner.run(as_ids(b), [len(i) for i, _ in b], capture=False, logits="plain")
        runner.run(as_ids(b), [len(i) for i, _ in b])
    sync()
    # ---------------------------------------------------------------- forward-only
    t0 = time.perf_counter()
    for b in batches[args.warmup:]:
        runner.run(as_ids(b), [len(i) for i, _ in b], capture=False, logits="plain")
    sync()
    fwd_s = time.perf_counter() - t0
    timed_tokens = sum(tokens_per[args.warmup:])

    # ---------------------------------------------------------------- full path
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="dflash-extract-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = make_spec({"bench": 1}, {}, {}, 1, {})
    width = n_layers * H

    def full_pass(bs, name):
        writer = ShardWriter(out_dir, name, 0, LOSSLESS, args.topk,
                             shard_meta(LOSSLESS, args.topk, width, n_layers, spec["fingerprint"]), 256 << 20)
        host = HostPipeline(writer, args.workers, 4, device, layer_ids, LOSSLESS, sanity=True)
        doc = 0
        for b in bs:
            lens = [len(i) for i, _ in b]
            out = runner.run(as_ids(b), lens)
            stats = feature_stats(out.hidden_TD, lens, n_layers)
            docs = []
            for ids, mask in b:
                docs.append(DocMeta(f"d{doc}", doc, ids.astype(np.int32), mask))
                doc += 1
            host.submit(docs, out.hidden_TD, lens, n_layers, out.topk_ids_TK, out.topk_logprobs_TK, stats)
        timers = host.close()
        info = writer.commit()
        return timers, info

    full_pass(batches[: args.warmup], shard_name(0, 2))
    sync()
    t0 = time.perf_counter()
    timers, info = full_pass(batches[args.warmup:], shard_name(1, 2))
    sync()
    full_s = time.perf_counter() - t0
    fwd_tps, full_tps = timed_tokens / fwd_s, timed_tokens / full_s
    res = {"model": args.model, "params": params, "batches": len(batches) - args.warmup, "tokens": timed_tokens,
           "token_budget": args.token_budget, "topk": args.topk, "layers": layer_ids, "workers": args.workers,
           "forward_only_tok_s": fwd_tps, "full_tok_s": full_tps, "ratio": full_tps / fwd_tps,
           "mfu_forward_only": 2 * params * fwd_tps / 790e12, "mfu_full": 2 * params * full_tps / 790e12,
           "raw_feature_MBps": info.raw_feature_bytes / full_s / 1e6, "written_MBps": info.bytes / full_s / 1e6,
           "compression_ratio": info.bytes / info.raw_feature_bytes, "gpu_blocked_s": timers.gpu_blocked_s,
           "writer_idle_s": timers.writer_idle_s, "compress_cpu_s": timers.compress_s, "full_wall_s": full_s,
           "kernels": runner.kernel_paths, "cores": os.cpu_count()}
    if device.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    print(json.dumps(res, indent=2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"\n{'path':14s} {'tok/s':>9s} {'MFU':>6s}")
    print(f"{'forward-only':14s} {fwd_tps:9.0f} {res['mfu_forward_only']:6.1%}")
    print(f"{'full extract':14s} {full_tps:9.0f} {res['mfu_full']:6.1%}   ratio {res['ratio']:.3f}; host "
          f"{res['raw_feature_MBps']:.0f} MB/s raw -> {res['written_MBps']:.0f} MB/s written; target waited "
          f"{timers.gpu_blocked_s:.2f}s for the host")


if __name__ == "__main__":
    main()
