"""How much of a staged prefill still costs the decode when both run at once (regenerate --overlap-prefill).

bench/regen_overlap_sim.py models the overlap mode with one unknown, the "overlap cost": the share of the
staging prefills' device time that still lands on the decode's timeline. This measures it directly, with random
weights in SmolLM2-135M's shape (bench/decode_step_profile.py's model; no carry needed), bf16 on CUDA:

  decode   --steps graphed decode steps of the main engine (--batch rows, lengths spread as under continuous
           batching) on a high-priority stream, alone;
  prefill  --calls staging prefill calls (`regen_staging.StagingArea.top_up`, the real code: --prefill-rows
           prompts of --prefill-tokens each a call, first tokens chosen) on the low-priority side stream, alone;
  both     the two queued at once, as overlap mode queues them; the time until both are done.

overlap_cost = (both - decode) / prefill: 0 = the prefill hid entirely under the decode, 1 = none of it did.
Three repeats of each, medians. --calls defaults to what session 12's regen spent: prefill ~0.26 of decode time.

    python bench/prefill_overlap.py --json out.json     # H200
    python bench/prefill_overlap.py --smoke             # CPU: tiny sizes; no streams, so the cost is 1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode_step_profile import build_model  # noqa: E402
from dflash_pipe.eval.regen_sampling import Decoding  # noqa: E402
from dflash_pipe.eval.regen_staging import StagingArea  # noqa: E402
from dflash_pipe.target.static_forward import StaticKVEngine  # noqa: E402


def timed(cuda: bool, streams, fn) -> float:
    """Seconds from the start of `fn`'s queueing until every stream in `streams` has finished its work."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record(streams[0])
    for s in streams[1:]:
        s.wait_event(start)
    fn()
    ends = []
    for s in streams:
        e = torch.cuda.Event(enable_timing=True)
        e.record(s)
        ends.append(e)
    torch.cuda.synchronize()
    return max(start.elapsed_time(e) for e in ends) / 1e3


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--calls", type=int, default=0, help="staging prefill calls (0 = ~0.26 of the decode time)")
    ap.add_argument("--prefill-rows", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.smoke:
        args.device, args.batch, args.max_len, args.steps, args.prefill_rows, args.prefill_tokens = \
            "cpu", 8, 64, 6, 4, 16
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    model = build_model(dev, torch.bfloat16 if cuda else torch.float32, args.smoke)
    main_eng = StaticKVEngine(model, args.batch, args.max_len, bucketed_prefill=True)
    main_eng.k_cache.normal_()
    main_eng.v_cache.normal_()
    rows = args.prefill_rows
    stage = StagingArea(model, rows, args.max_len, Decoding(), min_rows=8 if cuda else 1, min_free=rows)
    stage.policy = dataclasses.replace(stage.policy, budget=rows * args.prefill_tokens, round_rows=False)
    main_s = torch.cuda.Stream(priority=-1) if cuda else None
    g = torch.Generator().manual_seed(0)
    lo, hi = min(60, args.max_len // 8), args.max_len - args.steps - 8      # no row outgrows max_len in a run
    lengths = torch.randint(lo, hi, (args.batch,), generator=g).tolist()
    len_t = torch.tensor(lengths, device=dev)
    cur = torch.randint(0, 49152, (args.batch, 1), device=dev)
    prompts = [torch.randint(3, 49152, (args.prefill_tokens,), generator=g).tolist() for _ in range(rows)]

    def decode():
        with torch.cuda.stream(main_s) if cuda else contextlib.nullcontext():
            main_eng.lengths[:args.batch].copy_(len_t)       # the rows back to their spread: one copy, not
            main_eng._bound[:args.batch] = lengths           # `truncate`'s kernel a row
            for _ in range(args.steps):
                main_eng.forward(cur)

    def prefill(calls):      # every call queued before any wait (take_back would sync the side stream)
        for _ in range(calls):
            stage.top_up([SimpleNamespace(prompt=p, key=i) for i, p in enumerate(prompts)])
            stage.groups.clear()
            stage._timed.clear()
            stage.free = list(range(rows))
            with stage._side():
                stage.engine.reset()

    streams = [main_s, stage.stream] if cuda else [None]
    for _ in range(2):                               # warm-up: graph captures (decode lengths, prefill shape)
        decode()
        prefill(3)
    t_dec = [timed(cuda, streams, decode) for _ in range(args.repeats)]
    per_call = statistics.median(timed(cuda, streams, lambda: prefill(1)) for _ in range(args.repeats))
    calls = args.calls or max(1, round(0.26 * statistics.median(t_dec) / per_call))
    t_pre = [timed(cuda, streams, lambda: prefill(calls)) for _ in range(args.repeats)]
    t_both = [timed(cuda, streams, lambda: (decode(), prefill(calls))) for _ in range(args.repeats)]
    d, p, b = statistics.median(t_dec), statistics.median(t_pre), statistics.median(t_both)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "batch": args.batch, "steps": args.steps, "step_ms": round(d / args.steps * 1e3, 3),
           "prefill_calls": calls, "prefill_shape": [rows, args.prefill_tokens],
           "prefill_ms_per_call": round(p / calls * 1e3, 3), "decode_s": round(d, 4), "prefill_s": round(p, 4),
           "both_s": round(b, 4), "overlap_cost": round((b - d) / p, 3), "serial_s": round(d + p, 4)}
    print(f"SUMMARY decode {args.steps} steps {res['decode_s']} s ({res['step_ms']} ms/step), {calls} staging "
          f"prefills {res['prefill_s']} s ({res['prefill_ms_per_call']} ms a call), both at once {res['both_s']} s "
          f"(serial {res['serial_s']}): overlap cost {res['overlap_cost']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
