"""The benchmarks' one timing rule: median of per-call timings after a few untimed calls (CUDA events on a
GPU, synchronised after each call; perf_counter on the CPU)."""

from __future__ import annotations

import time

import torch


def call_times_ms(fn, reps: int, warmup: int = 3, device: torch.device | str = "cuda") -> list[float]:
    """Milliseconds of each of `reps` calls of `fn()` on `device` after `warmup` untimed ones (CUDA events there,
    synchronised after each call, so host work inside a call counts; else wall time)."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_ms(fn, reps: int, warmup: int = 3, device: torch.device | str = "cuda") -> float:
    """Median milliseconds of `fn()` over `reps` calls on `device` (CUDA events there, else wall time)."""
    return sorted(call_times_ms(fn, reps, warmup, device))[reps // 2]
