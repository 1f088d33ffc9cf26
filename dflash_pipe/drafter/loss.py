"""Training loss and metrics of the drafter (SPEC §5), computed without materialising [Q, V] logits.

Loss. Slot k (1..B-1) of a block predicts `input_ids[anchor + k]`; slot 0 is the anchor itself
and never trained. Per-slot cross-entropy is weighted by w_k = exp(-(k-1)/gamma): early slots
matter most, because a draft is accepted only up to its first miss. The loss is
sum(w * CE) / sum(w) over valid slots (label != -100) of this rank's row.

KD (optional). The cache holds the target's top-k next-token log-probs. For slot k the teacher
is the target's prediction at position anchor+k-1 (it predicts anchor+k). The KD term is the
cross-entropy of the student against the teacher's top-k probabilities *plus one tail bucket*:
the teacher's remaining mass 1 - sum(top-k p) against the student's mass outside those ids.
Renormalising over the top-k alone would throw that mass away and under-count the KL (SPEC §2).
Total = (1 - kd_weight) * CE + kd_weight * KD, both with the same slot weights.

Memory. lm_head + log-softmax run over `loss_chunk_tokens` query rows at a time, each chunk under
activation checkpointing: only one chunk's fp32 logits exist at a time, in forward and again in
backward (8192 x 248,320 fp32 logits would be 8 GB).

Metrics (no grad, returned as sums and counts so the trainer can all-reduce them):
per-slot top-1 accuracy, and the simulated acceptance length tau of each block = 1 + the length
of the prefix of slots 1.. whose argmax equals the label (stopping at the first miss or invalid
label); a block counts when it has any valid label.

Two averages of those per-block tau values are reported. `tau` is their mean over the sampled
anchors (uniform over the response). `tau_walk` is their harmonic mean, num_blocks / sum(1/tau):
speculative decoding takes one step per block, so it spends its steps where acceptance is short,
and where tau is locally constant along a document, decoding it advances tau tokens per step, giving
tokens / steps = L / sum(len_r / tau_r) = the harmonic mean over positions. The arithmetic mean is
an upper bound on the real tau; `tau_walk` estimates it (BENCHMARKS.md, quality session 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import UsageError, ValidationError
from .fused_loss import fused_head_loss

IGNORE_INDEX = -100
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))  # DFlash recipe values (SPEC §5)


def default_gamma(block_size: int) -> float:
    """7 / 5 / 4 for B = 16 / 10 / 8; piecewise-linear between them, B/2 below 8, slope 1/3 above 16."""
    if block_size < 2:
        raise UsageError(f"block_size must be >= 2, got {block_size}")
    for (b0, g0), (b1, g1) in zip(_GAMMA_POINTS, _GAMMA_POINTS[1:]):
        if b0 <= block_size <= b1:
            return g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)
    if block_size < _GAMMA_POINTS[0][0]:
        return block_size / 2.0
    return _GAMMA_POINTS[-1][1] + (block_size - _GAMMA_POINTS[-1][0]) / 3.0


def slot_weights(block_size: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """[B] weights: 0 for slot 0, exp(-(k-1)/gamma) for k >= 1."""
    if not gamma > 0:
        raise UsageError(f"loss gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, device=device, dtype=torch.float64)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.to(dtype)


@dataclass
class KDTargets:
    """Teacher distribution for every query slot: ids/log-probs [N, B, K] (slot 0 unused)."""

    topk_ids_NBK: torch.Tensor
    topk_logprobs_NBK: torch.Tensor
    weight: float


def gather_kd_targets(topk_ids_SK: torch.Tensor, topk_logprobs_SK: torch.Tensor, anchor_index_N: torch.Tensor,
                      block_size: int, weight: float) -> KDTargets:
    """Per-slot teacher rows from the packed context's top-k: slot k uses context row anchor + k - 1.

    Rows past the end of the context are clamped; those slots must be masked by their labels (a
    label exists only when anchor + k is inside the same document, so row anchor + k - 1 is too).
    """
    s = topk_ids_SK.shape[0]
    offs = torch.arange(block_size, device=anchor_index_N.device, dtype=torch.int64) - 1
    rows = (anchor_index_N.to(torch.int64)[:, None] + offs[None, :]).clamp(0, s - 1)
    return KDTargets(topk_ids_SK[rows].to(torch.int64), topk_logprobs_SK[rows], float(weight))


def _chunk_terms(hidden_cH, lm_head_VH, labels_c, weights_c, kd_ids_cK, kd_lp_cK):
    """(sum w*CE, sum w*KD, argmax) of one chunk of query rows. Recomputed in backward."""
    if hidden_cH.dtype != lm_head_VH.dtype and not torch.is_autocast_enabled(hidden_cH.device.type):
        hidden_cH = hidden_cH.to(lm_head_VH.dtype)  # never upcast the [V, H] head (5 GB at 248k x 5120)
    logits = F.linear(hidden_cH, lm_head_VH)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(-1, labels_c.clamp(min=0)[:, None])[:, 0]
    ce_sum = (ce * weights_c.to(ce.dtype)).sum()
    if kd_ids_cK is not None:
        student_lp = logits.gather(-1, kd_ids_cK) - lse[:, None]
        teacher_p = torch.exp(kd_lp_cK.to(logits.dtype))
        teacher_tail = (1.0 - teacher_p.sum(-1)).clamp(min=0.0)
        # Student log-mass outside the teacher's ids: logsumexp with those ids pushed to the most
        # negative finite value (finite, so a tail of exactly zero gives 0 and a finite gradient).
        outside = logits.scatter(-1, kd_ids_cK, torch.finfo(logits.dtype).min)
        student_tail_lp = torch.logsumexp(outside, dim=-1) - lse
        kd = -(teacher_p * student_lp).sum(-1) - teacher_tail * student_tail_lp
        kd_sum = (kd * weights_c.to(kd.dtype)).sum()
    else:
        kd_sum = ce_sum.new_zeros(())
    return ce_sum, kd_sum, logits.argmax(-1)


def draft_loss(hidden_QH: torch.Tensor, lm_head_VH: torch.Tensor, labels_NB: torch.Tensor, block_size: int,
               gamma: float, loss_chunk_tokens: int, kd: KDTargets | None = None, fused: bool = False):
    """Weighted per-slot CE (+ optional top-k KD with tail bucket). Returns (loss, metrics).

    hidden_QH: drafter output [N*B, H]; lm_head_VH: frozen target head [V, H];
    labels_NB: int64, -100 = ignore (slot 0 is always ignored).
    metrics: tensors (detached) — loss_sum, ce_sum, kd_sum, weight_sum, correct_per_slot [B],
    valid_per_slot [B], tau_sum, inv_tau_sum, num_blocks; see `summarize_metrics`.
    """
    n, b = labels_NB.shape
    if b != block_size or hidden_QH.shape[0] != n * b:
        raise ValidationError(f"draft_loss: labels {tuple(labels_NB.shape)} / hidden {tuple(hidden_QH.shape)} do not "
                              f"match block_size {block_size}")
    if hidden_QH.shape[1] != lm_head_VH.shape[1]:
        raise ValidationError(f"draft_loss: hidden width {hidden_QH.shape[1]} != lm_head width {lm_head_VH.shape[1]}")
    if loss_chunk_tokens < 1:
        raise UsageError(f"loss_chunk_tokens must be >= 1, got {loss_chunk_tokens}")
    kd_weight = 0.0 if kd is None else float(kd.weight)
    if not 0.0 <= kd_weight <= 1.0:
        raise UsageError(f"kd_weight must be in [0, 1], got {kd_weight}")

    labels = labels_NB.to(torch.int64).clone()
    labels[:, 0] = IGNORE_INDEX
    valid_NB = labels != IGNORE_INDEX
    weights_NB = slot_weights(block_size, gamma, hidden_QH.device, torch.float64)[None, :] * valid_NB
    flat_labels, flat_weights = labels.reshape(-1), weights_NB.reshape(-1)
    kd_ids = kd_lp = None
    if kd is not None and kd_weight > 0:
        kd_ids = kd.topk_ids_NBK.reshape(n * b, -1).to(torch.int64)
        kd_lp = kd.topk_logprobs_NBK.reshape(n * b, -1)

    if fused:  # gradient computed in the forward pass, no logits recompute (fused_loss.py)
        loss, ce_sum, kd_sum, pred_flat = fused_head_loss(
            hidden_QH, lm_head_VH, flat_labels, flat_weights, kd_ids, kd_lp, kd_weight, loss_chunk_tokens)
        weight_sum = flat_weights.sum().to(ce_sum.dtype)
        total = (1.0 - kd_weight) * ce_sum + kd_weight * kd_sum
        preds = [pred_flat]
    else:
        ce_sum = kd_sum = hidden_QH.new_zeros((), dtype=torch.promote_types(hidden_QH.dtype, torch.float32))
        preds = []
        use_ckpt = torch.is_grad_enabled() and hidden_QH.requires_grad
        for start in range(0, n * b, loss_chunk_tokens):
            sl = slice(start, start + loss_chunk_tokens)
            args = (hidden_QH[sl], lm_head_VH, flat_labels[sl], flat_weights[sl],
                    None if kd_ids is None else kd_ids[sl], None if kd_lp is None else kd_lp[sl])
            if use_ckpt:
                c_ce, c_kd, c_pred = checkpoint(_chunk_terms, *args, use_reentrant=False)
            else:
                c_ce, c_kd, c_pred = _chunk_terms(*args)
            ce_sum = ce_sum + c_ce
            kd_sum = kd_sum + c_kd
            preds.append(c_pred)
        weight_sum = flat_weights.sum().to(ce_sum.dtype)
        total = (1.0 - kd_weight) * ce_sum + kd_weight * kd_sum
        # A row without any valid slot gives loss 0 with zero gradients (no NaN, no host sync).
        loss = total / weight_sum.clamp(min=1e-6)

    with torch.no_grad():
        pred_NB = torch.cat(preds).reshape(n, b)
        hit_NB = (pred_NB == labels) & valid_NB
        accepted = torch.cumprod(hit_NB[:, 1:].to(torch.int64), dim=1).sum(dim=1)
        block_counts = valid_NB[:, 1:].any(dim=1)
        metrics = {
            "loss_sum": total.detach(),
            "ce_sum": ce_sum.detach(),
            "kd_sum": kd_sum.detach(),
            "weight_sum": weight_sum.detach(),
            "correct_per_slot": hit_NB.sum(dim=0),
            "valid_per_slot": valid_NB.sum(dim=0),
            "tau_sum": ((1 + accepted) * block_counts).sum(),
            "inv_tau_sum": (block_counts / (1 + accepted).to(torch.float32)).sum(),
            "num_blocks": block_counts.sum(),
        }
    return loss, metrics


def summarize_metrics(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sums/counts (possibly all-reduced over ranks) -> loss, ce, kd, acc, acc_k (k = 1..B-1), tau, tau_walk."""
    def ratio(a, b):
        b = float(b)
        return float(a) / b if b > 0 else math.nan

    out = {
        "loss": ratio(metrics["loss_sum"], metrics["weight_sum"]),
        "ce": ratio(metrics["ce_sum"], metrics["weight_sum"]),
        "kd": ratio(metrics["kd_sum"], metrics["weight_sum"]),
        "acc": ratio(metrics["correct_per_slot"].sum(), metrics["valid_per_slot"].sum()),
        "tau": ratio(metrics["tau_sum"], metrics["num_blocks"]),
    }
    if "inv_tau_sum" in metrics:
        out["tau_walk"] = ratio(metrics["num_blocks"], metrics["inv_tau_sum"])
    correct, valid = metrics["correct_per_slot"].tolist(), metrics["valid_per_slot"].tolist()
    for k in range(1, len(correct)):
        out[f"acc_{k}"] = ratio(correct[k], valid[k])
    return out
