"""Overlap the target forward with device->host copies, compression, Parquet writes and shard commits.

One `HostPipeline` lives for the whole extraction run of a rank (every shard it writes):

    main thread   begin_shard(writer) -> per batch: forward -> encode every document's planes into
                  one device buffer -> one async copy into a staging slot -> submit
                  -> end_shard(finalize) -> next shard's forwards start at once ... -> close()
    worker pool   per document: wait for the batch's copy event -> sanity check -> zstd
    writer thread takes queued items strictly in order: a batch's rows -> ShardWriter.add, then
                  frees the slot; a shard end -> finalize(handle) (commit: footer, fsync, rename;
                  then the sidecar), while the main thread already runs the next shard's forwards

The staging slots (`StagingRing`) are allocated once when the pipeline starts, sized from the
token budget, and reused across shards. The ring bounds the batches in flight: the GPU waits
(`gpu_blocked_s`) only when every slot is taken, i.e. when compression, the disk or a commit is
the slower side; `writer_idle_s` is the writer waiting for compressed rows.

Failures: an exception in a worker, in `ShardWriter.add` or in a finalize callback is recorded by
the writer thread, which then skips all further work (it still frees slots), and is re-raised on
the main thread by the next `begin_shard` / `submit` / `end_shard` / `flush` / `close`. `abort()`
(after any exception, Ctrl-C included) stops the writer thread and then aborts the writer of every
shard whose finalize did not complete: temp files are removed and no sidecar is written, while a
shard that finished committing stays committed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..cache.codec import EncodedHidden
from ..cache.writer import ShardWriter, make_row
from ..faults import fault_point
from .sanity import check_doc
from .staging import Part, StagingRing, pack_batch, view_part

log = logging.getLogger("dflash_pipe.extract")


class PipelineAborted(RuntimeError):
    """Set as the pipeline's failure by `abort()` when nothing else failed first."""


@dataclass
class DocMeta:
    sample_id: str
    doc_index: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]


@dataclass
class PipelineTimers:
    """Per shard. gpu_blocked_s is added by the main thread, compress_s by the workers (under a
    lock), the rest by the writer thread."""

    gpu_blocked_s: float = 0.0  # main thread waiting for a free slot (host side too slow)
    writer_idle_s: float = 0.0  # writer waiting for compressed rows
    compress_s: float = 0.0  # summed over workers
    write_s: float = 0.0
    commit_s: float = 0.0  # the finalize callback (commit + sidecar) on the writer thread
    docs: int = 0
    stats_rows: list = field(default_factory=list)  # (num_tokens, float32 [layers, 3]) per document
    fp8_terms: list = field(default_factory=list)  # float32 [4] per batch (see codec.fp8_error_terms)


@dataclass
class ShardHandle:
    """One shard in the pipeline. `committed` / `result` are set by the writer thread after
    finalize returns; read them only after `flush()` or `close()`."""

    index: int
    writer: ShardWriter
    started: float = field(default_factory=time.perf_counter)
    timers: PipelineTimers = field(default_factory=PipelineTimers)
    committed: bool = False
    result: Any = None


@dataclass
class _Batch:
    shard: ShardHandle
    futures: list
    slot: torch.Tensor
    parts: dict
    event: Any


@dataclass
class _EndShard:
    shard: ShardHandle
    finalize: Callable[[ShardHandle], Any]


@dataclass
class _Flush:
    done: threading.Event


def _settle(fut: Future) -> None:
    """Wait for a job without raising (its error, if any, was or will be reported elsewhere)."""
    try:
        fut.exception()
    except CancelledError:
        pass


