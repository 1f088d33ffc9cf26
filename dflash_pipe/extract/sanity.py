"""Write-time sanity checks on target features.

A serving engine once shipped an all-zero feature bug: drafters trained on it looked fine and
accepted nothing. So every document is checked before it is written: no NaN/Inf, no all-zero
layer, no layer whose tokens are all identical. The statistics are computed on the device
(cheap reductions) and copied to the host with the features, so the check never stalls the
GPU with a synchronisation; the compression worker evaluates them.
"""

from __future__ import annotations

import torch

from ..errors import DegenerateFeatures

COLLAPSE_REL = 1e-4  # token-to-token spread / RMS below this = every token carries the same vector


def feature_stats(hidden_TD: torch.Tensor, doc_lens: list[int], num_layers: int) -> torch.Tensor:
    """float32 [num_docs, num_layers, 3]: (non-finite count, RMS, RMS of deviation from the doc mean)."""
    out = []
    start = 0
    for T in doc_lens:
        x = hidden_TD[start:start + T].float().view(T, num_layers, -1)
        start += T
        bad = (~torch.isfinite(x)).sum(dim=(0, 2)).float()
        rms = x.pow(2).mean(dim=(0, 2)).sqrt()
        dev = (x - x.mean(dim=0, keepdim=True)).pow(2).mean(dim=(0, 2)).sqrt()
        out.append(torch.stack([bad, rms, dev], dim=-1))
    return torch.stack(out)


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
