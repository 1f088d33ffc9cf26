"""Model regenerate's overlap mode (regen_staging.py) against the direct path under measured H200 costs: no GPU.

The workload and the prefill cost model are bench/regen_refill_sim.py's (SmolLM2's own answers to ShareGPT first
turns; a prefill call costs --call-ms + --token-us per padded token; the real `plan_refill` plans every call).
Both modes run the backend's schedule launch by launch on a device timeline:

  direct   refill the free slots (prefills on the decode's timeline), --check-every decode steps of --step-ms
           (its --attention-share scaled by the share of slots holding a row: emptied slots attend nothing),
           then the host's gap between launches (--host-gap-ms: the collect's wait, its parsing, the next
           launch's planning; the device idles);
  overlap  land staged rows into free slots (ready ones; a device wait for the oldest when >= min_free slots
           idle with none ready), refill straight into the slots only when nothing decodes or >= min_free still
           idle, the steps, then top up the staging area (--staging-rows, a quarter free) on a side timeline that
           starts with the launch's steps; a fraction --overlap-cost of each staging call's time still lands on
           the decode's timeline (0 = a perfect overlap, 1 = none). Answers are collected from the state --lag
           steps before a launch's end, and the host gap is hidden up to those steps' time.

Prints one JSON row per (mode, lag, staging rows, overlap cost): modelled seconds, tok/s, the ratio to the bare
loop (batch x steps at --step-ms), occupancy, prefill seconds on each timeline, device waits. A model, not a
measurement: the H200 run is `bench/regen_throughput.py --overlap off,on`. Session 12's costs:

    python bench/regen_overlap_sim.py --step-ms 4.92 --host-gap-ms 4.3 --calibrate-prefill-s 3.62 \\
        --lag 0,2,4 --staging-rows 64,128,256 --overlap-cost 0,0.25,0.5
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.regen_refill_sim import workload  # noqa: E402
from dflash_pipe.eval.regen_refill import RefillPolicy, plan_refill  # noqa: E402
from dflash_pipe.target.prefill_shapes import PrefillShapes  # noqa: E402


class Model:
    """One run of the schedule (module docstring); `run` returns its row."""

    def __init__(self, work, args, overlap: bool, lag: int = 0, staging_rows: int = 0, cost: float = 1.0):
        self.work, self.a, self.B = work, args, args.batch
        self.overlap, self.lag, self.S, self.cost = overlap, lag if overlap else 0, staging_rows, cost
        self.pol = RefillPolicy.for_batch(self.B, True, args.max_length)
        self.spol = RefillPolicy.for_batch(max(1, staging_rows), True, args.max_length,
                                           min_free=max(1, staging_rows // 4))
        self.shapes = PrefillShapes(8, args.max_length, 2.0)
        self.t = self.side = self.main_prefill = self.side_prefill = 0.0
        self.steps = self.live_steps = self.waits = self.padded = 0

    def _calls(self, free: int, ready: list[int], live: int, pol: RefillPolicy) -> list[tuple[list[int], float]]:
        """Planned prefill calls as (indices into `ready`, seconds)."""
        window = [self.work[j][0] for j in ready[:max(free, pol.lookahead)]]
        out = []
        for call in plan_refill(free, window, len(ready), live, pol):
            rb, tb = self.shapes.choose(len(call), max(window[i] for i in call))
            self.shapes.use((rb, tb))
            self.padded += rb * tb
            out.append((call, (self.a.call_ms + self.a.token_us * rb * tb / 1e3) / 1e3))
        return out

    def run(self) -> dict:
        B, a = self.B, self.a
        ready = list(range(len(self.work)))
        slots = [None] * B                       # [work index, tokens generated]
        staged: list[list] = []                  # [ready time on the side timeline, [work indices]]
        sfree = self.S
        while ready or staged or any(s is not None for s in slots):
            free = [i for i, s in enumerate(slots) if s is None]
            live = B - len(free)
            if self.overlap and free and staged:
                wait = not live or len(free) >= self.pol.min_free
                while staged and free:
                    g = staged[0]
                    if g[0] > self.t:
                        if not wait:
                            break
                        self.waits += 1
                        self.t, wait = g[0], False
                    while g[1] and free:
                        slots[free.pop(0)] = [g[1].pop(0), 1]
                        sfree += 1
                    if not g[1]:
                        staged.pop(0)
                live = B - len(free)
            if not self.overlap or not live or len(free) >= self.pol.min_free:
                taken = set()
                for call, secs in self._calls(len(free), ready, live, self.pol):
                    self.t += secs
                    self.main_prefill += secs
                    for i in call:
                        slots[free.pop(0)] = [ready[i], 1]
                        taken.add(i)
                ready = [j for i, j in enumerate(ready) if i not in taken]
            start = self.t
            seen = None
            for k in range(a.check_every):
                if not any(s is not None for s in slots):
                    break
                self.steps += 1
                occupied = sum(s is not None for s in slots) / B     # rows with keys to attend over
                self.t += a.step_ms * (1 - a.attention_share + a.attention_share * occupied) / 1e3
                for s in slots:
                    if s is not None and s[1] < self.work[s[0]][1]:
                        s[1] += 1
                        self.live_steps += 1
                if k == a.check_every - 1 - self.lag:
                    seen = [s is not None and s[1] >= self.work[s[0]][1] for s in slots]
            if self.overlap and ready:
                taken = set()
                for call, secs in self._calls(sfree, ready, 1, self.spol):
                    self.side = max(self.side, start) + secs
                    self.side_prefill += secs
                    self.t += self.cost * secs
                    staged.append([self.side, [ready[i] for i in call]])
                    sfree -= len(call)
                    taken.update(call)
                ready = [j for i, j in enumerate(ready) if i not in taken]
            self.t += max(0.0, a.host_gap_ms - self.lag * a.step_ms) / 1e3
            for i, s in enumerate(slots):            # the collect: rows finished by the snapshot
                if s is not None and (seen[i] if seen is not None else s[1] >= self.work[s[0]][1]):
                    slots[i] = None
        tokens = sum(n for _, n in self.work)
        return {"mode": "overlap" if self.overlap else "direct", "lag": self.lag, "staging_rows": self.S,
                "overlap_cost": self.cost if self.overlap else None, "s": round(self.t, 2),
                "tok_s": round(tokens / self.t), "ratio_to_bare": round(tokens / self.t / (B * 1e3 / a.step_ms), 3),
                "occupancy": round(self.live_steps / max(1, self.steps * B), 3), "decode_steps": self.steps,
                "prefill_s_on_decode": round(self.main_prefill + self.cost * self.side_prefill * self.overlap, 2),
                "prefill_s_side": round(self.side_prefill, 2), "device_waits": self.waits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--check-every", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=4.92, help="a decode step at the full batch (session 12)")
    ap.add_argument("--attention-share", type=float, default=0.38,
                    help="the share of a full step that is attention, which scales with the rows holding keys "
                         "(session 12's profile: 38 %%); the rest costs the same at any occupancy")
    ap.add_argument("--host-gap-ms", type=float, default=4.3, help="device idle between launches (session 12: "
                                                                  "~1.6 s over ~370 launches)")
    ap.add_argument("--call-ms", type=float, default=1.0)
    ap.add_argument("--token-us", type=float, default=0.7)
    ap.add_argument("--calibrate-prefill-s", type=float, default=0.0,
                    help="set --token-us so that the direct mode models this many prefill seconds")
    ap.add_argument("--lag", default="2")
    ap.add_argument("--staging-rows", default="128")
    ap.add_argument("--overlap-cost", default="0,0.25,0.5")
    ap.add_argument("--model-cache", default="~/.cache/dflash-pipe/models")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = workload(args)
    print(f"{len(work)} prompts, {sum(n for _, n in work):,} answer tokens", flush=True)
    if args.calibrate_prefill_s:             # the direct mode's calls at 0 us a token: the launch costs alone
        probe = Model(work, argparse.Namespace(**{**vars(args), "token_us": 0.0}), overlap=False)
        probe.run()
        args.token_us = (args.calibrate_prefill_s - probe.main_prefill) * 1e6 / probe.padded
        print(f"calibrated: {args.token_us:.3f} us per padded token ({args.calibrate_prefill_s} s of direct-mode "
              f"prefill: {probe.main_prefill:.2f} s of calls + {probe.padded:,} padded tokens)", flush=True)
    rows = [Model(work, args, overlap=False).run()]
    print(json.dumps(rows[0]), flush=True)
    for lag, S, cost in itertools.product(map(int, args.lag.split(",")), map(int, args.staging_rows.split(",")),
                                          map(float, args.overlap_cost.split(","))):
        rows.append(Model(work, args, True, lag, S, cost).run())
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
