"""The grouped SDPA path ('sdpa-grouped') computes the dense mask's attention: float64 forward and backward against
the dense SDPA path and the per-query loop reference, padding blocks, groups that see no context, host spans
against device-derived spans, the whole drafter, and the cost it saves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_pipe.drafter import DFlashDrafter, DrafterModelConfig
from dflash_pipe.drafter.attention import attend
from dflash_pipe.drafter.grouped import WIDTH_QUANTUM, group_size, group_spans, set_group_blocks
from dflash_pipe.drafter.masks import AttentionMask, block_positions
from tests.test_drafter_attention import naive_attention, qkv
from tests.test_drafter_masks import loop_reference
from tests.test_drafter_support import random_packed_row


@pytest.fixture
def group_blocks():
    """Set the grouped path's blocks per group for one test, then restore the default."""
    from dflash_pipe.drafter.grouped import GROUP_BLOCKS

    before = GROUP_BLOCKS["blocks"]
    yield set_group_blocks
    set_group_blocks(before)


def mask_of(row, host=False):
    host_t = (row.ctx_doc, row.anchor_index, row.block_doc, row.block_valid) if host else None
    return AttentionMask(row.ctx_doc, row.anchor_index, row.block_doc, row.block_valid, row.block_size, host=host_t)


def grads_of(path, row, q, k, v, w):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, mask_of(row), path)
    return out, torch.autograd.grad((out * w).sum(), leaves)


@pytest.mark.parametrize("blocks", [1, 2, 3, 5, 64])
def test_grouped_equals_dense_sdpa_forward_and_backward_float64(group_blocks, blocks):
    group_blocks(blocks)
    row = random_packed_row(5, doc_lens=(13, 5, 17, 9), pad_ctx=4, blocks_per_doc=4, pad_blocks=3)
    q, k, v = qkv(row, hq=6, hkv=2, d=16, seed=11)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    dense, dense_grads = grads_of("sdpa", row, q, k, v, w)
    grouped, grouped_grads = grads_of("sdpa-grouped", row, q, k, v, w)
    torch.testing.assert_close(grouped, dense, rtol=1e-12, atol=1e-12)
    for g, d in zip(grouped_grads, dense_grads):
        torch.testing.assert_close(g, d, rtol=1e-11, atol=1e-12)
    # and against the per-query loop reference, independent of both SDPA calls
    torch.testing.assert_close(grouped, naive_attention(q, k, v, loop_reference(row)), rtol=1e-10, atol=1e-10)


