"""Staging of one forward batch: device-side packing and the ring of host slots it is copied into.

`pack_batch` turns a batch's outputs (every document's encoded planes, top-k, sanity stats, fp8
error terms) into one flat uint8 device buffer, so that the batch crosses to the host in a single
copy. `StagingRing` holds the host buffers ("slots") those copies land in. The slots are allocated
once, up front, at the size of the largest batch the token budget allows (`max_batch_bytes`):
pinned allocations are slow and may synchronise the device, so a run of any number of shards
allocates nothing after start-up. A batch that still does not fit (a budget estimate that was
wrong) grows its slot once, as a fallback, and `grown` counts it.

Threading: `take` (main thread) blocks while every slot is in flight, which is what bounds the
batches queued for compression; `give` is called by the writer thread once a batch's rows are out.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import numpy as np
import torch

from ..cache.codec import FP8, LOSSLESS, encode_hidden

ALIGN = 8  # every piece starts on an 8-byte boundary, so any dtype view of it is legal


@dataclass
class Part:
    name: str
    offset: int  # bytes into the flat buffer
    shape: tuple
    dtype: torch.dtype


def pack_batch(hidden_TD, lens, codec, num_layers, topk_ids=None, topk_lps=None, stats=None, fp8_terms=None):
    """All of one batch's outputs as one flat uint8 buffer on their device + where each piece lives."""
    pieces, parts, off = [], [], 0

    def add(name, t):
        nonlocal off
        if off % ALIGN:
            pad = ALIGN - off % ALIGN
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
            off += pad
        flat = t.contiguous().view(torch.uint8).reshape(-1)
        pieces.append(flat)
        parts.append(Part(name, off, tuple(t.shape), t.dtype))
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
    if fp8_terms is not None:
        add("fp8", fp8_terms)
    return torch.cat(pieces), {p.name: p for p in parts}


def view_part(buf: torch.Tensor, p: Part) -> torch.Tensor:
    n = int(np.prod(p.shape)) * torch.empty((), dtype=p.dtype).element_size()
    return buf[p.offset:p.offset + n].view(p.dtype).view(p.shape)


def max_batch_bytes(token_budget: int, width: int, num_layers: int, codec: str, topk: int) -> int:
    """Upper bound of `pack_batch`'s output for a batch of at most `token_budget` tokens.

    Features (lossless: 2 bytes per value; fp8: 1 byte + a float32 scale per token and layer),
    top-k (int32 id + fp16 log-prob per token and k), sanity stats (float32 [docs, layers, 3],
    docs <= tokens), the fp8 error terms, and the alignment padding (<= 4 pieces per document).
    """
    T = token_budget
    if codec == LOSSLESS:
        feats = T * width * 2
    elif codec == FP8:
        feats = T * width + T * num_layers * 4
    else:
        raise ValueError(f"unknown codec {codec!r}")
    return feats + T * topk * 6 + T * num_layers * 12 + 16 + ALIGN * (4 * T + 2)


def alloc_slot(nbytes: int, pinned: bool) -> torch.Tensor:
    """One host staging buffer (module-level so tests can count allocations)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


class StagingRing:
    """A fixed set of host buffers, handed out one per batch in flight (see the module docstring)."""

    def __init__(self, num_slots: int, slot_bytes: int, pinned: bool):
        self.pinned = pinned
        self.allocations = 0
        self.grown = 0
        self._free: queue.Queue = queue.Queue()
        for _ in range(max(1, num_slots)):
            self._free.put(self._alloc(slot_bytes))

    def _alloc(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        return alloc_slot(max(1, int(nbytes)), self.pinned)

    def take(self) -> torch.Tensor:
        """A free slot; blocks while all are in flight."""
        return self._free.get()

    def fit(self, slot: torch.Tensor, nbytes: int) -> torch.Tensor:
        """`slot` if it holds `nbytes`, else a larger replacement (the fallback; main thread only)."""
        if slot.numel() >= nbytes:
            return slot
        self.grown += 1
        return self._alloc(nbytes * 1.25)

    def give(self, slot: torch.Tensor) -> None:
        self._free.put(slot)
