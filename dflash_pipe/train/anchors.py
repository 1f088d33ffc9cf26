"""Anchors and block labels (SPEC §5), as plain numpy on one document.

An anchor is a position t with loss_mask[t] and loss_mask[t+1]: the block starting there is
[input_ids[t], MASK x (B-1)] and slot k (1..B-1) predicts input_ids[t+k]. Slot 0 is never
trained; a target past the end of the document or on an unsupervised token is ignored (-100).

Copy-weighted anchors (``--copy-anchor-weight W``, default 0 = uniform): an anchor where prompt lookup could copy
(`copyable`: the n-gram ending at it occurred earlier in the document and was followed by the same next token)
is drawn with weight 1 + W instead of 1, so that more blocks teach the drafter to copy from its context. Session
19's eval lost to prompt lookup only where the target repeats itself (MT-Bench second turns, 0.98x; 1.21x on first
turns): BENCHMARKS.md, "Issue 19: where prompt lookup holds MT-Bench's ratio down".
"""

from __future__ import annotations

import numpy as np

IGNORE = -100


def eligible_anchors(loss_mask_T: np.ndarray) -> np.ndarray:
    m = np.asarray(loss_mask_T).astype(bool)
    return np.flatnonzero(m[:-1] & m[1:]).astype(np.int64)


def copyable(input_ids_T: np.ndarray, n: int = 3) -> np.ndarray:
    """bool [T]: position t ends an n-gram that occurred earlier in the document (its first occurrence ending at
    j < t) and input_ids[j + 1] == input_ids[t + 1]: prompt lookup would propose the right next token there."""
    ids = np.asarray(input_ids_T, dtype=np.int64)
    T = ids.size
    out = np.zeros(T, dtype=bool)
    if T < n + 1:
        return out
    grams = np.lib.stride_tricks.sliding_window_view(ids[:T - 1], n)        # row i: the n-gram ending at i + n - 1
    _, first, inverse = np.unique(grams, axis=0, return_index=True, return_inverse=True)
    j = first[inverse.reshape(-1)] + n - 1                                    # where each n-gram first ended
    t = np.arange(n - 1, T - 1)
    out[t] = (j < t) & (ids[j + 1] == ids[t + 1])
    return out


def sample_anchors(loss_mask_T: np.ndarray, max_anchors: int, rng: np.random.Generator,
                   weights_T: np.ndarray | None = None) -> np.ndarray:
    """Up to `max_anchors` eligible positions without replacement, sorted: uniformly, or in proportion to
    `weights_T` (per position, > 0) when given."""
    cand = eligible_anchors(loss_mask_T)
    if cand.size > max_anchors:
        p = None
        if weights_T is not None:
            w = np.asarray(weights_T, dtype=np.float64)[cand]
            p = w / w.sum()
        cand = np.sort(rng.choice(cand, size=max_anchors, replace=False, p=p))
    return cand


def block_labels(input_ids_T: np.ndarray, loss_mask_T: np.ndarray, anchors: np.ndarray, block_size: int) -> np.ndarray:
    """int64 [len(anchors), B]: slot k of anchor a -> input_ids[a + k] if supervised, else -100."""
    T = len(input_ids_T)
    pos = anchors[:, None] + np.arange(block_size)[None, :]
    inside = pos < T
    safe = np.where(inside, pos, 0)
    ok = inside & np.asarray(loss_mask_T).astype(bool)[safe]
    labels = np.where(ok, np.asarray(input_ids_T, dtype=np.int64)[safe], IGNORE)
    labels[:, 0] = IGNORE
    return labels