def test_grouped_differs_when_the_mask_differs(group_blocks):
    group_blocks(2)
    row = random_packed_row(6, doc_lens=(8, 12), blocks_per_doc=3, pad_blocks=1)
    q, k, v = qkv(row, seed=1)
    base = attend(q, k, v, mask_of(row), "sdpa-grouped")
    # one more document boundary: the second document's blocks now see less context
    doc = row.ctx_doc.clone()
    doc[8:14] = 1
    doc[14:20] = 2
    shifted = AttentionMask(doc, row.anchor_index, doc[row.anchor_index].to(torch.int32) * row.block_valid,
                            row.block_valid, row.block_size)
    other = attend(q, k, v, shifted, "sdpa-grouped")
    torch.testing.assert_close(other, attend(q, k, v, shifted, "sdpa"), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(other, base, atol=1e-6)


def test_spans_cover_each_groups_valid_blocks_only():
    lo = np.array([0, 3, 0, 7, 9, 9, 0, 0])
    hi = np.array([2, 5, 0, 8, 12, 9, 0, 0])
    valid = np.array([True, True, False, True, True, True, False, False])
    s_lo, s_hi = group_spans(lo, hi, valid, 2)
    # group 0: [0,2) and [3,5); group 1: a padding block and [7,8); group 2: [9,12) and an empty interval;
    # group 3: padding only
    assert s_lo.tolist() == [0, 7, 9, 0] and s_hi.tolist() == [5, 8, 12, 0]
    assert [group_size(n, 32) for n in (512, 96, 37, 7)] == [32, 32, 1, 7]
    assert group_size(512, 48) == 32 and group_size(1024, 64) == 64


def test_host_spans_equal_spans_from_the_mask_tensors(group_blocks):
    group_blocks(4)
    row = random_packed_row(8, doc_lens=(21, 3, 30), pad_ctx=2, blocks_per_doc=6, pad_blocks=2)
    with_host, without = mask_of(row, host=True).grouped(4), mask_of(row).grouped(4)
    assert torch.equal(with_host.key_index_GW, without.key_index_GW)
    assert torch.equal(with_host.mask_GQW, without.mask_GQW)
    assert with_host.width % WIDTH_QUANTUM == 0
    # a mask moved between devices keeps the host tensors it was built from
    moved = mask_of(row).to("cpu").grouped(4)
    assert torch.equal(moved.mask_GQW, without.mask_GQW)


def test_grouped_scores_fewer_keys_at_the_quality_runs_shape():
    """At 8,192 packed tokens of ~400-token documents and 512 or 1,024 anchors, the grouped layout scores a small
    fraction of the dense mask's keys, and the fraction stays flat as the anchors double."""
    rng = np.random.default_rng(0)
    lens = []
    while sum(lens) < 8192 - 600:
        lens.append(int(rng.integers(150, 513)))
    lens.append(8192 - sum(lens))
    doc = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
    starts = np.cumsum([0] + lens[:-1])
    for n in (512, 1024):
        anchors = np.sort(rng.choice(8192, size=n, replace=False))
        mask = AttentionMask(torch.from_numpy(doc), torch.from_numpy(anchors), torch.from_numpy(doc[anchors]),
                             torch.ones(n, dtype=torch.bool), 16)
        lay = mask.grouped(32)
        dense_keys, grouped_keys = 8192 + n * 16, lay.width
        lo, hi, valid = mask.host_ranges()
        s_lo, s_hi = group_spans(lo, hi, valid, 32)
        unrounded = int((s_hi - s_lo).max()) + 32 * 16
        assert grouped_keys % WIDTH_QUANTUM == 0 and 0 <= grouped_keys - unrounded < WIDTH_QUANTUM
        assert grouped_keys < dense_keys / 6, (n, grouped_keys, dense_keys)
        assert lay.mask_GQW.sum() == mask.dense_bool().sum()      # every visible pair is kept
        assert max(starts) < 8192


def test_drafter_forward_and_backward_equal_with_the_dense_path(group_blocks, monkeypatch):
    import dflash_pipe.drafter.attention as attention_mod

    calls = []
    real = attention_mod.grouped_attend
    monkeypatch.setattr(attention_mod, "grouped_attend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    group_blocks(3)
    torch.manual_seed(0)
    row = random_packed_row(9, doc_lens=(11, 7, 15), pad_ctx=3, blocks_per_doc=4, pad_blocks=2, block_size=4)
    cfg = DrafterModelConfig(hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             intermediate_size=48, rms_norm_eps=1e-6, rope_theta=1e4, block_size=4, mask_token_id=1,
                             target_layer_ids=[0, 2], num_target_layers=3, vocab_size=64)
    dense_model = DFlashDrafter(cfg, "sdpa").double()
    grouped_model = DFlashDrafter(cfg, "sdpa-grouped").double()
    grouped_model.load_state_dict(dense_model.state_dict())
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(row.S, 2 * 32, generator=g, dtype=torch.float64)
    embeds = torch.randn(row.N * 4, 32, generator=g, dtype=torch.float64)
    bpos = block_positions(row.ctx_pos, row.anchor_index, 4)
    outs = []
    for model in (dense_model, grouped_model):
        out = model(feats, embeds, row.ctx_pos, bpos, mask_of(row))
        out.square().sum().backward()
        outs.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    assert len(calls) == 2                                          # both layers of the grouped drafter
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-11, atol=1e-12)
    for a, b in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_config_accepts_the_grouped_path_and_names_the_choices():
    from dflash_pipe.errors import UsageError

    base = dict(hidden_size=32, num_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, rms_norm_eps=1e-6, rope_theta=1e4, block_size=4, mask_token_id=1,
                target_layer_ids=[0], num_target_layers=2, vocab_size=64)
    assert DrafterModelConfig(**base, attention="sdpa-grouped").attention == "sdpa-grouped"
    with pytest.raises(UsageError, match="sdpa-grouped"):
        DrafterModelConfig(**base, attention="grouped")


def test_training_with_the_grouped_path_follows_the_dense_run(tmp_path, monkeypatch, group_blocks):
    """The trainer and its validation on the grouped path: the same losses and final weights as on the dense path
    (to rounding: the two SDPA calls sum in other orders), and a real difference when the mask changes."""
    import json

    from safetensors.torch import load_file

    from dflash_pipe.train.trainer import run_train
    from tests.cache_helpers import write_train_cache
    from tests.test_train_validation import _cfg

    import dflash_pipe.drafter.attention as attention_mod

    calls = []
    real = attention_mod.grouped_attend
    monkeypatch.setattr(attention_mod, "grouped_attend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    group_blocks(4)                                   # 12 anchors a step: 3 groups
    cache, val = tmp_path / "cache", tmp_path / "val"
    write_train_cache(cache, num_docs=16, seed=2)
    write_train_cache(val, num_docs=10, seed=5)
    runs = {}
    for path in ("sdpa", "sdpa-grouped"):
        cfg = _cfg(tmp_path, cache, tmp_path / path, val)
        cfg.drafter.attention = path
        cfg.train.num_anchors = 12
        runs[path] = run_train(cfg)
        assert bool(calls) == (path == "sdpa-grouped")
    hist = {p: [json.loads(x) for x in (tmp_path / p / "metrics.jsonl").read_text().splitlines()] for p in runs}
    assert len(hist["sdpa"]) == len(hist["sdpa-grouped"]) > 4
    for a, b in zip(hist["sdpa"], hist["sdpa-grouped"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
    assert runs["sdpa-grouped"]["val"]["val_loss"] == pytest.approx(runs["sdpa"]["val"]["val_loss"], rel=1e-4)
    last = {p: load_file(str(sorted((tmp_path / p).glob("ckpt-*"))[-1] / "model.safetensors")) for p in runs}
    for name, w in last["sdpa"].items():
        torch.testing.assert_close(last["sdpa-grouped"][name], w, rtol=1e-3, atol=1e-5)
    assert abs(hist["sdpa"][-1]["loss"] - hist["sdpa"][0]["loss"]) > 1e-2   # it trained: the check has teeth


def test_repeat_each_is_repeat_interleave():
    from dflash_pipe.drafter.grouped import _repeat_each

    x = torch.arange(2 * 3 * 4).view(2, 3, 4)
    for dim in range(3):
        assert torch.equal(_repeat_each(x, 3, dim), x.repeat_interleave(3, dim=dim))


def test_step_widths_repeat_so_the_sdpa_plan_is_reused():
    """cuDNN builds a plan for every new SDPA shape (~150 ms on the H100): over training-like steps (random anchors on
    fresh ~400-token documents) the rounded width takes a handful of values, where the unrounded span changes nearly
    every step."""
    rng = np.random.default_rng(1)
    raw, rounded = set(), set()
    for _ in range(40):
        lens = []
        while sum(lens) < 8192 - 600:
            lens.append(int(rng.integers(150, 513)))
        lens.append(8192 - sum(lens))
        doc = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
        anchors = np.sort(rng.choice(8192, size=512, replace=False))
        mask = AttentionMask(torch.from_numpy(doc), torch.from_numpy(anchors), torch.from_numpy(doc[anchors]),
                             torch.ones(512, dtype=torch.bool), 16)
        lo, hi, valid = mask.host_ranges()
        s_lo, s_hi = group_spans(lo, hi, valid, 32)
        raw.add(int((s_hi - s_lo).max()))
        rounded.add(mask.grouped(32).width)
    assert len(raw) >= 30 and len(rounded) <= 8, (len(raw), sorted(rounded))
