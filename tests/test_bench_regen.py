"""The regenerate benchmark's own arithmetic (bench/regen_profile.py, bench/regen_throughput.py): the device's busy
time and idle gaps from overlapping kernel spans, and the --overlap mode grammar."""

from __future__ import annotations

import random

from bench.regen_profile import busy_and_gaps, gap_histogram
from bench.regen_throughput import mode_flags


def test_busy_time_and_gaps_equal_a_count_of_covered_microseconds():
    """Random integer spans, many overlapping or nested: the merged busy time equals the number of covered µs
    counted one by one, and busy + gaps spans first start to last end."""
    rng = random.Random(3)
    for _ in range(50):
        spans = sorted((s, s + rng.randint(1, 30)) for s in (rng.randint(0, 400) for _ in range(rng.randint(1, 25))))
        covered = set()
        for s, e in spans:
            covered.update(range(s, e))
        busy, gaps = busy_and_gaps(spans)
        assert busy == len(covered)
        assert busy + sum(gaps) == max(e for _, e in spans) - spans[0][0]
        assert all(g > 0 for g in gaps)
    assert busy_and_gaps([]) == (0.0, [])


def test_gap_histogram_buckets_every_gap_once():
    h = gap_histogram([5, 19.9, 20, 150, 2_500, 10_000, 50_000])
    assert {k: v["count"] for k, v in h.items()} == {"0-20us": 2, "20-100us": 1, "100-500us": 1, "500-2000us": 0,
                                                    "2000-10000us": 1, ">=10000us": 2}
    assert h[">=10000us"]["ms"] == 60.0


def test_overlap_modes_map_to_regenerate_flags():
    assert mode_flags("off") == {"overlap": False, "compact": False, "prefetch_prompts": True,
                                 "prefill_layout": "auto"}
    f = mode_flags("on+compact+padded+early2+every16")
    assert f == {"overlap": True, "compact": True, "prefetch_prompts": True, "prefill_layout": "padded",
                 "collect_early": 2, "steps_per_launch": 16}
    assert mode_flags("off+early0+noprefetch")["collect_early"] == 0
