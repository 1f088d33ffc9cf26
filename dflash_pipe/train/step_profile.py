"""`train --profile-steps A:B[,C:D]`: torch.profiler over a few training steps of a real run (rank 0).

Why: on the H100 the compiled SmolLM2 drafter step runs at a median 46-54 ms inside the quality window, while
`bench/train_step.py` times the same shape alone at about half that (20.8 ms with 3 layers on the H200). Only the
run itself can say whether the difference is device work (extraction sharing the GPU), host work between steps
(the loader, logging, the step statistics) or waiting. A window of ~20 steps costs a few seconds of a run.

For each window the profiler starts after step A (and after that step's validation or checkpoint, if any) and
stops right after step B (steps counted as the log counts them); validation, checkpoints or round boundaries that
fall inside are named in the report. It then writes, under <output_dir>/profile/:

    steps_A-B.txt    wall, device and host time per step, then the top ops by device time and by host time
    steps_A-B.json   the per-step numbers (wall_ms; device_ms: kernels and copies summed; cpu_ms: host time of
                     the top-level ops on the busiest thread, the step loop's as a rule; cpu_ms_other_threads:
                     the loader's and the checkpoint writer's; inside: the non-step work in the window;
                     threads_ms: each thread group's time on a CPU, and runnable but waiting for one, a step,
                     from /proc: thread_times.py), for scripts

device_ms below wall_ms means the device idled; a host op whose time is close to the wall is the bound.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from ..errors import UsageError
from . import thread_times

log = logging.getLogger("dflash_pipe.train")


def parse_profile_steps(spec: str) -> list[tuple[int, int]]:
    """'100:120,3000:3020' -> [(100, 120), (3000, 3020)]; '' -> []. Each A < B, windows in order, not overlapping."""
    out: list[tuple[int, int]] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            a, b = (int(x) for x in part.split(":"))
        except ValueError:
            raise UsageError(f"--profile-steps {spec!r}: cannot parse {part!r}", "use A:B, e.g. 100:120") from None
        if not 0 <= a < b or (out and a < out[-1][1]):
            raise UsageError(f"--profile-steps {spec!r}: {part!r} must be 0 <= A < B, after the window before it")
        out.append((a, b))
    return out


DEVICE_TIME_KEYS = ("self_device_time_total", "self_cuda_time_total")   # (older torch: the cuda name)


def _device_us(evt) -> float:
    return next((float(getattr(evt, k)) for k in DEVICE_TIME_KEYS if hasattr(evt, k)), 0.0)


class StepProfiler:
    """The trainer calls `after_step(step)` right after every step (it ends a window at B before that step's
    validation or checkpoint), `before_next_step(step)` once that step's validation and checkpoint are done (it
    starts a window at A after them: session 26's windows began at multiples of --val-every, and the 32
    validation batches run there made up most of each window) and `note(what)` for any other work that lands
    inside a window (a validation, a checkpoint, a round boundary), which the window's report then names.
    All are no-ops without windows. step = steps done so far."""

    def __init__(self, spec: str, out_dir: Path, is_main: bool, device: torch.device):
        self.windows = parse_profile_steps(spec) if is_main else []
        self.out_dir, self.device = Path(out_dir) / "profile", device
        self._prof = None
        self._t0 = 0.0
        self._notes: list[str] = []
        self._threads: dict = {}

    def after_step(self, step: int) -> None:
        if self._prof is not None and step >= self.windows[0][1]:
            self._guarded(self._stop, *self.windows.pop(0))

    def before_next_step(self, step: int) -> None:
        if not self.windows or self._prof is not None:
            return
        a, _ = self.windows[0]
        if step == a:
            self._guarded(self._start, *self.windows[0])
        elif step > a:   # resumed past the window: skip it
            self.windows.pop(0)

    def note(self, what: str) -> None:
        if self._prof is not None:
            self._notes.append(what)

    def _guarded(self, fn, a: int, b: int) -> None:
        try:
            fn(a, b)
        except Exception as exc:  # noqa: BLE001 - a measurement never stops the training run
            log.warning("train: --profile-steps %d:%d failed (%s: %s); profiling off for this run", a, b,
                        type(exc).__name__, exc)
            print(f"train: --profile-steps {a}:{b} failed ({type(exc).__name__}: {exc}); profiling off", flush=True)
            self.windows, self._prof = [], None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _start(self, a: int, b: int) -> None:
        self._notes = []
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._sync()
        self._prof = torch.profiler.profile(activities=acts)
        self._prof.__enter__()
        self._threads = thread_times.snapshot()
        self._t0 = time.perf_counter()

    def _stop(self, a: int, b: int) -> None:
        self._sync()
        wall = time.perf_counter() - self._t0
        threads = thread_times.per_step_ms(self._threads, thread_times.snapshot(), b - a)
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        avgs = prof.key_averages()
        n = b - a
        device_us = sum(_device_us(e) for e in avgs
                        if str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1")))
        by_thread: dict[int, float] = {}   # host time of the top-level ops, per thread (the loop, the loader's)
        for e in prof.events():
            if getattr(e, "cpu_parent", None) is None and str(getattr(e, "device_type", "CPU")).endswith("CPU"):
                by_thread[e.thread] = by_thread.get(e.thread, 0.0) + e.cpu_time_total
        busiest = sorted(by_thread.values(), reverse=True)
        rec = {"steps": [a, b], "wall_ms": round(wall * 1e3 / n, 3), "device_ms": round(device_us / 1e3 / n, 3),
               "cpu_ms": round((busiest[0] if busiest else 0.0) / 1e3 / n, 3),
               "cpu_ms_other_threads": [round(t / 1e3 / n, 3) for t in busiest[1:]], "device": str(self.device),
               "inside": self._notes, "threads_ms": threads}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"steps_{a}-{b}"
        lines = [f"steps {a}..{b} ({n}): wall {rec['wall_ms']} ms a step, device (kernels + copies) "
                 f"{rec['device_ms']} ms, host (top-level ops, busiest thread) {rec['cpu_ms']} ms, other threads "
                 f"{rec['cpu_ms_other_threads']} ms" + (f"; inside the window: {', '.join(self._notes)}"
                                                        if self._notes else "")]
        if threads:
            lines.append("threads, ms a step on a CPU (+ runnable, waiting for one): " + ", ".join(
                f"{k} {v['cpu']} (+{v['runnable_wait']})" for k, v in threads.items()))
        lines.append("")
        if self.device.type == "cuda":
            for key in DEVICE_TIME_KEYS:
                try:
                    lines += ["top ops by device time:", avgs.table(sort_by=key, row_limit=30), ""]
                    break
                except (AttributeError, KeyError, ValueError):
                    continue
        lines += ["top ops by host time:", avgs.table(sort_by="self_cpu_time_total", row_limit=30)]
        stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        stem.with_suffix(".json").write_text(json.dumps(rec) + "\n")
        print(f"train: profiled {lines[0]} -> {stem}.txt", flush=True)

    def close(self) -> None:
        """The run ended inside a window: drop the profiler without writing."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            try:
                prof.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001 - the run's own outcome is what matters here
                log.warning("train: closing the profiler failed (%s)", exc)
