"""What a window round-boundary checkpoint costs the step loop: synchronous write vs background write.

Builds fp32 masters + AdamW state of `--params` parameters (a stand-in with the drafter's parameter count;
the SmolLM2 1-layer drafter of bench/window_stream.py has ~6 M trainable, the 3-layer quality recipe ~15 M),
then times, per repeat: the host snapshot the step loop pays (train/checkpoint.snapshot(copy=True)), the
background write (files + fsync + COMPLETE marker + rename) and a synchronous save_checkpoint.

    python bench/window_checkpoint_cost.py --params 6e6 --repeats 5 [--device cuda] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_pipe.train.checkpoint import save_checkpoint, snapshot, write_snapshot  # noqa: E402
from dflash_pipe.train.master_weights import MasterWeights  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=6e6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dir", default="", help="where to write (default: a temp dir; use the run's disk)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    dev = torch.device(a.device)
    width = 1024
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(max(1, int(a.params) // (width * width)))]).to(dev)
    weights = MasterWeights(model, torch.float32)
    opt = torch.optim.AdamW(weights.masters, lr=1e-4)
    model(torch.randn(4, width, device=dev)).sum().backward()
    opt.step()
    out = {"params": sum(t.numel() for t in weights.masters), "device": a.device, "snapshot_ms": [], "write_ms": [],
           "sync_save_ms": []}
    with tempfile.TemporaryDirectory(dir=a.dir or None) as d:
        for i in range(a.repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            snap = snapshot(weights, opt, copy=True)
            t1 = time.perf_counter()
            write_snapshot(Path(d) / "bg", i, snap, {"step": i}, keep=2)
            t2 = time.perf_counter()
            save_checkpoint(Path(d) / "sync", i, weights, opt, {"step": i}, keep=2)
            t3 = time.perf_counter()
            out["snapshot_ms"].append((t1 - t0) * 1e3)
            out["write_ms"].append((t2 - t1) * 1e3)
            out["sync_save_ms"].append((t3 - t2) * 1e3)
        out["bytes"] = sum(f.stat().st_size for f in (Path(d) / "bg").glob("ckpt-*/*"))
    for k in ("snapshot_ms", "write_ms", "sync_save_ms"):
        out[k + "_median"] = statistics.median(out[k])
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
