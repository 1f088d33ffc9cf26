"""Overlap the target forward with device->host copies, compression and Parquet writes.

    main thread   forward(batch k) -> encode every document's planes into one device buffer
                  -> one async copy into a pinned staging slot (ring of `queue_batches` slots)
    worker pool   wait for the copy event -> sanity check -> zstd, one job per document
    writer thread take documents strictly in order -> ShardWriter.add -> free the slot

A slot is a pinned buffer reused for the whole run (pinned allocations are slow and may
synchronise), so the steady state allocates nothing. The semaphore bounds batches in flight:
the GPU waits only when every slot is taken, i.e. when compression or the disk is the slower
side. The time the main thread spends blocked there, against the time the writer spends waiting
for compressed rows, says which side is the bottleneck.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache.codec import EncodedHidden, encode_hidden
from ..cache.writer import ShardWriter, make_row
from ..faults import fault_point
from .sanity import check_doc


@dataclass
class DocMeta:
    sample_id: str
    doc_index: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]


@dataclass
class PipelineTimers:
    gpu_blocked_s: float = 0.0  # main thread waiting for a free slot (host side too slow)
    writer_idle_s: float = 0.0  # writer waiting for compressed rows
    compress_s: float = 0.0  # summed over workers
    write_s: float = 0.0
    docs: int = 0
    stats_rows: list = field(default_factory=list)


@dataclass
class _Part:
    name: str
    offset: int  # bytes into the staging buffer
    shape: tuple
    dtype: torch.dtype


def _pack_batch(hidden_TD, lens, codec, num_layers, topk_ids, topk_lps, stats):
    """All of one batch's outputs as one flat uint8 device buffer + where each piece lives."""
    pieces, parts, off = [], [], 0

    def add(name, t):
        nonlocal off
        flat = t.contiguous().view(torch.uint8).reshape(-1)
        pieces.append(flat)
        parts.append(_Part(name, off, tuple(t.shape), t.dtype))
        off += flat.numel()

    start = 0
    for i, T in enumerate(lens):
        enc = encode_hidden(hidden_TD[start:start + T], codec, num_layers)
        add(f"planes{i}", enc.planes)
        if enc.scale is not None:
            add(f"scale{i}", enc.scale)
        if topk_ids is not None:
            add(f"tki{i}", topk_ids[start:start + T])
            add(f"tkl{i}", topk_lps[start:start + T])
        start += T
    if stats is not None:
        add("stats", stats)
    return torch.cat(pieces), {p.name: p for p in parts}


def _view(buf: torch.Tensor, p: _Part) -> torch.Tensor:
    n = int(np.prod(p.shape)) * torch.empty((), dtype=p.dtype).element_size()
    return buf[p.offset:p.offset + n].view(p.dtype).view(p.shape)


class HostPipeline:
    def __init__(self, writer: ShardWriter, workers: int, max_inflight: int, device: torch.device,
                 layer_ids: list[int], codec: str, sanity: bool = True):
        self.writer = writer
        self.device = device
        self.layer_ids = layer_ids
        self.codec = codec
        self.sanity = sanity
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="dflash-compress")
        self.slots = threading.BoundedSemaphore(max(1, max_inflight))
        self._free: queue.Queue = queue.Queue()
        self._pinned: list[torch.Tensor] = []
        for _ in range(max(1, max_inflight)):
            self._free.put(None)  # slot tokens; buffers are allocated on first use, grown if needed
        self.batches: queue.Queue = queue.Queue()
        self.timers = PipelineTimers()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._write_loop, name="dflash-writer", daemon=True)
        self._thread.start()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _staging(self, nbytes: int) -> torch.Tensor:
        buf = self._free.get()
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(int(nbytes * 1.25), dtype=torch.uint8, pin_memory=True)
        return buf

    def submit(self, docs: list[DocMeta], hidden_TD: torch.Tensor, lens: list[int], num_layers: int,
               topk_ids=None, topk_lps=None, stats_NL3=None) -> None:
        """Hand one forward batch over; returns once its copy is queued (blocks if all slots are busy)."""
        self._raise_if_failed()
        t0 = time.perf_counter()
        self.slots.acquire()
        self.timers.gpu_blocked_s += time.perf_counter() - t0
        flat, parts = _pack_batch(hidden_TD, lens, self.codec, num_layers, topk_ids, topk_lps, stats_NL3)
        event, slot = None, None
        if self.copy_stream is not None:
            slot = self._staging(flat.numel())
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                slot[:flat.numel()].copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            flat.record_stream(self.copy_stream)  # the device buffer must outlive the copy
            host = slot
        else:
            host = flat
        stats = _view(host, parts["stats"]) if "stats" in parts else None
        futures = [self.pool.submit(self._compress, d, i, host, parts, event, stats, num_layers)
                   for i, d in enumerate(docs)]
        self.batches.put((futures, slot))

    def _compress(self, doc: DocMeta, i: int, host, parts, event, stats, num_layers: int):
        if event is not None:
            event.synchronize()
        t0 = time.perf_counter()
        T = len(doc.input_ids)
        if stats is not None and self.sanity:
            check_doc(stats[i], doc.sample_id, T, self.layer_ids)
        fault_point("extract.compress")
        planes = _view(host, parts[f"planes{i}"])
        scale = _view(host, parts[f"scale{i}"]) if f"scale{i}" in parts else None
        width = planes.shape[-2]
        enc = EncodedHidden(self.codec, T, width, planes, scale)
        tki = _view(host, parts[f"tki{i}"]) if f"tki{i}" in parts else None
        tkl = _view(host, parts[f"tkl{i}"]) if f"tkl{i}" in parts else None
        row = make_row(doc.sample_id, doc.doc_index, doc.input_ids, doc.loss_mask, enc, tki, tkl)
        # raw (uncompressed) planes are views into the staging slot: copy them out before it is reused
        row.hidden = {k: (v if isinstance(v, bytes) else v.copy()) for k, v in row.hidden.items()}
        with self._lock:
            self.timers.compress_s += time.perf_counter() - t0
        return row, (None if stats is None else stats[i].clone())

    def _write_loop(self) -> None:
        while True:
            item = self.batches.get()
            if item is None:
                return
            futures, slot = item
            try:
                if self._error is None:
                    for fut in futures:
                        t0 = time.perf_counter()
                        row, stats = fut.result()
                        t1 = time.perf_counter()
                        self.writer.add(row)
                        self.timers.writer_idle_s += t1 - t0
                        self.timers.write_s += time.perf_counter() - t1
                        self.timers.docs += 1
                        if stats is not None:
                            self.timers.stats_rows.append((row.num_tokens, stats))
            except BaseException as exc:  # noqa: BLE001 - surfaced to the main thread
                self._error = exc
            finally:
                for fut in futures:  # a failed batch: let its other jobs finish before reusing the slot
                    fut.exception() if not fut.cancelled() else None
                if self.copy_stream is not None:
                    self._free.put(slot)
                self.slots.release()

    def close(self) -> PipelineTimers:
        """Wait for everything in flight; re-raise the first failure."""
        self.batches.put(None)
        self._thread.join()
        self.pool.shutdown(wait=True)
        self._raise_if_failed()
        return self.timers

    def abort(self) -> None:
        self._error = self._error or RuntimeError("aborted")
        self.batches.put(None)
        self._thread.join(timeout=60)
        self.pool.shutdown(wait=False, cancel_futures=True)
