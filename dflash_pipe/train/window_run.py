"""Window mode of `train --follow --passes-per-shard K`: the trainer's side of the window ledger.

Rank 0 decides everything and the other ranks follow: it assigns commit sequence numbers to newly
committed shards (cache/window.py), writes the ledger, and broadcasts the commit order as one int
tensor (no pickle) to every rank at every look; rounds are then a pure function of that order
(schedule.build_round_schedule), so all ranks read the same window and none opens a shard outside
it. Per round boundary (trainer.py):

    end_round(r)      shards whose last read was round r -> `retired` (ledger written)
    checkpoint        complete checkpoint at (r + 1, step 0)
    collect(r + 1)    retired shards no read from round r + 1 on needs -> `deleted` in the ledger,
                      then their files are unlinked; checkpoints of rounds <= r are pruned (they
                      would need a deleted shard). A SIGKILL anywhere leaves a ledger and a newest
                      complete checkpoint that agree; `--resume auto` redoes what is missing.
"""

from __future__ import annotations

import functools
import logging
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..cache.manifest import committed_shards
from ..cache.window import (DELETED, Ledger, check_owner, delete_shard_file, group_released, ledger_name,
                            ledger_names, ledger_path, load_ledger, member_ledgers, save_ledger)
from ..errors import CacheError, RuntimeFailure, UsageError
from ..faults import fault_point
from .checkpoint import complete_checkpoints, read_state
from .schedule import EpochSchedule, build_round_schedule, retired_after, window_members, window_rounds

log = logging.getLogger("dflash_pipe.train")
_GIVE_UP = 1


def _locked(method):
    """Run under the coordinator's lock (the read-ahead's look runs on another thread)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


def window_group(spec: str, out_dir: Path) -> list[str]:
    """`--window-group DIR,DIR,...` as resolved output dirs (sorted, so every member writes the same list); []
    for a trainer alone. This run's own output dir must be one of them."""
    dirs = [d.strip() for d in spec.split(",") if d.strip()]
    if not dirs:
        return []
    group = sorted({str(Path(d).expanduser().resolve()) for d in dirs})
    own = str(Path(out_dir).resolve())
    if own not in group:
        raise UsageError(f"--window-group {spec!r} does not list this run's --output-dir {own}",
                         "give every member of the group the same list, its own output dir included")
    return group


