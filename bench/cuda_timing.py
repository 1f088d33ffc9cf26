"""The GPU benchmarks' one timing rule: median of CUDA-event timings after a few untimed calls."""

from __future__ import annotations

import torch


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` over `reps` calls, each bracketed by CUDA events and synchronised."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[reps // 2]
