"""Prompt-lookup (n-gram) drafting: the model-free baseline DFlash must beat.

The proposer looks for the longest suffix of the committed tokens, n = max_n down to min_n,
that also occurs earlier in them, and drafts the tokens that followed that earlier occurrence
(up to `num`). Among several earlier occurrences of the same n-gram the most recent one wins
(recent context tends to predict the continuation best; HF's prompt-lookup decoding takes the
first occurrence instead). An earlier occurrence starting at i must be followed by at least one
token (i + n <= len - 1, which also excludes the suffix itself); it proposes
tokens[i + n : i + n + num], which may run into the suffix (a repeating pattern keeps
repeating). No match: no drafts, and the step commits only the target's own token (tau = 1).

It runs through the same `speculative_generate` harness as DFlash (only the proposer differs).
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import UsageError


def ngram_propose(tokens: list[int] | np.ndarray, num: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Drafts for the continuation of `tokens` by prompt lookup (module docstring)."""
    if not 1 <= min_n <= max_n:
        raise UsageError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    if num <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n:]
        # windows starting at 0..length-n-1 (the last window is the suffix itself)
        windows = sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + num].tolist()
    return []


class NgramProposer:
    """`Proposer` for `speculative_generate`: prompt lookup over the committed tokens."""

    needs_features = False

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise UsageError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: list[int], features: torch.Tensor | None, num: int) -> list[int]:
        return ngram_propose(tokens, num, self.max_n, self.min_n)
