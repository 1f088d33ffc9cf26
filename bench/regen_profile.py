"""Where regenerate's time goes on the device: one `run_regenerate` under torch.profiler (issue 18).

The timed runs of bench/regen_throughput.py say how fast regenerate is; this says why. It runs regenerate once more
(a fresh output file, warm kernels and graphs) with CPU and CUDA activity recorded and reports:
  - gpu_busy_share: the union of the CUDA kernels' and copies' time spans over the run's wall time (what a
    perfect host could at most recover is the rest);
  - idle gaps: the device's idle intervals between consecutive kernels, as a histogram (the host falling behind
    at each launch shows as one gap per launch);
  - the top host-side ops by self CPU time and the top device kernels by device time (profiler tables).
Called by `bench/regen_throughput.py --profile N` with its first --overlap mode; writes `<json stem>_profile.txt`.
The profiler's own per-op cost slows the host a little, so the gaps are an upper bound.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

GAP_EDGES_US = (20, 100, 500, 2_000, 10_000)


def _device_spans(prof) -> list[tuple[float, float]]:
    """(start, end) in µs of every device-side event (kernels, memcpy, memset), sorted."""
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            spans.append((e.time_range.start, e.time_range.end))
    return sorted(spans)


def busy_and_gaps(spans: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Merged busy time and the idle gaps between merged intervals (µs)."""
    busy, gaps = 0.0, []
    cur_s = cur_e = None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy, gaps


def gap_histogram(gaps: list[float]) -> dict:
    """Count and total ms of the gaps in each bucket of GAP_EDGES_US."""
    edges = (0,) + GAP_EDGES_US + (float("inf"),)
    out = {}
    for lo, hi in zip(edges, edges[1:]):
        sel = [g for g in gaps if lo <= g < hi]
        name = f"{lo}-{hi}us" if hi != float("inf") else f">={lo}us"
        out[name] = {"count": len(sel), "ms": round(sum(sel) / 1e3, 1)}
    return out


def profile_regen(run, table_path: Path) -> dict:
    """Run `run()` (a regenerate call) under the profiler; the summary dict, the tables into `table_path`."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        result = run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6
    spans = _device_spans(prof)
    busy, gaps = busy_and_gaps(spans)
    first_last = (spans[-1][1] - spans[0][0]) if spans else 0.0
    ka = prof.key_averages()
    tables = ["# host ops by self CPU time", ka.table(sort_by="self_cpu_time_total", row_limit=30),
              "# device ops by device time", ka.table(sort_by="self_device_time_total", row_limit=30)
              if spans else "(no device)"]
    table_path.write_text("\n\n".join(tables))
    return {"result": result, "wall_s": round(wall_us / 1e6, 3),
            "device_span_s": round(first_last / 1e6, 3), "gpu_busy_s": round(busy / 1e6, 3),
            "gpu_busy_share": round(busy / max(1.0, first_last), 3), "gaps": len(gaps),
            "gap_histogram": gap_histogram(gaps), "tables": str(table_path)}
