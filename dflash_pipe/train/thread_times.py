"""CPU time per thread of this process, for `train --profile-steps` (Linux /proc; empty elsewhere).

torch.profiler times torch ops, not the Python between them, nor who held the interpreter. The trainer's step
loop shares the process with the loader's producer, decode and fetch threads and the checkpoint writer. Reading
each thread's time on a CPU (and time spent runnable but waiting for one) over a profiled window says whether the
step loop's thread was busy all along (host-bound), and how much the other threads ran beside it.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

_TASKS = Path("/proc/self/task")


def group_name(name: str) -> str:
    """'dflash-decode_3' -> 'dflash-decode': a pool's threads are reported together."""
    return re.sub(r"[_-]?\d+$", "", name) or name


def snapshot() -> dict[int, tuple[str, int, int]]:
    """native thread id -> (group name, ns on a CPU, ns runnable but waiting for a CPU), every thread of the
    process (threads Python did not start are named 'native:<comm>')."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, int, int]] = {}
    try:
        tids = [int(p.name) for p in _TASKS.iterdir()]
    except (OSError, ValueError):
        return out
    for tid in tids:
        try:
            run_ns, wait_ns = (int(x) for x in (_TASKS / str(tid) / "schedstat").read_text().split()[:2])
            name = names.get(tid) or "native:" + (_TASKS / str(tid) / "comm").read_text().strip()
        except (OSError, ValueError):
            continue   # a thread that ended meanwhile, or no schedstat on this kernel
        out[tid] = (group_name(name), run_ns, wait_ns)
    return out


def per_step_ms(before: dict, after: dict, steps: int) -> dict[str, dict[str, float]]:
    """{group: {"cpu": ms a step on a CPU, "runnable_wait": ms a step waiting for one}}, busiest first; threads that
    started inside the window count from 0, threads that ended inside it are not counted (their /proc entry is gone)."""
    acc: dict[str, list[int]] = {}
    for tid, (name, run, wait) in after.items():
        _, run0, wait0 = before.get(tid, (name, 0, 0))
        a = acc.setdefault(name, [0, 0])
        a[0] += run - run0
        a[1] += wait - wait0
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])
    return {k: {"cpu": round(r / 1e6 / steps, 3), "runnable_wait": round(w / 1e6 / steps, 3)}
            for k, (r, w) in rows if r or w}


def report_run(out_dir: Path, before: dict, steps: int, wall_s: float, device_wait_s: float) -> str | None:
    """The whole run's CPU time per thread group, per step: <out_dir>/thread_times.json and one line for the log.
    `device_wait_s`: the step loop's time waiting for the device to finish a step (step_stats.py); a CUDA wait
    spins, so it counts as the step loop's CPU time too: the loop's own work is its CPU time less this. None when
    there is nothing to report (no /proc, no steps)."""
    threads = per_step_ms(before, snapshot(), steps) if before and steps > 0 else {}
    if not threads:
        return None
    rec = {"steps": steps, "wall_ms_per_step": round(wall_s * 1e3 / steps, 3),
           "device_wait_ms_per_step": round(device_wait_s * 1e3 / steps, 3), "threads_ms": threads}
    (Path(out_dir) / "thread_times.json").write_text(json.dumps(rec) + "\n")
    top = ", ".join(f"{k} {v['cpu']:.1f} (+{v['runnable_wait']:.1f})" for k, v in list(threads.items())[:6])
    return (f"train: threads over {steps} steps, wall {rec['wall_ms_per_step']:.1f} ms a step, the step loop waiting "
            f"for the device {rec['device_wait_ms_per_step']:.1f} of it; ms a step on a CPU (+ runnable, waiting for "
            f"one): {top}")
