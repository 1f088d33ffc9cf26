"""Triton kernels for the static-KV engine's elementwise work on CUDA: RoPE of q|k (optionally writing the K/V cache)
and SiLU(gate) * up.

Elementwise kernels are most of a prefill call's device time at SmolLM2's size. In the H100 profile of a
64 x 64-token call (session 31, BENCHMARKS.md), GEMMs took 30 % and elementwise kernels and copies 66 %. Two
groups stand out there:
* RoPE is three kernels a layer: swap the halves (a flip), x * cos, then addcmul.
* The MLP's SiLU(gate) * up is two kernels, each reading strided halves of the fused gate|up output (PyTorch's
  slower, unvectorized path).
Each becomes one kernel here, one program per token. The result equals PyTorch's bit for bit where the hardware's
exp and fused multiply-adds round as PyTorch's do. Each kernel rounds to the input dtype wherever the PyTorch ops it
replaces round:
* RoPE: ``round(round(x * cos) + rotate_half(x) * sin)``, as ``addcmul(x * cos, swapped, signed_sin)`` computes it.
* SwiGLU: ``round(round(silu(g)) * u)``, silu computed in fp32.
Where the engine attends through the per-row kernel, which reads keys and values from the cache only, the RoPE
kernel also writes the rotated keys and the values into the cache rows (`rope_into_cache`). That replaces the
engine's two `index_put` kernels a layer, the third group of the profile.

CUDA and bf16 / fp16 only (`supported`). The CPU, fp32 targets and anything else keep the PyTorch ops
(small_batch_ops.py). Triton is imported on first use, as in decode_attention.py. Each kernel has one fixed
configuration (no autotuning), so a CUDA graph can capture it after its first, compiling call.
"""

from __future__ import annotations

import functools

import torch

from .decode_attention import triton_available

ENABLED = True                    # a seam for A/B runs (bench/regen_throughput.py's +torchops): False = PyTorch ops


