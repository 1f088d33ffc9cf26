"""The epoch schedule: which documents form which batch on which rank. Pure and deterministic.

Built from metadata alone (document lengths per row group), so every rank can compute every
rank's schedule without communicating, and a resumed run rebuilds exactly the batches of the
interrupted one and fast-forwards without decoding a single feature.

  * shard order: a permutation seeded by (seed, epoch); identity in follow mode's first epoch
    (shards are consumed as extraction commits them, in index order);
  * row groups are numbered globally in that order; rank r takes every world-th one;
  * within one shard, a rank's row groups are shuffled, then its documents are shuffled in
    windows of `shuffle_rows` (seeded by seed, epoch, rank, shard);
  * documents are packed greedily, in order, into batches of at most `context_tokens` tokens
    (a longer document is cut to `context_tokens`). Packing carries over from shard to shard,
    so appending a shard never changes earlier batches (needed for follow mode);
  * every rank runs min over ranks of its batch count: uneven data never hangs DDP.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DocRef:
    shard: int
    row_group: int
    row: int
    num_tokens: int  # tokens used (the document is cut to context_tokens)


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]))


def shard_order(shards: list[int], seed: int, epoch: int, follow_first_epoch: bool) -> list[int]:
    shards = sorted(shards)
    if follow_first_epoch:
        return shards
    return [shards[i] for i in _rng(seed, epoch, 7).permutation(len(shards))]


def rank_docs_of_shard(shard: int, rg_lengths: list[list[int]], first_global_rg: int, rank: int, world: int,
                       seed: int, epoch: int, shuffle_rows: int, context_tokens: int) -> list[DocRef]:
    """This rank's documents of one shard, in epoch order."""
    mine = [rg for rg in range(len(rg_lengths)) if (first_global_rg + rg) % world == rank]
    rng = _rng(seed, epoch, rank, shard, 1)
    mine = [mine[i] for i in rng.permutation(len(mine))]
    docs = [DocRef(shard, rg, row, min(n, context_tokens)) for rg in mine for row, n in enumerate(rg_lengths[rg])]
    if shuffle_rows > 1:
        for start in range(0, len(docs), shuffle_rows):
            window = docs[start:start + shuffle_rows]
            docs[start:start + shuffle_rows] = [window[i] for i in rng.permutation(len(window))]
    return docs


class Packer:
    """Greedy in-order packing into batches of <= context_tokens. `open` is the unfinished batch."""

    def __init__(self, context_tokens: int):
        self.context_tokens = context_tokens
        self.batches: list[list[DocRef]] = []
        self.open: list[DocRef] = []
        self._open_tokens = 0

    def add(self, doc: DocRef) -> None:
        if self.open and self._open_tokens + doc.num_tokens > self.context_tokens:
            self.batches.append(self.open)
            self.open, self._open_tokens = [], 0
        self.open.append(doc)
        self._open_tokens += doc.num_tokens

    def finish(self) -> None:
        if self.open:
            self.batches.append(self.open)
            self.open, self._open_tokens = [], 0


@dataclass
class EpochSchedule:
    per_rank: list[list[list[DocRef]]]  # rank -> batches -> docs
    final: bool  # all data of the epoch is known (False only in follow mode, mid-extraction)
    dropped_batches: int = 0

    @property
    def steps(self) -> int:
        """Steps every rank can run now (equal on all ranks)."""
        return min(len(b) for b in self.per_rank)

    def batch(self, rank: int, step: int) -> list[DocRef]:
        return self.per_rank[rank][step]


def build_epoch_schedule(lengths: dict[int, list[list[int]]], world: int, seed: int, epoch: int,
                         context_tokens: int, shuffle_rows: int, follow_first_epoch: bool = False,
                         final: bool = True) -> EpochSchedule:
    """lengths: shard -> row group -> document lengths (only the shards available so far)."""
    packers = [Packer(context_tokens) for _ in range(world)]
    global_rg = 0
    for shard in shard_order(list(lengths), seed, epoch, follow_first_epoch):
        rgs = lengths[shard]
        for rank in range(world):
            for doc in rank_docs_of_shard(shard, rgs, global_rg, rank, world, seed, epoch, shuffle_rows,
                                          context_tokens):
                packers[rank].add(doc)
        global_rg += len(rgs)
    if final:
        for p in packers:
            p.finish()
    per_rank = [p.batches for p in packers]
    sched = EpochSchedule(per_rank, final)
    sched.dropped_batches = sum(len(b) for b in per_rank) - world * sched.steps if final else 0
    return sched


def batch_rng(seed: int, epoch: int, rank: int, step: int) -> np.random.Generator:
    """Anchor sampling randomness of one batch: a function of its position only."""
    return _rng(seed, epoch, rank, step, 3)


# ---------------------------------------------------------------------- window mode (--passes-per-shard K)

def window_members(round_: int, passes: int, num_shards: int) -> list[int]:
    """Commit sequence numbers read in round r: every c with r-K < c <= r (and c < num_shards)."""
    return list(range(max(0, round_ - passes + 1), min(round_, num_shards - 1) + 1))


def window_rounds(passes: int, num_shards: int) -> int:
    """Rounds until every shard was read K times: shard c is read in rounds c .. c+K-1."""
    return num_shards + passes - 1


def retired_after(round_: int, passes: int, num_shards: int) -> list[int]:
    """Sequence numbers whose last read is round r (retired once it ends)."""
    c = round_ - passes + 1
    if round_ == window_rounds(passes, num_shards) - 1:  # the last round retires everything left
        return list(range(max(0, c), num_shards))
    return [c] if 0 <= c < num_shards else []


def build_round_schedule(lengths_by_seq: dict[int, list[list[int]]], shard_of_seq: list[int], round_: int,
                         passes: int, num_shards: int, world: int, seed: int, context_tokens: int,
                         shuffle_rows: int) -> EpochSchedule:
    """One round of the windowed schedule, a pure function of (seed, commit order, K, round).

    The round's shards (`window_members`) are shuffled together by (seed, round); shard c is in its
    pass r-c. Row groups are dealt to ranks and packed exactly as in an epoch (rank r takes every
    world-th row group; every rank runs min over ranks of its batch count); the round ends with
    its own last batch (packing does not carry over into the next round)."""
    members = window_members(round_, passes, num_shards)
    order = [members[i] for i in _rng(seed, round_, 11).permutation(len(members))]
    packers = [Packer(context_tokens) for _ in range(world)]
    global_rg = 0
    for c in order:
        rgs = lengths_by_seq[c]
        for rank in range(world):
            for doc in rank_docs_of_shard(shard_of_seq[c], rgs, global_rg, rank, world, seed, round_, shuffle_rows,
                                          context_tokens):
                packers[rank].add(doc)
        global_rg += len(rgs)
    for p in packers:
        p.finish()
    per_rank = [p.batches for p in packers]
    sched = EpochSchedule(per_rank, True)
    sched.dropped_batches = sum(len(b) for b in per_rank) - world * sched.steps
    return sched
