"""Chunked loss == unchunked float64 loops (values and gradients); KD with tail bucket; tau/accuracy."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_pipe.drafter.loss import (KDTargets, default_gamma, draft_loss, gather_kd_targets, slot_weights,
                                      summarize_metrics)
from dflash_pipe.errors import UsageError

N, B, H, V, K = 5, 6, 12, 40, 4


def make_case(seed=0, kd_weight=0.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N * B, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N, B), generator=g)
    labels[:, 0] = 7            # slot 0 must be ignored even when it carries a token
    labels[1, 3:] = -100        # block that runs past its document
    labels[4, :] = -100         # padding block
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N * B)]).view(N, B, K)
    raw = torch.randn(N, B, K + 1, generator=g, dtype=torch.float64)
    lp = torch.log_softmax(raw, dim=-1)[..., :K]  # top-k of a distribution with tail mass left over
    lp[0, 2] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))  # a row with zero tail
    kd = KDTargets(ids, lp.to(torch.float16), kd_weight) if kd_weight else None
    return hidden, head, labels, kd


def reference_loss(hidden, head, labels, gamma, kd):
    logits = hidden @ head.T
    logp = torch.log_softmax(logits, dim=-1)
    num = hidden.new_zeros(())
    den = 0.0
    for j in range(N):
        for k in range(1, B):
            lab = int(labels[j, k])
            if lab == -100:
                continue
            w = math.exp(-(k - 1) / gamma)
            row = j * B + k
            term = -logp[row, lab]
            if kd is not None:
                ids = kd.topk_ids_NBK[j, k]
                p = torch.exp(kd.topk_logprobs_NBK[j, k].double())
                tail = max(0.0, 1.0 - float(p.sum()))
                q = torch.softmax(logits[row], dim=-1)
                q_tail = 1.0 - q[ids].sum()
                kd_term = -(p * torch.log(q[ids])).sum() - tail * torch.log(q_tail)
                term = (1 - kd.weight) * term + kd.weight * kd_term
            num = num + w * term
            den += w
    return num / den


@pytest.mark.parametrize("kd_weight", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("chunk", [1, 7, N * B, 1000])
def test_chunked_loss_and_grads_equal_float64_reference(chunk, kd_weight):
    hidden, head, labels, kd = make_case(1, kd_weight)
    gamma = 2.5
    h1 = hidden.clone().requires_grad_()
    loss, metrics = draft_loss(h1, head, labels, B, gamma, chunk, kd)
    h2 = hidden.clone().requires_grad_()
    ref = reference_loss(h2, head, labels, gamma, kd)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    (g1,) = torch.autograd.grad(loss, h1)
    (g2,) = torch.autograd.grad(ref, h2)
    torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-12)
    assert float(metrics["loss_sum"] / metrics["weight_sum"]) == pytest.approx(float(ref.detach()), rel=1e-10)
    assert summarize_metrics(metrics)["loss"] == pytest.approx(float(ref.detach()), rel=1e-10)


def test_kd_tail_bucket_differs_from_renormalised_topk():
    """The tail term is really there: dropping it (renormalising the teacher) gives another value."""
    hidden, head, labels, kd = make_case(2, 1.0)
    loss, _ = draft_loss(hidden, head, labels, B, 3.0, 8, kd)
    renorm = KDTargets(kd.topk_ids_NBK, torch.log_softmax(kd.topk_logprobs_NBK.double(), -1), 1.0)
    loss_renorm, _ = draft_loss(hidden, head, labels, B, 3.0, 8, renorm)
    assert abs(float(loss) - float(loss_renorm)) > 1e-3


def test_tau_and_accuracy_on_hand_made_blocks():
    vocab = hid = 8
    head = torch.eye(vocab, dtype=torch.float64)
    blocks = [  # (predicted tokens per slot, labels per slot); slot 0 entries are irrelevant
        ([0, 1, 2, 3, 4, 5], [9, 1, 2, 6, 4, 5]),           # miss at slot 3 -> tau 3
        ([0, 1, 2, 3, 4, 5], [0, 1, -100, 3, 4, 5]),        # invalid label at slot 2 stops -> tau 2
        ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]),           # all accepted -> tau B
        ([0, 7, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]),           # first slot wrong -> tau 1
        ([0, 1, 2, 3, 4, 5], [-100] * 6),                   # padding block: not counted
        ([3, 3, 3, 3, 3, 3], [3, 3, 3, -100, -100, -100]),  # runs out of document -> tau 3
    ]
    preds = torch.tensor([p for p, _ in blocks])
    labels = torch.tensor([lab for _, lab in blocks])
    labels = torch.where(labels >= vocab, torch.zeros_like(labels), labels)  # slot 0 "9" -> any token
    hidden = 5.0 * torch.nn.functional.one_hot(preds.view(-1), vocab).to(torch.float64)
    assert hidden.shape[1] == hid
    _, m = draft_loss(hidden, head, labels, 6, 4.0, 5)

    taus, correct, valid = [], [0] * 6, [0] * 6
    for p, lab in zip(preds.tolist(), labels.tolist()):
        if all(x == -100 for x in lab[1:]):
            continue
        t = 1
        for k in range(1, 6):
            if lab[k] == -100 or p[k] != lab[k]:
                break
            t += 1
        taus.append(t)
        for k in range(1, 6):
            if lab[k] != -100:
                valid[k] += 1
                correct[k] += int(p[k] == lab[k])
    assert taus == [3, 2, 6, 1, 3]
    assert int(m["num_blocks"]) == len(taus) and int(m["tau_sum"]) == sum(taus)
    assert m["correct_per_slot"].tolist() == correct and m["valid_per_slot"].tolist() == valid
    s = summarize_metrics(m)
    assert s["tau"] == pytest.approx(sum(taus) / len(taus))
    assert s["tau_walk"] == pytest.approx(len(taus) / sum(1.0 / t for t in taus))  # harmonic mean
    assert s["acc_1"] == pytest.approx(correct[1] / valid[1])


def test_row_without_valid_labels_gives_zero_loss_and_zero_grads():
    hidden, head, labels, _ = make_case(3)
    h = hidden.clone().requires_grad_()
    loss, m = draft_loss(h, head, torch.full_like(labels, -100), B, 7.0, 4)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(h.grad, torch.zeros_like(h))
    assert int(m["num_blocks"]) == 0 and math.isnan(summarize_metrics(m)["tau"])


def test_slot_weights_and_default_gamma():
    w = slot_weights(16, 7.0, dtype=torch.float64)
    assert float(w[0]) == 0.0
    assert [float(x) for x in w[1:]] == pytest.approx([math.exp(-(k - 1) / 7.0) for k in range(1, 16)])
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)  # SPEC §5
    seq = [default_gamma(b) for b in range(2, 40)]
    assert all(b > a for a, b in zip(seq, seq[1:]))  # monotone, no jumps at the table points
    with pytest.raises(UsageError):
        default_gamma(1)
    with pytest.raises(UsageError):
        slot_weights(4, 0.0)


def test_gather_kd_targets_uses_the_previous_position():
    S, k = 20, 3
    ids = torch.arange(S * k).view(S, k)
    lps = -torch.rand(S, k)
    anchors = torch.tensor([0, 5, 17])
    t = gather_kd_targets(ids, lps, anchors, 4, 0.5)
    for j, a in enumerate(anchors.tolist()):
        for slot in range(1, 4):
            row = min(a + slot - 1, S - 1)
            assert torch.equal(t.topk_ids_NBK[j, slot], ids[row])
            assert torch.equal(t.topk_logprobs_NBK[j, slot], lps[row])
    assert t.weight == 0.5 and t.topk_ids_NBK.dtype == torch.int64


def test_tau_walk_is_the_decoding_walk_tau_when_acceptance_is_piecewise_constant():
    """The harmonic mean of per-position tau equals tokens / steps of a greedy walk through a document
    whose acceptance is constant over stretches (each stretch a multiple of its tau); the arithmetic
    mean over positions does not (it over-states the walk)."""
    stretches = [(8, 64), (1, 40), (3, 33), (16, 32), (2, 10)]  # (tau, length)
    tau_at = [t for t, n in stretches for _ in range(n)]
    pos, steps = 0, 0
    while pos < len(tau_at):  # speculative decoding: one step accepts tau_at[pos] tokens
        pos += tau_at[pos]
        steps += 1
    walk = len(tau_at) / steps
    m = {"loss_sum": torch.tensor(0.0), "ce_sum": torch.tensor(0.0), "kd_sum": torch.tensor(0.0),
         "weight_sum": torch.tensor(1.0), "correct_per_slot": torch.zeros(2), "valid_per_slot": torch.ones(2),
         "tau_sum": torch.tensor(float(sum(tau_at))), "num_blocks": torch.tensor(float(len(tau_at))),
         "inv_tau_sum": torch.tensor(sum(1.0 / t for t in tau_at), dtype=torch.float64)}
    s = summarize_metrics(m)
    assert s["tau_walk"] == pytest.approx(walk, rel=1e-12)
    assert s["tau"] > 1.5 * walk
