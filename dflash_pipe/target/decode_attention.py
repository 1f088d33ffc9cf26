"""Decode attention that reads only each row's own keys: the static-KV engine's large-batch path on CUDA.

With SDPA the engine attends every row of a step over the same `kv_len` keys: the longest row's
length rounded up to a bucket, with a mask for the rest. Under regenerate's continuous batching some
row is always near `max_len`, so a step reads the whole K/V buffer (12 GB at SmolLM2's shape, batch
1,024, max_len 512) although the rows hold ~170 tokens on average. `decode_attention` reads, per
(row, KV head), only the keys that row can see: one Triton program each, an online softmax over
64-key blocks up to the row's own length, the G query heads of the KV head (times the T new tokens)
as the rows of one small matrix product (GQA without copying keys).

Semantics (the same as the SDPA path of `StaticKVEngine._compute`): q [B, KVH, G*T, D] with rows
ordered (g, t) (`decode_attention`), or q [B, T, H, D] as the projection makes it, query head
h = kv_head * G + g (`row_attention`: the kernel reads q and writes the output through strides, so the
engine's 16-token prefill chunks need no transposing copies). The new tokens' keys are already written
at positions old[b] .. old[b] + T - 1 of cache row rows[b]; query (g, t) sees keys
0 .. min(old[b] + t, kv_len - 1). The output has q's shape and dtype. fp32 accumulation, the
probabilities rounded to the value dtype before the PV product (as flash attention does); bf16 / fp16
only (an fp32 `tl.dot` would run in TF32, which the engine never turns on).
`decode_attention_reference` / `row_attention_reference` are the same math in PyTorch (CPU tests, the
GPU test's reference).

Triton is imported on first use, only where CUDA is (it is never installed on CPU machines); the
kernel has one fixed configuration (CONFIG; no autotuning, so a CUDA graph can capture its launch after the first
call compiled it).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("dflash_pipe.target")

# (keys per step of the online softmax, warps, software-pipelining stages) of a launch. On the H100 (session 31)
# bench/decode_attention_tune.py timed (128, 2, 3) at 0.108 ms a decode call against 0.127 for this one, and
# (64, 2, 3) at 0.060 against 0.069 for 16-token chunks, but in regenerate (SmolLM2, batch 1,024) the decode steps'
# device time did not move (9.60 s against 9.68) while the bf16 answers changed (4,031 of 13,835 rows identical)
CONFIG = (64, 4, 2)
MAX_QUERY_ROWS = 64               # G * T handled by one program (the engine's T <= 16 with G <= 4)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton imports and a CUDA device exists (never on the CPU machines)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "use SDPA"
        log.info("decode attention: Triton unavailable (%r); SDPA reads the padded K/V", exc)
        return False
    return True


def supported(device: torch.device, dtype: torch.dtype, query_rows: int, head_dim: int) -> bool:
    """Whether the kernel takes such a call: CUDA, bf16 / fp16, a power-of-two head dim, at most 64 query rows."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and query_rows <= MAX_QUERY_ROWS
            and head_dim in (16, 32, 64, 128, 256) and triton_available())


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(Q, K, V, O, ROWS, OLD, scale, kv_len,
                                s_qb, s_qh, s_qg, s_qt, s_kr, s_kh, s_kn, s_vr, s_vh, s_vn, s_ob, s_oh, s_og, s_ot,
                                M: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        row = tl.load(ROWS + b).to(tl.int64)
        old = tl.load(OLD + b).to(tl.int32)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK)
        live_m = offs_m < M
        g_m, t_m = offs_m // T, offs_m % T                        # query row m = (query head g of h, token t)
        q = tl.load(Q + b * s_qb + h * s_qh + (g_m * s_qg + t_m * s_qt)[:, None] + offs_d[None, :],
                    mask=live_m[:, None], other=0.0)
        limit = tl.minimum(old + t_m + 1, kv_len)       # query row m sees keys < limit[m]
        n_end = tl.minimum(old + T, kv_len)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        k_base = K + row * s_kr + h * s_kh
        v_base = V + row * s_vr + h * s_vh
        for start in range(0, n_end, BLOCK):
            n = start + offs_n
            inside = n < n_end
            k = tl.load(k_base + n[:, None] * s_kn + offs_d[None, :], mask=inside[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(n[None, :] < limit[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * s_vn + offs_d[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + b * s_ob + h * s_oh + (g_m * s_og + t_m * s_ot)[:, None] + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=live_m[:, None])

    return decode_attention_kernel


def decode_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, rows: torch.Tensor,
                     old: torch.Tensor, T: int, kv_len: int, scale: float, config: tuple[int, int, int] | None = None
                     ) -> torch.Tensor:
    """Attention of q [B, KVH, G*T, D] over cache rows `rows` of k_layer / v_layer [n_rows, KVH, size, D],
    each row over its own visible keys (module docstring). Launches one kernel; no host sync. `config`:
    (keys per block, warps, stages) instead of the module's defaults (the tuning bench's sweep)."""
    B, KVH, M, D = q.shape
    out = torch.empty((B, KVH, M, D), dtype=q.dtype, device=q.device)
    s_q, s_o = q.stride(2), out.stride(2)                      # row m = g * T + t
    _launch(q, (q.stride(0), q.stride(1), T * s_q, s_q), out, (out.stride(0), out.stride(1), T * s_o, s_o),
            k_layer, v_layer, rows, old, M, T, D, kv_len, scale, config)
    return out


def row_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, rows: torch.Tensor,
                  old: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
    """`decode_attention` of q [B, T, H, D] (the projection's layout; any strides with the head dim contiguous),
    written as [B, T, H, D] (contiguous): the same kernel, the same numbers, no transposing copies (module
    docstring)."""
    B, T, H, D = q.shape
    KVH = k_layer.shape[1]
    G = H // KVH
    out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    _launch(q, (q.stride(0), G * q.stride(2), q.stride(2), q.stride(1)),
            out, (out.stride(0), G * out.stride(2), out.stride(2), out.stride(1)),
            k_layer, v_layer, rows, old, G * T, T, D, kv_len, scale, None)
    return out


def _launch(q, q_strides, out, out_strides, k_layer, v_layer, rows, old, M: int, T: int, D: int, kv_len: int,
            scale: float, config) -> None:
    """One kernel launch over (row, KV head): q / out addressed by (batch, KV head, query head g, token t)
    strides."""
    if q.stride(-1) != 1 or k_layer.stride(-1) != 1 or v_layer.stride(-1) != 1:
        raise ValueError("decode_attention needs the head dim contiguous in q, keys and values")
    B, KVH = q.shape[0], k_layer.shape[1]
    block_m = max(16, 1 << (M - 1).bit_length())
    block_n, warps, stages = config or CONFIG
    _kernel()[(B, KVH)](q, k_layer, v_layer, out, rows, old, float(scale), int(kv_len), *q_strides,
                        k_layer.stride(0), k_layer.stride(1), k_layer.stride(2),
                        v_layer.stride(0), v_layer.stride(1), v_layer.stride(2), *out_strides,
                        M=M, T=T, D=D, BLOCK_M=block_m, BLOCK=block_n, num_warps=warps, num_stages=stages)


def decode_attention_reference(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, rows: torch.Tensor,
                               old: torch.Tensor, T: int, kv_len: int, scale: float) -> torch.Tensor:
    """The same result in PyTorch (fp32 math, float64 for float64 inputs), one row at a time over exactly its
    visible keys."""
    B, KVH, M, D = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    t = torch.arange(M, device=q.device) % T
    for b in range(B):
        r, o = int(rows[b]), int(old[b])
        n = min(o + T, kv_len)
        keys, vals = k_layer[r, :, :n].to(acc), v_layer[r, :, :n].to(acc)           # [KVH, n, D]
        scores = torch.einsum("hmd,hnd->hmn", q[b].to(acc), keys) * scale
        visible = torch.arange(n, device=q.device)[None, :] < torch.clamp(o + t + 1, max=kv_len)[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[b] = torch.einsum("hmn,hnd->hmd", torch.softmax(scores, dim=-1), vals).to(q.dtype)
    return out


def row_attention_reference(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, rows: torch.Tensor,
                            old: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
    """`row_attention` in PyTorch: q [B, T, H, D] regrouped to [B, KVH, G*T, D] for the reference, and back."""
    B, T, H, D = q.shape
    KVH = k_layer.shape[1]
    G = H // KVH
    grouped = q.reshape(B, T, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * T, D)
    o = decode_attention_reference(grouped, k_layer, v_layer, rows, old, T, kv_len, scale)
    return o.reshape(B, KVH, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)
