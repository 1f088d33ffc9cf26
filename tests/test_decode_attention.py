"""Per-row-length decode attention (dflash_pipe/target/decode_attention.py) on the CPU.

The Triton kernel itself runs only on CUDA (tests/test_decode_attention_gpu.py compares it with the
reference). Here: the reference equals the engine's own masked-SDPA formulation over the padded
`kv_len`, and the engine routed through the per-row path (the reference standing in for the kernel)
gives the SDPA engine's logits over prefills, decode steps, verify-sized steps and row subsets.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_pipe.errors import UsageError
from dflash_pipe.target import decode_attention as da
from dflash_pipe.target import static_forward
from dflash_pipe.target.loading import build_random_model
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.eval_helpers import liven


def _padded_sdpa(q, k, v, rows, old, T, kv_len, scale):
    """The engine's SDPA path: every row over keys 0..kv_len-1, masked at key > old + t."""
    B, KVH, M, D = q.shape
    G = M // T
    pos = old[:, None] + torch.arange(T)
    visible = torch.arange(kv_len)[None, None, :] <= pos[:, :, None]
    mask = visible[:, None, None].expand(B, 1, G, T, kv_len).reshape(B, 1, G * T, kv_len)
    return F.scaled_dot_product_attention(q, k[rows, :, :kv_len], v[rows, :, :kv_len], attn_mask=mask, scale=scale)


@pytest.mark.parametrize("T", [1, 3, 16])
def test_reference_equals_the_padded_masked_sdpa_in_float64(T):
    g = torch.Generator().manual_seed(T)
    n_rows, KVH, G, D, size = 9, 3, 3, 16, 70
    k = torch.randn(n_rows, KVH, size, D, generator=g, dtype=torch.float64)
    v = torch.randn(n_rows, KVH, size, D, generator=g, dtype=torch.float64)
    rows = torch.tensor([4, 0, 7, 2, 8])
    old = torch.tensor([0, 5, size - T, 33, 17])
    q = torch.randn(len(rows), KVH, G * T, D, generator=g, dtype=torch.float64)
    for kv_len in (size, 48):          # 48 cuts the longer rows, as the engine's slice of the buffer does
        got = da.decode_attention_reference(q, k, v, rows, old, T, kv_len, 0.3)
        want = _padded_sdpa(q, k, v, rows, old, T, kv_len, 0.3)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_supported_is_false_without_cuda_and_rows_mode_is_refused_on_the_cpu():
    assert not da.supported(torch.device("cpu"), torch.bfloat16, 3, 64)
    model = build_random_model("tiny-llama", seed=0, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(UsageError, match="attention 'rows' needs CUDA"):
        StaticKVEngine(model, 4, 64, attention="rows")


def _decode_trace(eng, prompts):
    """Prefill rows of different lengths, 12 decode steps with some rows idle, a 4-token verify step on all
    rows, 3 steps on a subset of rows (eager, with row indices): every logits tensor, in order."""
    out = []
    T = max(map(len, prompts))
    ids = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    o = eng.forward(ids, torch.tensor([len(p) for p in prompts]), rows=list(range(len(prompts))), last_only=True)
    cur = o.logits.argmax(-1, keepdim=True)
    for step in range(12):
        live = torch.tensor([(r + step) % 4 != 0 for r in range(len(prompts))])
        o = eng.forward(cur, live.long())
        out.append(o.logits[:, 0].clone())
        cur = torch.where(live[:, None], o.logits[:, 0].argmax(-1, keepdim=True), cur)
    block = torch.cat([cur, (cur + torch.arange(1, 4)) % 1000], dim=1)
    out.append(eng.forward(block).logits.clone())
    sub = [5, 1, 3]
    cur = cur[sub]
    for _ in range(3):
        o = eng.forward(cur, rows=sub)
        out.append(o.logits[:, 0].clone())
        cur = o.logits[:, 0].argmax(-1, keepdim=True)
    return out


def test_engine_on_the_per_row_path_equals_the_sdpa_engine(monkeypatch):
    model = liven(build_random_model("tiny-llama", seed=0, device=torch.device("cpu"), dtype=torch.float32).eval())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 40, 17, 1, 33, 64)]
    want = _decode_trace(StaticKVEngine(model, len(prompts), 96, kv_bucket=16, attention="sdpa"), prompts)

    calls = []

    def stand_in(*args):                         # the kernel's reference, counted
        calls.append(args[0].shape)
        return da.row_attention_reference(*args)

    eng = StaticKVEngine(model, len(prompts), 96, kv_bucket=16, attention="sdpa")
    eng.ops.attention = "rows"                   # as on CUDA with Triton (the CPU constructor refuses "rows")
    monkeypatch.setattr(da, "supported", lambda *a: True)
    monkeypatch.setattr(static_forward, "row_length_attention", stand_in)
    got = _decode_trace(eng, prompts)
    layers = len(eng.layers)
    assert len(calls) == layers * (12 + 1 + 3)   # every decode / verify / subset step, no prefill (T > 16)
    assert {c[1] for c in calls} == {1, 4} and {c[2] for c in calls} == {eng.heads}    # q as [B, T, H, D]
    for a, b in zip(got, want):                  # fp32: the two attentions differ only in summation order
        assert a.shape == b.shape and float((a - b).abs().max() / b.abs().max()) <= 1e-5
