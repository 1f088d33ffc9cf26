"""Stage 1's data read: one pass over the source per rank hands every shard of the rank its conversations.

Shard ``s`` of ``num_shards`` holds the selected conversations (after ``skip_samples`` /
``max_samples``) whose 0-based index ``i`` has ``i % num_shards == s``, in source order: exactly
what `iter_shard` yields on a fresh stream, so doc_index, sample ids and shard membership (and the
cache's bytes) are the same as when every shard re-read the source. Re-reading per shard made the
work grow as shards x dataset (the H200 window run: ~0.6 s of re-parsing per 10 k-token shard).

Memory: the raw `Conversation` objects of this rank's shards still to extract are held, never
other ranks' (1/world of the selected data), and at most ``max_held_docs`` of them at once
(default 200 000: ~1-2 GB of ShareGPT-sized chats). A rank whose share is larger reads its shards
in consecutive groups, one pass per group (a DFlash-scale 800 k source on 2 ranks: 2 passes
instead of 48 k). A shard's list is released when it is handed out. An index of file offsets would
hold less, but rows come from JSON, JSONL, Parquet and the embedded sets, and re-seeking each
format is more code than the memory saved is worth at these sizes.

Reader stats: every pass reads the whole selected stream, so `ShardDocs.stats` are the whole
reader's counts (rows read, malformed rows by reason) - the contract of each sidecar's
``data_reader`` block is unchanged. With ``strict``, a malformed row now fails in the first pass,
before any shard file is opened (it used to fail inside the first shard).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..config import DataConfig
from ..data.sources import Conversation, load_conversations
from ..data.stats import DataStats

log = logging.getLogger("dflash_pipe.extract")
MAX_HELD_DOCS = 200_000


@dataclass
class ShardDocs:
    """One shard's conversations as (selected index, conversation), and the reader's counts."""

    shard: int
    docs: list[tuple[int, Conversation]]
    stats: DataStats


class RankShardReader:
    """This rank's shards' conversations, read in as few passes over the source as memory allows.

    `take` the shards in the order given (the order extraction runs them); the first pass runs in
    the constructor, so `total_docs` (the progress bar's total) is known before any forward.
    """

    def __init__(self, data: DataConfig, num_shards: int, shards: list[int], max_held_docs: int = MAX_HELD_DOCS):
        if max_held_docs < 1:
            raise ValueError(f"max_held_docs must be >= 1, got {max_held_docs}")
        self.data, self.num_shards, self.max_held_docs = data, int(num_shards), int(max_held_docs)
        self.shards = list(shards)
        self.passes = 0
        self.read_s = 0.0
        self.selected = 0  # selected conversations in the whole source (all shards)
        self._pending = list(shards)  # not yet read, in extraction order
        self._held: dict[int, ShardDocs] = {}
        if self._pending:
            self._read_group()

    @property
    def total_docs(self) -> int:
        """Selected conversations in this rank's shards (before tokenization drops any)."""
        return sum(len(range(s, self.selected, self.num_shards)) for s in self.shards)

    def take(self, shard: int) -> ShardDocs:
        if shard not in self._held:
            if not self._pending or self._pending[0] != shard:
                raise ValueError(f"shard {shard} was already handed out or is not next in {self.shards}")
            self._read_group()
        return self._held.pop(shard)

    def _read_group(self) -> None:
        """One pass: collect the longest prefix of the pending shards that fits `max_held_docs`
        (at least one shard; shards are dropped from the end of the group as the pass overflows)."""
        t0 = time.perf_counter()
        d, n = self.data, self.num_shards
        group = list(self._pending)
        slots: dict[int, list] = {s: [] for s in group}
        held = 0
        stats = DataStats()
        count = 0
        for i, conv in enumerate(load_conversations(d.source, d.format, d.strict, stats, d.skip_samples,
                                                    d.max_samples)):
            count += 1
            slot = slots.get(i % n)
            if slot is None:
                continue
            slot.append((i, conv))
            held += 1
            while held > self.max_held_docs and len(group) > 1:
                held -= len(slots.pop(group.pop()))
        self.selected = count
        self._held.update({s: ShardDocs(s, slots[s], stats) for s in group})
        del self._pending[:len(group)]
        self.passes += 1
        self.read_s += time.perf_counter() - t0
        log.info("read %d selected conversations for shards %s in %.1fs (pass %d, %d held)",
                 count, _span(group), time.perf_counter() - t0, self.passes, held)


def _span(shards: list[int]) -> str:
    return f"{shards[0]}..{shards[-1]} ({len(shards)})" if len(shards) > 2 else str(shards)
