"""lm_head + loss with the gradient computed in the forward pass (no logits recompute).

The checkpointed chunk loop in loss.py keeps memory bounded but runs every chunk's lm_head GEMM
twice (forward, then again in backward). At the seed's size that recompute is 2 x 8192 x 248,320
x 5120 = 21 TFLOP, about a tenth of the step. Here each chunk computes its logits once, turns
them into d(loss)/d(logits) on the spot (softmax minus the target distribution, times the slot
weight) and multiplies back through the frozen head, so only the [Q, H] gradient is kept:

    CE:  dL/dz = w * (softmax(z) - onehot(label))
    KD:  L = -sum_k p_k log q_k - t log Q_out,  q = softmax(z), Q_out = student mass outside the
         teacher's ids, t = teacher tail mass:
         dL/dz_i = w * (q_i (sum_k p_k + t) - [i in K] p_i - [i not in K] t q_i / Q_out)

Backward then only scales the stored gradient. The head is frozen, so no weight gradient is
needed. Same results as the unfused path (tests compare both against float64 math).
"""

from __future__ import annotations

import torch


def _grad_logits(logits, labels_c, w_c, kd_ids_cK, kd_lp_cK, kd_weight: float, out_dtype: torch.dtype):
    """[c, V] logits -> (CE sum, KD sum, argmax, dL/dz in out_dtype). Pure elementwise + row reductions:
    on CUDA it runs compiled, so the fp32 [c, V] intermediates never reach memory (eager, this part
    makes ~8 passes over a 0.5 GB fp32 buffer per 512-token chunk; compiled, 2 reads of the bf16 logits
    and 1 write of the bf16 gradient)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(acc)
    lse = torch.logsumexp(logits, dim=-1)
    safe_labels = labels_c.clamp(min=0)
    ce = lse - logits.gather(-1, safe_labels[:, None])[:, 0]
    pred = logits.argmax(-1)
    ce_sum = (ce * w_c).sum()
    q = torch.exp(logits - lse[:, None])
    ce_w = (1.0 - kd_weight) * w_c
    grad_z = (q * ce_w[:, None]).scatter_add(-1, safe_labels[:, None], -ce_w[:, None])
    kd_sum = ce_sum.new_zeros(())
    if kd_ids_cK is not None:
        p = torch.exp(kd_lp_cK.to(acc))
        tail = (1.0 - p.sum(-1)).clamp(min=0.0)
        # The student's mass outside the teacher's ids in log space, from the logits with those ids masked: not
        # 1 - sum(q_ids), which loses every digit once the student puts more than ~1 - 1e-7 on the ids (a
        # confident drafter on an easy token); until session 27 that noise, divided by a clamped Q_out, made
        # the gradient ~2,000x too large on such rows. q_i / Q_out = exp(z_i - lse_out) off the ids, 0 on them.
        outside = logits.scatter(-1, kd_ids_cK, torch.finfo(acc).min)   # as loss.py: finite, exp() gives 0
        lse_out = torch.logsumexp(outside, dim=-1)
        lq_ids = logits.gather(-1, kd_ids_cK) - lse[:, None]
        kd = -(p * lq_ids).sum(-1) - tail * (lse_out - lse)
        kd_sum = (kd * w_c).sum()
        kw = kd_weight * w_c
        # q_i (sum p + t) on every i, - t q_i / Q_out off the teacher's ids, - p_i on them
        grad_z = grad_z + q * ((p.sum(-1) + tail) * kw)[:, None] - torch.exp(outside - lse_out[:, None]) * \
            (tail * kw)[:, None]
        grad_z = grad_z.scatter_add(-1, kd_ids_cK, -p * kw[:, None])
    return ce_sum, kd_sum, pred, grad_z.to(out_dtype)


_GRAD_LOGITS_COMPILED = torch.compile(_grad_logits, dynamic=False)
_COMPILE = {"on": True}


def set_compiled_loss(enabled: bool) -> None:
    """Use the compiled `_grad_logits` on CUDA (default) or always the eager one (tests, debugging)."""
    _COMPILE["on"] = bool(enabled)


def _chunk(h_cH, W_VH, labels_c, w_c, kd_ids_cK, kd_lp_cK, kd_weight, norm):
    logits = h_cH.to(W_VH.dtype) @ W_VH.t()  # bf16 GEMM on GPU (fp32 accumulate), then fp32 math
    fn = _GRAD_LOGITS_COMPILED if (logits.is_cuda and _COMPILE["on"]) else _grad_logits
    ce_sum, kd_sum, pred, grad_z = fn(logits, labels_c, w_c, kd_ids_cK, kd_lp_cK, kd_weight, W_VH.dtype)
    grad_h = (grad_z @ W_VH).to(h_cH.dtype) / norm
    return ce_sum, kd_sum, pred, grad_h


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_QH, lm_head_VH, labels, weights, kd_ids, kd_lp, kd_weight, chunk, norm):
        grads, preds = [], []
        ce_total = kd_total = hidden_QH.new_zeros((), dtype=torch.promote_types(hidden_QH.dtype, torch.float32))
        for start in range(0, hidden_QH.shape[0], chunk):
            sl = slice(start, start + chunk)
            ce_s, kd_s, pred, g = _chunk(hidden_QH[sl], lm_head_VH, labels[sl], weights[sl],
                                         None if kd_ids is None else kd_ids[sl],
                                         None if kd_lp is None else kd_lp[sl], kd_weight, norm)
            ce_total = ce_total + ce_s
            kd_total = kd_total + kd_s
            preds.append(pred)
            grads.append(g)
        ctx.save_for_backward(torch.cat(grads))
        loss = ((1.0 - kd_weight) * ce_total + kd_weight * kd_total) / norm
        ctx.mark_non_differentiable(ce_total, kd_total)
        return loss, ce_total, kd_total, torch.cat(preds)

    @staticmethod
    def backward(ctx, g_loss, *_):
        (grad_h,) = ctx.saved_tensors
        return grad_h * g_loss.to(grad_h.dtype), None, None, None, None, None, None, None, None


def fused_head_loss(hidden_QH, lm_head_VH, labels, weights, kd_ids, kd_lp, kd_weight: float, chunk: int):
    """(loss, ce_sum, kd_sum, argmax) with loss = ((1-a) CE + a KD) / sum(weights); see module doc."""
    weights = weights.to(torch.promote_types(hidden_QH.dtype, torch.float32))
    norm = weights.sum().clamp(min=1e-6)
    return _FusedHeadLoss.apply(hidden_QH, lm_head_VH, labels, weights, kd_ids, kd_lp, float(kd_weight), int(chunk),
                                norm)
