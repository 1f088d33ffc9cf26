"""What the trainer knows about a cache: its spec, which shards are there (a finished cache's manifest, or in
`--follow` mode the committed prefix), each shard's document lengths per row group, and one Parquet handle per
(shard, thread) for the decode workers."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from ..cache import load_manifest, load_spec
from ..cache.fs import open_cache_fs
from ..cache.manifest import MANIFEST_FILE, committed_shards
from ..cache.reader import ShardReader
from ..cache.verify import head_file_damage
from ..cache.window import consumed_indices, load_ledgers
from ..config import parse_shard_subset
from ..errors import CacheError

log = logging.getLogger("dflash_pipe.loader")


def shard_subset(spec: dict, shards: str) -> list[int] | None:
    """The `--shards` subset of a cache (None = all shards), checked against the cache's shard count."""
    return parse_shard_subset(shards, int(spec["num_shards"])) if shards.strip() else None


def checked_manifest(fs, spec: dict) -> dict:
    """The cache's manifest.json, loaded and naming the spec's fingerprint; CacheError (exit 3) otherwise. Under
    --follow the callers (CacheIndex, the validation cache's Validator) count such a manifest as not written yet:
    `plan` RESUMEs the cache and extract rewrites it."""
    man = load_manifest(fs)
    if man["fingerprint"] != spec["fingerprint"]:
        raise CacheError(f"{fs.uri}: manifest and cache_spec.json disagree on the fingerprint",
                         f"`dflash-pipe cache verify {fs.cli_location}` prints the fix")
    return man


