"""A training step's metrics and gradient norm, read on the host one step later.

Reading them at the end of the step (`.cpu()`, `float()`) blocks the host until the device has finished
that step, so step N+1 cannot be queued while the GPU runs step N. Instead the step packs them into one
float64 tensor on its device (`StepStats.pack`: float32 / int64 sums and counts, which float64 holds
exactly, so the summaries are the same floats), `PendingStepStats.push` starts its copy into pinned host
memory (CUDA: non-blocking, then an event) and reads the step pushed before it, whose copy has long
finished by then. `drain()` reads the one still pending; the trainer calls it before whatever has to
see every finished step: a checkpoint, validation, a stop, the end of an epoch or round.

Reading a step raises RuntimeFailure when its gradient norm is not finite, naming that step's epoch and
batch. A step's time runs from the end of the step before it (or `begin_phase`) to its own end: on CUDA
between timing events on the stream (no host sync), on the CPU by the host clock when the step returned.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..drafter import summarize_metrics
from ..errors import RuntimeFailure


@dataclass
class StepStats:
    """One step's metric sums / counts and gradient norm, packed on the step's device."""
    packed: torch.Tensor                        # float64: the metrics in `layout` order, then the gradient norm
    layout: tuple[tuple[str, int | None], ...]  # (metric name, element count; None for a 0-dim metric)
    epoch: int
    batch: int                                  # the batch's index in its epoch

    @classmethod
    def pack(cls, metrics: dict[str, torch.Tensor], grad_norm: torch.Tensor, epoch: int, batch: int,
             all_reduce: Callable[[torch.Tensor], Any] | None = None) -> StepStats:
        """`all_reduce` (torch.distributed's, world > 1) sums the metrics over the ranks in place. The gradient
        norm is not reduced: DDP averaged the gradients, so it is the same on every rank."""
        sums = torch.cat([torch.atleast_1d(v.detach().to(torch.float64)) for v in metrics.values()])
        if all_reduce is not None:
            all_reduce(sums)
        packed = torch.cat([sums, grad_norm.detach().to(torch.float64).reshape(1)])
        return cls(packed, tuple((k, v.numel() if v.dim() else None) for k, v in metrics.items()), epoch, batch)

    def read(self, values: torch.Tensor | None = None) -> tuple[dict[str, float], float]:
        """(summarize_metrics of the metrics, gradient norm) from `values`, the host copy of `packed` (default:
        copied now, which waits for the device). Raises RuntimeFailure if the gradient norm is not finite."""
        values = self.packed.cpu() if values is None else values
        metrics, i = {}, 0
        for name, n in self.layout:
            metrics[name] = values[i] if n is None else values[i:i + n]
            i += 1 if n is None else n
        grad_norm = float(values[i])
        if not math.isfinite(grad_norm):
            raise RuntimeFailure(f"non-finite gradient norm at epoch {self.epoch} batch {self.batch}",
                                 "lower --lr, check the cache with `dflash-pipe cache verify --decode`")
        return summarize_metrics(metrics), grad_norm


@dataclass
class StepRecord:
    """A step as read on the host."""
    metrics: dict[str, float]
    grad_norm: float
    seconds: float  # from the end of the step before it (or begin_phase) to its own end
    note: Any       # what the caller pushed with it


class PendingStepStats:
    """Holds the last pushed step until the next push (or `drain`) reads it. `defer=False` reads every step
    at its own push (waiting for the device): the synchronous reference the tests compare against."""

    def __init__(self, device: torch.device, defer: bool = True):
        self.device, self.defer = device, defer
        self._pending = None  # (stats, host values, start mark, end mark, note)
        self._last_mark = self._mark()
        self.device_wait_s = 0.0  # host time spent waiting here for the device to finish a step: ~0 = host-bound

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def begin_phase(self) -> None:
        """The next step's time counts from now (the start of an epoch or round, waits included)."""
        self._last_mark = self._mark()

    def push(self, stats: StepStats, note: Any = None) -> StepRecord | None:
        """Start copying `stats` to the host; read and return the step pushed before it (None if there is
        none), or `stats` itself when not deferring. If that read raises, `stats` is dropped with it."""
        if stats.packed.device.type == "cuda":
            values = torch.empty(stats.packed.shape, dtype=stats.packed.dtype, pin_memory=True)
            values.copy_(stats.packed, non_blocking=True)
        else:
            values = stats.packed  # already on the host (and the CPU step has finished)
        end = self._mark()
        entry = (stats, values, self._last_mark, end, note)
        self._last_mark = end
        previous, self._pending = self._pending, None
        record = self._read(previous) if previous is not None else None
        self._pending = entry
        return self.drain() if not self.defer else record

    def drain(self) -> StepRecord | None:
        """Read the pending step now (waiting for the device if it has not finished); None if there is none."""
        entry, self._pending = self._pending, None
        return self._read(entry) if entry is not None else None

    def _read(self, entry) -> StepRecord:
        stats, values, start, end, note = entry
        if isinstance(end, float):
            seconds = end - start
        else:
            t0 = time.perf_counter()
            end.synchronize()  # the step, and the copy of its values queued after it, are done
            self.device_wait_s += time.perf_counter() - t0
            seconds = start.elapsed_time(end) / 1e3
        metrics, grad_norm = stats.read(values)
        return StepRecord(metrics, grad_norm, seconds, note)
