"""bench/round_gaps.py: a window trainer's round-boundary cost recovered from metrics.jsonl timestamps."""

import pytest

from bench.round_gaps import round_gaps


def test_boundary_cost_is_recovered_and_validation_intervals_are_skipped():
    recs, t = [], 0.0
    for step in range(9, 400, 10):              # logged every 10 steps, 50 ms a step, 30 steps a round
        epoch = step // 30
        if recs:
            t += 10 * 0.05
            if epoch != recs[-1]["epoch"]:
                t += 0.4                          # what each boundary costs
            if (recs[-1]["step"] + 1) // 100 != (step + 1) // 100:
                t += 7.0                          # a validation pass every 100 steps
        recs.append({"step": step, "epoch": epoch, "time": t})
    got = round_gaps(recs, val_every=100)
    assert got["step_ms_inside_rounds"] == pytest.approx(50.0)
    crossings = sum(1 for a, b in zip(recs, recs[1:]) if a["epoch"] != b["epoch"]
                    and (a["step"] + 1) // 100 == (b["step"] + 1) // 100)
    assert got["boundaries"] == crossings > 5
    assert got["boundary_extra_s_median"] == pytest.approx(0.4)
    assert got["boundary_extra_s_total"] == pytest.approx(0.4 * crossings, abs=0.05)
    assert round_gaps(recs)["boundary_extra_s_total"] > got["boundary_extra_s_total"] + 7   # without skipping
