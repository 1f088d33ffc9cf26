"""Both attention paths compute the same masked GQA attention; the recompile lock raises."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_pipe.drafter.attention import (attend, compilation_locked, compilation_unlocked, lock_compilation,
                                           reraise_recompile, unlock_compilation)
from dflash_pipe.drafter.masks import AttentionMask
from dflash_pipe.errors import RuntimeFailure, UsageError
from tests.test_drafter_masks import loop_reference
from tests.test_drafter_support import random_packed_row


def naive_attention(q, k, v, allowed):
    """float64 reference: per (head, query row) softmax over the allowed keys, GQA by head // group."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    out = torch.zeros_like(q)
    d = q.shape[-1]
    for h in range(hq):
        kh, vh = k[0, h // group], v[0, h // group]
        for i in range(q.shape[2]):
            keys = allowed[i].nonzero()[:, 0]
            scores = (kh[keys] @ q[0, h, i]) / math.sqrt(d)
            p = torch.exp(scores - scores.max())
            p = p / p.sum()
            out[0, h, i] = p @ vh[keys]
    return out


def qkv(row, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_len, kv_len = row.N * row.block_size, row.S + row.N * row.block_size
    mk = lambda *s: (2.0 * torch.randn(*s, generator=g, dtype=torch.float64)).to(dtype)
    return mk(1, hq, q_len, d), mk(1, hkv, kv_len, d), mk(1, hkv, kv_len, d)


def mask_of(row):
    return AttentionMask(row.ctx_doc, row.anchor_index, row.block_doc, row.block_valid, row.block_size)


def test_sdpa_forward_and_backward_equal_float64_reference():
    row = random_packed_row(1, doc_lens=(6, 11, 4), pad_ctx=3, blocks_per_doc=3, pad_blocks=2)
    q, k, v = qkv(row)
    allowed = loop_reference(row)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, mask_of(row), "sdpa")
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = naive_attention(*ref_leaves, allowed)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_leaves)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_flex_forward_equals_sdpa_forward_on_cpu(dtype, tol):
    row = random_packed_row(2, doc_lens=(13, 5, 17), pad_ctx=4, blocks_per_doc=4, pad_blocks=3)
    q, k, v = qkv(row, hq=6, hkv=2, d=16, dtype=dtype, seed=3)
    mask = mask_of(row)
    flex = attend(q, k, v, mask, "flex", flex_compiled=False, flex_dtype=None)
    sdpa = attend(q, k, v, mask, "sdpa")
    assert flex.dtype == dtype
    torch.testing.assert_close(flex, sdpa, rtol=tol, atol=tol)
    # and it is not trivially equal: a different mask gives a different output
    other = AttentionMask(row.ctx_doc, row.anchor_index, row.block_doc, torch.zeros_like(row.block_valid),
                          row.block_size)
    assert not torch.allclose(attend(q, k, v, other, "sdpa"), sdpa, atol=1e-3)


def test_padding_blocks_attend_only_to_themselves():
    row = random_packed_row(4, pad_blocks=2)
    q, k, v = qkv(row)
    out = attend(q, k, v, mask_of(row), "sdpa")
    assert torch.isfinite(out).all()
    B, S = row.block_size, row.S
    j = row.N - 1
    own = torch.zeros(q.shape[2], k.shape[2], dtype=torch.bool)
    own[:, S + j * B:S + (j + 1) * B] = True
    ref = naive_attention(q, k, v, own)
    torch.testing.assert_close(out[:, :, j * B:(j + 1) * B], ref[:, :, j * B:(j + 1) * B])


def test_shape_and_path_errors():
    row = random_packed_row(0)
    q, k, v = qkv(row)
    with pytest.raises(UsageError, match="'flex', 'sdpa' or 'sdpa-grouped', got 'dense'"):
        attend(q, k, v, mask_of(row), "dense")
    with pytest.raises(UsageError, match="do not match the mask"):
        attend(q[:, :, :-1], k, v, mask_of(row), "sdpa")
    with pytest.raises(UsageError, match="multiple"):
        attend(q[:, :3], k, v, mask_of(row), "sdpa")


def test_recompile_lock_turns_a_shape_change_into_runtime_failure():
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    try:
        fn(torch.ones(3))
        lock_compilation()
        assert compilation_locked()
        with reraise_recompile("a test call"):
            torch.testing.assert_close(fn(torch.ones(3)), torch.full((3,), 3.0))  # same shape: no recompile
        with pytest.raises(RuntimeFailure, match="recompile"):
            with reraise_recompile("a test call"):
                fn(torch.ones(5))
        with compilation_unlocked():
            assert not compilation_locked()
            torch.testing.assert_close(fn(torch.ones(5)), torch.full((5,), 3.0))
        assert compilation_locked()
    finally:
        unlock_compilation()
    assert not compilation_locked()
    with pytest.raises(ValueError, match="unrelated"):  # other errors pass through unchanged
        with reraise_recompile("x"):
            raise ValueError("unrelated")
