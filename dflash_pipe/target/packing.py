"""Per-document bookkeeping of one packed row: positions, boundaries and the attention mask.

Several documents share one target forward (batch 1, T = sum(doc_lens)). Full-attention
layers stay exact when (a) RoPE positions restart at 0 in every document and (b) a query
only sees keys of its own document, causally - a block-diagonal causal mask.

transformers (5.17 and 5.24) would *detect* packing from restarting position_ids when no
attention mask is given (masking_utils.find_packed_sequence_indices) and build that mask
itself; we do not rely on the heuristic. The runner always passes the mask explicitly as a
4-D tensor, which `create_causal_mask` returns unchanged in both versions (and which
`create_recurrent_attention_mask` ignores, so linear-attention layers get no mask):
boolean (True = attend) for SDPA, additive float (0 / finfo.min) for eager. A single
document gets no mask, so SDPA takes its plain causal path exactly as a standalone forward.

No host sync: on CUDA, `stage_row` builds every index tensor of a row (positions, document
ids, cu_seqlens, FLA's chunk indices) on the host, in ONE pinned buffer, and sends it with a
single non_blocking copy; the runner keeps the pinned buffer until the next row. A pageable
`.to(device)` is a cudaMemcpy + cudaStreamSynchronize that drains the GPU queue (the H200
profile showed four per batch before this).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import UsageError


@dataclass(frozen=True)
class PackedRow:
    doc_lens: tuple[int, ...]
    total: int
    cu_seqlens_cpu: torch.Tensor       # int64 [n_docs + 1], on the CPU (FLA's host-side copy)

    @property
    def lens_cpu(self) -> torch.Tensor:
        return self.cu_seqlens_cpu[1:] - self.cu_seqlens_cpu[:-1]

    @property
    def num_docs(self) -> int:
        return len(self.doc_lens)

    def spans(self) -> list[tuple[int, int]]:
        c = self.cu_seqlens_cpu.tolist()
        return list(zip(c[:-1], c[1:]))


def make_packed_row(doc_lens: Sequence[int], num_tokens: int) -> PackedRow:
    lens = tuple(int(n) for n in doc_lens)
    if not lens:
        raise UsageError("a packed row needs at least one document (doc_lens is empty)")
    if any(n <= 0 for n in lens):
        raise UsageError(f"document lengths must be positive, got {list(lens)}")
    if sum(lens) != num_tokens:
        raise UsageError(f"doc_lens sum to {sum(lens)} but the row has {num_tokens} tokens",
                         "pass one length per packed document, in order")
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return PackedRow(lens, num_tokens, cu)


# FLA's token chunk for causal_conv1d and chunk_gated_delta_rule (0.6.0 defaults; gdn_packing passes it).
FLA_CHUNK = 64
_ALIGN = 16          # int64 elements (128 B) between the segments of the staged buffer: aligned pointers


def _host_positions(row: PackedRow) -> torch.Tensor:
    return torch.arange(row.total) - torch.repeat_interleave(row.cu_seqlens_cpu[:-1], row.lens_cpu)


def _host_doc_ids(row: PackedRow) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(row.num_docs), row.lens_cpu)


def host_chunk_indices(row: PackedRow, chunk_size: int) -> torch.Tensor:
    """[n_chunks, 2] int64 (document, chunk within the document): FLA's `prepare_chunk_indices`."""
    counts = (row.lens_cpu + chunk_size - 1) // chunk_size
    seg = torch.repeat_interleave(torch.arange(row.num_docs), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return torch.stack([seg, torch.arange(seg.numel()) - first], 1)


@dataclass(frozen=True)
class DeviceRow:
    """A packed row's index tensors on the device: views of one buffer, sent by one non-blocking copy."""
    positions: torch.Tensor                  # [1, T] int64, restarting at 0 in every document
    doc_ids: torch.Tensor                    # [T] int64
    cu_seqlens: torch.Tensor                 # [n_docs + 1] int64
    chunk_indices: torch.Tensor | None       # [n_chunks, 2] int64 for FLA (None unless asked for)
    host: torch.Tensor                       # the host source (pinned on CUDA): keep it until the copy ran


def stage_row(row: PackedRow, device: torch.device, chunk_size: int | None = None) -> DeviceRow:
    """Build the row's index tensors on the host and copy them to `device` without a host sync.

    On CUDA the host buffer is pinned and the copy is non_blocking (stream-ordered, so every
    kernel launched after it sees the data). The caller must keep `DeviceRow.host` alive until
    the copy has run (the runner holds the last row's); the caching host allocator also refuses
    to reuse a pinned block before its copy event completed.
    """
    T = row.total
    parts = [_host_positions(row), _host_doc_ids(row), row.cu_seqlens_cpu]
    if chunk_size:
        parts.append(host_chunk_indices(row, chunk_size).reshape(-1))
    offsets, n = [], 0
    for p in parts:
        offsets.append(n)
        n += -(-p.numel() // _ALIGN) * _ALIGN
    host = torch.empty(n, dtype=torch.int64, pin_memory=device.type == "cuda")
    for off, p in zip(offsets, parts):
        host[off:off + p.numel()].copy_(p)
    dev = host.to(device, non_blocking=True)
    views = [dev[off:off + p.numel()] for off, p in zip(offsets, parts)]
    chunks = views[3].view(-1, 2) if chunk_size else None
    return DeviceRow(views[0].view(1, T), views[1], views[2], chunks, host)


def packed_position_ids(row: PackedRow, device: torch.device) -> torch.Tensor:
    """[1, T] positions restarting at 0 in every document (a blocking copy: tests and references)."""
    return _host_positions(row).unsqueeze(0).to(device)


def document_ids(row: PackedRow, device: torch.device) -> torch.Tensor:
    return _host_doc_ids(row).to(device)


def block_causal_mask(row: PackedRow, device: torch.device, attn_implementation: str,
                      dtype: torch.dtype, doc_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """The 4-D document mask [1, 1, T, T] for `attn_implementation`, or None for one document.

    `doc_ids`: the row's document ids already on `device` (DeviceRow.doc_ids), else copied here.
    """
    if row.num_docs == 1:
        return None
    doc = doc_ids if doc_ids is not None else document_ids(row, device)
    pos = torch.arange(row.total, device=device)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    allowed = allowed[None, None]
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        additive = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    raise UsageError(f"no explicit document mask for attn_implementation '{attn_implementation}'")


def flash_varlen_kwargs(row: PackedRow, device: torch.device, cu_seqlens: torch.Tensor | None = None) -> dict:
    """flash_attention_2 keeps documents apart through cu_seqlens instead of a mask.

    Host-known max lengths (no `.item()`); `cu_seqlens` already on the device (DeviceRow) is cast there.
    """
    cu = cu_seqlens if cu_seqlens is not None else row.cu_seqlens_cpu.to(device)
    cu = cu.to(dtype=torch.int32)
    longest = max(row.doc_lens)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
