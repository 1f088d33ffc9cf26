"""Training-step benchmark at the seed's config (GPU): time, peak memory, MFU, recompiles, loader rate.

Shape: context 8192, 512 anchors x block 16, 27B-shaped drafter (5 layers, hidden 5120, 32/8 heads,
head_dim 128, intermediate 17408), vocab 248,320 (frozen bf16 lm_head on the GPU, embeddings on
the CPU). Every step goes through the trainer's own `_train_step` (planes -> bf16 on the GPU,
BlockMask, drafter, loss, AdamW fused, clipping) on real-structure batches (bench/seed_shape.py).
FLOPs per step = 6 x trainable params x query tokens + 4 x lm_head params x query tokens.

    python bench/train_step.py --variants compiled-fused,compiled-fused-mlp3,compiled,eager --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.seed_shape import SeedShape, heavy_tailed_features, structure_batches, write_seed_shard  # noqa: E402
from dflash_pipe.cache.codec import LOSSLESS, encode_hidden  # noqa: E402
from dflash_pipe.config import RunConfig  # noqa: E402
from dflash_pipe.drafter import DrafterModelConfig, lock_compilation, unlock_compilation  # noqa: E402
from dflash_pipe.drafter.attention import set_flex_tuning  # noqa: E402
from dflash_pipe.drafter.grouped import set_group_blocks  # noqa: E402
from dflash_pipe.train.components import block_embeds, build_model, build_optimizer  # noqa: E402
from dflash_pipe.train.master_weights import MasterWeights  # noqa: E402
from dflash_pipe.train.loader import TrainBatch  # noqa: E402
from dflash_pipe.train.metrics import step_flops  # noqa: E402
from dflash_pipe.train.trainer import DeviceFeed, _train_step  # noqa: E402

# param: dtype of the draft Linear weights during forward/backward (bf16 = fp32 masters in the
# optimizer, train/master_weights.py; fp32 = fp32 weights cast by autocast at every use).
VARIANTS = {
    "eager": dict(compile=False, fused=False, mlp=0, param="bf16"),
    "compiled": dict(compile=True, fused=False, mlp=0, param="bf16"),
    "compiled-fused": dict(compile=True, fused=True, mlp=0, param="bf16"),
    "compiled-fused-fp32w": dict(compile=True, fused=True, mlp=0, param="fp32"),
    "compiled-fused-mlp1": dict(compile=True, fused=True, mlp=1, param="bf16"),
    "compiled-fused-mlp2": dict(compile=True, fused=True, mlp=2, param="bf16"),
    "compiled-fused-mlp3": dict(compile=True, fused=True, mlp=3, param="bf16"),
    "compiled-fused-mlp5": dict(compile=True, fused=True, mlp=5, param="bf16"),
    # the quality runs' setting (manifests/quality-smollm2-gpu.toml): dense-mask SDPA, nothing compiled
    "eager-sdpa": dict(compile=False, fused=True, mlp=0, param="bf16", attention="sdpa"),
    # the same without the dense grid: SDPA over each group of blocks' context span (drafter/grouped.py)
    "eager-grouped": dict(compile=False, fused=True, mlp=0, param="bf16", attention="sdpa-grouped"),
}
# --shape smollm2: the quality runs' drafter (SmolLM2-135M target: hidden 576, 9/3 heads of 64, 3 layers)
SMOLLM2 = dict(context=4096, anchors=256, block=16, hidden=576, layers=3, heads=9, kv_heads=3, head_dim=64,
               intermediate=1536, vocab=49152, target_layers=5, mask_token_id=2)


class BenchHead:
    """FrozenHead stand-in with random tensors: lm_head bf16 on the GPU, embeddings bf16 on the CPU."""

    def __init__(self, shape: SeedShape, device):
        base = torch.randn(1024, shape.hidden) * 0.02
        self.embed_VH = base.repeat((shape.vocab + 1023) // 1024, 1)[: shape.vocab].to(torch.bfloat16)
        g = torch.Generator(device=device).manual_seed(1)
        self.lm_head_VH = (torch.randn(shape.vocab, shape.hidden, generator=g, device=device) * 0.02).to(torch.bfloat16)
        self.device = device
        self._mask_rows: dict = {}

    def block_embeds(self, anchor_tokens_N, mask_token_id, block_size, dtype):   # the trainer's own
        return block_embeds(self.embed_VH, self._mask_rows, anchor_tokens_N, mask_token_id, block_size, dtype,
                            self.device)


def make_batches(shape: SeedShape, count: int, planes_pool: list[torch.Tensor], max_doc: int = 0) -> list[TrainBatch]:
    out = []
    for i, b in enumerate(structure_batches(shape, count, max_doc=max_doc)):
        t = (lambda a: torch.from_numpy(a).pin_memory()) if torch.cuda.is_available() else torch.from_numpy
        out.append(TrainBatch(0, i, planes_pool[i % len(planes_pool)], None, t(b["input_ids"]), t(b["ctx_doc"]),
                              t(b["ctx_pos"]), t(b["anchor_index"]), t(b["block_doc"]), t(b["block_valid"]),
                              t(b["labels"]), t(b["input_ids"][b["anchor_index"]]), None, None, b["docs"],
                              b["tokens"], int(b["block_valid"].sum())))
    return out


def run_variant(name: str, shape: SeedShape, head: BenchHead, batches: list[TrainBatch], steps: int,
                warmup: int, device) -> dict:
    v = VARIANTS[name]
    dcfg = DrafterModelConfig(hidden_size=shape.hidden, num_layers=shape.layers, num_attention_heads=shape.heads,
                              num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                              intermediate_size=shape.intermediate, rms_norm_eps=1e-6, rope_theta=1e7,
                              block_size=shape.block, mask_token_id=shape.mask_token_id,
                              target_layer_ids=[1, 16, 31, 46, 61][: shape.target_layers], num_target_layers=64,
                              vocab_size=shape.vocab,
                              attention=v.get("attention", "flex") if device.type == "cuda"
                              else ("sdpa-grouped" if v.get("attention") == "sdpa-grouped" else "sdpa"))
    cfg = RunConfig()
    cfg.train.fused_loss = v["fused"]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(dcfg, device, 0, v["compile"], v["mlp"])
    weights = MasterWeights(model, torch.bfloat16 if v["param"] == "bf16" else torch.float32)
    total = warmup + steps
    opt, sched = build_optimizer(weights.masters, cfg, device, total)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    trainable = sum(p.numel() for p in model.parameters())
    flops = step_flops(trainable, head.lm_head_VH.numel(), shape.anchors * shape.block)
    times, compile_s = [], None
    res = {"variant": name, **v}
    feed = DeviceFeed((batches[i % len(batches)] for i in range(total)), device)  # H2D overlapped, as in training
    probe = PhaseProbe(weights, device)
    try:
        for i in range(total):
            sync(device)
            t0 = time.perf_counter()
            batch, on_device = next(feed)
            if i == total - 1:
                probe.arm()  # the last step also reports where its memory peak and optimizer time are
            _train_step(model, weights, head, opt, sched, batch, dcfg, device, autocast, LOSSLESS,
                        shape.target_layers, 7.0, cfg, on_device, after_backward=feed.prefetch).read()
            sync(device)  # .read(): the metrics to the host at once (the trainer reads them a step later)
            dt = time.perf_counter() - t0
            if i == 0:
                compile_s = dt
                if device.type == "cuda":
                    lock_compilation()
            if i >= warmup:
                times.append(dt)
        res.update(ok=True, recompiles_under_lock=0, **probe.result())
    except Exception as exc:  # noqa: BLE001 - report and continue with the next variant
        res.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
    finally:
        unlock_compilation()
    if times:
        ms = 1000 * float(np.median(times))
        res.update(step_ms=ms, step_ms_mean=1000 * float(np.mean(times)), first_step_s=compile_s,
                   tflops=flops / (ms / 1000) / 1e12, mfu=flops / (ms / 1000) / 790e12,
                   peak_gib=res.get("peak_gib", torch.cuda.max_memory_allocated(device) / 2 ** 30
                                    if device.type == "cuda" else 0.0),
                   reserved_gib=torch.cuda.max_memory_reserved(device) / 2 ** 30 if device.type == "cuda" else 0.0,
                   trainable_params=trainable,
                   flops_per_step=flops, steps_timed=len(times))
    probe.restore()
    del model, opt, sched, weights
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


class PhaseProbe:
    """Wraps MasterWeights.step for one armed step: peak memory of forward+backward, memory held after
    backward (all grads alive), peak during the optimizer step, and the optimizer step's GPU time."""

    def __init__(self, weights: MasterWeights, device):
        self.weights, self.device, self.armed, self.out = weights, device, False, {}
        self._orig = weights.step
        weights.step = self._step

    def arm(self) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.out["peak_before_probe_gib"] = torch.cuda.max_memory_allocated(self.device) / 2 ** 30
            torch.cuda.reset_peak_memory_stats(self.device)
            self.armed = True

    def _step(self, opt, grad_clip):
        if not self.armed:
            return self._orig(opt, grad_clip)
        gib = 2 ** 30
        sync(self.device)
        self.out["peak_fwd_bwd_gib"] = torch.cuda.max_memory_allocated(self.device) / gib
        self.out["alloc_after_bwd_gib"] = torch.cuda.memory_allocated(self.device) / gib
        torch.cuda.reset_peak_memory_stats(self.device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        norm = self._orig(opt, grad_clip)
        b.record()
        sync(self.device)
        self.out["optimizer_ms"] = a.elapsed_time(b)
        self.out["peak_step_gib"] = torch.cuda.max_memory_allocated(self.device) / gib
        self.armed = False
        return norm

    def result(self) -> dict:
        """Includes peak_gib: the run's peak over all steps (the probe resets the counter)."""
        out = dict(self.out)
        peaks = [v for k, v in out.items() if k.startswith("peak_")]
        if peaks and self.device.type == "cuda":
            out["peak_gib"] = max(peaks + [torch.cuda.max_memory_allocated(self.device) / 2 ** 30])
        return out

    def restore(self) -> None:
        self.weights.step = self._orig


def best_flex_variant(path: str) -> tuple[int, int, dict | None]:
    """(q tile, kv tile, kernel_options) of the fastest correct "ranges" variant of a bench/flex_kernel.py result."""
    rows = [r for r in json.loads(Path(path).read_text())
            if r.get("ok") and r.get("mask_mod") == "ranges" and r.get("rel_err_vs_first", 1) < 2e-2
            and r.get("grad_rel_err_vs_first", 1) < 2e-2]
    if not rows:
        return 128, 128, None
    best = min(rows, key=lambda r: r["ms"])
    return int(best["block"][0]), int(best["block"][1]), best.get("kernel_options")


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loader_rate(shape: SeedShape, workers: int, batches: int = 8, row_group_mb: int | None = None) -> dict:
    """Decode throughput of the real loader at the seed's feature width (synthetic heavy-tailed values).

    Row groups as extraction writes them (`extract.row_group_mb`, default 64 MiB; sessions 2-3 measured
    with 256 MiB ones, i.e. ~4x fewer row groups to read in parallel per batch)."""
    from dflash_pipe.config import ExtractConfig

    row_group_mb = row_group_mb or ExtractConfig().row_group_mb
    from dflash_pipe.train.loader import BatchLoader, CacheIndex

    tmp = Path(tempfile.mkdtemp(prefix="dflash-loader-bench-"))
    width, info, enc_s = write_seed_shard(tmp, shape, shape.target_layers, batches, row_group_mb, workers, {"bench": 1})
    index = CacheIndex(tmp)
    loader = BatchLoader(index, rank=0, world=1, seed=0, context_tokens=shape.context, num_anchors=shape.anchors,
                         max_anchors_per_doc=512, block_size=shape.block, shuffle_rows=1, workers=workers,
                         want_topk=False, pin_memory=torch.cuda.is_available())
    # steady state: the clock starts once the first `prefetch` batches (buffer allocation, pool start)
    # are out; the cold figure counts from the first request
    n, raw, t_cold, t_warm, raw_warm, n_warm = 0, 0, time.perf_counter(), None, 0, 0
    for batch in loader.iterate(0, 0):
        n += 1
        raw += batch.tokens * width * 2
        batch.release()  # as the trainer's DeviceFeed does once the copy is done
        if t_warm is not None:
            raw_warm += batch.tokens * width * 2
            n_warm += 1
        elif n == loader.prefetch:
            t_warm = time.perf_counter()
    end = time.perf_counter()
    loader.close()
    warm_s = end - t_warm if t_warm is not None and n_warm else float("nan")
    return {"workers": workers, "row_group_mb": row_group_mb, "batches": n, "steady_batches": n_warm,
            "decode_GBps": raw_warm / warm_s / 1e9 if n_warm else raw / (end - t_cold) / 1e9,
            "decode_cold_GBps": raw / (end - t_cold) / 1e9, "batch_ms": 1000 * warm_s / max(1, n_warm),
            "encode_GBps": info.raw_feature_bytes / enc_s / 1e9, "ratio": info.bytes / info.raw_feature_bytes,
            "plane_buffers_allocated": loader.plane_pool.allocated}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="compiled-fused,compiled-fused-mlp3,compiled,eager")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lock-steps", type=int, default=50, help="steps of the first variant run under the lock")
    ap.add_argument("--loader-workers", type=int, default=8)
    ap.add_argument("--json", default="")
    ap.add_argument("--flex-block", default="128,128")
    ap.add_argument("--flex-from", default="", help="take the fastest tiles from a bench/flex_kernel.py --json file")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on the CPU (checks the script, no numbers)")
    ap.add_argument("--shape", choices=("seed", "smollm2"), default="seed",
                    help="seed: the 27B-shaped drafter; smollm2: the quality runs' 3-layer drafter at width 576")
    ap.add_argument("--context", type=int, default=0, help="context tokens per step (default: the shape's)")
    ap.add_argument("--anchors", type=int, default=0, help="anchors per step (default: the shape's)")
    ap.add_argument("--layers", type=int, default=0, help="drafter layers (default: the shape's)")
    ap.add_argument("--max-doc", type=int, default=-1,
                    help="cut the ShareGPT documents to this many tokens (default: 1280 for --shape smollm2, as the "
                         "quality runs extract; the context for the seed shape)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the eager variants at a real shape")
    ap.add_argument("--group-blocks", type=int, default=0,
                    help="blocks per group of the eager-grouped variant (default: drafter/grouped.py's)")
    ap.add_argument("--in-process", action="store_true",
                    help="run all variants in this process (default: one child process per variant when there are "
                         "several, so no variant's memory or compiled code leaks into the next one's numbers)")
    ap.add_argument("--no-loader", action="store_true", help="skip the loader's decode-rate measurement (children of "
                    "a multi-variant run get it from the first one)")
    args = ap.parse_args()
    names = args.variants.split(",")
    if len(names) > 1 and not args.in_process:
        return run_isolated(args, names)
    device = torch.device("cpu" if args.cpu_smoke else args.device)
    shape = bench_shape(args)
    if args.flex_from:
        qb, kb, kernel_options = best_flex_variant(args.flex_from)
    else:
        (qb, kb), kernel_options = (int(x) for x in args.flex_block.split(",")), None
    set_flex_tuning(qb, kb, kernel_options)
    if args.group_blocks:
        set_group_blocks(args.group_blocks)
    print(f"flex tiles {qb}x{kb} kernel_options {kernel_options}", flush=True)
    width = shape.hidden * shape.target_layers
    pool = [encode_hidden(heavy_tailed_features(shape.context, width, s), LOSSLESS, shape.target_layers).planes
            for s in range(3)]
    if device.type == "cuda":
        pool = [p.pin_memory() for p in pool]
    batches = make_batches(shape, max(args.lock_steps, args.steps + args.warmup), pool, max_doc_tokens(args))
    head = BenchHead(shape, device)
    lr = {} if args.no_loader else loader_rate(shape, args.loader_workers)  # first: needs no compile
    print(json.dumps({"loader": lr}), flush=True)
    results = []
    for i, name in enumerate(names):
        steps = max(args.steps, args.lock_steps - args.warmup) if i == 0 else args.steps
        r = run_variant(name, shape, head, batches, steps, args.warmup, device)
        results.append(r)
        print(json.dumps(r), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"flex_tiles": [qb, kb], "flex_kernel_options": kernel_options,
                                                   "variants": results, "loader": lr}, indent=2))
    report(results, lr, shape, width, args.json, {"flex_tiles": [qb, kb], "flex_kernel_options": kernel_options})