class WindowCoordinator:
    def __init__(self, index, out_dir: Path, passes: int, rank: int, world: int, device: torch.device,
                 poll_s: float, timeout_s: float, seed: int, context_tokens: int, shuffle_rows: int,
                 group: list[str] | None = None):
        self.index = index
        self.cache_dir, self.spec = index.cache_dir, index.spec
        self.n = int(self.spec["num_shards"])
        self.passes, self.rank, self.world = passes, rank, world
        self.out_dir = Path(out_dir)
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.seed, self.S, self.shuffle_rows = seed, context_tokens, shuffle_rows
        self.comm_device = device if (dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")
        self.order: list[int] = []  # shard index of each commit sequence number, equal on every rank
        self.lengths_by_seq: dict[int, list[list[int]]] = {}
        self._peeked: dict[int, tuple[int, list[list[int]]]] = {}  # seq -> (shard, lengths) read by peek_schedule
        self._schedule: tuple[int, EpochSchedule] | None = None  # (round, its schedule) built from lengths_by_seq
        self.ledger: Ledger | None = None
        # peek_schedule runs on the read-ahead's own thread (round_carry.py); it and the step loop's looks,
        # retirements and deletions take turns on the ledger, the commit order and the lengths
        self._lock = threading.RLock()
        self.group = list(group or [])
        self._unlinked: set[int] = set()                     # released shards whose files are known to be gone
        owner = str(self.out_dir.resolve())
        self.ledger_file = ledger_name(owner, self.group)   # window.json alone, window-<hash>.json in a group
        if rank == 0:
            # a temp file of this trainer's killed predecessor (a ledger write cut by SIGKILL); live writers' stay
            self.index.fs.remove_stale_temps()
            self._check_neighbours(owner)
            path = ledger_path(self.cache_dir, self.ledger_file)
            led = load_ledger(self.cache_dir, self.spec, self.ledger_file)
            if led is not None and led.finished and led.owner != owner:
                raise CacheError(f"{path}: another window run ({led.owner}) has consumed this cache",
                                 "rerun `dflash-pipe extract` (it re-extracts the consumed shards) first")
            if led is not None:
                check_owner(led, owner, passes, path)
                if sorted(led.group) != self.group and not led.finished:
                    raise UsageError(f"{path}: this run streams the cache in the window group {led.group or '(none)'}, "
                                     f"not {self.group or '(none)'}", "resume with the original --window-group")
            self.ledger = led or Ledger(self.spec["fingerprint"], passes, owner, group=self.group)
            self._sweep()  # killed between the ledger write and the unlink: the files the group released go now

    def _check_neighbours(self, owner: str) -> None:
        """A trainer alone and a window group cannot stream one cache at once (each would delete what the other
        still reads); nor can two groups. Finished ledgers are history and do not count."""
        names = ledger_names(self.index.fs)
        for name in names:
            if name == self.ledger_file:
                continue
            other = load_ledger(self.cache_dir, self.spec, name)
            if other is not None and other.finished and self.ledger_file not in names and other.deleted_indices():
                raise CacheError(f"{ledger_path(self.cache_dir, name)}: another window run ({other.owner}) has "
                                 "consumed this cache",
                                 "rerun `dflash-pipe extract` (it re-extracts the consumed shards) first")
            if other is None or other.finished or (self.group and sorted(other.group) == self.group):
                continue
            raise UsageError(f"{ledger_path(self.cache_dir, name)}: the cache is being streamed by "
                             f"{'the window group ' + str(other.group) if other.group else 'the window run ' + other.owner}"
                             f", and this run has --window-group {self.group or '(none)'}",
                             "give every trainer of this cache the same --window-group (its members' output dirs), "
                             "or use another --cache-dir")

    def _sweep(self, pending: list | None = None) -> list[int]:
        """Rank 0: unlink the shard files this trainer released (ledger state deleted; `pending`: those not known
        to be gone, taken under the lock) that every group member has released too (alone: all of them).
        Idempotent; returns the indices unlinked now."""
        gone = []
        fs = self.index.fs
        if pending is None:
            pending = self._released_pending()
        members = member_ledgers(self.cache_dir, self.spec, self.ledger) if self.group and pending else None
        for e in pending:
            name = self._name(e.index)
            if fs.exists(name):              # (a look is a HEAD request on object storage)
                if self.group and not group_released(self.cache_dir, self.spec, self.ledger, e.index, members):
                    continue                 # another member still reads it: looked at again next boundary
                delete_shard_file(self.cache_dir, name)
                gone.append(e.index)
            self._unlinked.add(e.index)
        return gone

    @property
    def rounds(self) -> int:
        return window_rounds(self.passes, self.n)

    def _name(self, index: int) -> str:
        from ..cache.schema import shard_name

        return shard_name(index, self.n)

    # ------------------------------------------------------------------ agreeing on the commit order
    def _look(self, give_up: bool) -> bool:
        """One collective look for new shards. Returns rank 0's give-up decision."""
        buf = torch.full((self.n + 1,), -1, dtype=torch.int64)
        if self.rank == 0:
            order = self._update_ledger()
            buf[0] = _GIVE_UP if give_up else 0
            buf[1:1 + len(order)] = torch.tensor(order, dtype=torch.int64)
        if dist.is_initialized():
            buf = buf.to(self.comm_device)
            dist.broadcast(buf, src=0)
            buf = buf.cpu()
        vals = buf.tolist()
        self.order = [v for v in vals[1:] if v >= 0]
        return vals[0] == _GIVE_UP

    @_locked
    def _update_ledger(self) -> list[int]:
        """Rank 0: add newly committed shards to the ledger (saved), in index order. Returns the commit order."""
        known = frozenset(self.ledger.order())
        committed = committed_shards(self.cache_dir, self.spec, skip=known)
        new = sorted(i for i in committed if i not in known and not committed[i].get("deleted"))
        n0 = len(self.ledger.shards)
        for i in new:  # the first look that sees a shard fixes its place in the commit order...
            self.ledger.add(i, committed[i]["bytes"])
        if new:
            try:
                save_ledger(self.cache_dir, self.ledger)
            except BaseException:  # ...once it is saved: until then the order in memory stays the one on disk
                # (the read-ahead's look drops its errors; a kill after training on an unsaved order would
                # resume with another), and the next look adds these shards again
                del self.ledger.shards[n0:]
                raise
        return self.ledger.order()

    def wait_round(self, round_: int, before_waiting=None) -> float:
        """Block (collectively) until every shard round `round_` reads is committed; load their lengths.
        `before_waiting()` runs once if the shards are not there at the first look (rank 0 completes a
        background checkpoint and its deletions: the extractor may be waiting for that space). Returns the
        seconds spent waiting for shards to be committed (0 when the first look found them)."""
        need = min(round_, self.n - 1) + 1
        waited, said, first_miss = 0.0, False, True
        t0 = time.perf_counter()
        while True:
            give_up = self._look(self.rank == 0 and waited >= self.timeout_s)
            if len(self.order) >= need:
                break
            if first_miss:  # the same on every rank (it depends on the broadcast order only)
                first_miss = False
                if before_waiting is not None:
                    before_waiting()
                continue  # look again at once: the deletions may be what the extractor waited for
            if give_up:
                raise RuntimeFailure(f"window: no new shard committed in {self.cache_dir} for {self.timeout_s:.0f}s "
                                     f"(round {round_} needs {need} of {self.n} shards, {len(self.order)} committed): "
                                     "the extractor seems gone; the last complete checkpoint is kept",
                                     "rerun `dflash-pipe extract` on this cache, then rerun this train command "
                                     "(it resumes); or raise --follow-timeout-s")
            if not said and self.rank == 0:
                log.info("window: round %d waits for shard %d of %d (%d committed)", round_, need, self.n,
                         len(self.order))
                said = True
            time.sleep(self.poll_s)
            waited += self.poll_s
        if said and self.rank == 0:
            log.info("window: resumed after waiting %.0fs for shards", waited)
        shard_wait = 0.0 if first_miss else time.perf_counter() - t0  # only when the first look missed
        self._load_members(round_)
        return shard_wait

    @_locked
    def _load_members(self, round_: int) -> None:
        self._schedule = None
        members = window_members(round_, self.passes, self.n)
        for c in list(self.lengths_by_seq):
            if c not in members:
                del self.lengths_by_seq[c]
        for c in members:
            if c in self.lengths_by_seq:
                continue
            shard = self.order[c]
            fs = self.index.fs  # a directory or an object-store prefix
            path = fs.path(self._name(shard)) if fs.is_local else fs.display(self._name(shard))
            present = fs.exists(self._name(shard))
            entry = self.ledger.entry(shard) if self.ledger is not None else None
            if not present and entry is not None and entry.state == DELETED:
                raise CacheError(f"window: round {round_} reads shard {path} (commit #{c}), which this window run "
                                 "already deleted: the checkpoint resumed from is older than the deletion",
                                 "resume from the newest checkpoint (--resume auto); older ones are pruned")
            if not present:
                raise CacheError(f"window: shard {path} (commit #{c}) is still in the window (round {round_} reads "
                                 f"it) but its file is missing: deleted by hand?",
                                 "rerun `dflash-pipe extract` on this cache to re-extract it, then rerun this train "
                                 "command (it resumes where it stopped)")
            self.index.paths[shard] = path
            peeked = self._peeked.pop(c, None)
            self.lengths_by_seq[c] = peeked[1] if peeked and peeked[0] == shard else self.index._read_lengths(path)
        for c in [c for c in self._peeked if c < min(members, default=0)]:
            del self._peeked[c]

    @_locked
    def peek_schedule(self, round_: int) -> EpochSchedule | None:
        """Round `round_`'s schedule if every shard it reads is already in the ledger, else None: no
        collective, no waiting (the loader reads the next round ahead with it, round_carry.py). Rank 0 adds
        newly committed shards to the ledger as a look does; other ranks read the ledger rank 0 wrote. The
        order is append-only, so the result equals what `wait_round` + `schedule` give later."""
        if round_ >= self.rounds:
            return None
        try:
            if self.rank == 0:
                order = self._update_ledger()
            else:
                led = load_ledger(self.cache_dir, self.spec, self.ledger_file)
                order = led.order() if led is not None else []
            need = min(round_, self.n - 1) + 1
            if len(order) < need:
                return None
            lengths = {}
            for c in window_members(round_, self.passes, self.n):
                shard = order[c]
                if c < len(self.order) and self.order[c] == shard and c in self.lengths_by_seq:
                    lengths[c] = self.lengths_by_seq[c]
                    continue
                if c not in self._peeked:
                    fs = self.index.fs
                    path = fs.path(self._name(shard)) if fs.is_local else fs.display(self._name(shard))
                    self._peeked[c] = (shard, self.index._read_lengths(path))
                    self.index.paths[shard] = path
                lengths[c] = self._peeked[c][1]
        except (CacheError, OSError, ValueError) as exc:  # the real look names the problem
            log.debug("window: no read-ahead of round %d (%s)", round_, exc)
            return None
        return build_round_schedule(lengths, order, round_, self.passes, self.n, self.world, self.seed, self.S,
                                    self.shuffle_rows)

    @_locked
    def schedule(self, round_: int) -> EpochSchedule:
        """Round `round_`'s schedule (after its wait_round); built once per round (the trainer and the loader ask)."""
        if self._schedule is None or self._schedule[0] != round_:
            self._schedule = (round_, build_round_schedule(self.lengths_by_seq, self.order, round_, self.passes,
                                                           self.n, self.world, self.seed, self.S, self.shuffle_rows))
        return self._schedule[1]

    # ------------------------------------------------------------------ retirement and deletion
    @_locked
    def end_round(self, round_: int, loader) -> None:
        """Round `round_` is complete on every rank: retire the shards it read for the last time."""
        done = retired_after(round_, self.passes, self.n)
        for c in done:
            loader.forget_shard(self.order[c])
        if self.rank == 0 and done:
            if any([self.ledger.retire(c, round_) for c in done]):
                save_ledger(self.cache_dir, self.ledger)
            fault_point("train.window.after_retire")

    @_locked
    def _released_pending(self) -> list:
        return [e for e in self.ledger.in_state(DELETED) if e.index not in self._unlinked]  # known gone: no look

    def collect(self, boundary_round: int) -> list[int]:
        """Rank 0, after a complete checkpoint at (boundary_round, 0): delete what no later read needs. Runs on
        the checkpoint writer's thread (checkpoint_writer.py): the ledger under the lock, the unlinks (the slow
        part, ~1 s a boundary on the H100's disk in session 25) outside it, so the step loop's retirements and the
        read-ahead's looks do not wait for them."""
        if self.rank != 0:
            return []
        with self._lock:
            gone = self.ledger.deletable(boundary_round)
            if gone:
                fault_point("train.window.before_delete")
                for e in gone:
                    e.state = DELETED
                save_ledger(self.cache_dir, self.ledger)  # first the ledger, then the files (a kill in between:
            # the next start unlinks what the ledger says is deleted); in a group, the files every member has
            # released by now, this boundary's or older ones
            pending = self._released_pending()
        unlinked = self._sweep(pending)
        if gone or unlinked:
            log.info("window: released shards %s (retired, checkpointed at round %d); files deleted: %s",
                     [e.index for e in gone], boundary_round, unlinked)
        self.prune_checkpoints(boundary_round)
        return [e.index for e in gone]

    def prune_checkpoints(self, boundary_round: int) -> None:
        """Checkpoints of rounds before the boundary may need deleted shards: remove them."""
        for ck in complete_checkpoints(self.out_dir):
            try:
                r = int(read_state(ck).get("epoch", 0))
            except CacheError:
                continue
            if r < boundary_round:
                shutil.rmtree(ck, ignore_errors=True)

    @_locked
    def finish(self) -> None:
        """After the final checkpoint: delete every remaining shard and mark the cache consumed."""
        if self.rank != 0:
            return
        self.collect(self.rounds)
        self.ledger.finished = True
        save_ledger(self.cache_dir, self.ledger)
