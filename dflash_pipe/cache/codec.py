"""Feature codecs: how one document's target features become bytes and back.

Layout (both codecs) is *channel-major*: the [T, D] feature matrix is stored transposed, [D, T],
so that each channel's values are contiguous. On real activations this lets zstd's per-block
Huffman tables adapt to per-channel magnitudes (outlier channels, layer scales) and beats the
order-0 entropy bound of the token-major stream (measured in bench/cache_codec.py).

lossless  bf16 split into byte planes. The high byte (sign + 7 exponent bits, ~3.2 bits of
          entropy) is zstd-1 compressed; the low byte (~7.97 bits, incompressible) is stored raw.
fp8       e4m3 bytes with one fp32 scale per (token, layer) = absmax/448, zstd-1 compressed.
          Lossy; the writer records the reconstruction error in the manifest.

Encoding (`encode_hidden`) runs on the tensor's device: on the GPU the split/transpose/quantise
cost nothing next to the target forward and the host only runs zstd. Decoding is split the
same way: the host decompresses planes into a batch buffer (`PlaneBatch`), and
`planes_to_hidden` turns the buffer into a bf16 [S, D] tensor on whatever device it lives on.

Top-k teacher signal: int32 ids and fp16 log-probs [T, k], byte-plane split token-major + zstd-1.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

LOSSLESS = "lossless"
FP8 = "fp8"
CODECS = (LOSSLESS, FP8)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ZSTD_LEVEL = 1

_local = threading.local()


def _cctx() -> zstandard.ZstdCompressor:
    # zstandard contexts are not thread-safe: one per thread.
    if not hasattr(_local, "cctx"):
        _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
        _local.dctx = zstandard.ZstdDecompressor()
    return _local.cctx


def _dctx() -> zstandard.ZstdDecompressor:
    _cctx()
    return _local.dctx


def zstd_compress(buf) -> bytes:
    return _cctx().compress(buf)


def zstd_decompress(buf, expected_size: int) -> bytes:
    out = _dctx().decompress(buf, max_output_size=expected_size)
    if len(out) != expected_size:
        raise ValueError(f"decompressed {len(out)} bytes, expected {expected_size}")
    return out


def as_u8(t: torch.Tensor) -> np.ndarray:
    """Zero-copy uint8 numpy view of a contiguous CPU tensor."""
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def u8_tensor(buf) -> torch.Tensor:
    """Zero-copy read-only bytes -> uint8 tensor (torch warns on read-only buffers; we never write)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.writeable:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    return torch.from_numpy(arr)


# --------------------------------------------------------------------------- hidden states
@dataclass
class EncodedHidden:
    """One document's features as planes, channel-major, on some device (not yet compressed)."""

    codec: str
    num_tokens: int
    width: int
    planes: torch.Tensor  # lossless: uint8 [2, D, T] (0 = low byte, 1 = high byte); fp8: uint8 [D, T]
    scale: torch.Tensor | None = None  # fp8: float32 [T, num_layers]

    def to(self, device, non_blocking: bool = False) -> "EncodedHidden":
        return EncodedHidden(self.codec, self.num_tokens, self.width,
                             self.planes.to(device, non_blocking=non_blocking),
                             None if self.scale is None else self.scale.to(device, non_blocking=non_blocking))


