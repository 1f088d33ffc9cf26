"""Padded shapes of the static-KV engine's bucketed prefill: few distinct shapes, so each can be a CUDA graph.

A prefill of R prompts whose longest has T tokens runs as `prefill_shape(R, T)` = (row bucket, length
bucket): rows padded up to a power of two (at least `min_rows`; `rows_per_octave` > 1, which only
bench/regen_refill_sim.py uses, makes them finer), tokens up to two buckets per octave (32, 64, 96, 128, 192,
256, 384, 512, 768, ...: the longest prompt is padded by less than half its length).
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


def row_bucket(n: int, min_rows: int = 8, per_octave: int = 1) -> int:
    """Padded row count of a prefill of `n` prompts: a power of two (at least `min_rows`); with `per_octave` k,
    k buckets per octave, the multiples of p / 2k in (p / 2, p] for p = next_pow2(n) (k = 2: 8, 16, 24, 32, 48,
    64, 96, 128, 192, ...; the step never below min_rows)."""
    if per_octave <= 1 or n <= min_rows:
        return max(min_rows, next_pow2(n))
    step = max(min_rows, next_pow2(n) // (2 * per_octave))
    return -(-n // step) * step


def row_bucket_below(n: int, min_rows: int = 8, per_octave: int = 1) -> int:
    """The largest row bucket <= n (n >= min_rows), i.e. the most prompts a call takes without padding rows."""
    m = n
    while row_bucket(m, min_rows, per_octave) > n:
        m -= 1
    return m


def rows_per_call(t_bucket: int, budget: int, min_rows: int = 8) -> int:
    """The most prompts of length bucket `t_bucket` one call takes within `budget` padded tokens (a power of two,
    at least min_rows, so a prompt longer than the budget still goes, alone in its call)."""
    return max(min_rows, next_pow2(max(1, budget // t_bucket) + 1) // 2)


class PrefillShapes:
    """The padded shapes a prefill engine has used, and the choice of a call's shape.

    A new shape costs its first, eager call and the capture of its graph at the second (each about one eager
    forward of host time: ~57 ms on the H200's host for SmolLM2) while padding costs only compute (~0.7 us a
    token there), so a call takes the smallest shape already used that holds it, if that pads it to at most
    `reuse_ratio` x the tokens of its own bucket shape; otherwise its own bucket shape (reuse_ratio 1 = off).
    The engine's default is 2 (session 8 used 4: a 64 x 64 refill then ran as 64 x 192, and 36 % of the padded
    tokens were such reuse; bench/regen_refill_sim.py models 2 as the better trade at batch 1024).
    """

    def __init__(self, min_rows: int = 8, max_len: int = 1 << 30, reuse_ratio: float = 4.0, rows_per_octave: int = 1):
        self.min_rows, self.max_len, self.reuse_ratio = min_rows, max_len, reuse_ratio
        self.rows_per_octave = rows_per_octave
        self.uses: dict[tuple[int, int], int] = {}

    def bucket(self, rows: int, longest: int) -> tuple[int, int]:
        return (row_bucket(rows, self.min_rows, self.rows_per_octave),
                max(min(length_bucket(longest), self.max_len), longest))

    def choose(self, rows: int, longest: int) -> tuple[int, int]:
        own = self.bucket(rows, longest)
        limit = self.reuse_ratio * own[0] * own[1]
        fits = [s for s in self.uses if s[0] >= rows and s[1] >= longest and s[0] * s[1] <= limit]
        return min(fits, key=lambda s: (s[0] * s[1], s)) if fits else own

    def use(self, shape: tuple[int, int]) -> int:
        """Count a call of `shape`; how many calls it has had, this one included."""
        n = self.uses[shape] = self.uses.get(shape, 0) + 1
        return n