class CacheIndex:
    """What the trainer knows about a cache: spec, which shards exist, document lengths."""

    def __init__(self, cache_dir: str | Path, follow: bool = False, shards: str = "", wait_s: float = 0.0):
        self.fs = open_cache_fs(cache_dir)
        self.cache_dir = self.fs.root if self.fs.is_local else self.fs.uri
        self.follow = follow
        self.spec = self._wait_for_spec(wait_s) if follow and wait_s > 0 else load_spec(self.fs)
        if self.spec is None:
            raise CacheError(f"{self.cache_dir}: no cache_spec.json (not a dflash-pipe cache)",
                             "run `dflash-pipe extract` first or fix --cache-dir")
        self.subset = shard_subset(self.spec, shards)
        self.features = self.spec["features"]
        self.lengths: dict[int, list[list[int]]] = {}
        self.paths: dict[int, Path | str] = {}
        self.final = False
        self.committed = 0  # follow mode: shards seen committed so far (any order; all of them once final)
        self._damaged_manifest_said = False  # follow mode: the warning about a damaged manifest.json is logged
        self._prefix: dict[int, Path | str] = {}  # follow mode: the committed prefix 0..p-1 and its locations
        self._readers: dict[tuple[int, int], ShardReader] = {}
        self._lock = threading.Lock()

    def _wait_for_spec(self, wait_s: float, poll_s: float = 1.0) -> dict | None:
        """--follow started together with extraction: the spec and the head file appear once the target is
        loaded (minutes for a large one). Wait for both, up to `wait_s`; a head file that fails its header check
        (`head_file_damage`: `plan` RESUMEs such a cache and extract rewrites the head) counts as not written yet."""
        t0 = time.monotonic()
        said = False
        while True:
            spec = load_spec(self.fs)
            head = spec["features"].get("head_file", "") if spec is not None else ""
            if spec is not None and self.fs.exists(head or "-") and head_file_damage(self.fs, head) is None:
                return spec
            if time.monotonic() - t0 > wait_s:
                return spec  # the caller names what is missing
            if not said:
                log.info("follow: waiting for extraction to write %s/cache_spec.json and the target head",
                         self.cache_dir)
                said = True
            time.sleep(poll_s)

    def refresh(self) -> bool:
        """Pick up newly committed shards. Returns whether the data is final (manifest written)."""
        ledgers = load_ledgers(self.fs, self.spec)
        gone = consumed_indices(self.fs, self.spec, ledgers)
        if gone:
            owners = ", ".join(f"{led.owner} ({led.file})" for led in ledgers)
            raise CacheError(f"{self.cache_dir}: shards {sorted(gone)} were consumed (deleted) by the window run "
                             f"{owners}",
                             "rerun `dflash-pipe extract` to re-extract them (a finished window run's cache), or "
                             "resume that run with --follow --passes-per-shard K")
        man = self._manifest()
        if man is not None:
            shards = {e["index"]: self._location(e["abs_path"]) for e in man["shards"]}
            self.final = True
            self.committed = len(shards)
        elif self.follow:
            # the shards of the prefix seen before are committed for good: their sidecars are not read again
            # (one GET each per poll on a store); the prefix grows only from where it ended
            known = frozenset(self._prefix)
            done = committed_shards(self.fs, self.spec, skip=known)
            self.committed = max(self.committed, len(known) + len(done))
            prefix = len(self._prefix)
            while prefix in done:  # only a prefix keeps the schedule stable as shards arrive
                self._prefix[prefix] = self._location(self.fs.display(done[prefix]["path"]))
                prefix += 1
            shards = dict(self._prefix)
        else:
            raise CacheError(f"{self.cache_dir}: no {MANIFEST_FILE}: extraction has not finished",
                             "wait for `dflash-pipe extract` to finish (or rerun it to resume), or pass --follow")
        if self.subset is not None:
            shards = {i: p for i, p in shards.items() if i in self.subset}
        for i, path in sorted(shards.items()):
            if i not in self.lengths:
                self.lengths[i] = self._read_lengths(path)
                self.paths[i] = path
        return self.final

    def _manifest(self) -> dict | None:
        """The cache's manifest; None while there is none. A damaged one (does not load, or names another
        fingerprint than the spec) is exit 3, except in follow mode: plan says RESUME for such a cache and
        run_pipeline.sh starts extract beside `train --follow`, and extract rewrites it from the sidecars once
        its shards are all committed. Until then it counts as not written yet (one warning)."""
        if not self.fs.exists(MANIFEST_FILE):
            return None
        try:
            man = checked_manifest(self.fs, self.spec)
        except CacheError as exc:
            if not self.follow:
                raise
            if not self._damaged_manifest_said:
                log.warning("follow: %s is damaged (%s); reading the committed shards' sidecars as if it were not "
                            "written yet, until extract rewrites it (rerun `dflash-pipe extract` if none is running)",
                            self.fs.display(MANIFEST_FILE), exc.message)
                self._damaged_manifest_said = True
            return None
        return man

    def _location(self, path: str) -> Path | str:
        """A shard's local path, or its object URI (Path() would fold 's3://' into 's3:/')."""
        return Path(path) if self.fs.is_local else path

    def _read_lengths(self, path: Path | str) -> list[list[int]]:
        reader = ShardReader(path, expect_fingerprint=self.spec["fingerprint"])
        col = reader.num_tokens_column()
        out, start = [], 0
        for rg in range(reader.num_row_groups):
            n = reader.row_group_rows(rg)
            out.append([int(x) for x in col[start:start + n]])
            start += n
        return out

    def forget(self, shard: int) -> None:
        with self._lock:
            for key in [k for k in self._readers if k[0] == shard]:
                del self._readers[key]
        self.paths.pop(shard, None)
        self.lengths.pop(shard, None)

    def reader(self, shard: int) -> ShardReader:
        """A reader of `shard` for the calling thread: a pyarrow ParquetFile must not be read from two
        threads at once (concurrent read_row_group calls on one handle crash), and the decode workers
        read row groups in parallel. Opening one costs a footer read; there are workers x shards of them."""
        key = (shard, threading.get_ident())
        with self._lock:
            if key not in self._readers:
                self._readers[key] = ShardReader(self.paths[shard], expect_fingerprint=self.spec["fingerprint"])
            return self._readers[key]
