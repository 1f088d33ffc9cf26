"""The static-KV engine's cache rows: preallocated K/V, one length per row, and the row operations (roll back,
empty, move, copy between engines). `StaticKVEngine` (static_forward.py) computes on them.

K/V buffers are ``[layers, rows, kv_heads, max_len + 1, head_dim]`` (the + 1 is a spare slot that writes past
max_len land in). Lengths live on the device; `_bound` is the host's upper bound of each row's length, so
choosing an attended length never syncs. With ``scratch_row`` one extra row past ``max_batch`` takes the writes of
a bucketed prefill's padding rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import UsageError
from .runner_utils import to_device


class KVRows:
    """The cache rows of an engine (module docstring)."""

    def __init__(self, layers: int, max_batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, kv_bucket: int, scratch_row: bool = False):
        self.max_batch, self.max_len, self.kv_bucket = max_batch, max_len, kv_bucket
        self.device, self.dtype = device, dtype
        self.size = max_len + 1                          # + one spare slot for writes past max_len
        self.scratch_row = max_batch if scratch_row else None   # where padding rows of a prefill write
        n_rows = max_batch + bool(scratch_row)
        shape = (layers, n_rows, kv_heads, self.size, head_dim)
        with torch.inference_mode():
            self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            self.lengths = torch.zeros(n_rows, dtype=torch.long, device=device)
        self._bound = [0] * n_rows                       # host upper bound of each row's length

    def cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @torch.inference_mode()
    def truncate(self, row: int, new_len: int) -> None:
        """Keep the first `new_len` tokens of `row` (roll back a verify); only shrinks."""
        if not 0 <= new_len <= self.max_len:
            raise UsageError(f"truncate: length {new_len} outside 0..{self.max_len}")
        self.lengths[row].fill_(new_len)
        self._bound[row] = new_len

    @torch.inference_mode()
    def reset(self, rows: Sequence[int] | None = None) -> None:
        """Empty `rows` (all rows when None)."""
        rows = range(self.max_batch) if rows is None else rows
        idx = list(rows)
        if not idx:
            return
        self.lengths.index_fill_(0, to_device(idx, self.device), 0)   # no host sync
        for r in idx:
            self._bound[r] = 0

    @torch.inference_mode()
    def move_rows(self, src: Sequence[int], dst: Sequence[int], chunk: int = 64) -> None:
        """Move rows `src` (K/V, lengths) to the empty rows `dst`, then empty `src` (no host sync)."""
        for i in range(0, len(src), chunk):
            s = to_device(list(src[i:i + chunk]), self.device)
            d = to_device(list(dst[i:i + chunk]), self.device)
            self.k_cache[:, d] = self.k_cache[:, s]
            self.v_cache[:, d] = self.v_cache[:, s]
            self.lengths[d] = self.lengths[s]
        for a, b in zip(src, dst):
            self._bound[b] = self._bound[a]
        self.reset(src)

    @torch.inference_mode()
    def copy_rows_from(self, other: KVRows, src: Sequence[int], dst: Sequence[int], width: int) -> None:
        """Rows `src` of `other` (an engine over the same layers) into rows `dst` of this one: the K/V of their
        first `width` positions (at least their lengths) and their lengths (no host sync; regenerate's staged
        prefills, regen_staging.py)."""
        if (other.k_cache.shape[0], other.k_cache.shape[2], other.k_cache.shape[4], other.dtype) != (
                self.k_cache.shape[0], self.k_cache.shape[2], self.k_cache.shape[4], self.dtype):
            raise UsageError("copy_rows_from: the engines' caches differ in layers, KV heads, head size or dtype")
        if len(src) != len(dst) or any(not 0 <= r < self.max_batch for r in dst):
            raise UsageError(f"copy_rows_from: {len(src)} rows into rows {list(dst)[:8]}... of a "
                             f"{self.max_batch}-row cache")
        w = min(width, self.size, other.size)
        s, d = to_device(list(src), self.device), to_device(list(dst), self.device)
        self.k_cache[:, d, :, :w] = other.k_cache[:, s, :, :w]
        self.v_cache[:, d, :, :w] = other.v_cache[:, s, :, :w]
        self.lengths[d] = other.lengths[s]
        for a, b in zip(src, dst):
            self._bound[b] = other._bound[a]

    def widen_bounds(self, n: int) -> None:
        """Rows 0..n-1 may have grown by any amount (a step the caller captured in its own CUDA graph): their host
        bounds go to max_len."""
        self._bound[:n] = [self.max_len] * n

    def length(self, row: int) -> int:
        """The row's length (a host sync; for tests and debugging)."""
        return int(self.lengths[row])

    def attended_length(self, rows: Sequence[int], T: int) -> int:
        need = max(self._bound[r] for r in rows) + T
        return min(self.size, -(-need // self.kv_bucket) * self.kv_bucket)