def _fp8_quantize(x_TLH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [T, L, H] -> (e4m3 values, fp32 scale [T, L]); scale = absmax / 448 per (token, layer).

    The divisor is a tensor, not the Python number: CUDA divides a tensor by a Python scalar as a multiplication
    by its reciprocal, which is not the correctly rounded quotient (1/448 is inexact), so the scales, and the
    values quantised with them, differed from the CPU's in some elements (H200, session 16: the scales differed
    and 382 of 448,320 values were off the reference). Tensor by tensor, both devices round each quotient once."""
    amax = x_TLH.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    return (x_TLH / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def _fp8_dequantize(q_TLH: torch.Tensor, scale_TL: torch.Tensor) -> torch.Tensor:
    """e4m3 [T, L, H] and fp32 scale [T, L] -> bf16 [T, L * H]: what an fp8 cache gives back."""
    T, L, H = q_TLH.shape
    return (q_TLH.float() * scale_TL.unsqueeze(-1)).view(T, L * H).to(torch.bfloat16)


def encode_hidden(hidden_TD: torch.Tensor, codec: str, num_layers: int) -> EncodedHidden:
    """Split/quantise [T, D] features into channel-major planes, on the tensor's device."""
    T, D = hidden_TD.shape
    if codec == LOSSLESS:
        u8 = hidden_TD.to(torch.bfloat16).contiguous().view(torch.uint8).view(T, D, 2)
        return EncodedHidden(codec, T, D, u8.permute(2, 1, 0).contiguous())
    if codec == FP8:
        q, scale = _fp8_quantize(hidden_TD.float().view(T, num_layers, D // num_layers))
        return EncodedHidden(codec, T, D, q.view(torch.uint8).view(T, D).t().contiguous(), scale.contiguous())
    raise ValueError(f"unknown codec {codec!r}")


def hidden_columns(codec: str) -> tuple[str, ...]:
    return ("hidden_hi", "hidden_lo") if codec == LOSSLESS else ("hidden_q", "hidden_scale")


def compress_hidden(enc: EncodedHidden) -> dict[str, bytes | np.ndarray]:
    """Host side: planes (CPU tensors) -> column values. Runs in the compression pool."""
    if enc.codec == LOSSLESS:
        return {"hidden_hi": zstd_compress(as_u8(enc.planes[1])), "hidden_lo": as_u8(enc.planes[0])}
    return {"hidden_q": zstd_compress(as_u8(enc.planes)), "hidden_scale": as_u8(enc.scale)}


def planes_shape(codec: str, width: int, num_tokens: int) -> tuple[int, ...]:
    return (2, width, num_tokens) if codec == LOSSLESS else (width, num_tokens)


def decompress_hidden_into(codec: str, values: dict[str, memoryview], num_tokens: int, width: int,
                           planes_out: torch.Tensor, scale_out: torch.Tensor | None, offset: int) -> None:
    """Decode one row's column values into columns [offset, offset+T) of a batch plane buffer.

    planes_out: lossless uint8 [2, D, S]; fp8 uint8 [D, S]. scale_out: fp8 float32 [S, n].
    """
    n = width * num_tokens
    T = num_tokens
    if codec == LOSSLESS:
        hi = u8_tensor(zstd_decompress(values["hidden_hi"], n)).view(width, T)
        lo = u8_tensor(values["hidden_lo"])
        if lo.numel() != n:
            raise ValueError(f"hidden_lo has {lo.numel()} bytes, expected {n}")
        planes_out[1, :, offset:offset + T] = hi
        planes_out[0, :, offset:offset + T] = lo.view(width, T)
    else:
        q = u8_tensor(zstd_decompress(values["hidden_q"], n)).view(width, T)
        planes_out[:, offset:offset + T] = q
        sc = u8_tensor(values["hidden_scale"])
        if scale_out is None or sc.numel() != scale_out.shape[1] * T * 4:
            raise ValueError(f"hidden_scale has {sc.numel()} bytes, expected {T} x num_layers x 4")
        scale_out[offset:offset + T] = sc.view(torch.float32).view(T, -1)


def planes_to_hidden(codec: str, planes: torch.Tensor, scale: torch.Tensor | None = None,
                     num_layers: int = 1) -> torch.Tensor:
    """Batch plane buffer -> bf16 [S, D] on the planes' device (run it on the GPU when training there)."""
    if codec == LOSSLESS:
        _, D, S = planes.shape
        # interleave the planes into [D, S] 16-bit words, then one 2-byte transpose (4x faster on the
        # CPU than permuting single bytes; on the GPU both are noise)
        words = torch.empty(D, S, 2, dtype=torch.uint8, device=planes.device)
        words[..., 0] = planes[0]
        words[..., 1] = planes[1]
        return words.view(torch.int16).view(D, S).t().contiguous().view(torch.bfloat16)
    D, S = planes.shape
    return _fp8_dequantize(planes.t().contiguous().view(torch.float8_e4m3fn).view(S, num_layers, D // num_layers),
                           scale)


def decode_hidden(codec: str, values: dict[str, memoryview], num_tokens: int, width: int,
                  num_layers: int) -> torch.Tensor:
    """One row -> bf16 [T, D] on the CPU (for verification, tests and small jobs)."""
    planes = torch.empty(planes_shape(codec, width, num_tokens), dtype=torch.uint8)
    scale = torch.empty(num_tokens, num_layers, dtype=torch.float32) if codec == FP8 else None
    decompress_hidden_into(codec, values, num_tokens, width, planes, scale, 0)
    return planes_to_hidden(codec, planes, scale, num_layers)


# --------------------------------------------------------------------------- top-k
def encode_split(x: torch.Tensor) -> bytes:
    """Any fixed-width CPU tensor -> zstd-1 of its byte planes (token-major)."""
    itemsize = x.element_size()
    u8 = x.contiguous().view(torch.uint8).view(-1, itemsize)
    return zstd_compress(as_u8(u8.t().contiguous()))


def decode_split(buf, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape))
    planes = u8_tensor(zstd_decompress(buf, count * itemsize)).view(itemsize, count)
    return planes.t().contiguous().view(dtype).view(shape)


def fp8_roundtrip(hidden_TD: torch.Tensor, num_layers: int) -> torch.Tensor:
    """[T, D] features -> bf16 [T, D], the values an fp8 cache gives back for them (`encode_hidden`'s
    quantisation, then `planes_to_hidden`'s dequantisation), on the tensor's device. Quantisation is per
    (token, layer), so rows of a packed batch come out as they would document by document. For bf16
    features (a bf16 target: what a lossless cache holds exactly) this is what training on an fp8 cache
    of the same extraction reads, to the bit."""
    T, D = hidden_TD.shape
    return _fp8_dequantize(*_fp8_quantize(hidden_TD.float().view(T, num_layers, D // num_layers)))


def fp8_error_terms(hidden_TD: torch.Tensor, doc_lens: list[int], num_layers: int) -> torch.Tensor:
    """fp8 round-trip error of a batch, on its device (no sync): [sum of per-token relative L2,
    max relative L2, min cosine, tokens]. Quantised exactly as `encode_hidden` does per document."""
    rec = fp8_roundtrip(hidden_TD, num_layers).float()
    ref = hidden_TD.float()
    rel = (rec - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    cos = torch.nn.functional.cosine_similarity(rec, ref, dim=-1)
    # torch.full, not torch.tensor(T, device=...): a host->device copy of a Python scalar would
    # synchronise the stream, i.e. wait for the forward
    return torch.stack([rel.sum(), rel.max(), cos.min(),
                        torch.full((), float(hidden_TD.shape[0]), device=rel.device)])
