"""Small host-to-device copies without a host sync and without per-copy pinning: regenerate's launch path.

Between two launches regenerate uploads a few small int64 tensors per prefill call (the prompts' tokens in
chunks, their rows, their sampling keys, the rows to reset). Each upload used to build the tensor with
`torch.tensor(list)` (~0.3 ms for 8 k ints on the CPU box) and pin it with `pin_memory()` (0.46 ms a call under
cProfile on the H100's host), and that host time sits between the previous launch's last queued step and the next
launch's first kernel, where the device has at most a step of work left.

`host_long(values)` builds the tensor from an `array('q')` buffer (4-10x faster than `torch.tensor` on a list).
`PinnedRing` keeps a few pinned host blocks and reuses them round-robin: a copy goes block -> device with
`non_blocking=True`, and an event recorded after it marks when the block may be written again. A block is
written only after its previous copy's event has completed (`Event.synchronize`, which with RING_SLOTS blocks
and a handful of uploads per launch has completed long before), so a queued copy never reads bytes of a later
upload. The copies and the events go to the caller's current stream.
"""

from __future__ import annotations

import threading
from array import array

import torch

RING_SLOTS = 16                   # pinned blocks; a block is reused after RING_SLOTS - 1 other uploads
MIN_BLOCK_BYTES = 1 << 16         # a block's first size; grown (re-pinned) when an upload needs more
USE_RING = True                   # False: pin each upload on its own (torch's caching host allocator); bench A/B


def host_long(values) -> torch.Tensor:
    """A host int64 tensor of a list / tuple / range of ints (a tensor: as it is, made int64). Through an
    `array('q')` buffer, which is several times faster than `torch.tensor(list)`; the same values."""
    if isinstance(values, torch.Tensor):
        return values.long()
    try:
        buf = array("q", values)
    except (TypeError, OverflowError):
        return torch.tensor(values, dtype=torch.long)   # the exact error torch gives for such values
    if len(buf) == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(buf, dtype=torch.long)       # shares `buf`, which the tensor keeps alive


class PinnedRing:
    """RING_SLOTS pinned host blocks for small asynchronous uploads (module docstring)."""

    def __init__(self, slots: int = RING_SLOTS, min_bytes: int = MIN_BLOCK_BYTES) -> None:
        self.blocks: list[torch.Tensor | None] = [None] * slots
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.min_bytes = min_bytes
        self.next = 0
        self.waits = 0                         # uploads that found their block's previous copy still queued
        self._lock = threading.Lock()

    def upload(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`t` (a host tensor) on the CUDA `device`, copied asynchronously on the current stream."""
        if torch.cuda.is_current_stream_capturing():
            # a captured copy would read the block at every replay, long after later uploads rewrote it
            raise RuntimeError("host-to-device upload during CUDA graph capture: copy into a static input instead")
        src = t.contiguous().reshape(-1)
        nbytes = src.numel() * src.element_size()
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        if nbytes == 0:
            return out
        with self._lock:
            i = self.next
            self.next = (i + 1) % len(self.blocks)
            ev = self.events[i]
            if ev is not None and not ev.query():
                self.waits += 1
                ev.synchronize()               # the block's previous copy has not run yet
            blk = self.blocks[i]
            if blk is None or blk.numel() < nbytes:
                blk = self.blocks[i] = torch.empty(max(nbytes, self.min_bytes, 2 * (0 if blk is None else
                                                                                   blk.numel())),
                                                   dtype=torch.uint8, pin_memory=True)
            staged = blk[:nbytes].view(src.dtype)
            staged.copy_(src)
            out.view(-1).copy_(staged, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.events[i] = ev
        return out


_RING = PinnedRing()


def upload(x, device: torch.device) -> torch.Tensor:
    """A host list / tensor on `device` without a host sync (`runner_utils.to_device`): on CUDA through a
    reused pinned block and an async copy (module docstring); elsewhere a plain `.to`."""
    t = host_long(x) if not isinstance(x, torch.Tensor) else x
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    if not USE_RING:
        return t.pin_memory().to(device, non_blocking=True)
    return _RING.upload(t, device)
