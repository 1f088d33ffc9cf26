"""The learning-rate curve of a window run (`train --follow --passes-per-shard K`), laid over shard passes.

A window run's step count is known only once its last shard is committed: a round's steps depend on its
shards' documents. The whole-cache curve (components.build_optimizer: linear warm-up, then cosine over a
known step count) therefore runs here on another axis, the run's n x K shard passes. Round r reads
m_r = len(window_members(r)) shards, so it covers progress [P_r, P_(r+1)), P_r = (m_0 + ... + m_(r-1)) / (n K),
spread linearly over its own steps (its schedule, hence its step count, is known when it starts):

    step i of round r (S_r steps):  progress p = P_r + (P_(r+1) - P_r) * i / S_r
    factor = min(1, p_end / warmup)                          while p < warmup (p_end: the step's end)
             floor + (1 - floor) * (1 + cos(pi * (p - warmup) / (1 - warmup))) / 2   after

The curve ends with the run's last step whatever the shards' sizes, and a step's LR is a function of
(round, step in round, S_r) alone: a resumed run follows the uninterrupted run's curve exactly, with nothing
new in the checkpoint. Session 8's H200 run had sized its cosine from an estimate made on the first shard
(1,058 steps for the 1,087 it ran), so its last 29 steps ran at the floor.

With `--max-steps` the run's length is the user's: the step-based curve of whole-cache training over
exactly that many steps (trainer.py).
"""

from __future__ import annotations

import math

from .schedule import window_members, window_rounds


class WindowLR:
    """LambdaLR's factor of a window run; `begin_round` before each round's first step, then `refresh`."""

    def __init__(self, passes: int, num_shards: int, warmup_frac: float, min_lr_frac: float):
        sizes = [len(window_members(r, passes, num_shards)) for r in range(window_rounds(passes, num_shards))]
        total, done, self.starts = sum(sizes), 0, []  # = K n shard passes
        for m in sizes:
            self.starts.append(done / total)
            done += m
        self.starts.append(1.0)  # the last round ends at exactly 1
        self.warmup, self.floor = float(warmup_frac), float(min_lr_frac)
        self.round, self.first_step, self.steps = 0, 0, None

    @property
    def rounds(self) -> int:
        return len(self.starts) - 1

    def begin_round(self, round_: int, first_step: int, steps: int) -> None:
        """Round `round_` runs `steps` steps from global step `first_step` on."""
        if not 0 <= round_ < self.rounds:
            raise ValueError(f"round {round_} outside 0..{self.rounds - 1}")
        self.round, self.first_step, self.steps = int(round_), int(first_step), int(steps)

    def progress(self, step: int) -> tuple[float, float]:
        """(progress at the start of global `step`, at its end). Past the current round's steps: the next
        round's start (LambdaLR asks for the next round's first step before that round has begun; `refresh`
        after `begin_round` replaces it)."""
        a, b = self.starts[self.round], self.starts[self.round + 1]
        i = step - self.first_step
        if self.steps is None:  # before the first round begins
            return a, a
        if i >= self.steps:
            return b, b
        return a + (b - a) * i / self.steps, a + (b - a) * (i + 1) / self.steps

    def __call__(self, step: int) -> float:
        p0, p1 = self.progress(step)
        w = self.warmup
        if w > 0 and p0 < w:
            return min(1.0, p1 / w)
        x = min(1.0, max(0.0, (p0 - w) / (1.0 - w)))
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * x))

    def refresh(self, opt, sched) -> None:
        """Set the learning rate of the next step (sched.last_epoch) from the round just begun."""
        f = self(sched.last_epoch)
        for group, base in zip(opt.param_groups, sched.base_lrs):
            group["lr"] = base * f
        sched._last_lr = [g["lr"] for g in opt.param_groups]


def planned_total(first_step: int, steps: int, round_: int, passes: int, num_shards: int) -> int:
    """The run's step count as known when round `round_` (`steps` steps from `first_step` on) begins: exact for
    the rounds so far, the later rounds at this round's steps per shard pass (each at least one step). Exact
    in the last round; for the progress line, the ETA and the checkpoint's `total_steps`, not for the LR."""
    rate = steps / max(1, len(window_members(round_, passes, num_shards)))
    later = sum(max(1, math.ceil(len(window_members(q, passes, num_shards)) * rate - 1e-9))
                for q in range(round_ + 1, window_rounds(passes, num_shards)))
    return first_step + steps + later
