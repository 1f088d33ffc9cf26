"""Codec round trips: lossless is bit-exact (incl. NaN/Inf/denormals), fp8 within its bound."""

import numpy as np
import pytest
import torch

from dflash_pipe.cache.codec import (FP8, LOSSLESS, compress_hidden, decode_hidden, decode_split, encode_hidden,
                                     encode_split, planes_to_hidden)
from tests.cache_helpers import heavy_tailed


def _roundtrip(hidden, codec, num_layers):
    enc = encode_hidden(hidden, codec, num_layers)
    values = {k: memoryview(v if isinstance(v, bytes) else v.tobytes()) for k, v in compress_hidden(enc).items()}
    return decode_hidden(codec, values, hidden.shape[0], hidden.shape[1], num_layers)


def test_lossless_is_bit_exact_on_random_bits():
    # every 16-bit pattern, including NaNs with payloads, +-Inf, denormals and -0
    all_bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    hidden = all_bits[torch.randperm(65536)].view(torch.bfloat16).view(512, 128)
    out = _roundtrip(hidden, LOSSLESS, 2)
    assert torch.equal(out.view(torch.int16), hidden.view(torch.int16))


def test_lossless_is_bit_exact_on_activation_like_data():
    hidden = heavy_tailed(333, 96, seed=1)
    out = _roundtrip(hidden, LOSSLESS, 3)
    assert torch.equal(out.view(torch.int16), hidden.view(torch.int16))


def test_lossless_compresses_activation_like_data():
    hidden = heavy_tailed(2048, 256, seed=2)
    vals = compress_hidden(encode_hidden(hidden, LOSSLESS, 1))
    stored = len(vals["hidden_hi"]) + vals["hidden_lo"].nbytes
    assert stored < 0.8 * hidden.numel() * 2


def test_planes_layout_is_channel_major_byte_split():
    hidden = heavy_tailed(7, 5, seed=3)
    enc = encode_hidden(hidden, LOSSLESS, 1)
    bits = hidden.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(enc.planes[1].to(torch.int32), (bits >> 8).t())
    assert torch.equal(enc.planes[0].to(torch.int32), (bits & 0xFF).t())


def test_fp8_error_within_bound_per_token_and_layer():
    num_layers, H = 4, 64
    hidden = heavy_tailed(300, num_layers * H, seed=4)
    # one layer much smaller than the others: a single per-token scale would underflow it
    hidden = hidden.view(300, num_layers, H)
    hidden[:, 2] *= 1e-3
    hidden = hidden.view(300, -1)
    out = _roundtrip(hidden, FP8, num_layers).float().view(300, num_layers, H)
    ref = hidden.float().view(300, num_layers, H)
    rel = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 per element, bf16 output adds 2^-9
    assert rel.max().item() < 2 ** -4 + 2 ** -8
    assert torch.isfinite(out).all()


def test_fp8_zero_layer_stays_zero():
    hidden = torch.zeros(5, 8, dtype=torch.bfloat16)
    hidden[:, 4:] = 1.5
    out = _roundtrip(hidden, FP8, 2)
    assert torch.equal(out, hidden)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float16])
def test_split_roundtrip(dtype):
    x = (torch.randn(50, 7) * 1000).to(dtype)
    assert torch.equal(decode_split(encode_split(x), dtype, (50, 7)), x)


def test_planes_to_hidden_matches_on_batch_buffer():
    a, b = heavy_tailed(3, 10, 5), heavy_tailed(4, 10, 6)
    planes = torch.zeros(2, 10, 9, dtype=torch.uint8)
    for off, h in ((0, a), (3, b)):
        planes[:, :, off:off + h.shape[0]] = encode_hidden(h, LOSSLESS, 1).planes
    out = planes_to_hidden(LOSSLESS, planes)
    assert torch.equal(out[:3], a) and torch.equal(out[3:7], b)
    assert np.all(out[7:].view(torch.int16).numpy() == 0)