def supported(x: torch.Tensor) -> bool:
    """Whether the kernels take `x`: CUDA, bf16 / fp16, last dim contiguous, Triton importable."""
    return (ENABLED and x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and triton_available())


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(X, COS, SIN, OUT, T, NH, s_xb, s_xt, s_xh, s_cb, s_ct, s_sb, s_st,
                    HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // T
        t = pid % T
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HALF)
        live = (h < NH)[:, None]
        x_at = X + b * s_xb + t * s_xt + h[:, None] * s_xh + d[None, :]
        x1 = tl.load(x_at, mask=live, other=0.0)
        x2 = tl.load(x_at + HALF, mask=live, other=0.0)
        c_at = COS + b * s_cb + t * s_ct + d
        s_at = SIN + b * s_sb + t * s_st + d
        c1 = tl.load(c_at).to(tl.float32)[None, :]
        c2 = tl.load(c_at + HALF).to(tl.float32)[None, :]
        s1 = tl.load(s_at).to(tl.float32)[None, :]
        s2 = tl.load(s_at + HALF).to(tl.float32)[None, :]
        dt = x1.dtype
        a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)        # x * cos, rounded as its own op is
        a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
        o1 = a1 + x2.to(tl.float32) * -s1                             # addcmul: one rounding
        o2 = a2 + x1.to(tl.float32) * s2
        o_at = OUT + pid * NH * 2 * HALF + h[:, None] * 2 * HALF + d[None, :]
        tl.store(o_at, o1.to(dt), mask=live)
        tl.store(o_at + HALF, o2.to(dt), mask=live)

    @triton.jit
    def silu_mul_kernel(GU, OUT, I, s_row, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = col < I
        g = tl.load(GU + row * s_row + col, mask=live, other=0.0)
        u = tl.load(GU + row * s_row + I + col, mask=live, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)                  # silu, rounded as its own op is
        tl.store(OUT + row * I + col, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=live)

    @triton.jit
    def rope_cache_kernel(X, V, COS, SIN, Q_OUT, KC, VC, ROWS, WPOS, T, H, KVH, s_xb, s_xt, s_xh, s_vb, s_vt, s_vh,
                          s_cb, s_ct, s_sb, s_st, s_kr, s_kh, s_kn, s_vr, s_vhh, s_vn,
                          HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // T
        t = pid % T
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HALF)
        live = (h < H + KVH)[:, None]
        x_at = X + b * s_xb + t * s_xt + h[:, None] * s_xh + d[None, :]
        x1 = tl.load(x_at, mask=live, other=0.0)
        x2 = tl.load(x_at + HALF, mask=live, other=0.0)
        c_at = COS + b * s_cb + t * s_ct + d
        s_at = SIN + b * s_sb + t * s_st + d
        c1 = tl.load(c_at).to(tl.float32)[None, :]
        c2 = tl.load(c_at + HALF).to(tl.float32)[None, :]
        s1 = tl.load(s_at).to(tl.float32)[None, :]
        s2 = tl.load(s_at + HALF).to(tl.float32)[None, :]
        dt = x1.dtype
        o1 = ((x1.to(tl.float32) * c1).to(dt).to(tl.float32) + x2.to(tl.float32) * -s1).to(dt)
        o2 = ((x2.to(tl.float32) * c2).to(dt).to(tl.float32) + x1.to(tl.float32) * s2).to(dt)
        is_q = (h < H)[:, None]
        q_at = Q_OUT + pid * H * 2 * HALF + h[:, None] * 2 * HALF + d[None, :]
        tl.store(q_at, o1, mask=is_q)
        tl.store(q_at + HALF, o2, mask=is_q)
        row = tl.load(ROWS + b).to(tl.int64)
        pos = tl.load(WPOS + pid).to(tl.int64)
        is_k = live & ~is_q
        k_at = KC + row * s_kr + (h[:, None] - H) * s_kh + pos * s_kn + d[None, :]
        tl.store(k_at, o1, mask=is_k)
        tl.store(k_at + HALF, o2, mask=is_k)
        hv = tl.arange(0, BLOCK_H)
        is_v = (hv < KVH)[:, None]
        dd = tl.arange(0, 2 * HALF)
        v = tl.load(V + b * s_vb + t * s_vt + hv[:, None] * s_vh + dd[None, :], mask=is_v, other=0.0)
        tl.store(VC + row * s_vr + hv[:, None] * s_vhh + pos * s_vn + dd[None, :], v, mask=is_v)

    return rope_kernel, silu_mul_kernel, rope_cache_kernel


def rope_tokens(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` of x [B, T, NH, D] (any strides but the last) with cos / sin
    [B, T, D] (HF's rotary output; unsigned sin): a new contiguous [B, T, NH, D]. One kernel; no host sync."""
    B, T, NH, D = x.shape
    if D % 2 or D & (D - 1) or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_tokens needs a power-of-two head dim and contiguous cos / sin rows")
    out = torch.empty((B, T, NH, D), dtype=x.dtype, device=x.device)
    _kernels()[0][(B * T,)](x, cos, sin, out, T, NH, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
                            cos.stride(1), sin.stride(0), sin.stride(1), HALF=D // 2,
                            BLOCK_H=max(2, 1 << (NH - 1).bit_length()), num_warps=4)
    return out


def rope_into_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                    k_layer: torch.Tensor, v_layer: torch.Tensor, rows: torch.Tensor, write_pos: torch.Tensor):
    """`rope_tokens` of q|k [B, T, H + KVH, D] whose rotated keys, and the values v [B, T, KVH, D], go straight into
    the cache: token (b, t) to position write_pos[b, t] of row rows[b] of k_layer / v_layer [n_rows, KVH, size, D]
    (what the engine's two `index_put`s did). Returns the rotated queries, a new contiguous [B, T, H, D]."""
    B, T, NH, D = qk.shape
    KVH = NH - heads
    if (D & (D - 1) or cos.stride(-1) != 1 or sin.stride(-1) != 1 or v.stride(-1) != 1 or k_layer.stride(-1) != 1
            or v_layer.stride(-1) != 1 or not write_pos.is_contiguous() or v.shape != (B, T, KVH, D)):
        raise ValueError("rope_into_cache: a power-of-two head dim, contiguous rows and positions needed")
    q = torch.empty((B, T, heads, D), dtype=qk.dtype, device=qk.device)
    _kernels()[2][(B * T,)](qk, v, cos, sin, q, k_layer, v_layer, rows, write_pos, T, heads, KVH,
                            qk.stride(0), qk.stride(1), qk.stride(2), v.stride(0), v.stride(1), v.stride(2),
                            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
                            k_layer.stride(0), k_layer.stride(1), k_layer.stride(2),
                            v_layer.stride(0), v_layer.stride(1), v_layer.stride(2),
                            HALF=D // 2, BLOCK_H=max(2, 1 << (NH - 1).bit_length()), num_warps=4)
    return q


def silu_mul(gate_up: torch.Tensor, inner: int) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [..., 2 * inner] (gate first; rows contiguous): a new [..., inner]."""
    lead = gate_up.shape[:-1]
    gu = gate_up.reshape(-1, 2 * inner)
    if gu.stride(-1) != 1:
        raise ValueError("silu_mul needs gate|up rows with a contiguous last dim")
    out = torch.empty((gu.shape[0], inner), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _kernels()[1][(gu.shape[0], -(-inner // block))](gu, out, inner, gu.stride(0), BLOCK=block, num_warps=4)
    return out.view(*lead, inner)

