"""Graceful stop of `dflash-pipe train` on SIGINT / SIGTERM (Ctrl-C, `timeout --signal=INT`, preemption).

Inside `with GracefulStop(...)` (main thread only; elsewhere nothing is installed) the first SIGINT or
SIGTERM only sets a flag. When `should_stop(step)` says so, the trainer checkpoints that step and calls
`leave()`, which raises `StopRequested` (a KeyboardInterrupt: exit 130); `--resume auto` continues there.
A second signal of either kind restores the previous handlers and raises KeyboardInterrupt at once (a
stuck run can still be killed); copies within `repeat_grace_s` of the first do not count, since under
torchrun a scheduler's SIGTERM reaches each worker directly and again forwarded by torchrun. The
previous handlers are restored when the block exits.

One process: the flag is read at every step. torch.distributed with world > 1: a signal may reach only
some ranks, so the flag is all-reduced (MAX) as a one-element tensor on the training device. That is a
collective: every rank calls `should_stop` at every step (they are in lockstep) and it communicates only
when `step % log_every == 0` (else False), one tiny all-reduce per logged step, nothing measurable. The
stop lands up to `log_every` steps after the signal; torchrun SIGKILLs its workers 30 s after it
forwards a signal, so those steps plus one checkpoint have to fit in that time.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import torch
import torch.distributed as dist

from ..dist import DistInfo
from .checkpoint import PREFIX

log = logging.getLogger("dflash_pipe.train")


class StopRequested(KeyboardInterrupt):
    """Raised after the stop checkpoint is on disk; KeyboardInterrupt so the CLI exits 130."""


class GracefulStop:
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, device: torch.device, info: DistInfo, log_every: int, repeat_grace_s: float = 1.0):
        self.device, self.info, self.log_every, self.repeat_grace_s = device, info, max(1, log_every), repeat_grace_s
        self.signal_name: str | None = None  # the first signal this process got
        self._first_at: float | None = None
        self._previous: dict = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at, self.signal_name = now, signal.Signals(signum).name
            return
        if now - self._first_at >= self.repeat_grace_s:
            self._restore()
            raise KeyboardInterrupt(f"second signal ({signal.Signals(signum).name}): stopping at once")

    @property
    def requested(self) -> bool:
        """Whether this process got a signal (not what the other ranks got)."""
        return self._first_at is not None

    def should_stop(self, step: int) -> bool:
        """After step `step`: stop now? With world > 1 a collective that all ranks call at every step."""
        if self.info.world <= 1 or not dist.is_initialized():
            return self.requested
        if step % self.log_every:
            return False
        flag = torch.tensor([int(self.requested)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def leave(self, step: int, total: int, out_dir) -> None:
        """After the stop checkpoint: report where the run stopped (main rank), raise StopRequested."""
        why = self.signal_name or "a signal to another rank"
        if self.info.is_main:
            print(f"train: stopped on {why} after step {step}/{total}; checkpoint {out_dir}/{PREFIX}{step:08d}, "
                  f"no export; rerun the same command (--resume auto) to continue from step {step}", flush=True)
        else:
            log.info("rank %d: stopped with the other ranks after step %d", self.info.rank, step)
        raise StopRequested(f"stopped after step {step}")