def bench_shape(args) -> SeedShape:
    """The seed's or the quality drafter's shape (--shape), or a tiny one for --cpu-smoke (checks the script, no
    numbers); --context / --anchors override the step's size, --layers the drafter's depth."""
    if args.cpu_smoke:
        shape = SeedShape(context=512, anchors=16, block=8, hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16,
                          intermediate=128, vocab=49152 + 16, target_layers=2, mask_token_id=49152 + 3)
    else:
        shape = SeedShape(**SMOLLM2) if args.shape == "smollm2" else SeedShape()
    return dataclasses.replace(shape, context=args.context or shape.context, anchors=args.anchors or shape.anchors,
                               layers=args.layers or shape.layers)


def max_doc_tokens(args) -> int:
    return (1280 if args.shape == "smollm2" else 0) if args.max_doc < 0 else args.max_doc


def run_isolated(args, names: list[str]) -> None:
    """Each variant in its own process (the first also runs the lock steps); the loader measured once here."""
    import subprocess
    import tempfile as tf

    results, head_info, lr = [], {}, {}
    for i, name in enumerate(names):
        out = Path(tf.mkdtemp(prefix="train-step-")) / "r.json"
        cmd = [sys.executable, __file__, "--variants", name, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--lock-steps", str(args.lock_steps if i == 0 else 0), "--loader-workers", str(args.loader_workers),
               "--flex-block", args.flex_block, "--json", str(out)] + (["--flex-from", args.flex_from]
                                                                      if args.flex_from else []) \
            + (["--cpu-smoke"] if args.cpu_smoke else []) + (["--no-loader"] if args.no_loader or i > 0 else []) \
            + ["--shape", args.shape, "--context", str(args.context), "--anchors", str(args.anchors),
               "--layers", str(args.layers), "--group-blocks", str(args.group_blocks), "--max-doc", str(args.max_doc),
               "--device", args.device]
        rc = subprocess.run(cmd).returncode
        got = json.loads(out.read_text()) if out.is_file() else {}
        results += got.get("variants") or [{"variant": name, "ok": False, "error": f"child exited {rc}, no result"}]
        lr = lr or got.get("loader", {})
        head_info = head_info or {k: got[k] for k in ("flex_tiles", "flex_kernel_options") if k in got}
    shape = bench_shape(args)
    report(results, lr, shape, shape.hidden * shape.target_layers, args.json, head_info)


