"""Overlap the target forward with device->host copies, compression and Parquet writes.

    main thread   forward(batch k) -> encode planes on the GPU -> async copy into pinned memory
    worker pool   wait for the copy event -> sanity check -> zstd compress, one job per document
    writer thread take documents strictly in order -> ShardWriter.add

A semaphore bounds the batches in flight (`queue_batches`). The GPU waits only when every slot
is taken, i.e. when compression or the disk is the slower side; the time the main thread spends
blocked there, against the time the writer spends waiting for compressed rows, says which side
is the bottleneck.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..cache.codec import EncodedHidden
from ..cache.writer import ShardWriter, make_row
from ..faults import fault_point
from .sanity import check_doc


@dataclass
class DocJob:
    sample_id: str
    doc_index: int
    input_ids: object  # np.int32 [T]
    loss_mask: object  # np.uint8 [T]
    hidden: EncodedHidden
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None


@dataclass
class PipelineTimers:
    gpu_blocked_s: float = 0.0  # main thread waiting for a free slot (host side too slow)
    writer_idle_s: float = 0.0  # writer waiting for compressed rows
    compress_s: float = 0.0  # summed over workers
    write_s: float = 0.0
    docs: int = 0
    stats_rows: list = field(default_factory=list)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class HostPipeline:
    def __init__(self, writer: ShardWriter, workers: int, max_inflight: int, device: torch.device,
                 layer_ids: list[int], sanity: bool = True):
        self.writer = writer
        self.device = device
        self.layer_ids = layer_ids
        self.sanity = sanity
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="dflash-compress")
        self.slots = threading.BoundedSemaphore(max(1, max_inflight))
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

    def submit(self, jobs: list[DocJob], stats_NL3: torch.Tensor | None) -> None:
        """Hand one forward batch over; returns once its copies are queued (blocks if all slots are busy)."""
        self._raise_if_failed()
        t0 = time.perf_counter()
        self.slots.acquire()
        self.timers.gpu_blocked_s += time.perf_counter() - t0
        event = None
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                host_jobs = [self._job_to_host(j) for j in jobs]
                host_stats = _to_host(stats_NL3)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            # the device tensors must outlive the copies: tie them to the copy stream
            for j in jobs:
                for t in (j.hidden.planes, j.hidden.scale, j.topk_ids, j.topk_logprobs):
                    if t is not None:
                        t.record_stream(self.copy_stream)
        else:
            host_jobs, host_stats = jobs, stats_NL3
        futures = [self.pool.submit(self._compress, job, event, host_stats, i) for i, job in enumerate(host_jobs)]
        self.batches.put(futures)

    @staticmethod
    def _job_to_host(j: DocJob) -> DocJob:
        h = j.hidden
        return DocJob(j.sample_id, j.doc_index, j.input_ids, j.loss_mask,
                      EncodedHidden(h.codec, h.num_tokens, h.width, _to_host(h.planes), _to_host(h.scale)),
                      _to_host(j.topk_ids), _to_host(j.topk_logprobs))

    def _compress(self, job: DocJob, event, stats_NL3, i: int):
        if event is not None:
            event.synchronize()
        t0 = time.perf_counter()
        if stats_NL3 is not None:
            if self.sanity:
                check_doc(stats_NL3[i], job.sample_id, job.hidden.num_tokens, self.layer_ids)
        fault_point("extract.compress")
        row = make_row(job.sample_id, job.doc_index, job.input_ids, job.loss_mask, job.hidden,
                       job.topk_ids, job.topk_logprobs)
        with self._lock:
            self.timers.compress_s += time.perf_counter() - t0
        return row, (None if stats_NL3 is None else stats_NL3[i])

    def _write_loop(self) -> None:
        while True:
            futures = self.batches.get()
            if futures is None:
                return
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
