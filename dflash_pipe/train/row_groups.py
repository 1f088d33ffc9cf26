"""The loader's memory: recently read row groups (shared by the decode workers and the read-ahead threads,
each row group read once) and reusable plane buffers."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from .cache_index import CacheIndex


class RowGroupCache:
    """A few recently read row groups (consecutive batches draw from the same ones). Called from the
    decode workers: a row group being read by one worker is waited for, not read twice."""

    def __init__(self, index: CacheIndex, capacity: int = 8):
        self.index, self.capacity = index, capacity
        self._items: OrderedDict = OrderedDict()
        self._reading: dict[tuple[int, int], threading.Event] = {}
        self._lock = threading.Lock()
        # how the row groups were read: ahead (fetch threads) or on demand by a decode worker, and the
        # seconds decode workers spent reading or waiting for one (what read-ahead is there to hide)
        self.reads_ahead = self.reads_on_demand = 0
        self.prefetch_calls = 0      # row groups the loader asked to read ahead (a decode worker may still win the race)
        self.worker_wait_s = 0.0

    def forget(self, shard: int) -> None:
        with self._lock:
            for key in [k for k in self._items if k[0] == shard]:
                del self._items[key]

    def prefetch(self, shard: int, rg: int, pool: ThreadPoolExecutor) -> None:
        """Start reading a row group the schedule needs soon (object storage: hides the GET latency behind
        the decode of earlier batches). A failed prefetch is dropped: the decode worker's own read raises."""
        with self._lock:
            self.prefetch_calls += 1
            if (shard, rg) in self._items or (shard, rg) in self._reading:
                return

        def fetch():
            try:
                self.rows(shard, rg, ahead=True)
            except Exception:  # noqa: BLE001 - surfaced by the worker that needs it
                pass
        pool.submit(fetch)

    def rows(self, shard: int, rg: int, ahead: bool = False):
        """The row group's rows; `ahead`: called by a read-ahead thread (counted apart, its wait is not a batch's)."""
        key = (shard, rg)
        t0 = time.perf_counter()
        try:
            while True:
                with self._lock:
                    if key in self._items:
                        self._items.move_to_end(key)
                        return self._items[key]
                    wait = self._reading.get(key)
                    if wait is None:
                        self._reading[key] = threading.Event()
                        break
                wait.wait()  # another worker reads it; if that read failed, try ourselves
            try:
                rows = self.index.reader(shard).read_row_group(rg)
                with self._lock:
                    self._items[key] = rows
                    while len(self._items) > self.capacity:
                        self._items.popitem(last=False)
                    if ahead:
                        self.reads_ahead += 1
                    else:
                        self.reads_on_demand += 1
                return rows
            finally:
                with self._lock:
                    self._reading.pop(key).set()
        finally:
            if not ahead:
                waited = time.perf_counter() - t0
                if waited > 1e-3:  # a hit costs microseconds; only reads and waits are counted
                    with self._lock:
                        self.worker_wait_s += waited

    def summary(self) -> str:
        return (f"{self.reads_ahead + self.reads_on_demand} row groups read ({self.reads_ahead} ahead, "
                f"{self.reads_on_demand} on demand); decode workers spent {self.worker_wait_s:.1f}s reading or "
                "waiting for them")


class PlanePool:
    """Reusable (pinned) plane buffers of one batch shape. A fresh 420 MB pinned, zeroed buffer per
    batch costs more than decoding into it; a reused one only needs its padding tail zeroed."""

    def __init__(self, shape: tuple, dtype: torch.dtype, pin: bool):
        self.shape, self.dtype, self.pin = shape, dtype, pin
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0

    def take(self) -> tuple[torch.Tensor, bool]:
        """(buffer, fresh): fresh buffers are zeroed; reused ones hold the previous batch."""
        with self._lock:
            if self._free:
                return self._free.pop(), False
            self.allocated += 1
        return torch.zeros(self.shape, dtype=self.dtype, pin_memory=self.pin), True

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
