"""fp32 precision of the KD loss's gradient when the student is confident (issue 19's recipe trains with KD 0.5).

A 5,000-token head where one teacher id's logit stands `gap` above the rest on every row; the teacher keeps 0.001 of
its mass outside its top-8. For each gap: the student's mass outside the teacher's ids, and the relative error of the
fp32 gradient (fused and unfused loss paths) against the same loss in float64. Runs on the CPU in seconds; to compare
another version of the package, put it first on PYTHONPATH.

    python bench/fused_kd_precision.py [--gaps 10,20,25,30]
"""

from __future__ import annotations

import argparse

import torch

from dflash_pipe.drafter import fused_loss
from dflash_pipe.drafter.loss import KDTargets, draft_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gaps", default="10,20,25,30")
    args = ap.parse_args()
    fused_loss.set_compiled_loss(False)
    n, b, h, v, k = 4, 4, 16, 5000, 8
    g = torch.Generator().manual_seed(0)
    head = torch.randn(v, h, generator=g) * 0.3
    head[:, 0], head[7] = 0, 0
    head[7, 0] = 1.0
    base = torch.randn(n * b, h, generator=g) * 0.3
    labels = torch.full((n, b), 7)
    labels[:, 0] = -100
    ids = torch.stack([torch.cat([torch.tensor([7]), torch.randperm(v - 8, generator=g)[:k - 1] + 8])
                       for _ in range(n * b)]).view(n, b, k)
    lp = torch.tensor([0.99] + [0.009 / (k - 1)] * (k - 1)).log().expand(n, b, k)
    print(f"{'gap':>5} {'mass outside':>13} {'fused fp32 rel err':>19} {'unfused fp32 rel err':>21}")
    for gap in (float(x) for x in args.gaps.split(",")):
        hidden = base.clone()
        hidden[:, 0] = gap
        grads = {}
        for name, fused, dtype in (("fused", True, torch.float32), ("unfused", False, torch.float32),
                                   ("ref", False, torch.float64)):
            x = hidden.to(dtype).clone().requires_grad_(True)
            loss, _ = draft_loss(x, head.to(dtype), labels, b, 3.0, 5, KDTargets(ids, lp.to(dtype), 0.5), fused=fused)
            loss.backward()
            grads[name] = x.grad.double()
        q = (hidden.double() @ head.double().t()).softmax(-1)
        outside = (q * torch.ones_like(q, dtype=torch.bool).scatter(-1, ids.view(n * b, k), False)).sum(-1).median()
        err = {m: float((grads[m] - grads["ref"]).norm() / grads["ref"].norm()) for m in ("fused", "unfused")}
        print(f"{gap:5.0f} {float(outside):13.2e} {err['fused']:19.3e} {err['unfused']:21.3e}")


if __name__ == "__main__":
    main()
