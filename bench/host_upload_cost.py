"""Host time of one small host-to-device upload (issue 18's launch path): the pre-session-35 way
(`torch.tensor(list)` + `pin_memory()` + async copy) against `host_upload.upload` (an `array('q')` buffer and a
reused pinned block), for list sizes of regenerate's uploads (a refill's keys / rows ~80, a chunked prefill's
packed inputs ~8 k). Host microseconds per upload; the copies run as they are queued (an idle device), as between
regenerate's launches.

    python bench/host_upload_cost.py [--json out.json]          # CUDA (on the CPU: the list -> tensor part only)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_pipe.target import host_upload  # noqa: E402


def old_way(values, dev):
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def new_way(values, dev):
    return host_upload.upload(values, dev) if dev.type == "cuda" else host_upload.host_long(values)


def per_upload_us(fn, values, dev, n: int) -> float:
    for _ in range(10):
        fn(values, dev)                                   # warm: allocator blocks, the ring's pinned blocks
    if dev.type == "cuda":
        torch.cuda.synchronize()                          # then an idle device: each copy runs as it is queued
    t0 = time.perf_counter()
    for _ in range(n):
        fn(values, dev)
    dt = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return dt / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="uploads timed per (way, size)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = random.Random(0)
    res = {"device": str(dev), "n": args.n, "us_per_upload": {}}
    for size in (80, 1024, 8192):
        values = [rng.randrange(49152) for _ in range(size)]
        old, new = per_upload_us(old_way, values, dev, args.n), per_upload_us(new_way, values, dev, args.n)
        res["us_per_upload"][size] = {"old": round(old, 1), "new": round(new, 1), "old_to_new": round(old / new, 2)}
        print(f"{size:>5} ints: old {old:7.1f} us, new {new:7.1f} us ({old / new:.2f}x)", flush=True)
    res["ring_waits"] = host_upload._RING.waits
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
