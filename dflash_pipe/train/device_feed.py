"""DeviceFeed: the trainer's batches copied to the GPU on a side stream, one step ahead."""

from __future__ import annotations

import time

import torch

_NOT_STARTED = object()


class DeviceFeed:
    """Copy batch k+1 to the GPU on a side stream while step k computes (the planes are ~420 MB at the
    seed's size: a serial copy would idle the GPU for that long every step). On CPU it passes through.

    `prefetch()` starts the next copy; the trainer calls it right after backward, so the next batch's
    planes arrive during the optimizer step instead of sitting on the GPU through the forward/backward
    memory peak (0.4 GiB at the seed's size). A batch not prefetched is started by `__next__`.
    `wait_s` accumulates the host time spent waiting for the loader inside `prefetch()` (data wait
    that happens inside the step)."""

    def __init__(self, batches, device: torch.device):
        self.batches, self.device = batches, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.previous = None  # (batch, copy event) handed out last; its host buffers are not released yet
        self.pending = _NOT_STARTED  # the next batch's (batch, tensors, event); None = the data has ended
        self.wait_s = 0.0

    def prefetch(self) -> None:
        if self.pending is _NOT_STARTED:
            t0 = time.perf_counter()
            self.pending = self._start()
            self.wait_s += time.perf_counter() - t0

    def take_wait_s(self) -> float:
        w, self.wait_s = self.wait_s, 0.0
        return w

    def _start(self):
        batch = next(self.batches, None)
        if batch is None:
            return None
        if self.stream is None:
            return batch, batch.tensors(), None
        with torch.cuda.stream(self.stream):
            t = {k: v.to(self.device, non_blocking=True) for k, v in batch.tensors().items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        return batch, t, event

    def __iter__(self):
        return self

    def __next__(self):
        item = self._start() if self.pending is _NOT_STARTED else self.pending
        self.pending = _NOT_STARTED
        if item is None:
            # the last batch's host buffers go back too: a window run makes a feed per round, and a buffer never
            # given back made the loader allocate (pin and zero) a fresh one at every round
            self._release_previous()
            raise StopIteration
        batch, t, event = item
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            for v in t.values():
                v.record_stream(torch.cuda.current_stream(self.device))
        self._release_previous()
        self.previous = (batch, event)
        return batch, t

    def _release_previous(self) -> None:
        """The batch handed out last gives its host buffers back to the loader: on CPU its step has finished,
        on the GPU its copy has (the event is long complete by now; synchronize() only makes it certain)."""
        if self.previous is not None:
            old, old_event = self.previous
            self.previous = None
            if old_event is not None:
                old_event.synchronize()
            old.release()
