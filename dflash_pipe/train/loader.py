"""Streaming loader: cache metadata -> deterministic schedule -> fixed-shape batches, prefetched.

Every batch has the same shapes (context_tokens, num_anchors, block_size), so compiled code never
sees a new shape. Features stay as compressed planes until a decode thread writes them straight
into the batch's (pinned) plane buffer; the trainer turns planes into bf16 on the GPU.
The loader's position is (epoch, step): resuming rebuilds the schedule and continues at that step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..cache.codec import FP8, planes_shape
from ..cache.manifest import MANIFEST_FILE
from ..errors import RuntimeFailure
from .anchors import IGNORE, block_labels, copyable, sample_anchors
from .cache_index import CacheIndex
from .row_groups import PlanePool, RowGroupCache
from .schedule import DocRef, EpochSchedule, batch_rng, build_epoch_schedule

log = logging.getLogger("dflash_pipe.loader")


READ_AHEAD_LOCAL, READ_AHEAD_REMOTE = 4, 8


def auto_read_ahead(read_ahead: int, local: bool) -> int:
    """`[train] loader_read_ahead`, with -1 resolved: 8 batches on object storage, 4 on local disk. At the seed
    shape on the H200 host (`bench/objstore_loader.py`, session 11) 4 batches of ranged GETs gave 0.76x the
    local decode rate and 8 gave 0.99x; local disk gains nothing past 4 (its reads are memory-mapped)."""
    if read_ahead < 0:
        return READ_AHEAD_LOCAL if local else READ_AHEAD_REMOTE
    return read_ahead


class FollowTimeout(RuntimeFailure):
    """Follow mode: no new shard for --follow-timeout-s while the trainer waited (exit 4). Raised between steps
    (or from the next batch's prefetch, before the optimizer step): the steps done so far are complete."""


@dataclass
class TrainBatch:
    epoch: int
    step: int
    planes: torch.Tensor  # uint8 [2, D, S] (lossless) or [D, S] (fp8)
    scale: torch.Tensor | None  # fp8: float32 [S, n_layers]
    input_ids_S: torch.Tensor  # int64
    ctx_doc_S: torch.Tensor  # int32, -1 = padding
    ctx_pos_S: torch.Tensor  # int64, position inside its document
    anchor_index_N: torch.Tensor  # int64, packed context index of each anchor (0 for padding blocks)
    block_doc_N: torch.Tensor  # int32, -1 for padding blocks
    block_valid_N: torch.Tensor  # bool
    labels_NB: torch.Tensor  # int64, -100 = ignore
    anchor_tokens_N: torch.Tensor  # int64
    topk_ids_SK: torch.Tensor | None
    topk_logprobs_SK: torch.Tensor | None
    num_docs: int
    tokens: int  # real (non-padding) context tokens
    anchors_available: int  # anchors eligible before capping at num_anchors
    sample_ids: tuple = ()  # the documents of this batch, in context order
    release_fn: object = None  # returns the plane buffers to the loader's pool (see release())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}

    def release(self) -> None:
        """The consumer is done with the host buffers (their copy to the GPU has completed): the
        loader may reuse them. Optional: an unreleased batch is simply garbage-collected."""
        fn, self.release_fn = self.release_fn, None
        if fn is not None:
            fn()


def block_targets(input_ids_S: np.ndarray, masks: list[np.ndarray], offsets: list[int], num_anchors: int,
                  block_size: int, max_per_doc: int, rng: np.random.Generator, copy_weight: float = 0.0):
    """Anchors and labels of one packed row, padded to exactly `num_anchors` blocks.

    Per document: up to `max_per_doc` anchors (uniform, without replacement; with `copy_weight` > 0 an anchor
    where prompt lookup could copy weighs 1 + copy_weight: anchors.py); over the row: if
    more than `num_anchors` were drawn, `num_anchors` of them uniformly, kept in context order.
    Returns (anchor_index_N, labels_NB, block_doc_N, block_valid_N, anchors_available).
    """
    anchors, labels, block_doc, available = [], [], [], 0
    for j, (mask, o) in enumerate(zip(masks, offsets)):
        doc = input_ids_S[o:o + len(mask)]
        a = sample_anchors(mask, max_per_doc, rng, 1.0 + copy_weight * copyable(doc) if copy_weight > 0 else None)
        available += a.size
        anchors.append(a + o)
        labels.append(block_labels(doc, mask, a, block_size))
        block_doc.append(np.full(a.size, j, np.int32))
    anchor_index = np.concatenate(anchors) if anchors else np.zeros(0, np.int64)
    lab = np.concatenate(labels) if labels else np.zeros((0, block_size), np.int64)
    bdoc = np.concatenate(block_doc) if block_doc else np.zeros(0, np.int32)
    if anchor_index.size > num_anchors:
        keep = np.sort(rng.choice(anchor_index.size, size=num_anchors, replace=False))
        anchor_index, lab, bdoc = anchor_index[keep], lab[keep], bdoc[keep]
    n_real, pad = anchor_index.size, num_anchors - anchor_index.size
    anchor_index = np.concatenate([anchor_index, np.zeros(pad, np.int64)])
    lab = np.concatenate([lab, np.full((pad, block_size), IGNORE, np.int64)])
    bdoc = np.concatenate([bdoc, np.full(pad, -1, np.int32)])
    return anchor_index, lab, bdoc, np.arange(num_anchors) < n_real, available


class BatchLoader:
    def __init__(self, index: CacheIndex, *, rank: int, world: int, seed: int, context_tokens: int,
                 num_anchors: int, max_anchors_per_doc: int, block_size: int, shuffle_rows: int,
                 workers: int, want_topk: bool, pin_memory: bool, follow_poll_s: float = 2.0, prefetch: int = 3,
                 read_ahead: int = -1, copy_anchor_weight: float = 0.0, follow_timeout_s: float = 0.0):
        self.index = index
        self.timeout_s = follow_timeout_s  # follow mode: give up when no new shard came for this long (0 = never)
        self.copy_weight = copy_anchor_weight     # anchors.py: extra weight of anchors prompt lookup could copy
        self.rank, self.world, self.seed = rank, world, seed
        self.S, self.N, self.B = context_tokens, num_anchors, block_size
        self.max_per_doc = max_anchors_per_doc
        self.shuffle_rows = shuffle_rows
        self.want_topk = want_topk and index.features.get("topk", 0) > 0
        self.pin = pin_memory
        self.poll_s = follow_poll_s
        self.prefetch = max(1, prefetch)
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="dflash-decode")
        # `prefetch` batches are assembled at once (each batch's rng is derived from its step, so the
        # result does not depend on the order): a batch of a few long documents alone would keep only
        # a few decode workers busy
        self.producer = ThreadPoolExecutor(max_workers=self.prefetch, thread_name_prefix="dflash-batch")
        self._stat_lock = threading.Lock()
        self.rg_cache = RowGroupCache(index)
        # the row groups of the next `read_ahead` batches are read on their own threads while the decode
        # workers work: ranged GETs on object storage; on local disk the read is memory-mapped but a row
        # group's decompression and page checksums still cost ~0.1 s per 64 MiB, which the first batch that
        # needs it (and every decode worker waiting on that batch) would otherwise sit through
        self.read_ahead = auto_read_ahead(read_ahead, index.fs.is_local)
        self.fetcher = (ThreadPoolExecutor(max_workers=max(2, workers), thread_name_prefix="dflash-fetch")
                        if self.read_ahead else None)
        self.codec = index.features["codec"]
        self.width = index.features["width"]
        self.num_layers = index.features["num_layers"]
        self.decode_s = 0.0
        self.plane_pool = PlanePool(planes_shape(self.codec, self.width, self.S), torch.uint8, pin_memory)
        self.scale_pool = PlanePool((self.S, self.num_layers), torch.float32, pin_memory) if self.codec == FP8 else None
        self.schedule_fn = None  # window mode: round -> EpochSchedule (train/window_run.py)
        self.carry = None  # window mode: a RoundCarry reading the next round ahead (train/round_carry.py)

    # ------------------------------------------------------------------ schedule
    def schedule(self, epoch: int, follow_first_epoch: bool) -> EpochSchedule:
        if self.schedule_fn is not None:
            return self.schedule_fn(epoch)
        final = self.index.refresh()
        return build_epoch_schedule(self.index.lengths, self.world, self.seed, epoch, self.S, self.shuffle_rows,
                                    follow_first_epoch=follow_first_epoch, final=final)

    def wait_for_step(self, epoch: int, step: int, follow_first_epoch: bool) -> EpochSchedule | None:
        """Schedule that contains `step`, waiting for extraction in follow mode; None = epoch over. Gives up
        (exit 4) once no new shard was committed for `timeout_s` while waiting: the extractor seems gone."""
        t0 = last = time.monotonic()
        seen, waited = self.index.committed, False
        while True:
            sched = self.schedule(epoch, follow_first_epoch)
            if step < sched.steps:
                if waited:
                    log.info("follow: resumed after waiting %.0fs for shards", time.monotonic() - t0)
                return sched
            if sched.final:
                return None
            now = time.monotonic()
            if self.index.committed > seen:  # the extractor is making progress: the clock restarts
                seen, last = self.index.committed, now
            elif self.timeout_s > 0 and now - last > self.timeout_s:
                raise FollowTimeout(
                    f"follow: no new shard committed in {self.index.cache_dir} for {self.timeout_s:.0f}s and no "
                    f"{MANIFEST_FILE} (seen {seen} of {self.index.spec['num_shards']} shards committed, step "
                    f"{step} of epoch {epoch} needs more): the extractor seems gone; the steps trained are kept "
                    "(checkpointed on the way out)",
                    "resume `dflash-pipe extract` on this cache (rerun it), then rerun this train command with "
                    "--resume auto; or raise --follow-timeout-s")
            if not waited:
                log.info("follow: waiting for extraction (%d of %d shards usable, step %d)", len(self.index.lengths),
                         self.index.spec["num_shards"], step)
            waited = True
            time.sleep(self.poll_s)

    # ------------------------------------------------------------------ batches
    def iterate(self, epoch: int, start_step: int, follow_first_epoch: bool = False):
        """Yield TrainBatch for steps start_step.. of this epoch, `prefetch` batches ahead."""
        pending: deque = deque()
        sched = self.schedule(epoch, follow_first_epoch)
        step = start_step
        if self.carry is not None:  # window mode: batches of this round read ahead during the last one
            pending, step = self.carry.take(epoch, start_step, sched, self.rank)
        ahead, carry_ahead = step, 0  # carry_ahead: a step of the next round (its read-ahead)
        while True:
            while len(pending) < self.prefetch and step < sched.steps:
                pending.append(self.producer.submit(self.assemble, sched.batch(self.rank, step), epoch, step))
                step += 1
            if self.carry is not None and step >= sched.steps:  # the look for the next round starts at once
                self.carry.top_up(epoch + 1, self.prefetch - len(pending) - len(self.carry), self._submit)
                if self.carry.sched is not None:  # and the row groups of its first batches are read early
                    carry_ahead = self._fetch_ahead(self.carry.sched, self.carry.next_step,
                                                    max(carry_ahead, self.carry.next_step))
            ahead = self._fetch_ahead(sched, step, max(ahead, step))
            if not pending:
                if sched.final:
                    return
                sched = self.wait_for_step(epoch, step, follow_first_epoch)
                if sched is None:
                    return
                continue
            yield pending.popleft().result()
            if step >= sched.steps and not sched.final:
                sched = self.schedule(epoch, follow_first_epoch)

    def _submit(self, sched: EpochSchedule, epoch: int, step: int):
        return self.producer.submit(self.assemble, sched.batch(self.rank, step), epoch, step)

    def _fetch_ahead(self, sched: EpochSchedule, step: int, ahead: int) -> int:
        """Prefetch the row groups of steps [ahead, step + read_ahead); returns the new `ahead`. The row-group
        cache grows to hold what the batches in flight and the read-ahead need, so nothing fetched is evicted
        before its batch reads it."""
        if not self.read_ahead:
            return ahead
        end = min(sched.steps, step + self.read_ahead)
        if ahead >= end:
            return ahead
        window = {(d.shard, d.row_group) for s in range(max(0, step - self.prefetch), end)
                  for d in sched.batch(self.rank, s)}
        self.rg_cache.capacity = max(self.rg_cache.capacity, len(window) + 8)
        for s in range(ahead, end):
            for d in sched.batch(self.rank, s):
                self.rg_cache.prefetch(d.shard, d.row_group, self.fetcher)
        return end

    def assemble(self, docs: list[DocRef], epoch: int, step: int) -> TrainBatch:
        """One batch: each decode worker reads its document's row group (cached, deduplicated) and
        decodes the planes straight into the batch buffer; this thread then builds ids and anchors."""
        t0 = time.perf_counter()
        S, N, B = self.S, self.N, self.B
        planes, fresh = self.plane_pool.take()
        scale, fresh_scale = self.scale_pool.take() if self.scale_pool else (None, True)
        input_ids = np.zeros(S, np.int64)
        ctx_doc = np.full(S, -1, np.int32)
        ctx_pos = np.zeros(S, np.int64)
        topk = self.index.features.get("topk", 0)
        tk_ids = np.zeros((S, topk), np.int32) if self.want_topk else None
        tk_lp = np.full((S, topk), -np.inf, np.float16) if self.want_topk else None
        rng = batch_rng(self.seed, epoch, self.rank, step)
        offsets, off = [], 0
        for d in docs:
            offsets.append(off)
            off += d.num_tokens
        if not fresh:  # padding context must be zero (masked keys still enter the attention matmul)
            planes[..., off:] = 0
        if scale is not None and not fresh_scale:
            scale[off:] = 0
        futures = [self.pool.submit(self._decode_doc, d, o, planes, scale, tk_ids, tk_lp)
                   for d, o in zip(docs, offsets)]
        rows = [f.result() for f in futures]  # re-raises a worker's CacheError here
        for j, (row, d, o) in enumerate(zip(rows, docs, offsets)):
            T = d.num_tokens
            input_ids[o:o + T] = row.input_ids[:T].numpy()
            ctx_doc[o:o + T] = j
            ctx_pos[o:o + T] = np.arange(T)
        masks = [row.loss_mask[:d.num_tokens].numpy() for row, d in zip(rows, docs)]
        anchor_index, lab, bdoc, valid, available = block_targets(input_ids, masks, offsets, N, B,
                                                                  self.max_per_doc, rng, self.copy_weight)
        with self._stat_lock:
            self.decode_s += time.perf_counter() - t0
        # pinned (on this producer thread) when the planes are: a copy from pageable memory blocks the step loop's
        # thread until it is done, and these ~12 small tensors were half the host time of the trainer's copies
        t = (lambda a: torch.from_numpy(a).pin_memory()) if self.pin else torch.from_numpy

        def release(planes=planes, scale=scale):
            self.plane_pool.give(planes)
            if scale is not None:
                self.scale_pool.give(scale)

        return TrainBatch(epoch, step, planes, scale, t(input_ids), t(ctx_doc), t(ctx_pos), t(anchor_index),
                          t(bdoc), t(valid), t(lab), t(input_ids[anchor_index]),
                          None if tk_ids is None else t(tk_ids), None if tk_lp is None else t(tk_lp),
                          len(docs), off, available, tuple(r.sample_id for r in rows), release)

    def _decode_doc(self, d: DocRef, offset: int, planes, scale, tk_ids, tk_lp):
        """Read (or reuse) the document's row group, decode its planes into columns [offset, offset+T)."""
        row = self.rg_cache.rows(d.shard, d.row_group)[d.row]
        T = d.num_tokens
        if T == row.num_tokens:
            row.decode_into(planes, scale, offset)
        else:  # document cut to the context budget: decode whole, copy the head
            tmp = torch.empty(planes_shape(self.codec, self.width, row.num_tokens), dtype=torch.uint8)
            tmp_scale = torch.empty(row.num_tokens, self.num_layers) if scale is not None else None
            row.decode_into(tmp, tmp_scale, 0)
            planes[..., offset:offset + T] = tmp[..., :T]
            if scale is not None:
                scale[offset:offset + T] = tmp_scale[:T]
        if tk_ids is not None:
            ids, lps = row.teacher_topk()
            tk_ids[offset:offset + T] = ids[:T].numpy()
            tk_lp[offset:offset + T] = lps[:T].numpy()
        return row

    def forget_shard(self, shard: int) -> None:
        """Window mode: a retired shard is never read again; drop its readers and cached row groups."""
        self.index.forget(shard)
        self.rg_cache.forget(shard)

    def close(self) -> None:
        log.info("loader: %s", self.rg_cache.summary())
        if self.carry is not None:
            self.carry.close()
        self.producer.shutdown(wait=True, cancel_futures=True)
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.fetcher is not None:
            self.fetcher.shutdown(wait=True, cancel_futures=True)
