"""The cache's disk budget (`[extract] max_cache_gib`): extraction waits for room before opening a shard.

Held bytes = every shard file present in the cache dir (committed, not yet deleted by the window
trainer) + every in-flight shard temp file of a live writer, counted as at least the estimate of
one shard (it is still growing). The estimate of the next shard is the largest committed shard so
far, or, when the caller passes the next shard's token count, that count times the largest bytes per
token of a committed shard if that is more (a shard of more tokens than any before would otherwise be
under-estimated and push the cache over the budget); both come from the sidecars, which outlive deleted
shards. Before the first commit the estimate is unknown (0).
Check and temp-file creation happen under an exclusive lock on ``.window-space.lock`` so two ranks
cannot both take the last room. Waiting sleeps `poll_s` between looks (no busy loop).

On object storage (cache/fs.py) the budget bounds the objects held under the prefix: held bytes come
from one listing per look, the estimate from the sidecars (each read once). A store has no lock and
no visible in-flight uploads, so each extraction job counts its own: the next shard, and the shards it
opened whose objects the listing does not show yet (the previous shard is still uploading on the writer
thread while the next one opens), at their estimate. With J jobs the prefix can hold up to J - 1 shards
past the budget.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import RuntimeFailure, UsageError
from ..io_utils import is_temp_name, temp_writer_alive
from .fs import open_cache_fs

log = logging.getLogger("dflash_pipe.extract")
GIB = 1 << 30
LOCK_FILE = ".window-space.lock"


def _gib(n: int) -> str:
    return f"{n / GIB:.3g}"


def shard_estimate(sizes: list[tuple[int, int]], tokens: int = 0) -> int:
    """Bytes to reserve for the next shard from the committed shards' (bytes, tokens): the largest shard,
    or `tokens` x the largest bytes per token if that is more."""
    largest = max((b for b, _ in sizes), default=0)
    per_token = max((b / t for b, t in sizes if t > 0), default=0.0)
    return max(largest, math.ceil(tokens * per_token))


def committed_sizes(cache_dir: Path) -> list[tuple[int, int]]:
    """(bytes, tokens) of every committed shard, from the sidecars in a local cache dir."""
    out = []
    for p in cache_dir.glob("shard-*.json"):
        try:
            side = json.loads(p.read_text(encoding="utf-8"))
            out.append((int(side.get("bytes", 0)), int(side.get("tokens", 0))))
        except (OSError, ValueError, TypeError):
            continue  # a sidecar being replaced; the manifest code names damaged ones
    return out


def held_bytes(cache_dir: Path, estimate: int) -> tuple[int, int, int]:
    """(bytes, shard files, in-flight shards) currently held in the cache dir."""
    total = files = inflight = 0
    for p in cache_dir.iterdir():
        name = p.name
        try:
            if name.startswith("shard-") and name.endswith(".parquet"):
                total += p.stat().st_size
                files += 1
            elif is_temp_name(name) and name.startswith(".shard-") and ".parquet" in name and temp_writer_alive(name):
                total += max(p.stat().st_size, estimate)
                inflight += 1
        except FileNotFoundError:
            continue  # deleted or renamed while we looked
    return total, files, inflight


class DiskBudget:
    def __init__(self, cache_dir: str | Path, max_gib: float, passes_per_shard: int, timeout_s: float,
                 poll_s: float = 1.0, report_every_s: float = 30.0):
        self.fs = open_cache_fs(cache_dir)
        self.cache_dir = self.fs.root if self.fs.is_local else self.fs.uri
        self._sidecar_sizes: dict[str, tuple[int, int]] = {}  # object stores: (bytes, tokens) of sidecars read
        self._uploading: dict[str, int] = {}  # object stores: shards this job opened, not listed yet -> estimate
        self.limit = int(max_gib * GIB)
        self.passes = max(1, passes_per_shard)
        self.timeout_s, self.poll_s, self.report_every_s = timeout_s, poll_s, report_every_s
        self.waited_s = 0.0

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def check_fits_window(self, shard_bytes: int) -> None:
        need = (self.passes + 1) * shard_bytes
        if shard_bytes and self.limit < need:
            raise UsageError(
                f"--max-cache-gib {self.limit / GIB:.3g} is smaller than the window needs: a shard is "
                f"{shard_bytes / GIB:.3g} GiB ({shard_bytes} bytes); the trainer holds up to {self.passes} shards "
                f"(K + M - 1: --passes-per-shard K, --window-checkpoint-rounds M) and one more is being written: "
                f"{need / GIB:.3g} GiB",
                f"raise --max-cache-gib to at least {need / GIB:.3g}, or use more --num-shards (smaller shards)")

    @contextmanager
    def room_for_next_shard(self, tokens: int = 0, name: str = ""):
        """Wait until the next shard (of `tokens` tokens, if known; its file `name`) fits, then hold the lock
        while the caller creates its temp file (object stores: `name` is held until its object is listed)."""
        if not self.enabled:
            yield
            return
        if not self.fs.is_local:
            est = self._wait_remote(tokens)
            if name:
                self._uploading[name] = est
            yield
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        t0 = t_progress = time.monotonic()
        last_held, last_report = None, None
        with open(self.cache_dir / LOCK_FILE, "a+") as lock:
            while True:
                fcntl.flock(lock, fcntl.LOCK_EX)
                est = shard_estimate(committed_sizes(self.cache_dir), tokens)
                self.check_fits_window(est)
                held, files, inflight = held_bytes(self.cache_dir, est)
                if held + est <= self.limit:
                    try:
                        yield
                    finally:
                        fcntl.flock(lock, fcntl.LOCK_UN)
                    waited = time.monotonic() - t0
                    self.waited_s += waited
                    if waited > self.poll_s:
                        log.info("space freed after waiting %.0fs; opening the next shard", waited)
                    return
                fcntl.flock(lock, fcntl.LOCK_UN)
                now = time.monotonic()
                if last_held is None or held < last_held:
                    t_progress = now  # the timeout counts from the last time space was freed
                last_held = held
                if last_report is None or now - last_report >= self.report_every_s:
                    log.info("waiting for space: %s of %s GiB held by %d shards still to be trained "
                             "(+%d being written, next shard ~%s GiB; waited %.0fs)", _gib(held), _gib(self.limit),
                             files, inflight, _gib(est), now - t0)
                    last_report = now
                if now - t_progress > self.timeout_s:
                    self.waited_s += now - t0
                    raise self._trainer_gone("in", held, files)
                time.sleep(self.poll_s)

    def _trainer_gone(self, where: str, held: int, files: int) -> RuntimeFailure:
        """The error of a wait that saw no space freed for timeout_s (local: 'in' the dir; store: 'under' it)."""
        return RuntimeFailure(
            f"no space freed {where} {self.cache_dir} for {self.timeout_s:.0f}s: {_gib(held)} of "
            f"{_gib(self.limit)} GiB held by {files} shards; the trainer seems gone",
            "start or resume `dflash-pipe train --follow --passes-per-shard K` on this cache (it "
            "deletes consumed shards), then rerun extract; or raise --space-wait-timeout-s")

    def _remote_held(self, tokens: int) -> tuple[int, int, int]:
        """(held bytes, shard objects, estimate of the next shard) under an object-store prefix."""
        sizes = self.fs.list_sizes()
        for name in sizes:
            if name.startswith("shard-") and name.endswith(".json") and name not in self._sidecar_sizes:
                try:
                    side = json.loads(self.fs.read_bytes(name))
                    self._sidecar_sizes[name] = (int(side.get("bytes", 0)), int(side.get("tokens", 0)))
                except (FileNotFoundError, ValueError, TypeError):
                    continue
        shards = [n for n in sizes if n.startswith("shard-") and n.endswith(".parquet")]
        # complete: the listing counts it now; its sidecar (written after it, kept after the trainer deletes it)
        # ends the reservation even if the shard was consumed between two looks
        for name in [n for n in self._uploading if n in sizes or n.replace(".parquet", ".json") in sizes]:
            del self._uploading[name]
        held = sum(sizes[n] for n in shards) + sum(self._uploading.values())
        return held, len(shards), shard_estimate(list(self._sidecar_sizes.values()), tokens)

    def _wait_remote(self, tokens: int) -> int:
        """Wait until the next shard fits under the prefix; returns its estimate."""
        t0 = t_progress = last_report = time.monotonic()
        last_held = None
        while True:
            held, files, est = self._remote_held(tokens)
            self.check_fits_window(est)
            if held + est <= self.limit:
                self.waited_s += time.monotonic() - t0
                return est
            now = time.monotonic()
            if last_held is None or held < last_held:
                t_progress = now
            last_held = held
            if now - last_report >= self.report_every_s or now == t0:
                log.info("waiting for space: %s of %s GiB held by %d shard objects still to be trained under %s "
                         "(+%d of this job's still uploading)", _gib(held), _gib(self.limit), files,
                         len(self._uploading), self.cache_dir)
                last_report = now
            if now - t_progress > self.timeout_s:
                self.waited_s += now - t0
                raise self._trainer_gone("under", held, files)
            time.sleep(self.poll_s)
