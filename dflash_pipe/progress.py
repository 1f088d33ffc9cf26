"""Progress bars for long loops: items, tokens/s and an ETA (tqdm; silent when disabled or not a TTY)."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class ProgressBar:
    def __init__(self, total: int | None, desc: str, unit: str, enabled: bool):
        self._bar = tqdm(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True,
                         file=sys.stderr, mininterval=1.0, smoothing=0.1)
        self._t0 = time.perf_counter()
        self.tokens = 0

    def update(self, n: int = 1, tokens: int = 0) -> None:
        self.tokens += tokens
        elapsed = max(1e-9, time.perf_counter() - self._t0)
        if tokens:
            self._bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


def progress_bar(total: int | None, desc: str, unit: str = "it", enabled: bool = True) -> ProgressBar:
    return ProgressBar(total, desc, unit, enabled)
