"""Progress for long loops: items, tokens/s and an ETA.

On a terminal this is a tqdm bar; when stderr is a file or pipe (CI, `tee`, torchrun logs) it
prints one plain line every `log_every_s` seconds instead of carriage-return redraws.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class ProgressBar:
    def __init__(self, total: int | None, desc: str, unit: str, enabled: bool, log_every_s: float = 30.0):
        self.total, self.desc, self.unit = total, desc, unit
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr, mininterval=1.0,
                         smoothing=0.1) if self.tty else None
        self._t0 = self._last = time.perf_counter()
        self.log_every_s = log_every_s
        self.done = 0
        self.tokens = 0

    def update(self, n: int = 1, tokens: int = 0) -> None:
        self.done += n
        self.tokens += tokens
        now = time.perf_counter()
        elapsed = max(1e-9, now - self._t0)
        if self._bar is not None:
            if tokens:
                self._bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
            self._bar.update(n)
        elif self.enabled and now - self._last >= self.log_every_s:
            self._last = now
            eta = ""
            if self.total:
                eta = f", ETA {max(0.0, (self.total - self.done) * elapsed / max(1, self.done)):.0f}s"
            print(f"{self.desc}: {self.done}/{self.total or '?'} {self.unit}, {self.tokens / elapsed:,.0f} tok/s{eta}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def progress_bar(total: int | None, desc: str, unit: str = "it", enabled: bool = True) -> ProgressBar:
    return ProgressBar(total, desc, unit, enabled)
