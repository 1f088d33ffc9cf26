"""Which waiting prompts refill which free slots, in how many prefill calls (regenerate's engine backend).

A prefill call costs a launch (on CUDA a graph replay, ~1 ms, or an eager 30-layer forward, ~57 ms on the
H200's host) plus compute on its padded tokens; a free slot costs one idle row of every decode step until
it is refilled. `plan_refill` trades the two:

  * when: refill once at least `min_free` slots are free, or when every waiting prompt fits now (the ready
    list is short: the tail begins), or when nothing is decoding at all;
  * how many: every free slot; with `round_rows` (CUDA's default) the largest row bucket below the free count
    when that is nearer than the bucket above (34 free: 32 prompts, not 34 padded to 64 rows; the 2 slots wait
    for the next refill), except in the tail and when nothing decodes;
  * which: the n = min(free, waiting) prompts come from a lookahead window of the ready list (its first
    max(n, lookahead) entries), chosen by length bucket (prefill_shapes.length_bucket): the front prompt's
    bucket first (the oldest waiting prompt always goes, so none waits forever and the reordering stays inside
    the window), then the buckets with the most prompts in the window;
  * how: one call per length bucket (rows up to prefill_shapes.rows_per_call within `budget` padded tokens);
    a shorter bucket's group joins a longer one when it fits in the rows the longer call pads to anyway.

With `chunked` (the engine's chunked prefill, target/chunked_prefill.py: a prompt pads only its last 16-token
chunk, whatever it is grouped with) there is no padding to trade: the oldest n prompts go, in order, in calls of
at most `budget` chunked tokens.

Answers do not depend on the slot or on the order of admission (regen_sampling), and the driver writes in
input order, so taking prompts slightly out of order changes nothing in the output.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..target.chunked_prefill import CHUNK, chunk_count
from ..target.prefill_shapes import length_bucket, row_bucket, row_bucket_below, rows_per_call


@dataclass(frozen=True)
class RefillPolicy:
    min_free: int = 1           # refill when at least this many slots are free (or the conditions above)
    lookahead: int = 256        # ready-list entries considered per refill (at least the number taken)
    budget: int = 16384         # padded tokens per prefill call
    min_rows: int = 8           # the smallest row bucket (engine.prefill_min_rows)
    max_len: int = 1 << 30      # the engine's max_len (caps the length bucket)
    rows_per_octave: int = 1    # row buckets per octave: 1 = powers of two, as the engine pads (others: the sim)
    round_rows: bool = False    # take a row bucket's worth of prompts when that idles fewer slots than it pads
    chunked: bool = False       # the engine prefills fresh prompts in 16-token chunks (module docstring)

    @classmethod
    def for_batch(cls, batch: int, cuda: bool, max_len: int, budget: int | None = None,
                  min_free: int | None = None, min_rows: int = 8, chunked: bool = False) -> RefillPolicy:
        """Defaults: refill at B/32 free slots on CUDA (32 of 1024: see BENCHMARKS.md), any free slot on the CPU;
        on CUDA a refill takes a row bucket's worth when that is nearer (bench/regen_refill_sim.py: padded prefill
        tokens -38 % at batch 1024, modelled)."""
        return cls(min_free=max(1, batch // 32 if cuda else 1) if min_free is None else max(1, min_free),
                   lookahead=max(256, batch), budget=budget or (16384 if cuda else 2048),
                   min_rows=min_rows, max_len=max_len, round_rows=cuda, chunked=chunked)

    def bucket(self, n: int) -> int:
        return max(min(length_bucket(n), self.max_len), n)


def plan_refill(free: int, window: list[int], waiting: int, live: int, p: RefillPolicy) -> list[list[int]]:
    """Prefill calls for this launch: lists of indices into the ready list, whose first entries' prompt lengths
    are `window` (oldest first; at least min(free, waiting) of them, more are ignored past the lookahead), of
    `waiting` entries in all; `free` slots are free and `live` rows are decoding. Every index at most once;
    [] = wait."""
    n = min(free, waiting)
    if n == 0 or (free < p.min_free and waiting > free and live > 0):
        return []
    if p.chunked:
        return _chunked_calls(window[:n], p.budget)
    if p.round_rows and waiting > free and live > 0 and n > p.min_rows:  # not in the tail, not the first fill
        up, down = row_bucket(n, p.min_rows, p.rows_per_octave), row_bucket_below(n, p.min_rows, p.rows_per_octave)
        if n - down < up - n:
            n = down  # the slots left free wait for the next refill instead of padding rows now
    window = window[:max(n, p.lookahead)]
    if len(window) < n:
        raise ValueError(f"plan_refill: a window of {len(window)} prompts for {n} free slots")
    by_bucket: dict[int, list[int]] = defaultdict(list)
    for i, L in enumerate(window):
        by_bucket[p.bucket(L)].append(i)
    first = p.bucket(window[0])
    order = [first] + sorted((b for b in by_bucket if b != first), key=lambda b: (-len(by_bucket[b]), b))
    chosen: dict[int, list[int]] = {}
    need = n
    for b in order:
        take = by_bucket[b][:need]
        chosen[b] = take
        need -= len(take)
        if need == 0:
            break
    calls: list[tuple[int, list[int]]] = []       # (length bucket, indices)
    for b in sorted(chosen):
        idx, cap = chosen[b], rows_per_call(b, p.budget, p.min_rows)
        calls += [(b, idx[i:i + cap]) for i in range(0, len(idx), cap)]
    merged: list[tuple[int, list[int]]] = []
    for b, idx in sorted(calls, key=lambda c: -c[0]):     # longest bucket first: shorter groups join it if free
        for j, (mb, midx) in enumerate(merged):
            if (len(midx) + len(idx) <= row_bucket(len(midx), p.min_rows, p.rows_per_octave)
                    and len(midx) + len(idx) <= rows_per_call(mb, p.budget, p.min_rows)):
                merged[j] = (mb, midx + idx)
                break
        else:
            merged.append((b, idx))
    return [sorted(idx) for _, idx in merged]


def _chunked_calls(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices 0..len(lengths)-1 in order, cut into calls of at most `budget` tokens counted in whole chunks
    (a longer prompt goes alone)."""
    calls: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        cost = chunk_count(n) * CHUNK
        if not calls or used + cost > budget:
            calls.append([])
            used = 0
        calls[-1].append(i)
        used += cost
    return calls
