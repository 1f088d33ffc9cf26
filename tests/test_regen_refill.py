"""regenerate's refill planning (regen_refill.plan_refill) and the prefill shapes it leads to (prefill_shapes)."""

from __future__ import annotations

import random

import pytest

from dflash_pipe.eval.regen_refill import RefillPolicy, plan_refill
from dflash_pipe.target.prefill_shapes import PrefillShapes, length_bucket, row_bucket, row_bucket_below, rows_per_call


def test_length_buckets_pad_by_less_than_half_with_two_buckets_an_octave():
    buckets = [length_bucket(n) for n in range(1, 4097)]
    assert all(b >= n for n, b in enumerate(buckets, 1))
    assert all(b - n < max(32, n / 2) for n, b in enumerate(buckets, 1))
    assert buckets == sorted(buckets)
    assert sorted(set(buckets)) == [32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    assert [row_bucket(n) for n in (1, 8, 9, 33, 1000)] == [8, 8, 16, 64, 1024]
    assert rows_per_call(64, 16384) == 256 and rows_per_call(96, 16384) == 128 and rows_per_call(8192, 2048) == 8


def test_a_used_shape_is_reused_within_the_ratio_and_not_beyond():
    s = PrefillShapes(reuse_ratio=2.0)
    assert s.choose(20, 50) == (32, 64)                       # nothing used yet: its own bucket
    s.use((64, 64))
    assert s.choose(20, 30) == (32, 32)                       # 4096 tokens > 2 x 1024
    assert s.choose(20, 50) == (64, 64)                       # 4096 <= 2 x 2048
    assert s.choose(65, 50) == (128, 64)                      # too few rows
    s.use((32, 128))
    assert s.choose(20, 100) == (32, 128) and s.choose(20, 50) == (32, 128)   # the smaller of two of 4096
    assert s.choose(20, 129) == (32, 192)                     # nothing used holds 129 tokens
    assert PrefillShapes(reuse_ratio=1.0).choose(20, 50) == (32, 64)


def _check(plan, free, window, waiting, p):
    flat = [i for call in plan for i in call]
    assert len(flat) == len(set(flat)) == min(free, waiting)  # each prompt once, every free slot refilled
    assert 0 in flat                                          # the oldest waiting prompt always goes
    assert max(flat) < max(min(free, waiting), p.lookahead)   # from the lookahead window only
    for call in plan:
        longest = max(window[i] for i in call)
        rows = len(call)
        assert rows <= max(p.min_rows, rows_per_call(p.bucket(longest), p.budget, p.min_rows))
        assert rows <= p.min_rows or row_bucket(rows, p.min_rows) * p.bucket(longest) <= p.budget


@pytest.mark.parametrize("seed", range(30))
def test_plans_refill_every_free_slot_oldest_first_within_the_budget_and_window(seed):
    rng = random.Random(seed)
    p = RefillPolicy(min_free=rng.choice([1, 4, 32]), lookahead=rng.choice([1, 16, 256]),
                     budget=rng.choice([512, 4096, 16384]), min_rows=8, max_len=512)
    waiting = rng.randint(1, 600)
    window = [rng.choice([rng.randint(1, 64), rng.randint(1, 250)]) for _ in range(min(waiting, 700))]
    free = rng.randint(p.min_free, 300)
    plan = plan_refill(free, window, waiting, live=rng.randint(0, 5), p=p)
    _check(plan, free, window, waiting, p)
    distinct = {p.bucket(window[i]) for call in plan for i in call}
    assert len(plan) <= sum(-(-sum(1 for c in plan for i in c if p.bucket(window[i]) == b)
                              // rows_per_call(b, p.budget)) for b in distinct)   # at most one call per bucket


def test_it_waits_for_enough_free_slots_unless_the_tail_begins_or_nothing_runs():
    p = RefillPolicy(min_free=32, lookahead=64)
    window = [10] * 64
    assert plan_refill(31, window, 500, live=993, p=p) == []          # too few free slots: wait
    assert sum(map(len, plan_refill(32, window, 500, live=992, p=p))) == 32
    assert sum(map(len, plan_refill(5, window[:5], 5, live=1000, p=p))) == 5   # all waiting prompts fit: the tail
    assert sum(map(len, plan_refill(5, window, 500, live=0, p=p))) == 5         # nothing decoding
    assert plan_refill(0, window, 500, live=1024, p=p) == [] and plan_refill(9, [], 0, live=3, p=p) == []


def test_prompts_of_one_length_bucket_share_a_call_and_a_short_group_joins_a_long_call_for_free():
    p = RefillPolicy(min_free=1, lookahead=64, budget=16384)
    window = [200, 10, 12, 210, 11, 250] + [5] * 50        # buckets 256, 32, 32, 256, 32, 256, then 32s
    plan = plan_refill(6, window, len(window), live=10, p=p)
    assert sorted(map(sorted, plan)) == [[0, 1, 2, 3, 4, 5]]   # 3 long + 3 short fit the 8 rows padded anyway
    plan = plan_refill(12, window, len(window), live=10, p=p)
    assert [0, 3, 5] in plan and sum(map(len, plan)) == 12 and len(plan) == 2   # the long ones, then 9 short ones


def test_finer_row_buckets_and_the_bucket_below():
    assert [row_bucket(n, 8, 2) for n in (1, 8, 9, 20, 33, 34, 49, 70, 100, 1000)] == [8, 8, 16, 24, 48, 48, 64, 96,
                                                                                       128, 1024]
    assert [row_bucket(n, 8, 1) for n in range(1, 300)] == [row_bucket(n) for n in range(1, 300)]  # 1 = powers of 2
    for k in (1, 2, 4):
        for n in range(8, 600):
            below = row_bucket_below(n, 8, k)
            assert below <= n and row_bucket(below, 8, k) == below                          # a bucket, not above n
            assert all(row_bucket(m, 8, k) != m for m in range(below + 1, n + 1))           # the largest one


def test_round_rows_takes_the_nearer_row_bucket_except_in_the_tail():
    p = RefillPolicy(min_free=32, lookahead=256, round_rows=True)
    window = [10] * 256                                               # one length bucket: one call
    assert [len(c) for c in plan_refill(34, window, 500, live=990, p=p)] == [32]    # 2 left free, not 30 padded
    assert [len(c) for c in plan_refill(52, window, 500, live=972, p=p)] == [52]    # 64 is nearer than 32
    assert [len(c) for c in plan_refill(34, window[:34], 34, live=990, p=p)] == [34]   # the tail: all of them
    assert [len(c) for c in plan_refill(34, window, 500, live=0, p=p)] == [34]      # nothing decodes: fill it
    assert plan_refill(34, [40] + window, 500, live=990, p=p)[0][0] == 0             # the oldest still goes
    assert RefillPolicy.for_batch(1024, True, 512).round_rows and not RefillPolicy.for_batch(16, False, 512).round_rows


def test_chunked_policy_takes_the_oldest_prompts_in_order_within_the_token_budget():
    """With the engine's chunked prefill nothing is gained by grouping lengths: the n oldest prompts go in input
    order, cut into calls of at most `budget` tokens counted in whole 16-token chunks (a longer prompt alone);
    the waiting rule is the padded policy's."""
    p = RefillPolicy(min_free=4, lookahead=64, budget=64, chunked=True)
    window = [17, 3, 40, 16, 1, 70, 5, 9]                    # chunked costs 32, 16, 48, 16, 16, 80, 16, 16
    assert plan_refill(3, window, 100, live=10, p=p) == []  # too few free slots: wait
    assert plan_refill(8, window, 8, live=10, p=p) == [[0, 1], [2, 3], [4], [5], [6, 7]]
    assert plan_refill(5, window, 100, live=10, p=p) == [[0, 1], [2, 3], [4]]
    assert RefillPolicy.for_batch(1024, True, 512, chunked=True).chunked
