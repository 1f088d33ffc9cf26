"""Window round-boundary checkpoints written off the step loop.

The step loop pays only for the host snapshot (a device-to-host copy of the fp32 masters and AdamW
state, cloned where they already live on the host); a background thread writes the files, fsyncs,
writes the COMPLETE marker and renames (checkpoint.write_snapshot: invisible until complete). At
most one write is in flight: the next submit, any synchronous checkpoint and the end of the run wait
for it first.

`after_write(boundary)` (the window coordinator's `collect`: the ledger, then the shard files that
boundary retired, then older checkpoints) runs on the same background thread once the checkpoint is
COMPLETE, so the shards are deleted only when a complete checkpoint no longer needs them, and not on
the step loop: session 25's H100 pass spent ~0.96 s on each of its 63 deletions, 63 s of a 545 s
trainer, when the loop ran them. `done()` / `wait()` hand back the boundary of a finished write.
A failed write or deletion (disk full: exit 4 naming the file) is raised in the step loop by the
next look.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from .checkpoint import snapshot, write_snapshot

log = logging.getLogger("dflash_pipe.train")


class BackgroundCheckpoints:
    def __init__(self, out_dir: Path, keep: int, after_write: Callable[[int], object] | None = None):
        self.out_dir, self.keep, self.after_write = Path(out_dir), keep, after_write
        self._thread: threading.Thread | None = None
        self._boundary: int | None = None
        self._error: BaseException | None = None
        self.snapshot_s = self.write_s = 0.0  # totals over the run (logged per write)
        self.last_after_write_s = 0.0       # the finished write's after_write time (RoundClock's collect)
        self.writes = 0

    def submit(self, step: int, boundary: int, weights, opt, state: dict) -> int | None:
        """Snapshot now, write (then after_write) in the background. Returns the boundary of the previous write
        if it had to be waited for, else None."""
        previous = self.wait()
        t0 = time.perf_counter()
        snap = snapshot(weights, opt, copy=True)
        snap_s = time.perf_counter() - t0
        self.snapshot_s += snap_s
        self._boundary = boundary

        def write():
            t1 = time.perf_counter()
            try:
                write_snapshot(self.out_dir, step, snap, state, self.keep)
                t2 = time.perf_counter()
                if self.after_write is not None:
                    self.after_write(boundary)  # only now: the checkpoint above is COMPLETE
            except BaseException as exc:  # noqa: BLE001 - re-raised on the step loop's thread
                self._error = exc
                return
            t3 = time.perf_counter()
            self.write_s += t2 - t1
            self.last_after_write_s = t3 - t2
            self.writes += 1
            log.info("window: checkpoint at step %d (round %d) complete: snapshot %.0f ms on the step loop, "
                     "write %.0f ms and deletions %.0f ms in the background", step, boundary, snap_s * 1e3,
                     (t2 - t1) * 1e3, (t3 - t2) * 1e3)

        self._thread = threading.Thread(target=write, name="dflash-ckpt", daemon=True)
        self._thread.start()
        return previous

    def _finish(self) -> int | None:
        self._thread.join()
        self._thread = None
        boundary, self._boundary = self._boundary, None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return boundary

    def done(self) -> int | None:
        """The boundary of a write that has completed since the last look (once), else None."""
        if self._thread is None or self._thread.is_alive():
            return None
        return self._finish()

    def wait(self) -> int | None:
        """Block until the write in flight (if any) is complete; its boundary, else None."""
        return None if self._thread is None else self._finish()
