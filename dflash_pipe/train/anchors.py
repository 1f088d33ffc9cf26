"""Anchors and block labels (SPEC §5), as plain numpy on one document.

An anchor is a position t with loss_mask[t] and loss_mask[t+1]: the block starting there is
[input_ids[t], MASK x (B-1)] and slot k (1..B-1) predicts input_ids[t+k]. Slot 0 is never
trained; a target past the end of the document or on an unsupervised token is ignored (-100).
"""

from __future__ import annotations

import numpy as np

IGNORE = -100


def eligible_anchors(loss_mask_T: np.ndarray) -> np.ndarray:
    m = np.asarray(loss_mask_T).astype(bool)
    return np.flatnonzero(m[:-1] & m[1:]).astype(np.int64)


def sample_anchors(loss_mask_T: np.ndarray, max_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Up to `max_anchors` eligible positions, uniformly without replacement, sorted."""
    cand = eligible_anchors(loss_mask_T)
    if cand.size > max_anchors:
        cand = np.sort(rng.choice(cand, size=max_anchors, replace=False))
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
