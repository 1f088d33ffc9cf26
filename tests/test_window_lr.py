"""Window mode's learning-rate curve (train/window_lr.py): it covers exactly the steps the run takes, whatever
the shards' sizes, and a resumed run follows it exactly. Pure: round schedules from metadata, a real LambdaLR."""

import math

import numpy as np
import pytest
import torch

from dflash_pipe.config import RunConfig
from dflash_pipe.train.components import build_optimizer
from dflash_pipe.train.schedule import build_round_schedule, window_rounds
from dflash_pipe.train.window_lr import WindowLR, planned_total

LR = 1e-3


def _lengths(n, seed, spread):
    """Shards as extraction cuts them (the same number of documents each, so their tokens differ by some
    10-30 %): 3 row groups of 6 documents of 5..spread tokens."""
    rng = np.random.default_rng(seed)
    return {c: [[int(x) for x in rng.integers(5, spread, size=6)] for _ in range(3)] for c in range(n)}


def _round_steps(n, K, world, seed, S=96):
    lengths, order = _lengths(n, seed, 60), list(range(n))
    return [build_round_schedule(lengths, order, r, K, n, world, seed, S, 4).steps for r in range(window_rounds(K, n))]


def _cfg(warmup, floor):
    cfg = RunConfig()
    cfg.train.lr, cfg.train.warmup_frac, cfg.train.min_lr_frac = LR, warmup, floor
    return cfg


def _run(round_steps, K, n, warmup, floor, start=None):
    """The trainer's sequence: begin_round + refresh at each round's start, sched.step() after every step.
    start = (round, step in round, lr of that step) resumes there as trainer.run_train does. Returns
    (lr of every step from the start on, planned totals per round)."""
    w = torch.nn.Parameter(torch.zeros(1))
    plan = WindowLR(K, n, warmup, floor)
    opt, sched = build_optimizer([w], _cfg(warmup, floor), torch.device("cpu"), 1, lr_factor=plan)
    r0, i0 = (0, 0) if start is None else start[:2]
    step = sum(round_steps[:r0]) + i0
    if start is not None:  # load_checkpoint restores the groups' lr; the trainer then sets these two
        for g in opt.param_groups:
            g["lr"] = start[2]
        sched.last_epoch, sched._last_lr = step, [start[2]]
    lrs, totals = [], []
    for r in range(r0, len(round_steps)):
        first = step - (i0 if r == r0 else 0)
        plan.begin_round(r, first, round_steps[r])
        plan.refresh(opt, sched)
        totals.append(planned_total(first, round_steps[r], r, K, n))
        for _ in range(round_steps[r] - (i0 if r == r0 else 0)):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
            step += 1
    return lrs, totals


CASES = [(4, 2, 1, 5), (4, 2, 2, 5), (7, 3, 1, 1), (7, 3, 2, 2), (5, 1, 1, 3), (3, 4, 1, 4), (16, 4, 1, 0)]


@pytest.mark.parametrize("n,K,world,seed", CASES)
def test_the_curve_spans_exactly_the_steps_the_run_takes(n, K, world, seed):
    steps = _round_steps(n, K, world, seed)
    real = sum(steps)
    lrs, totals = _run(steps, K, n, warmup=0.1, floor=0.1)
    assert len(lrs) == real and totals[-1] == real  # the last round's plan is exact
    assert all(t >= s for t, s in zip(totals, np.cumsum(steps)))  # never short of the steps already known
    peak = lrs.index(max(lrs))
    assert all(a < b for a, b in zip(lrs[:peak], lrs[1:peak + 1]))  # warm-up rises to the peak...
    assert all(a > b for a, b in zip(lrs[peak + 1:], lrs[peak + 2:]))  # ...then (one more step at the peak, as
    # the step curve has) the cosine falls at every step:
    last_start = (1 - 1 / (n * K) - 0.1) / 0.9  # the last round reads one shard: its cosine position, at least
    assert 0.1 * LR < lrs[-1] <= LR * (0.1 + 0.45 * (1 + math.cos(math.pi * last_start)))  # never at the floor


@pytest.mark.parametrize("n,K,world,seed", [(16, 4, 1, 0), (16, 4, 2, 1), (12, 3, 1, 2)])
def test_it_is_the_whole_cache_curve_over_the_true_step_count_up_to_round_sizes(n, K, world, seed):
    """Against independent code: components.build_optimizer's step curve, told the real count afterwards."""
    steps = _round_steps(n, K, world, seed)
    lrs, _ = _run(steps, K, n, warmup=0.04, floor=0.0)
    ref_opt, ref = build_optimizer([torch.nn.Parameter(torch.zeros(1))], _cfg(0.04, 0.0), torch.device("cpu"),
                                   sum(steps))
    want = []
    for _ in range(sum(steps)):
        want.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref.step()
    assert max(abs(a - b) for a, b in zip(lrs, want)) < 0.1 * LR  # rounds of unequal tokens bend it a little
    assert abs(sum(lrs) - sum(want)) < 0.05 * sum(want)  # 4.2 % for (12, 3): each round ends in a part-batch


def test_the_old_first_shard_estimate_undercounts_where_the_curve_does_not():
    """Session 8's bug: a total sized from an estimate short of the real count ran the last steps at the floor."""
    steps = _round_steps(16, 4, 1, 0)
    first_shard_guess = planned_total(0, steps[0], 0, 4, 16)  # what round 0 knows
    lrs, _ = _run(steps, 4, 16, warmup=0.04, floor=0.0)
    assert first_shard_guess != sum(steps)  # round 0 alone cannot know the run's length...
    assert min(lrs) > 0  # ...but no step runs at lr 0


@pytest.mark.parametrize("n,K,world,seed", [(4, 2, 1, 5), (7, 3, 2, 2)])
def test_a_resumed_run_follows_the_uninterrupted_curve_exactly(n, K, world, seed):
    steps = _round_steps(n, K, world, seed)
    full, _ = _run(steps, K, n, warmup=0.2, floor=0.05)
    at = 0
    for r, s in enumerate(steps):
        for i in (0, s // 2):  # a round-boundary checkpoint and a mid-round one (SIGTERM / --checkpoint-every)
            if i < s:  # the lr in the checkpoint's optimizer groups does not matter: the round's start sets it
                resumed, _ = _run(steps, K, n, warmup=0.2, floor=0.05, start=(r, i, 7.0))
                assert resumed == full[at + i:]
        at += s


def test_progress_ends_at_one_and_rounds_weigh_their_shard_passes():
    plan = WindowLR(2, 3, 0.0, 0.0)  # rounds read 1, 2, 2, 1 shards: 6 shard passes
    assert plan.starts == [0.0, 1 / 6, 3 / 6, 5 / 6, 1.0]
    plan.begin_round(3, 40, 4)
    assert plan.progress(43) == (5 / 6 + (1 / 6) * 3 / 4, 1.0)
    assert plan(40) == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 6)))
    with pytest.raises(ValueError):
        plan.begin_round(4, 44, 1)