def report(results: list, lr: dict, shape: SeedShape, width: int, json_path: str, head_info: dict) -> None:
    best = min((r for r in results if r.get("ok")), key=lambda r: r["step_ms"], default=None)
    if best and lr:
        consume = shape.context * width * 2 / (best["step_ms"] / 1000) / 1e9
        lr["step_consumption_GBps"] = consume
        lr["decode_over_consumption"] = lr["decode_GBps"] / consume
    print(json.dumps({"loader": lr}), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({**head_info, "variants": results, "loader": lr}, indent=2))
    print(f"\n{'variant':24s} {'ms/step':>8s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GiB':>9s} {'1st step s':>10s}  status")
    for r in results:
        if r.get("step_ms"):
            print(f"{r['variant']:24s} {r['step_ms']:8.1f} {r['tflops']:8.1f} {r['mfu']:6.1%} {r['peak_gib']:9.2f} "
                  f"{r['first_step_s']:10.1f}  {'ok' if r['ok'] else r.get('error', '')[:60]}")
        else:
            print(f"{r['variant']:24s} failed: {r.get('error', '')[:100]}")
    if lr:
        print(f"loader: {lr['decode_GBps']:.2f} GB/s with {lr['workers']} workers"
              + (f" = {lr['decode_over_consumption']:.2f}x the step's consumption"
                 if "decode_over_consumption" in lr else ""))


if __name__ == "__main__":
    main()
