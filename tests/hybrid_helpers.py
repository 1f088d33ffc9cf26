"""Shared pieces of the hybrid-rollback state tests (CPU and GPU): the rollback path, the same
committed tokens fed in the same chunks without any rejected step (the bf16 noise floor's path),
a fresh one-pass prefill, and the relative error between two caches."""

from __future__ import annotations

import torch

from dflash_pipe.eval.recurrent_state import RecurrentSnapshot, cache_tensors
from dflash_pipe.eval.target_step import TargetVerifier, cache_kwarg_name, new_dynamic_cache


def rollback_path(model, prompt: list[int], accepts, block: int, seed: int, skip_restore: bool = False,
                  refeed: str = "forward"):
    """Prefill `prompt`, then one verify of `block - 1` random drafts + commit per entry of `accepts`.
    Returns (verifier, chunks): chunks are the token runs the cache ends up having been fed with
    (the prompt, then per step the last token + accepted drafts), the committed prefix in order."""
    verifier = TargetVerifier(model, refeed=refeed)
    if skip_restore:                                         # fault injection: a stale recurrent state
        verifier.snapshot.restore = lambda cache: None
    assert isinstance(verifier.snapshot, RecurrentSnapshot)
    verifier.prefill(prompt)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    chunks = [list(prompt)]
    for accept in accepts:
        fed = [verifier.tokens[-1]] + torch.randint(3, vocab, (block - 1,), generator=g).tolist()
        target = verifier.verify(fed[1:])
        verifier.commit(accept, target[accept])
        chunks.append(fed[:accept + 1])
    assert verifier.tokens[:-1] == [t for c in chunks for t in c]
    return verifier, chunks


@torch.inference_mode()
def fed_cache(model, chunks):
    """A fresh cache fed `chunks` one forward each (one chunk = a one-pass prefill)."""
    device = next(model.parameters()).device
    cache, kw = new_dynamic_cache(model), cache_kwarg_name(model)
    for c in chunks:
        model(input_ids=torch.tensor([c], device=device), use_cache=True, logits_to_keep=1, **{kw: cache})
    return cache


def worst_rel_error(cache, reference) -> float:
    """max over the cache's tensors (conv, recurrent, keys, values) of |a - b| / |b| (Frobenius)."""
    got, want = cache_tensors(cache), cache_tensors(reference)
    assert [a.shape for a in got] == [b.shape for b in want]
    return max(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)) for a, b in zip(got, want))


def bitwise_equal(cache, reference) -> bool:
    return all(torch.equal(a, b) for a, b in zip(cache_tensors(cache), cache_tensors(reference)))
