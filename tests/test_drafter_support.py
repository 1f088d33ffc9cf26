"""Shared builders for the drafter tests: a tiny config and random packed training rows.

The builders are written from the SPEC's wording, not from dflash_pipe code, so they can serve as
independent inputs; the one test here checks that a generated row obeys the packing invariants
the other tests rely on (anchors inside their document, padding where asked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_pipe.drafter.config import DrafterModelConfig


def tiny_config(**over) -> DrafterModelConfig:
    base = dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0, block_size=4, mask_token_id=63,
                target_layer_ids=[0, 2, 3], num_target_layers=5, vocab_size=64, attention="sdpa")
    base.update(over)
    return DrafterModelConfig(**base)


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> None:
    """Weights large enough that attention is far from uniform (mask mistakes then show up)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g, dtype=torch.float64))


@dataclass
class PackedRow:
    doc_lens: list[int]
    pad_ctx: int
    ctx_doc: torch.Tensor        # int32 [S]
    ctx_pos: torch.Tensor        # int64 [S]
    input_ids: torch.Tensor      # int64 [S]
    anchor_index: torch.Tensor   # int64 [N]
    block_doc: torch.Tensor      # int32 [N]
    block_valid: torch.Tensor    # bool [N]
    block_size: int

    @property
    def S(self) -> int:
        return self.ctx_doc.shape[0]

    @property
    def N(self) -> int:
        return self.anchor_index.shape[0]

    def labels(self) -> torch.Tensor:
        """[N, B]: input_ids[anchor + k] when anchor + k is in the same document, else -100; slot 0 -100."""
        out = torch.full((self.N, self.block_size), -100, dtype=torch.int64)
        for j in range(self.N):
            if not bool(self.block_valid[j]):
                continue
            a = int(self.anchor_index[j])
            for k in range(1, self.block_size):
                t = a + k
                if t < self.S and int(self.ctx_doc[t]) == int(self.block_doc[j]):
                    out[j, k] = int(self.input_ids[t])
        return out

    def block_pos(self) -> torch.Tensor:
        out = []
        for j in range(self.N):
            a = int(self.anchor_index[j])
            out += [int(self.ctx_pos[a]) + k for k in range(self.block_size)]
        return torch.tensor(out, dtype=torch.int64)


def random_packed_row(seed: int, doc_lens=(9, 14, 6), pad_ctx: int = 5, blocks_per_doc: int = 3,
                      pad_blocks: int = 2, block_size: int = 4, vocab: int = 64) -> PackedRow:
    """Documents packed back to back, then padding. Anchors include each document's first and last
    token (edges of the mask rule) plus random ones; `pad_blocks` padding blocks at the end."""
    g = torch.Generator().manual_seed(seed)
    ctx_doc, ctx_pos, anchors, bdoc = [], [], [], []
    start = 0
    for d, n in enumerate(doc_lens):
        ctx_doc += [d] * n
        ctx_pos += list(range(n))
        chosen = {0, n - 1}
        while len(chosen) < min(n, blocks_per_doc):
            chosen.add(int(torch.randint(0, n, (1,), generator=g)))
        for t in sorted(chosen):
            anchors.append(start + t)
            bdoc.append(d)
        start += n
    ctx_doc += [-1] * pad_ctx
    ctx_pos += [0] * pad_ctx
    valid = [True] * len(anchors) + [False] * pad_blocks
    anchors += [0] * pad_blocks
    bdoc += [0] * pad_blocks
    s = len(ctx_doc)
    return PackedRow(list(doc_lens), pad_ctx, torch.tensor(ctx_doc, dtype=torch.int32),
                     torch.tensor(ctx_pos, dtype=torch.int64), torch.randint(0, vocab, (s,), generator=g),
                     torch.tensor(anchors, dtype=torch.int64), torch.tensor(bdoc, dtype=torch.int32),
                     torch.tensor(valid), block_size)


def test_packed_row_invariants():
    row = random_packed_row(3)
    assert row.S == sum(row.doc_lens) + row.pad_ctx
    assert int((row.ctx_doc == -1).sum()) == row.pad_ctx
    for j in range(row.N):
        if bool(row.block_valid[j]):
            assert int(row.ctx_doc[row.anchor_index[j]]) == int(row.block_doc[j])
    assert int((~row.block_valid).sum()) == 2
    # every document contributes an anchor at its first token (position 0)
    firsts = {int(row.block_doc[j]) for j in range(row.N) if row.block_valid[j] and row.ctx_pos[row.anchor_index[j]] == 0}
    assert firsts == set(range(len(row.doc_lens)))
