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


def packed_position_ids(row: PackedRow, device: torch.device) -> torch.Tensor:
    """[1, T] positions restarting at 0 in every document."""
    starts = torch.repeat_interleave(row.cu_seqlens_cpu[:-1], torch.tensor(row.doc_lens))
    return (torch.arange(row.total) - starts).unsqueeze(0).to(device)


def document_ids(row: PackedRow, device: torch.device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(row.num_docs), torch.tensor(row.doc_lens)).to(device)


def block_causal_mask(row: PackedRow, device: torch.device, attn_implementation: str,
                      dtype: torch.dtype) -> torch.Tensor | None:
    """The 4-D document mask [1, 1, T, T] for `attn_implementation`, or None for one document."""
    if row.num_docs == 1:
        return None
    doc = document_ids(row, device)
    pos = torch.arange(row.total, device=device)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    allowed = allowed[None, None]
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        additive = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    raise UsageError(f"no explicit document mask for attn_implementation '{attn_implementation}'")


def flash_varlen_kwargs(row: PackedRow, device: torch.device) -> dict:
    """flash_attention_2 keeps documents apart through cu_seqlens instead of a mask."""
    cu = row.cu_seqlens_cpu.to(device=device, dtype=torch.int32)
    longest = max(row.doc_lens)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
