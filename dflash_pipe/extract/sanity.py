"""Write-time sanity checks on target features.

A serving engine once shipped an all-zero feature bug: drafters trained on it looked fine and
accepted nothing. So every document is checked before it is written: no NaN/Inf, no all-zero
layer, no layer whose tokens are all identical. The statistics are computed on the device and
copied to the host with the features, so the check never stalls the GPU with a synchronisation;
the compression worker evaluates them.

`feature_stats` is batched, not a loop over documents: a fixed number of kernels per layer whatever
the number of documents, no host sync (the layout reaches the device as one small pinned copy), and
temporaries of one layer's size ([T, H]; on CUDA at most one in float32), never a float32 copy of
the batch. Per-token sums come from reductions that read bf16 and accumulate in fp32; per-document
sums from one-hot matmuls (deterministic, unlike atomics; products with 1.0 and 0.0 are exact), with
NaN/Inf kept out of them so that a bad document cannot poison the others' statistics.

The deviation is two-pass: subtract the document's mean token (fp32), then square. The one-pass
E[x^2] - mean^2 in fp32 loses ~sqrt(eps) ~ 3e-4 of the RMS to cancellation, above the 1e-4 collapse
threshold. Two-pass, identical tokens leave only the mean's rounding (<= 2^-24 of the RMS), and an
error e in the mean adds only n * e^2 (sum over tokens of x - mean is zero), so no float64 pass over
the features is needed.
"""

from __future__ import annotations

import itertools

import torch

from ..errors import DegenerateFeatures

COLLAPSE_REL = 1e-4  # token-to-token spread / RMS below this = every token carries the same vector


def _doc_sums(onehot_DT: torch.Tensor, q_TK: torch.Tensor) -> torch.Tensor:
    """float64 [D, K] per-document sums of per-token values >= 0. A NaN/Inf stays in its own document
    (a bare one-hot matmul would spread it, 0 * NaN = NaN): sum the finite values, then restore it."""
    flags = torch.cat([q_TK.nan_to_num(0.0, 0.0, 0.0), q_TK.isnan(), q_TK == float("inf")], 1)
    val, nan, inf = (onehot_DT @ flags.double()).chunk(3, 1)
    return val.masked_fill(inf > 0, float("inf")).masked_fill(nan > 0, float("nan"))


def feature_stats(hidden_TD: torch.Tensor, doc_lens: list[int], num_layers: int) -> torch.Tensor:
    """float32 [num_docs, num_layers, 3]: (non-finite count, RMS, RMS of deviation from the doc mean).

    `doc_lens` are the lengths of the contiguous documents packed into the T rows of `hidden_TD`.
    A document-layer with a NaN/Inf gets a NaN deviation and a NaN (any NaN) or Inf RMS, as the
    plain per-document formulas give; the other documents are unaffected.
    """
    T, device = hidden_TD.shape[0], hidden_TD.device
    assert sum(doc_lens) == T, (sum(doc_lens), T)
    D, L = len(doc_lens), num_layers
    x = hidden_TD.view(T, L, -1)
    H = x.shape[-1]
    bounds = torch.tensor([0, *itertools.accumulate(doc_lens)], dtype=torch.int64, pin_memory=device.type == "cuda")
    bounds = bounds.to(device, non_blocking=True)  # the only host->device copy: stream-ordered, no sync
    doc_T = torch.searchsorted(bounds[1:], torch.arange(T, device=device), right=True)
    onehot_DT = doc_T == torch.arange(D, device=device)[:, None]
    n_D = bounds.diff().double()
    onehot64 = onehot_DT.double()
    # bf16 on CUDA is read in place (document sums: torch.mm with out_dtype, CUDA-only, fp32 accumulation).
    # Elsewhere (CPU, where bf16 arithmetic is slow; fp32 input) the layer is copied to fp32 and the document
    # sums are float64, which no TF32 setting can touch
    lowp = hidden_TD.is_cuda and hidden_TD.dtype in (torch.bfloat16, torch.float16)
    onehot_lp = onehot_DT.to(hidden_TD.dtype) if lowp else None
    bad, ss, dev = [], [], []
    for li in range(L):  # per layer, so that temporaries are [T, H], never [T, L * H]
        x_TH = x[:, li] if lowp else x[:, li].float()
        # x * 0 is NaN exactly where x is NaN/Inf, and ord=0 counts non-zeros (summing a bool mask would
        # upcast it to an int64 copy first)
        bad.append(torch.linalg.vector_norm(x_TH * 0, ord=0, dim=-1, dtype=torch.float32))
        ss.append(torch.linalg.vector_norm(x_TH, dim=-1, dtype=torch.float32))
        xs = x_TH.nan_to_num(0.0, 0.0, 0.0)  # NaN/Inf -> 0: in a matmul they would reach every document
        if lowp:
            sums = torch.mm(onehot_lp, xs, out_dtype=torch.float32)
        elif device.type == "cpu":  # serial there, so deterministic, and O(T * H) rather than O(D * T * H)
            sums = torch.zeros(D, H, dtype=torch.float64).index_add_(0, doc_T, xs.double())
        else:
            sums = onehot64 @ xs.double()
        del xs
        g = (sums / n_D[:, None]).float().index_select(0, doc_T)  # the token's document mean
        dev.append(torch.linalg.vector_norm(g.sub_(x_TH), dim=-1))  # |mean - x|: two-pass, no cancellation
        del g
    q = torch.cat([torch.stack(bad, 1), torch.stack(ss + dev, 1).double().square()], 1)
    s = _doc_sums(onehot64, q).view(D, 3, L)
    mean_sq = s[:, 1:] / (n_D * H)[:, None, None]
    dev_D = mean_sq[:, 1].sqrt().masked_fill(s[:, 0] > 0, float("nan"))
    return torch.stack([s[:, 0], mean_sq[:, 0].sqrt(), dev_D], -1).float()


def check_doc(stats_L3: torch.Tensor, sample_id: str, num_tokens: int, layer_ids: list[int]) -> None:
    """Raise DegenerateFeatures naming the sample and layer; `stats_L3` is one row of feature_stats."""
    for li, (bad, rms, dev) in enumerate(stats_L3.tolist()):
        layer = layer_ids[li]
        where = f"sample {sample_id}, target layer {layer}"
        hint = ("the target produced unusable features; check the model weights, dtype (fp16 overflow?) "
                "and the kernel path; pass --no-sanity-check only if you know why")
        if bad > 0:
            raise DegenerateFeatures(f"{where}: {int(bad)} non-finite feature values (NaN/Inf)", hint)
        if rms == 0.0:
            raise DegenerateFeatures(f"{where}: all features are exactly zero", hint)
        if num_tokens >= 4 and dev < COLLAPSE_REL * rms:
            raise DegenerateFeatures(f"{where}: all {num_tokens} tokens have the same feature vector "
                                     f"(spread/RMS = {dev / rms:.2e})", hint)


def layer_rms_summary(stats_NL3: torch.Tensor, doc_lens: list[int], layer_ids: list[int]) -> dict:
    """Token-weighted RMS sums per layer, for the manifest (merged by summing)."""
    w = torch.tensor(doc_lens, dtype=torch.float32)
    sums = (stats_NL3[:, :, 1] * w[:, None]).sum(0).tolist()
    return {f"layer_{layer}_rms_x_tokens": s for layer, s in zip(layer_ids, sums)}
