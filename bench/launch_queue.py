"""How far ahead of the device the host can queue regenerate's decode steps before a launch call blocks.

issue 18: `regenerate`'s driver queues a launch (a refill, then 8 decode steps), does its host work (detokenize,
tokenize, write), then waits for the launch's answers. If the CUDA launch queue holds fewer than 8 steps, queuing
the launch blocks until only that many are left, and host work longer than them idles the device.

Random SmolLM2-shaped weights (bench/decode_step_profile.py), bf16, regenerate's engine backend at --batch rows,
all slots live. The device is first held busy by a ~--hold-ms sleep kernel; then the host queues work item by item
and times each call. A call that returns in microseconds was queued; one that takes a step's time waited for queue
room. Items:
  step     EngineBackend._decode: the graphed forward (input copies + graph replay) and the eager token choice
  forward  the engine's graphed forward alone (input copies + replay)
  replay   the decode graph's replay alone
  kernel   one tiny eager kernel (`x.add_(1)`), up to 4,096 of them
For each: how many were queued before the first call that blocked, and the host ms of the calls.

    python bench/launch_queue.py --json queue.json           # CUDA
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode_step_profile import build_model  # noqa: E402
from dflash_pipe.eval.regen_backends import EngineBackend, TurnRequest  # noqa: E402
from dflash_pipe.eval.regen_sampling import Decoding  # noqa: E402


def queued_before_blocking(fn, n: int, hold_ms: float, block_ms: float) -> dict:
    """Hold the device busy, then call fn() n times: the host ms of each and how many returned before one took
    longer than block_ms."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(hold_ms * 1.98e6))          # ~hold_ms at ~2 GHz: the queue fills behind it
    ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    first_block = next((i for i, m in enumerate(ms) if m > block_ms), None)
    return {"queued_before_blocking": first_block if first_block is not None else f">= {n}",
            "host_ms_first_8": [round(m, 3) for m in ms[:8]],
            "host_ms_median_after_blocking": round(sorted(ms[first_block:])[len(ms[first_block:]) // 2], 3)
            if first_block is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--hold-ms", type=float, default=300.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model(dev, torch.bfloat16, smoke=False)
    be = EngineBackend(model, [0], args.batch, 512, 256, Decoding(), check_every=8)
    g = torch.Generator().manual_seed(0)
    ready = [TurnRequest(None, torch.randint(1, 49152, (int(n),), generator=g).tolist(), key=i, order=i)
             for i, n in enumerate(torch.randint(20, 200, (args.batch,), generator=g))]
    be.launch(ready)
    be.collect()
    for _ in range(3):                                   # graphs captured, kernels compiled
        be.launch([])
        be.collect()
    with torch.inference_mode():
        be.active.fill_(True)                            # every row decodes
    eng = be.engine
    cur, active = be.cur[:, None], be.active.long()
    graph = next(e[0] for k, e in eng._graphs.items() if k[:2] == (args.batch, 1))
    with torch.inference_mode():
        x = torch.zeros(1, device=dev)
    res = {"device": torch.cuda.get_device_name(), "batch": args.batch}
    with torch.inference_mode():
        t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t[0].record()
        for _ in range(8):
            be._decode()
        t[1].record()
        torch.cuda.synchronize()
        step_ms = t[0].elapsed_time(t[1]) / 8
        res["step_device_ms"] = round(step_ms, 3)
        block = step_ms / 3
        res["step"] = queued_before_blocking(be._decode, 48, args.hold_ms, block)
        res["forward"] = queued_before_blocking(lambda: eng.forward(cur, active), 48, args.hold_ms, block)
        res["replay"] = queued_before_blocking(graph.replay, 48, args.hold_ms, block)
        res["kernel"] = queued_before_blocking(lambda: x.add_(1), 4096, args.hold_ms, 0.5)
    for k in ("step", "forward", "replay", "kernel"):
        print(f"SUMMARY {k}: {res[k]['queued_before_blocking']} queued before a call blocked; host ms of the first "
              f"8 calls {res[k]['host_ms_first_8']}, median after blocking {res[k]['host_ms_median_after_blocking']}"
              f" (a decode step is {res['step_device_ms']} ms on the device)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
