"""Where a window run's round boundaries spend their time.

Session 24's compiled pass on the H100 spent a median 0.44 s at each of its 255 round boundaries, 112 s of a 619 s
trainer (from metrics.jsonl's timestamps), and nothing recorded what inside a boundary took it. The trainer times
each part here. Rank 0 appends one JSON line per boundary to <output_dir>/window_rounds.jsonl, and prints the totals
when training ends. The parts, in the order a boundary runs them:

    drain            the round's last step read back to the host (waits for the device to finish it)
    end_round        the round's shards retired (window_run.WindowCoordinator.end_round)
    checkpoint_wait  the previous background checkpoint write, and the deletions it allows, finished first
    snapshot         the next checkpoint's device-to-host copy (its write runs in the background)
    shard_wait       the next round's shards (waiting for extraction)
    first_batch      the next round's first batch from the loader

`wall_s` runs from the start of the drain to the first batch in hand. Whatever is not in a part (the learning-rate
curve for the round, building the loader's iterator) is the difference. One more column is not inside the wall:

    collect          since the previous boundary: the deletions a completed background checkpoint allows (ledger
                     write, shard files unlinked, older checkpoints pruned). Session 25 found them on the step
                     loop at ~0.96 s each (63 s of a 545 s trainer); they now run on the checkpoint's background
                     thread (checkpoint_writer.py), so this column is time off the loop, reported for the disk.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

PARTS = ("drain", "end_round", "checkpoint_wait", "snapshot", "shard_wait", "first_batch")
BETWEEN = ("collect",)   # timed between boundaries, reported with the next one


class RoundClock:
    def __init__(self, path: Path | None):
        self.path = path                  # None: time nothing (not a window run, or not rank 0)
        self._t0: float | None = None
        self._cur: dict[str, float] = {}
        self.totals = dict.fromkeys(PARTS + BETWEEN + ("wall",), 0.0)
        self.rounds = 0

    def begin(self) -> None:
        """A boundary starts (before the round's last step is drained)."""
        if self.path is not None:
            self._t0 = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        """Time spent on a BETWEEN part (outside any boundary); it goes with the next boundary's line."""
        self._cur[name] = self._cur.get(name, 0.0) + seconds

    @contextmanager
    def part(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            if self._t0 is not None:
                self._cur[name] = self._cur.get(name, 0.0) + time.perf_counter() - t

    def end(self, round_: int, step: int) -> None:
        """The next round's first batch is in hand: one line for this boundary (a no-op outside a boundary)."""
        if self._t0 is None:
            return
        wall = time.perf_counter() - self._t0
        self._t0 = None
        rec = {"round": round_, "step": step, "wall_s": round(wall, 6),
               **{f"{k}_s": round(self._cur.get(k, 0.0), 6) for k in PARTS + BETWEEN}}
        for k in PARTS + BETWEEN:
            self.totals[k] += self._cur.get(k, 0.0)
        self._cur = {}
        self.totals["wall"] += wall
        self.rounds += 1
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def summary(self) -> str | None:
        if not self.rounds:
            return None
        parts = ", ".join(f"{k} {self.totals[k]:.1f}" for k in PARTS)
        return (f"window: {self.rounds} round boundaries took {self.totals['wall']:.1f} s in all ({parts} s; "
                f"per boundary in {self.path.name}); deletions in the background {self.totals['collect']:.1f} s")
