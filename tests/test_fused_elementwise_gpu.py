"""GPU checks of the fused RoPE and SwiGLU kernels (`pytest -m gpu`, target/fused_elementwise.py): equal to the
PyTorch ops they replace (bit for bit but for rare last-bit differences of exp / fma), close to float64, taken by
the engine's forward, and the graphed decode step with them equal to one without them up to that rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_pipe.target import fused_elementwise as fe
from dflash_pipe.target.small_batch_ops import rope, signed_sin
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.test_static_forward_gpu import _model

pytestmark = pytest.mark.gpu


def _same_but_rare_last_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    diff = (a.float() - b.float()).abs()
    ulp = b.float().abs().clamp(min=1e-30) * (2.0 ** -7 if a.dtype == torch.bfloat16 else 2.0 ** -10)
    assert bool((diff <= ulp).all()), float((diff / ulp).max())
    assert float((diff > 0).float().mean()) <= 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_kernel_equals_the_three_pytorch_ops_on_the_fused_projections_view(dtype):
    """q|k as the engine sees it: the first 12 of 15 heads of a fused q|k|v output (a strided view), T = 16 and 1."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, T in ((37, 16), (1024, 1)):
        qkv = torch.randn(B, T, 15 * 64, device="cuda", dtype=dtype, generator=g)
        x = qkv[..., :12 * 64].view(B, T, 12, 64)
        ang = torch.rand(B, T, 32, device="cuda", generator=g) * 300
        cos, sin = (torch.cat([f(ang)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
        got = fe.rope_tokens(x, cos, sin)
        want = rope(x, cos[:, :, None], signed_sin(sin)[:, :, None])
        assert got.shape == want.shape and got.is_contiguous()
        _same_but_rare_last_bits(got, want)
        half = 32
        exact = (x.double() * cos.double()[:, :, None]
                 + torch.cat((-x[..., half:], x[..., :half]), -1).double() * sin.double()[:, :, None])
        assert float((got.double() - exact).abs().max()) <= 3 * 2.0 ** -7 * float(exact.abs().max())


def test_rope_into_cache_writes_what_rotation_then_index_put_write():
    """B = 5 rows x T = 16 tokens into cache rows [7, 2, 7, 0, 3] (a row may repeat at other positions, as chunks of
    one prompt do) of a 9-row cache: the queries equal `rope_tokens`' and the cache equals index_put's, bit for bit;
    every other cache entry is untouched."""
    g = torch.Generator(device="cuda").manual_seed(3)
    B, T, H, KVH, D = 5, 16, 9, 3, 64
    qkv = torch.randn(B, T, (H + 2 * KVH) * D, device="cuda", dtype=torch.bfloat16, generator=g)
    qk, v = qkv[..., :(H + KVH) * D].view(B, T, H + KVH, D), qkv[..., (H + KVH) * D:].view(B, T, KVH, D)
    ang = torch.rand(B, T, D // 2, device="cuda", generator=g) * 300
    cos, sin = (torch.cat([f(ang)] * 2, dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    rows = torch.tensor([7, 2, 7, 0, 3], device="cuda")
    pos = torch.tensor([0, 40, 16, 5, 100], device="cuda")[:, None] + torch.arange(T, device="cuda")
    caches = [torch.randn(9, KVH, 130, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    kc, vc = (c.clone() for c in caches)
    q = fe.rope_into_cache(qk, v, cos, sin, H, kc, vc, rows, pos.contiguous())
    want = fe.rope_tokens(qk, cos, sin)
    ref_k, ref_v = (c.clone() for c in caches)
    ref_k[rows[:, None], :, pos] = want[:, :, H:]
    ref_v[rows[:, None], :, pos] = v
    assert torch.equal(q, want[:, :, :H]) and q.is_contiguous()
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("inner", [1536, 1000])
def test_silu_mul_kernel_equals_silu_then_mul(inner):
    g = torch.Generator(device="cuda").manual_seed(1)
    gu = torch.randn(3, 17, 2 * inner, device="cuda", dtype=torch.bfloat16, generator=g) * 4
    got = fe.silu_mul(gu, inner)
    gate, up = gu.split([inner, inner], dim=-1)
    assert got.shape == (3, 17, inner)
    _same_but_rare_last_bits(got, F.silu(gate) * up)


def test_the_engine_takes_the_kernels_and_its_decode_step_matches_the_pytorch_ops(monkeypatch):
    """A bf16 engine over 96 rows (a 20-token prefill, then three graphed decode steps through the per-row kernel)
    with the kernels and with fused_elementwise.ENABLED off: all three kernels are called (the decode steps rotate
    into the cache), the logits agree within bf16 rounding and the greedy tokens on nearly every row; fp32 and CPU
    tensors are refused."""
    from dflash_pipe.target import small_batch_ops, static_forward

    model = _model(torch.bfloat16)
    assert not fe.supported(torch.zeros(2, device="cuda")) and not fe.supported(torch.zeros(2, dtype=torch.bfloat16))
    calls = {"rope": 0, "rope_cache": 0, "silu": 0}

    def counted(name, fn):
        def run(*a):
            calls[name] += 1
            return fn(*a)
        return run

    monkeypatch.setattr(static_forward, "rope_tokens", counted("rope", fe.rope_tokens))
    monkeypatch.setattr(static_forward, "rope_into_cache", counted("rope_cache", fe.rope_into_cache))
    monkeypatch.setattr(small_batch_ops.fused_elementwise, "silu_mul", counted("silu", fe.silu_mul))
    out = {}
    for enabled in (True, False):
        monkeypatch.setattr(fe, "ENABLED", enabled)
        eng = StaticKVEngine(model, 96, 128, kv_bucket=16)
        assert eng.row_attention(96)
        g = torch.Generator().manual_seed(2)
        eng.forward(torch.randint(0, 49152, (96, 20), generator=g))
        out[enabled] = torch.stack([eng.forward(torch.randint(0, 49152, (96, 1), generator=g)).logits.float().clone()
                                    for _ in range(3)])
        if enabled:
            assert min(calls.values()) > 0, calls
            seen = dict(calls)
    assert calls == seen                                   # none with the kernels off
    a, b = out[True], out[False]
    assert float((a - b).abs().max() / b.abs().max()) <= 3e-2
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.9
