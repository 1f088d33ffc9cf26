"""bf16 compute weights with fp32 master weights in the optimizer.

Under bf16 autocast an fp32 Linear weight is cast to bf16 at every use and that bf16 copy is kept
for the backward pass: 2 bytes per weight that live from the forward to the end of the backward,
on top of the 16 bytes per weight of fp32 weights + fp32 grads + the two AdamW moments. At the
seed's 1.73 B trainable weights that is 3.5 GB. Keeping the Linear weights themselves in bf16
(the compute copy) and a separate fp32 copy for the optimizer (the master) removes it:

    per Linear weight   fp32 weight + fp32 grad + autocast bf16 copy   ->   bf16 weight + bf16 grad + fp32 master
    (plus AdamW m, v in fp32 either way)          18 B                 ->              16 B

The arithmetic is unchanged for one micro-batch: the forward GEMMs read the same bf16 values
(bf16(master) either way), the weight-gradient GEMM writes bf16 in both cases (autocast then
only widens it to fp32), so the fp32 master gradient is the bf16 gradient widened. Gradient
clipping uses per-tensor fp32 norms exactly as `clip_grad_norm_` does. The CPU test
`tests/test_train_master_weights.py` checks bit-equality against the fp32-weights path.

The optimizer step runs in chunks of about `chunk_elems` weights: widen that chunk's grads to
fp32 (scaled by the clip factor), step AdamW on its masters, write the masters back to the bf16
weights, drop the fp32 grads. The transient is one chunk, not a full fp32 gradient set.

Norm weights (1-D) stay fp32 and are their own masters. With param_dtype fp32 nothing is
converted and the step is plain `clip_grad_norm_` + `opt.step()`.
"""

from __future__ import annotations

import torch

from ..drafter.export import plain_name

CHUNK_ELEMS = 256 << 20


class MasterWeights:
    """The drafter's parameters as (name, compute param, fp32 master) triples, in model order."""

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype = torch.float32,
                 chunk_elems: int = CHUNK_ELEMS):
        self.chunk_elems = chunk_elems
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self.masters: list[torch.Tensor] = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if compute_dtype != p.dtype and p.dim() >= 2:
                master = torch.nn.Parameter(p.detach().to(torch.float32).clone())
                with torch.no_grad():
                    p.data = p.data.to(compute_dtype)
            else:
                master = p
            self.names.append(plain_name(name))  # compiled layers' `_orig_mod.` dropped: checkpoints keep
            # the drafter's own names, so an eager run resumes a compiled run's checkpoint and export reads it
            self.params.append(p)
            self.masters.append(master)

    @property
    def separate(self) -> bool:
        """True when some weights have a master copy distinct from the compute weight."""
        return any(m is not p for p, m in zip(self.params, self.masters))

    # --- the step ------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """Total L2 norm of the gradients, from per-tensor fp32 norms (as clip_grad_norm_ computes it)."""
        norms = [torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float32) for p in self.params if p.grad is not None]
        if not norms:
            return torch.zeros((), device=self.params[0].device)
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def step(self, opt: torch.optim.Optimizer, grad_clip: float) -> torch.Tensor:
        """Clip (if grad_clip > 0), step the optimizer over the masters, refresh the compute weights.
        Returns the gradient norm before clipping (a device tensor; no sync)."""
        if not self.separate:
            if grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.params, grad_clip)
            else:
                norm = self.grad_norm()
            opt.step()
            return norm
        norm = self.grad_norm()
        coef = torch.clamp(grad_clip / (norm + 1e-6), max=1.0) if grad_clip > 0 else None
        # opt.step() steps every parameter that has a grad: take them all away first, then hand
        # back one chunk at a time, so each master is stepped exactly once.
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        for chunk in self._chunks():
            for i in chunk:
                if grads[i] is None:
                    continue
                g = grads[i] if grads[i].dtype == torch.float32 else grads[i].to(torch.float32)
                if coef is not None:
                    g.mul_(coef.to(g.device))
                self.masters[i].grad = g
                grads[i] = None
            opt.step()
            with torch.no_grad():
                for i in chunk:
                    p, m = self.params[i], self.masters[i]
                    m.grad = None
                    if m is not p:
                        p.copy_(m)
        return norm

    def _chunks(self) -> list[list[int]]:
        out, cur, n = [], [], 0
        for i, p in enumerate(self.params):
            cur.append(i)
            n += p.numel()
            if n >= self.chunk_elems:
                out.append(cur)
                cur, n = [], 0
        if cur:
            out.append(cur)
        return out

    # --- checkpoints ---------------------------------------------------------------------------
    def master_state(self) -> dict[str, torch.Tensor]:
        """name -> fp32 master (or the parameter itself where it is its own master)."""
        return dict(zip(self.names, self.masters))

    @torch.no_grad()
    def load_master_state(self, weights: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in weights]
        extra = [n for n in weights if n not in set(self.names)]
        if missing or extra:
            from ..errors import CacheError

            raise CacheError(f"checkpoint weights do not match the drafter: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}", "resume with the same drafter config, or --resume never")
        for n, p, m in zip(self.names, self.params, self.masters):
            m.copy_(weights[n].to(m.device, m.dtype))
            if m is not p:
                p.copy_(m)
