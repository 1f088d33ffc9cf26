"""Checks of a top-k of log_softmax against a float64 reference, exact up to the order of tied logits."""

from __future__ import annotations

import torch


def fp16_close(got_fp16: torch.Tensor, ref_f64: torch.Tensor) -> None:
    """Within one fp16 rounding step of the float64 value (what an fp16 store can promise)."""
    err = (got_fp16.double() - ref_f64).abs()
    ulp = torch.finfo(torch.float16).eps * ref_f64.abs().clamp_min(2 ** -14)
    assert bool((err <= ulp).all()), float((err / ulp).max())


def assert_valid_topk(ids: torch.Tensor, lp: torch.Tensor, logits: torch.Tensor, k: int) -> None:
    """`ids` / `lp` are a top-k of log_softmax(logits) (any float dtype, rows = tokens).

    The reference is float64. Position by position, the reference log-prob of each returned id
    must EQUAL the reference's j-th largest value, and ids must be distinct per row: so the ids
    may differ from the reference's only by permutations among exactly tied logits (including
    which of several tied values at the k-th place made it in). The log-probs must be within one
    fp16 rounding step of the reference values, and descending.
    """
    assert ids.shape == lp.shape == (logits.shape[0], k)
    assert ids.dtype == torch.int32 and lp.dtype == torch.float16
    ref = torch.log_softmax(logits.double(), dim=-1)
    ref_vals, _ = ref.topk(k, dim=-1)
    picked = ref.gather(-1, ids.long())
    bad = (picked != ref_vals).any(-1)
    assert not bool(bad.any()), f"rows {bad.nonzero()[:5, 0].tolist()} are not a top-{k}"
    srt = ids.sort(-1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()), "repeated id in a row"
    fp16_close(lp, ref_vals)
    assert bool((lp[:, :-1] >= lp[:, 1:]).all())


def tied_bf16_logits(rows: int, vocab: int, k: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """Random bf16 logits (many natural ties at bf16 resolution) plus crafted tie rows:
    row 0 all equal; row 1 k + 3 copies of its maximum; row 2 the k-th value tied 5 ways across the
    boundary (k - 2 distinct larger values, then 5 equal ones)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g, device=device) * 3).to(torch.bfloat16)
    x[0] = 0.5
    x[1, torch.randperm(vocab, generator=g, device=device)[:k + 3]] = 20.0
    x[2, :k - 2] = torch.arange(k - 2, device=device, dtype=torch.bfloat16) + 30
    x[2, k - 2:k + 3] = 25.0
    return x
