"""Where the engine backend's device time goes, launch by launch (regen_backends.EngineBackend).

A launch is marked as it is queued: at its start, after its prefills, after its decode steps (CUDA events on the
device's stream; the host clock on the CPU, where everything runs in order). A launch queued in two parts (the
host's work between them, regen_backends' `steps_before_host_work`) is also marked where its first part ends and
where its second part begins. Once a launch is done on the device, `account` adds its prefill span, its decode
span (less the pause between its parts) and the span from the previous launch's last step to its start. In both
gaps the device idles (but for the collect's small copies, or overlap mode's side stream), waiting for the host to
queue more. A launch still running stays pending, so reading the clock never waits for the device.
"""

from __future__ import annotations

from .regen_staging import mark


class LaunchClock:
    """Device seconds of prefills, decode steps, the gaps between launches and the pauses inside them."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.seconds = {"prefill": 0.0, "decode": 0.0, "between": 0.0, "paused": 0.0}
        self._pending: list[tuple] = []          # (start, after prefills, after decode, pause) of launches not counted
        self._last_end = None

    def mark(self):
        """A timing mark on the current stream (or the host clock)."""
        return mark(self.cuda)

    def add(self, start, after_prefill, pause: tuple | None = None) -> None:
        """Close the launch begun at `start` whose decode steps began at `after_prefill`; `pause`: the marks where its
        first part of steps ended and its second began, if it was queued in two parts."""
        self._pending.append((start, after_prefill, mark(self.cuda), pause))

    def account(self) -> None:
        """Count the launches the device has finished, in order."""
        keep = []
        span = (lambda a, b: b - a) if not self.cuda else (lambda a, b: a.elapsed_time(b) / 1e3)
        for m0, m1, m2, pause in self._pending:
            if keep or (self.cuda and not m2.query()):
                keep.append((m0, m1, m2, pause))
                continue
            last, self._last_end = self._last_end, m2
            paused = 0.0 if pause is None else span(*pause)
            self.seconds["prefill"] += span(m0, m1)
            self.seconds["decode"] += span(m1, m2) - paused
            self.seconds["paused"] += paused
            self.seconds["between"] += 0.0 if last is None else span(last, m0)
        self._pending = keep
