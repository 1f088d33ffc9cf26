"""Where the engine backend's device time goes, launch by launch (regen_backends.EngineBackend).

A launch is marked three times as it is queued: at its start, after its prefills, after its decode steps (CUDA
events on the device's stream; the host clock on the CPU, where everything runs in order). Once a launch is done
on the device, `account` adds its prefill span, its decode span and the span from the previous launch's last step
to its start. The device idles there but for the collect's small copies (or overlap mode's side stream), waiting
for the host to queue the next launch. A launch still running stays pending, so reading the clock never waits
for the device.
"""

from __future__ import annotations

from .regen_staging import mark


class LaunchClock:
    """Device seconds of prefills, decode steps and the gaps between launches (module docstring)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.seconds = {"prefill": 0.0, "decode": 0.0, "between": 0.0}
        self._pending: list[tuple] = []          # (start, after prefills, after decode) of launches not yet counted
        self._last_end = None

    def mark(self):
        """A timing mark on the current stream (or the host clock)."""
        return mark(self.cuda)

    def add(self, start, after_prefill) -> None:
        """Close the launch begun at `start` whose decode steps began at `after_prefill`."""
        self._pending.append((start, after_prefill, mark(self.cuda)))

    def account(self) -> None:
        """Count the launches the device has finished, in order."""
        keep = []
        span = (lambda a, b: b - a) if not self.cuda else (lambda a, b: a.elapsed_time(b) / 1e3)
        for m0, m1, m2 in self._pending:
            if keep or (self.cuda and not m2.query()):
                keep.append((m0, m1, m2))
                continue
            last, self._last_end = self._last_end, m2
            self.seconds["prefill"] += span(m0, m1)
            self.seconds["decode"] += span(m1, m2)
            self.seconds["between"] += 0.0 if last is None else span(last, m0)
        self._pending = keep
