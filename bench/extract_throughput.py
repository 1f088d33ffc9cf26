"""Stage-1 throughput on the GPU: the full extraction path vs a forward-only run, same model, same batches.

Target: the Qwen3.5-27B-shaped hybrid (64 layers = 16 x (3 Gated DeltaNet + 1 full attention),
hidden 5120, vocab 248,320), random bf16 weights, FLA kernels. Batches: real-structure documents
(bench/data/sharegpt_structure.npz) packed to --token-budget tokens.

  forward-only  the packed target forward + the LM head over every token (what `model(ids)` does),
                no capture, no top-k, nothing leaves the GPU
  gpu_side      runner.run (5-layer hook capture, chunked top-k, k=32) + feature_stats + the
                device-side channel-major encode/pack of the batch; no D2H, no host work
  full          the extract path: gpu_side + one pinned D2H per batch, zstd in a worker pool,
                Parquet shard writes, shard commits (footer + fsync + rename) on the writer thread

All three are timed over the same batches after a warm-up (FLA autotuning). The full path uses one
long-lived HostPipeline (as `dflash-pipe extract` does for all shards of a rank) for the warm-up
and the timed passes, and splits the timed batches into --shards-per-pass shards, so a shard's
commit overlaps the next shard's forwards as in a real run. It reports
  full_tok_s    tokens / wall until every shard is committed (includes the final drain + commit)
  steady_tok_s  tokens / wall until the last batch's forward + submit finished on the GPU
                (torch.cuda.synchronize after the last submit, before waiting for the writer)
Forward-only vs gpu_side vs steady vs full attributes the loss: GPU-side extra work, main-thread
host work, and the tail. --profile N runs N extra full-path batches under torch.profiler and writes
the CPU- and CUDA-time tables next to the --json output.

MFU counts 2 x params per token over 790 TFLOP/s. Host-side MB/s = raw bf16 feature bytes / s and
bytes written / s (over the full wall).

    python bench/extract_throughput.py --batches 12 --json out.json
    python bench/extract_throughput.py --model random:smollm2-135m-shape --layers 1,8,14,20,27 \
        --layouts packed,padded --json out.json     # the quality runs' target: the two attention layouts

--layouts times forward-only and gpu_side once per layout (`--attention-layout`: packed = one row with a
block-diagonal document mask, padded = one right-padded row per document, plain causal attention), in order,
on the same batches; the full path runs with the last one. `layouts` in the JSON holds each one's rates.
    python bench/extract_throughput.py --cpu-smoke --batches 4 --warmup 1 --token-budget 512 --json /tmp/x.json
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
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.seed_shape import load_structure  # noqa: E402
from dflash_pipe.cache import make_spec  # noqa: E402
from dflash_pipe.cache.codec import LOSSLESS  # noqa: E402
from dflash_pipe.cache.schema import shard_meta  # noqa: E402
from dflash_pipe.cache.writer import ShardWriter  # noqa: E402
from dflash_pipe.config import ExtractConfig  # noqa: E402
from dflash_pipe.extract.host_pipeline import DocMeta, HostPipeline  # noqa: E402
from dflash_pipe.extract.staging import max_batch_bytes, pack_batch  # noqa: E402
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


def split_shards(batches: list, n: int) -> list[list]:
    """Contiguous groups of batches, one per shard (no empty shard)."""
    n = max(1, min(n, len(batches)))
    bounds = np.linspace(0, len(batches), n + 1).round().astype(int)
    return [batches[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--row-group-mb", type=int, default=ExtractConfig().row_group_mb,
                    help="Parquet row group size (extraction's default; runs before session 4's third used 256)")
    ap.add_argument("--model", default="random:qwen3.5-27b-shape")
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--queue-batches", type=int, default=4, help="staging slots (batches in flight)")
    ap.add_argument("--shards-per-pass", type=int, default=2, help="shards the timed batches are split into")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="run N extra full-path batches under torch.profiler; tables go next to --json")
    ap.add_argument("--layers", default="1,16,31,46,61")
    ap.add_argument("--layouts", default="packed", help="comma list of extract --attention-layout values")
    ap.add_argument("--out-dir", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (checks the script only)")
    args = ap.parse_args()
    from dflash_pipe.target.loading import load_target
    from dflash_pipe.target.runner import TargetRunner

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    model = "random:tiny-qwen3.5" if args.cpu_smoke and args.model == ap.get_default("model") else args.model
    t0 = time.perf_counter()
    bundle = load_target(model, device=device, dtype=dtype, with_tokenizer=False)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in bundle.model.parameters())
    layer_ids = [int(x) for x in args.layers.split(",")]
    if args.cpu_smoke:
        layer_ids = [i for i in layer_ids if i < bundle.num_layers] or [0, bundle.num_layers - 1]
    kernels = "torch" if args.cpu_smoke else "fla"
    batches = packed_batches(args.token_budget, args.warmup + args.batches + args.profile)
    warm, timed, prof_batches = (batches[:args.warmup], batches[args.warmup:args.warmup + args.batches],
                                 batches[args.warmup + args.batches:])
    n_layers, H = len(layer_ids), bundle.hidden_size
    width = n_layers * H
    timed_tokens = sum(len(i) for b in timed for i, _ in b)

    def as_ids(b):
        ids = torch.from_numpy(np.concatenate([i for i, _ in b]).astype(np.int64))
        return ids.pin_memory() if device.type == "cuda" else ids

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    layouts, per_layout, runner = args.layouts.split(","), {}, None
    for layout in layouts:
        if runner is not None:
            runner.close()                      # one runner (its hooks) per model at a time
        runner = TargetRunner(bundle, layer_ids, topk=args.topk, linear_attn_kernels=kernels, layout=layout)
        print(f"target {model}: {params / 1e9:.2f}B params, built in {build_s:.0f}s; layout {layout}; kernels "
              f"{runner.kernel_paths}", flush=True)
        # ------------------------------------------------------------ warm-up
        # FLA autotunes per shape and every packed batch has its own length: run every batch through
        # both paths once before timing anything, so no timed pass pays for tuning.
        for b in batches:
            runner.run(as_ids(b), [len(i) for i, _ in b], capture=False, logits="plain")
            runner.run(as_ids(b), [len(i) for i, _ in b])
        sync()
        # ------------------------------------------------------------ forward-only
        t0 = time.perf_counter()
        for b in timed:
            runner.run(as_ids(b), [len(i) for i, _ in b], capture=False, logits="plain")
        sync()
        fwd_s = time.perf_counter() - t0
        # ------------------------------------------------------------ gpu side: forward + capture + encode/pack
        t0 = time.perf_counter()
        for b in timed:
            lens = [len(i) for i, _ in b]
            out = runner.run(as_ids(b), lens)
            stats = feature_stats(out.hidden_TD, lens, n_layers)
            pack_batch(out.hidden_TD, lens, LOSSLESS, n_layers, out.topk_ids_TK, out.topk_logprobs_TK, stats)
        sync()
        gpu_side_s = time.perf_counter() - t0
        per_layout[layout] = {"forward_only_tok_s": timed_tokens / fwd_s, "gpu_side_tok_s": timed_tokens / gpu_side_s}
        print(f"layout {layout}: forward-only {timed_tokens / fwd_s:,.0f} tok/s, gpu side "
              f"{timed_tokens / gpu_side_s:,.0f} tok/s", flush=True)

    # ---------------------------------------------------------------- full path, one long-lived pipeline
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="dflash-extract-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = make_spec({"bench": 1}, {}, {}, 1, {})
    meta = shard_meta(LOSSLESS, args.topk, width, n_layers, spec["fingerprint"])
    slot_bytes = max_batch_bytes(args.token_budget, width, n_layers, LOSSLESS, args.topk)
    t0 = time.perf_counter()
    host = HostPipeline(args.workers, args.queue_batches, slot_bytes, device, layer_ids, LOSSLESS, sanity=True)
    setup_s = time.perf_counter() - t0
    shard_ids = iter(range(10 ** 6))
    doc_ids = iter(range(10 ** 9))

    def full_pass(bs, n_shards):
        """Forward + submit every batch, shard by shard; returns (steady_s, full_s, handles)."""
        handles = []
        t_start = time.perf_counter()
        for group in split_shards(bs, n_shards):
            idx = next(shard_ids)
            with record_function("bench.begin_shard"):
                writer = ShardWriter(out_dir, f"shard-{idx:05d}.parquet", idx, LOSSLESS, args.topk, meta,
                                     args.row_group_mb << 20)
                handles.append(host.begin_shard(writer, idx))
            for b in group:
                lens = [len(i) for i, _ in b]
                with record_function("bench.forward"):
                    out = runner.run(as_ids(b), lens)
                with record_function("bench.feature_stats"):
                    stats = feature_stats(out.hidden_TD, lens, n_layers)
                with record_function("bench.submit"):
                    docs = [DocMeta(f"d{j}", j, ids.astype(np.int32), mask) for (ids, mask), j in zip(b, doc_ids)]
                    host.submit(docs, out.hidden_TD, lens, n_layers, out.topk_ids_TK, out.topk_logprobs_TK, stats)
            host.end_shard(lambda h: h.writer.commit())
        with record_function("bench.sync"):
            sync()
        steady_s = time.perf_counter() - t_start
        with record_function("bench.flush"):
            host.flush()
        return steady_s, time.perf_counter() - t_start, handles

    try:
        if warm:
            full_pass(warm, 1)
        allocations_before = host.ring.allocations
        steady_s, full_s, handles = full_pass(timed, args.shards_per_pass)
        prof_file = None
        if prof_batches:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                full_pass(prof_batches, 1)
            ka = prof.key_averages()
            text = "# self CPU time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=40)
            text += "\n\n# CPU time incl. children (bench.* = main-thread phases)\n"
            text += ka.table(sort_by="cpu_time_total", row_limit=40)
            if device.type == "cuda":
                text += "\n\n# CUDA time\n" + ka.table(sort_by="self_cuda_time_total", row_limit=40)
            prof_file = (Path(args.json).with_suffix(".profile.txt") if args.json else out_dir / "profile.txt")
            prof_file.write_text(text)
        close_wait_s = host.close()
    except BaseException:
        host.abort()
        raise
    infos = [h.result for h in handles]
    timers = [h.timers for h in handles]
    raw, written = sum(i.raw_feature_bytes for i in infos), sum(i.bytes for i in infos)
    fwd_tps, gpu_tps = timed_tokens / fwd_s, timed_tokens / gpu_side_s
    full_tps, steady_tps = timed_tokens / full_s, timed_tokens / steady_s
    blocked = sum(t.gpu_blocked_s for t in timers)
    res = {"model": model, "params": params, "batches": len(timed), "tokens": timed_tokens,
           "layout": layouts[-1], "layouts": per_layout,
           "token_budget": args.token_budget, "topk": args.topk, "layers": layer_ids, "workers": args.workers,
           "queue_batches": args.queue_batches, "shards_per_pass": len(handles),
           "forward_only_tok_s": fwd_tps, "gpu_side_tok_s": gpu_tps, "steady_tok_s": steady_tps,
           "full_tok_s": full_tps, "ratio": full_tps / fwd_tps, "steady_ratio": steady_tps / fwd_tps,
           "gpu_side_ratio": gpu_tps / fwd_tps,
           "mfu_forward_only": 2 * params * fwd_tps / 790e12, "mfu_gpu_side": 2 * params * gpu_tps / 790e12,
           "mfu_steady": 2 * params * steady_tps / 790e12, "mfu_full": 2 * params * full_tps / 790e12,
           "raw_feature_MBps": raw / full_s / 1e6, "written_MBps": written / full_s / 1e6,
           "compression_ratio": written / max(1, raw), "gpu_blocked_s": blocked,
           "writer_idle_s": sum(t.writer_idle_s for t in timers),
           "compress_cpu_s": sum(t.compress_s for t in timers), "commit_s": [t.commit_s for t in timers],
           "forward_only_s": fwd_s, "gpu_side_s": gpu_side_s, "steady_wall_s": steady_s, "full_wall_s": full_s,
           "tail_s": full_s - steady_s, "pipeline_setup_s": setup_s, "close_wait_s": close_wait_s,
           "staging_slot_bytes": slot_bytes, "staging_allocations": host.ring.allocations,
           "staging_allocations_in_timed_pass": host.ring.allocations - allocations_before,
           "staging_grown": host.ring.grown, "profile_file": str(prof_file) if prof_file else None,
           "kernels": runner.kernel_paths, "cores": os.cpu_count()}
    if device.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    print(json.dumps(res, indent=2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"\n{'path':14s} {'tok/s':>9s} {'MFU':>6s} {'ratio':>6s}")
    for name, tps in (("forward-only", fwd_tps), ("gpu side", gpu_tps), ("full, steady", steady_tps),
                      ("full", full_tps)):
        print(f"{name:14s} {tps:9.0f} {2 * params * tps / 790e12:6.1%} {tps / fwd_tps:6.3f}")
    print(f"host {res['raw_feature_MBps']:.0f} MB/s raw -> {res['written_MBps']:.0f} MB/s written; target waited "
          f"{blocked:.2f}s for the host; tail (drain + last commit) {res['tail_s']:.2f}s")
    if prof_file:
        print(f"profile tables: {prof_file}")


if __name__ == "__main__":
    main()
