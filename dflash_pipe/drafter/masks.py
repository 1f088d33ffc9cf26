"""The DFlash training attention mask (SPEC §5), in the two forms the attention paths need.

Layout of one packed training row:

    KV = [context 0..S-1 | block_0 (B entries) | block_1 | ... | block_{N-1}]      (S + N*B)
    Q  = [block_0 | block_1 | ... | block_{N-1}]                                  (N*B)

A query of block j sees
  * context entry c iff  doc[c] == doc_of_block[j]  and  c < anchor_index[j]  (strictly: the
    anchor token itself enters only through slot 0 of the block input, exactly as at inference,
    where the context holds the verified tokens *before* the new block), and block j is valid;
  * all B entries of its own block (no causal order inside a block);
  * nothing of any other block.
Padding blocks (valid = False) see only their own block, so every query row has at least one
visible key (no all-masked row, hence no NaN in the softmax); they carry no loss. Padding
context entries have doc = -1 and are seen by nobody.

Documents are packed, so `anchor_index` is the anchor's index in the packed context, not its
position inside its document; `doc` keeps blocks from attending to another document's tokens.

The rule depends on the query only through its block index. It is written twice:
  * `_visible(block, kv, ...)`, the rule as stated above (per-entry document gather), evaluated on an
    [N, KV] grid and repeated B times along the rows: the dense SDPA mask and the reference;
  * `_visible_ranges(block, kv, lo, hi, ...)`, the form flex_attention's `mask_mod` uses. Packed
    documents are contiguous runs of the context, so "same document and before the anchor" is the
    interval [start of the block's document, anchor). Two per-block bounds replace the per-entry
    gather and four comparisons; the tests prove both forms equal, and `check_contents` refuses a
    row whose documents are not contiguous.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from ..errors import ValidationError

FLEX_BLOCK_SIZE = 128


def _visible(block_idx, kv_idx, ctx_doc, anchor_index, block_doc, block_valid, ctx_len: int, block_size: int):
    """True where block `block_idx` may attend to KV entry `kv_idx`. Pure tensor ops, no data branching.

    Indices are clamped before every gather: flex evaluates mask_mod on the padded tail of its last
    128-wide tile too, and those indices must not read outside the captured tensors.
    """
    num_blocks = anchor_index.shape[0]
    blk = torch.clamp(block_idx, 0, num_blocks - 1)
    c = torch.clamp(kv_idx, 0, ctx_len - 1)
    doc_c = ctx_doc[c]
    sees_context = ((kv_idx < ctx_len) & (doc_c >= 0) & (doc_c == block_doc[blk])
                    & (kv_idx < anchor_index[blk]) & block_valid[blk])
    own_block = (kv_idx >= ctx_len) & (torch.div(kv_idx - ctx_len, block_size, rounding_mode="floor") == blk)
    return sees_context | own_block


def context_ranges(ctx_doc, anchor_index, block_doc, block_valid) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, the context interval [lo, hi) it sees: its document's first entry up to its anchor.

    Padding blocks get the empty interval [0, 0). Computed on the tensors' device without a host sync.
    Equal to `_visible`'s context part only when every document is one contiguous run (packing).
    """
    ctx_len = ctx_doc.shape[0]
    doc = ctx_doc.to(torch.int64)
    slot = torch.where((doc >= 0) & (doc < ctx_len), doc, ctx_len)  # padding / foreign ids -> spare slot
    first = torch.full((ctx_len + 1,), ctx_len, dtype=torch.int64, device=ctx_doc.device)
    first.scatter_reduce_(0, slot, torch.arange(ctx_len, device=ctx_doc.device), reduce="amin")
    lo = first[block_doc.to(torch.int64).clamp(0, ctx_len)]
    zero = torch.zeros_like(lo)
    valid = block_valid.to(torch.bool)
    return torch.where(valid, lo, zero), torch.where(valid, anchor_index.to(torch.int64), zero)


def _visible_ranges(block_idx, kv_idx, ctx_lo, ctx_hi, ctx_len: int, block_size: int):
    """`_visible` for contiguous documents: context interval [lo, hi) of the block, or its own block."""
    blk = torch.clamp(block_idx, 0, ctx_lo.shape[0] - 1)
    own_start = ctx_len + blk * block_size
    return ((kv_idx >= ctx_lo[blk]) & (kv_idx < ctx_hi[blk])) | ((kv_idx >= own_start) &
                                                                 (kv_idx < own_start + block_size))