class HostPipeline:
    def __init__(self, workers: int, num_slots: int, slot_bytes: int, device: torch.device,
                 layer_ids: list[int], codec: str, sanity: bool = True):
        self.device = device
        self.layer_ids = layer_ids
        self.codec = codec
        self.sanity = sanity
        self.ring = StagingRing(num_slots, slot_bytes, pinned=device.type == "cuda")
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="dflash-compress")
        self.shards: list[ShardHandle] = []  # every shard begun, in order
        self.writer_wait_s = 0.0  # main thread waiting in flush()/close()
        self._current: ShardHandle | None = None
        self._items: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_loop, name="dflash-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ main thread
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def begin_shard(self, writer: ShardWriter, index: int) -> ShardHandle:
        """Route the following submits to `writer`. Registered first, so abort() cleans it up."""
        handle = ShardHandle(index, writer)
        self.shards.append(handle)
        self._current = handle
        self._raise_if_failed()
        return handle

    def submit(self, docs: list[DocMeta], hidden_TD: torch.Tensor, lens: list[int], num_layers: int,
               topk_ids=None, topk_lps=None, stats_NL3=None, fp8_terms=None) -> None:
        """Hand one forward batch over; returns once its copy is queued (blocks if all slots are busy)."""
        self._raise_if_failed()
        shard = self._current
        if shard is None:
            raise RuntimeError("submit() outside begin_shard()/end_shard()")
        t0 = time.perf_counter()
        slot = self.ring.take()
        shard.timers.gpu_blocked_s += time.perf_counter() - t0
        try:
            self._raise_if_failed()
            flat, parts = pack_batch(hidden_TD, lens, self.codec, num_layers, topk_ids, topk_lps, stats_NL3,
                                     fp8_terms)
            slot = self.ring.fit(slot, flat.numel())
            event = self._copy_to_host(flat, slot)
        except BaseException:
            self.ring.give(slot)
            raise
        stats = view_part(slot, parts["stats"]) if "stats" in parts else None
        futures = [self.pool.submit(self._compress, shard, d, i, slot, parts, event, stats, num_layers)
                   for i, d in enumerate(docs)]
        self._items.put(_Batch(shard, futures, slot, parts, event))

    def _copy_to_host(self, flat: torch.Tensor, slot: torch.Tensor):
        """GPU: async copy on the copy stream, returns its event. CPU: a plain copy, no event."""
        n = flat.numel()
        if self.copy_stream is None:
            slot[:n].copy_(flat)
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            slot[:n].copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        flat.record_stream(self.copy_stream)  # the device buffer must outlive the copy
        return event

    def end_shard(self, finalize: Callable[[ShardHandle], Any]) -> None:
        """Queue the shard's end: the writer thread runs `finalize(handle)` after its last row."""
        shard, self._current = self._current, None
        if shard is None:
            raise RuntimeError("end_shard() without begin_shard()")
        self._raise_if_failed()
        self._items.put(_EndShard(shard, finalize))

    def flush(self) -> float:
        """Wait until the writer has done everything queued so far (commits included); re-raise a
        failure. Returns the seconds waited."""
        if not self._thread.is_alive():
            self._raise_if_failed()
            raise RuntimeError("flush() after close()")
        t0 = time.perf_counter()
        done = threading.Event()
        self._items.put(_Flush(done))
        done.wait()
        waited = time.perf_counter() - t0
        self.writer_wait_s += waited
        self._raise_if_failed()
        return waited

    def close(self) -> float:
        """Wait for everything in flight, stop the threads; re-raise the first failure.
        Returns the seconds the main thread waited for the writer."""
        t0 = time.perf_counter()
        self._items.put(None)
        self._thread.join()
        waited = time.perf_counter() - t0
        self.writer_wait_s += waited
        self.pool.shutdown(wait=True)
        self._raise_if_failed()
        return waited

    def abort(self, join_timeout_s: float = 300.0) -> None:
        """Stop everything; abort the writer of every shard whose finalize did not complete."""
        self._error = self._error or PipelineAborted("extraction aborted")
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._items.put(None)
        self._thread.join(timeout=join_timeout_s)
        if self._thread.is_alive():
            log.warning("the writer thread did not stop within %.0fs; removing unfinished shards anyway",
                        join_timeout_s)
        for h in self.shards:
            if not h.committed:
                h.writer.abort()

    # ------------------------------------------------------------------ worker pool
    def _compress(self, shard: ShardHandle, doc: DocMeta, i: int, host, parts: dict[str, Part], event, stats,
                  num_layers: int):
        if event is not None:
            event.synchronize()
        t0 = time.perf_counter()
        T = len(doc.input_ids)
        if stats is not None and self.sanity:
            check_doc(stats[i], doc.sample_id, T, self.layer_ids)
        fault_point("extract.compress")
        planes = view_part(host, parts[f"planes{i}"])
        scale = view_part(host, parts[f"scale{i}"]) if f"scale{i}" in parts else None
        width = planes.shape[-2]
        enc = EncodedHidden(self.codec, T, width, planes, scale)
        tki = view_part(host, parts[f"tki{i}"]) if f"tki{i}" in parts else None
        tkl = view_part(host, parts[f"tkl{i}"]) if f"tkl{i}" in parts else None
        row = make_row(doc.sample_id, doc.doc_index, doc.input_ids, doc.loss_mask, enc, tki, tkl)
        # raw (uncompressed) planes are views into the staging slot: copy them out before it is reused
        row.hidden = {k: (v if isinstance(v, bytes) else v.copy()) for k, v in row.hidden.items()}
        with self._lock:
            shard.timers.compress_s += time.perf_counter() - t0
        return row, (None if stats is None else stats[i].clone())

    # ------------------------------------------------------------------ writer thread
    def _write_loop(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            try:
                if isinstance(item, _Flush):
                    continue
                if self._error is not None:
                    continue  # failed or aborted: skip the work, still free the slots (finally)
                if isinstance(item, _Batch):
                    self._write_batch(item)
                else:
                    self._finish_shard(item)
            except BaseException as exc:  # noqa: BLE001 - surfaced to the main thread
                self._error = self._error or exc
            finally:
                if isinstance(item, _Batch):
                    for fut in item.futures:  # a failed batch: let its other jobs finish before reuse
                        _settle(fut)
                    self.ring.give(item.slot)
                elif isinstance(item, _Flush):
                    item.done.set()

    def _write_batch(self, b: _Batch) -> None:
        timers, writer = b.shard.timers, b.shard.writer
        for fut in b.futures:
            t0 = time.perf_counter()
            row, stats = fut.result()
            t1 = time.perf_counter()
            writer.add(row)
            timers.writer_idle_s += t1 - t0
            timers.write_s += time.perf_counter() - t1
            timers.docs += 1
            if stats is not None:
                timers.stats_rows.append((row.num_tokens, stats))
        if "fp8" in b.parts:
            if b.event is not None:
                b.event.synchronize()
            timers.fp8_terms.append(view_part(b.slot, b.parts["fp8"]).clone())

    def _finish_shard(self, end: _EndShard) -> None:
        t0 = time.perf_counter()
        end.shard.result = end.finalize(end.shard)
        end.shard.timers.commit_s += time.perf_counter() - t0
        end.shard.committed = True
