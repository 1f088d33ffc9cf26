"""CUDA checks of the grouped SDPA path (`pytest -m gpu tests/test_drafter_grouped_gpu.py`; gpu_bench.sh gputests).

* bf16 forward and backward as close to the fp32 dense reference as the dense path in bf16 is;
* no host sync while the layout is built and the attention runs forward and backward (the spans come from the
  batch's host tensors);
* at the quality runs' shape with 1,024 anchors, less peak memory than the dense path.
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.drafter.attention import attend
from dflash_pipe.drafter.masks import AttentionMask
from tests.test_drafter_gpu import DEV, fwd_bwd, mask_of, qkv, rel, row_of

pytestmark = pytest.mark.gpu


def test_grouped_bf16_forward_backward_as_close_as_dense():
    row = row_of(S=2048, N=128, seed=6)
    mask = mask_of(row)
    q, k, v = qkv(row, hq=9, hkv=3, d=64, seed=4)
    ref_out, ref_grads = fwd_bwd("sdpa", q, k, v, mask, torch.float32)
    dense_out, dense_grads = fwd_bwd("sdpa", q, k, v, mask, torch.bfloat16)
    grouped_out, grouped_grads = fwd_bwd("sdpa-grouped", q, k, v, mask, torch.bfloat16)
    grouped32, _ = fwd_bwd("sdpa-grouped", q, k, v, mask, torch.float32)
    assert rel(grouped32, ref_out) < 1e-5
    assert rel(grouped_out, ref_out) < max(2 * rel(dense_out, ref_out), 1e-2)
    for g, d, r in zip(grouped_grads, dense_grads, ref_grads):
        assert rel(g, r) < max(2 * rel(d, r), 2e-2)


def test_grouped_runs_without_a_host_sync():
    row = row_of(S=2048, N=128, seed=7)
    host = (row.ctx_doc, row.anchor_index, row.block_doc, row.block_valid)
    dev = [t.to(DEV) for t in host]
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in qkv(row, hq=9, hkv=3, d=64, seed=5))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = AttentionMask(*dev, row.block_size, host=host)
        out = attend(q, k, v, mask, "sdpa-grouped")
        out.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(q.grad.float()).all()


def test_grouped_peak_memory_below_dense_at_1024_anchors():
    from bench.seed_shape import SeedShape, structure_batches

    shape = SeedShape(context=8192, anchors=1024, block=16, hidden=576, layers=1, heads=9, kv_heads=3, head_dim=64,
                      intermediate=1536, vocab=49152, target_layers=5, mask_token_id=2)
    b = structure_batches(shape, 1, max_doc=1280)[0]
    t = {k: torch.from_numpy(b[k]) for k in ("ctx_doc", "anchor_index", "block_doc", "block_valid")}
    mask = AttentionMask(t["ctx_doc"], t["anchor_index"], t["block_doc"], t["block_valid"], 16).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, 9, 1024 * 16, 64, device=DEV, generator=g, dtype=torch.bfloat16)
    kv = [torch.randn(1, 3, 8192 + 1024 * 16, 64, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(2)]
    peaks, outs = {}, {}
    for path in ("sdpa", "sdpa-grouped"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, *kv)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = attend(*leaves, mask, path)
        out.float().sum().backward()
        torch.cuda.synchronize()
        peaks[path] = torch.cuda.max_memory_allocated() - base
        outs[path] = out.detach()
    assert rel(outs["sdpa-grouped"], outs["sdpa"]) < 1e-2
    assert peaks["sdpa-grouped"] < peaks["sdpa"], peaks
