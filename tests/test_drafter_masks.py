"""The attention mask equals a dense reference built with plain loops from the SPEC §5 rule."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.drafter.masks import AttentionMask, _visible, _visible_ranges, block_positions
from dflash_pipe.errors import ValidationError
from tests.test_drafter_support import random_packed_row


def loop_reference(row) -> torch.Tensor:
    """[N*B, S+N*B] from the rule, one element at a time."""
    S, N, B = row.S, row.N, row.block_size
    ref = torch.zeros(N * B, S + N * B, dtype=torch.bool)
    for j in range(N):
        valid = bool(row.block_valid[j])
        a = int(row.anchor_index[j])
        for r in range(B):
            q = j * B + r
            for c in range(S):
                ref[q, c] = valid and int(row.ctx_doc[c]) != -1 and int(row.ctx_doc[c]) == int(row.block_doc[j]) and c < a
            for kv_block in range(N):
                for e in range(B):
                    ref[q, S + kv_block * B + e] = kv_block == j
    return ref


def make_mask(row) -> AttentionMask:
    return AttentionMask(row.ctx_doc, row.anchor_index, row.block_doc, row.block_valid, row.block_size)


ROWS = [
    dict(seed=0),
    dict(seed=1, doc_lens=(1, 7, 20, 3), pad_ctx=0, blocks_per_doc=4, pad_blocks=0),
    dict(seed=2, doc_lens=(30,), pad_ctx=11, blocks_per_doc=6, pad_blocks=5, block_size=8),
    dict(seed=3, doc_lens=(5, 5, 5, 5, 5), pad_ctx=1, blocks_per_doc=5, pad_blocks=1, block_size=3),
]


@pytest.mark.parametrize("kw", ROWS)
def test_dense_mask_equals_loop_reference(kw):
    row = random_packed_row(**kw)
    dense = make_mask(row).dense_bool()
    ref = loop_reference(row)
    assert dense.dtype == torch.bool and dense.shape == ref.shape
    assert torch.equal(dense, ref)
    assert dense.any(dim=1).all()  # no empty query row, padding blocks included


@pytest.mark.parametrize("kw", ROWS[:2])
def test_mask_mod_equals_loop_reference(kw):
    row = random_packed_row(**kw)
    mod = make_mask(row).mask_mod
    ref = loop_reference(row)
    zero = torch.tensor(0)
    got = torch.zeros_like(ref)
    for q in range(ref.shape[0]):
        for kv in range(ref.shape[1]):
            got[q, kv] = bool(mod(zero, zero, torch.tensor(q), torch.tensor(kv)))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("kw", ROWS)
def test_block_mask_covers_exactly_the_reference_tiles(kw):
    """Eager BlockMask with small tiles: a tile is listed iff it holds a visible entry; 'full' tiles are all-visible."""
    row = random_packed_row(**kw)
    tile = 8
    bm = make_mask(row).block_mask(compiled=False, flex_block=tile)
    ref = loop_reference(row)
    q_tiles, kv_tiles = -(-ref.shape[0] // tile), -(-ref.shape[1] // tile)
    padded = torch.zeros(q_tiles * tile, kv_tiles * tile, dtype=torch.bool)
    padded[: ref.shape[0], : ref.shape[1]] = ref
    tiles = padded.view(q_tiles, tile, kv_tiles, tile)
    any_visible = tiles.any(dim=3).any(dim=1)
    listed = bm.to_dense()[0, 0].bool()
    assert torch.equal(listed[:q_tiles, :kv_tiles], any_visible)
    full_idx, full_num = bm.full_kv_indices[0, 0], bm.full_kv_num_blocks[0, 0]
    for qt in range(q_tiles):
        for i in range(int(full_num[qt])):
            kt = int(full_idx[qt, i])
            q0, k0 = qt * tile, kt * tile
            assert ref[q0:q0 + tile, k0:k0 + tile].all()


def test_block_positions_follow_the_anchor_positions():
    row = random_packed_row(5)
    assert torch.equal(block_positions(row.ctx_pos, row.anchor_index, row.block_size), row.block_pos())


def test_mask_is_sensitive_to_each_part_of_the_rule():
    """Changing one document id, one anchor, or one validity flag changes the mask where the rule says."""
    row = random_packed_row(0)
    base = make_mask(row).dense_bool()
    B, S = row.block_size, row.S
    j = 4  # a valid block with context before it
    assert bool(row.block_valid[j]) and int(row.ctx_pos[row.anchor_index[j]]) > 0
    a = int(row.anchor_index[j])
    moved = row.anchor_index.clone()
    moved[j] = a - 1
    m2 = AttentionMask(row.ctx_doc, moved, row.block_doc, row.block_valid, B).dense_bool()
    diff = (m2 != base).nonzero().tolist()
    assert diff == [[j * B + r, a - 1] for r in range(B)]
    invalid = row.block_valid.clone()
    invalid[j] = False
    m3 = AttentionMask(row.ctx_doc, row.anchor_index, row.block_doc, invalid, B).dense_bool()
    assert not m3[j * B:(j + 1) * B, :S].any() and m3[j * B:(j + 1) * B, S + j * B:S + (j + 1) * B].all()


def test_bad_inputs_are_refused():
    row = random_packed_row(0)
    with pytest.raises(ValidationError, match="same length"):
        AttentionMask(row.ctx_doc, row.anchor_index, row.block_doc[:-1], row.block_valid, 4)
    bad = row.anchor_index.clone()
    bad[0] = row.S + 3
    with pytest.raises(ValidationError, match="outside the packed context"):
        AttentionMask(row.ctx_doc, bad, row.block_doc, row.block_valid, 4)
    wrong_doc = row.block_doc.clone()
    wrong_doc[0] = 2
    with pytest.raises(ValidationError, match="document of its anchor"):
        AttentionMask(row.ctx_doc, row.anchor_index, wrong_doc, row.block_valid, 4)


@pytest.mark.parametrize("kw", ROWS)
def test_interval_form_equals_the_per_entry_rule(kw):
    """flex's mask_mod uses [doc start, anchor) per block; on packed rows it equals the rule as written."""
    row = random_packed_row(**kw)
    m = make_mask(row)
    blocks = torch.arange(m.num_blocks)[:, None]
    kv = torch.arange(m.kv_len)[None, :]
    ranges = _visible_ranges(blocks, kv, m.ctx_lo, m.ctx_hi, m.ctx_len, m.block_size)
    rule = _visible(blocks, kv, m.ctx_doc, m.anchor_index, m.block_doc, m.block_valid, m.ctx_len, m.block_size)
    assert torch.equal(ranges, rule)
    for j in range(m.num_blocks):  # the bounds themselves, by hand
        if bool(row.block_valid[j]):
            doc = int(row.block_doc[j])
            assert int(m.ctx_lo[j]) == (row.ctx_doc == doc).nonzero()[0].item()
            assert int(m.ctx_hi[j]) == int(row.anchor_index[j])
        else:
            assert int(m.ctx_lo[j]) == int(m.ctx_hi[j]) == 0


def test_non_contiguous_documents_are_refused():
    """The interval form needs each document to be one run; a row that interleaves two is refused."""
    doc = torch.tensor([0, 0, 1, 1, 0, 0, -1, -1], dtype=torch.int32)
    anchors, block_doc, valid = torch.tensor([5]), torch.tensor([0], dtype=torch.int32), torch.tensor([True])
    with pytest.raises(ValidationError, match="contiguous"):
        AttentionMask(doc, anchors, block_doc, valid, 2)
    ok = torch.tensor([0, 0, 0, 0, 1, 1, -1, -1], dtype=torch.int32)
    AttentionMask(ok, torch.tensor([3]), block_doc, valid, 2)
