"""feature_stats, the batched write-time statistics, against a per-document float64 reference."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_pipe.errors import DegenerateFeatures
from dflash_pipe.extract.sanity import COLLAPSE_REL, check_doc, feature_stats

L, H = 3, 40
LAYOUTS = {"one_doc": [64], "many_with_singletons": [1, 1, 7, 1, 2, 30, 1, 1, 5, 1],
           "unequal": [100, 3, 57, 1, 19]}


def reference(hidden: torch.Tensor, lens: list[int], layers: int) -> torch.Tensor:
    """The plain definition, one document at a time, in float64."""
    out, start = [], 0
    for n in lens:
        x = hidden[start:start + n].double().view(n, layers, -1)
        start += n
        bad = (~torch.isfinite(x)).sum((0, 2)).double()
        rms = x.pow(2).mean((0, 2)).sqrt()
        dev = (x - x.mean(0, keepdim=True)).pow(2).mean((0, 2)).sqrt()
        out.append(torch.stack([bad, rms, dev], -1))
    return torch.stack(out)


def features(lens: list[int], seed: int = 0, dtype=torch.bfloat16, layers: int = L, width: int = H) -> torch.Tensor:
    """Random features with per-channel offsets (the mean token is far from zero: dev is well below rms)."""
    g = torch.Generator().manual_seed(seed)
    offset = 4 * torch.randn(layers * width, generator=g)
    scale = torch.rand(layers * width, generator=g) + 0.1
    return (offset + scale * torch.randn(sum(lens), layers * width, generator=g)).to(dtype)


@pytest.mark.parametrize("lens", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_float64_per_document_reference(lens, dtype):
    h = features(lens, dtype=dtype)
    got, ref = feature_stats(h, lens, L), reference(h, lens, L)
    assert got.dtype == torch.float32 and got.shape == (len(lens), L, 3)
    assert torch.equal(got[..., 0], torch.zeros(len(lens), L))
    torch.testing.assert_close(got[..., 1:].double(), ref[..., 1:], rtol=1e-5, atol=0)
    assert torch.equal(got[torch.tensor(lens) == 1, :, 2], torch.zeros(lens.count(1), L))  # one token: no spread


def test_non_finite_values_are_counted_in_their_own_document_and_layer():
    lens = [6, 1, 9, 4]
    h = features(lens)
    h[2, H + 3] = h[5, H + 7] = float("nan")  # doc 0, layer 1: two
    h[6, 5] = float("inf")  # doc 1 (one token), layer 0
    h[10, 2 * H] = float("-inf")  # doc 2, layer 2: one -Inf and one NaN
    h[14, 2 * H + 9] = float("nan")
    got = feature_stats(h, lens, L)
    want = torch.zeros(len(lens), L)
    want[0, 1], want[1, 0], want[2, 2] = 2, 1, 2
    assert torch.equal(got[..., 0], want)
    torch.testing.assert_close(got.double(), reference(h, lens, L), rtol=1e-5, atol=0, equal_nan=True)
    assert got[1, 0, 1] == float("inf") and got[0, 1, 1:].isnan().all() and got[2, 2, 1:].isnan().all()
    clean = want == 0
    assert got[..., 1:][clean].isfinite().all()  # nothing leaked into the other documents or layers
    with pytest.raises(DegenerateFeatures, match="2 non-finite"):
        check_doc(got[0], "s0", lens[0], [10, 20, 30])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_collapsed_documents_are_flagged_and_a_normal_one_is_not(dtype):
    lens = [32, 32, 32, 3]
    h = features(lens, seed=1, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    h[32:64] = h[32]  # every token identical
    h[64:96] = h[64] * (1 + 1e-6 * torch.randn(32, L * H, generator=g))  # identical up to 1e-6 (relative)
    h = h.to(dtype)
    got = feature_stats(h, lens, L)
    rel = got[..., 2] / got[..., 1]
    assert (rel[0] > 0.05).all() and (rel[1:3] < COLLAPSE_REL).all()
    if dtype == torch.float32:  # the 1e-6 spread is resolved, not lost in cancellation
        assert (rel[2] > 1e-7).all()
        torch.testing.assert_close(got[2].double(), reference(h, lens, L)[2], rtol=1e-3, atol=0)
    check_doc(got[0], "ok", 32, [1, 2, 3])
    check_doc(got[3], "short", 3, [1, 2, 3])  # < 4 tokens: never called collapsed
    for i in (1, 2):
        with pytest.raises(DegenerateFeatures, match="all 32 tokens have the same feature vector"):
            check_doc(got[i], f"s{i}", 32, [1, 2, 3])


def test_bitwise_deterministic():
    lens = LAYOUTS["unequal"]
    h = features(lens, seed=3)
    assert torch.equal(feature_stats(h, lens, L), feature_stats(h, lens, L))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_fixed_op_sequence_whatever_the_number_of_documents_and_no_host_reads():
    h = features([64])
    seqs = []
    for lens in ([64], [1] * 64, [10, 1, 53]):
        with _Ops() as rec:
            feature_stats(h, lens, L)
        seqs.append(rec.ops)
    assert seqs[0] == seqs[1] == seqs[2]
    host_reads = [op for op in seqs[0] if any(s in op for s in ("_local_scalar_dense", "nonzero", "item"))]
    assert not host_reads


@pytest.mark.gpu
def test_cuda_matches_the_reference_without_a_host_sync():
    lens = [1, 700, 3, 2000, 1, 1391] + [1] * 10
    layers, width = 5, 512
    h = features(lens, seed=4, layers=layers, width=width)
    h[800, width + 1] = float("nan")
    hc = h.cuda()
    feature_stats(hc, lens, layers)  # warm-up: first-use allocations and library handles
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            got = feature_stats(hc, lens, layers)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not [str(w.message) for w in rec if "synchronizing CUDA operation" in str(w.message)]
    torch.testing.assert_close(got.cpu().double(), reference(h, lens, layers), rtol=1e-5, atol=0, equal_nan=True)
    torch.testing.assert_close(got, feature_stats(hc, lens, layers), rtol=0, atol=0, equal_nan=True)  # bitwise
