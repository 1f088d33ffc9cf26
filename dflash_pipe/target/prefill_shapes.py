"""Padded shapes of the static-KV engine's bucketed prefill: few distinct shapes, so each can be a CUDA graph.

A prefill of R prompts whose longest has T tokens runs as `prefill_shape(R, T)` = (row bucket, length
bucket): rows padded up to a power of two (at least `min_rows`), tokens up to two buckets per octave
(32, 64, 96, 128, 192, 256, 384, 512, 768, ...: a prompt is padded by less than a third of its length).
"""

from __future__ import annotations


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def length_bucket(n: int, min_step: int = 32) -> int:
    """Padded token count of a prefill whose longest prompt has `n` tokens."""
    if n < 1:
        raise ValueError(f"a prefill needs at least one token, got {n}")
    step = max(min_step, next_pow2(n) // 4)
    return -(-n // step) * step


def row_bucket(n: int, min_rows: int = 8) -> int:
    """Padded row count of a prefill of `n` prompts."""
    return max(min_rows, next_pow2(n))


def rows_per_call(t_bucket: int, budget: int, min_rows: int = 8) -> int:
    """The most prompts of length bucket `t_bucket` one call takes within `budget` padded tokens (a power of two,
    at least min_rows, so a prompt longer than the budget still goes, alone in its call)."""
    return max(min_rows, next_pow2(max(1, budget // t_bucket) + 1) // 2)