def _build_block_mask(ctx_lo, ctx_hi, ctx_len: int, block_size: int, flex_block) -> BlockMask:
    q_len = ctx_lo.shape[0] * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        return _visible_ranges(q_idx // block_size, kv_idx, ctx_lo, ctx_hi, ctx_len, block_size)

    return create_block_mask(mask_mod, None, None, q_len, ctx_len + q_len, device=ctx_lo.device,
                             BLOCK_SIZE=flex_block)


# Building a BlockMask eagerly at the seed's size costs seconds and GBs (SPEC §6); compiled it is
# milliseconds. The mask_mod closure is created *inside* the compiled function, so dynamo guards only
# on the shapes/devices of the two bound tensors and on the ints: one compilation per device and
# (S, N, B), reused for every step with fresh data.
COMPILED_BUILD_BLOCK_MASK = torch.compile(_build_block_mask, dynamic=False)


class AttentionMask:
    """The mask of one packed training row; built once per step and shared by all draft layers.

    ctx_doc_S: int32 [S], document index of each context entry (-1 = padding).
    anchor_index_N: int64 [N], packed context index of each block's anchor.
    block_doc_N: int32 [N], document of each block (ignored for padding blocks).
    block_valid_N: bool [N], False for padding blocks.
    host: the same four tensors on the host (the batch's), when these are on a device: the grouped SDPA path's
    spans come from them without a device sync (grouped.py).
    """

    def __init__(self, ctx_doc_S: torch.Tensor, anchor_index_N: torch.Tensor, block_doc_N: torch.Tensor,
                 block_valid_N: torch.Tensor, block_size: int, host: tuple | None = None):
        for name, t in (("ctx_doc_S", ctx_doc_S), ("anchor_index_N", anchor_index_N),
                        ("block_doc_N", block_doc_N), ("block_valid_N", block_valid_N)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValidationError(f"AttentionMask: {name} must be a 1-D tensor, got "
                                      f"{getattr(t, 'shape', type(t).__name__)}")
        n = anchor_index_N.shape[0]
        if block_doc_N.shape[0] != n or block_valid_N.shape[0] != n:
            raise ValidationError(f"AttentionMask: anchor_index_N, block_doc_N and block_valid_N must have the same "
                                  f"length, got {n}, {block_doc_N.shape[0]}, {block_valid_N.shape[0]}")
        if ctx_doc_S.shape[0] == 0 or n == 0 or block_size < 1:
            raise ValidationError(f"AttentionMask: empty context ({ctx_doc_S.shape[0]}), no blocks ({n}) or "
                                  f"block_size {block_size}")
        self.ctx_doc = ctx_doc_S.to(torch.int32)
        self.anchor_index = anchor_index_N.to(torch.int64)
        self.block_doc = block_doc_N.to(torch.int32)
        self.block_valid = block_valid_N.to(torch.bool)
        self.block_size = int(block_size)
        self.ctx_lo, self.ctx_hi = context_ranges(self.ctx_doc, self.anchor_index, self.block_doc, self.block_valid)
        self._block_mask: BlockMask | None = None
        self._dense: torch.Tensor | None = None
        self._host = host
        self._grouped: dict = {}
        if self.ctx_doc.device.type == "cpu":  # cheap here; on CUDA it would force a sync
            self.check_contents()

    # --- sizes -------------------------------------------------------------------------------
    @property
    def ctx_len(self) -> int:
        return self.ctx_doc.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.anchor_index.shape[0]

    @property
    def q_len(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_len(self) -> int:
        return self.ctx_len + self.q_len

    @property
    def device(self) -> torch.device:
        return self.ctx_doc.device

    def check_contents(self) -> None:
        """Refuse anchors outside the context and valid blocks whose document is padding."""
        valid = self.block_valid
        if valid.any():
            a = self.anchor_index[valid]
            if int(a.min()) < 0 or int(a.max()) >= self.ctx_len:
                raise ValidationError(f"AttentionMask: an anchor index is outside the packed context [0, {self.ctx_len})")
            if int(self.block_doc[valid].min()) < 0:
                raise ValidationError("AttentionMask: a valid block has document -1 (padding)")
            docs_at_anchor = self.ctx_doc[a]
            if not torch.equal(docs_at_anchor, self.block_doc[valid]):
                raise ValidationError("AttentionMask: a block's document differs from the document of its anchor token")
        doc = self.ctx_doc
        real = doc[doc >= 0]
        runs = int((real[1:] != real[:-1]).sum()) + 1 if real.numel() else 0
        if real.numel() and (runs != int(torch.unique(real).numel()) or int(real.max()) >= self.ctx_len):
            raise ValidationError("AttentionMask: the context's documents are not contiguous runs with ids below the "
                                  "context length (packing writes each document as one run)")

    def to(self, device: torch.device | str) -> "AttentionMask":
        host = self._host or ((self.ctx_doc, self.anchor_index, self.block_doc, self.block_valid)
                              if self.device.type == "cpu" else None)
        return AttentionMask(self.ctx_doc.to(device), self.anchor_index.to(device), self.block_doc.to(device),
                             self.block_valid.to(device), self.block_size, host=host)

    # --- the two forms -----------------------------------------------------------------------
    @property
    def mask_mod(self):
        """flex_attention mask_mod(b, h, q_idx, kv_idx) over this row's index tensors."""
        lo, hi, ctx_len, bs = self.ctx_lo, self.ctx_hi, self.ctx_len, self.block_size

        def mask_mod(b, h, q_idx, kv_idx):
            return _visible_ranges(q_idx // bs, kv_idx, lo, hi, ctx_len, bs)

        return mask_mod

    def block_mask(self, compiled: bool | None = None, flex_block: int | tuple = FLEX_BLOCK_SIZE) -> BlockMask:
        """The flex BlockMask (cached). compiled=None: compiled builder on CUDA, eager elsewhere."""
        if self._block_mask is None:
            use_compiled = self.device.type == "cuda" if compiled is None else compiled
            if use_compiled:
                from .attention import reraise_recompile

                with reraise_recompile("building the flex BlockMask"):
                    self._block_mask = COMPILED_BUILD_BLOCK_MASK(self.ctx_lo, self.ctx_hi, self.ctx_len,
                                                                 self.block_size, flex_block)
            else:
                self._block_mask = _build_block_mask(self.ctx_lo, self.ctx_hi, self.ctx_len, self.block_size,
                                                     flex_block)
        return self._block_mask

    def host_ranges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per block (lo, hi, valid) as host arrays: from the host tensors given, else from this mask's tensors
        (a copy to the host: one device sync when they live on a GPU)."""
        if self._host is not None:
            lo, hi = context_ranges(*(torch.as_tensor(t) for t in self._host))
            valid = torch.as_tensor(self._host[3]).to(torch.bool)
        else:
            lo, hi, valid = self.ctx_lo, self.ctx_hi, self.block_valid
        return lo.cpu().numpy(), hi.cpu().numpy(), valid.cpu().numpy()

    def grouped(self, group_blocks: int):
        """The grouped SDPA path's key layout (grouped.py), cached per group size and shared by all layers."""
        if group_blocks not in self._grouped:
            from .grouped import layout_for

            self._grouped[group_blocks] = layout_for(self, group_blocks)
        return self._grouped[group_blocks]

    def dense_bool(self) -> torch.Tensor:
        """[Q, KV] bool, True = may attend (SDPA convention). Built per block, then repeated B times."""
        if self._dense is None:
            blocks = torch.arange(self.num_blocks, device=self.device)[:, None]
            kv = torch.arange(self.kv_len, device=self.device)[None, :]
            per_block = _visible(blocks, kv, self.ctx_doc, self.anchor_index, self.block_doc, self.block_valid,
                                 self.ctx_len, self.block_size)
            self._dense = per_block.repeat_interleave(self.block_size, dim=0)
        return self._dense


def block_positions(ctx_positions_S: torch.Tensor, anchor_index_N: torch.Tensor, block_size: int) -> torch.Tensor:
    """RoPE positions of the block tokens: doc-relative anchor position + 0..B-1, flattened to [N*B]."""
    anchor_pos = ctx_positions_S.to(torch.int64)[anchor_index_N.clamp(0, ctx_positions_S.shape[0] - 1)]
    offsets = torch.arange(block_size, device=anchor_pos.device, dtype=torch.int64)
    return (anchor_pos[:, None] + offsets[None, :]).reshape(-1)
