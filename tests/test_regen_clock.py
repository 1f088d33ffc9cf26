"""regen_clock.LaunchClock: prefill, decode and between-launch spans from stand-in CUDA events, a launch still
running left pending, and the host clock on the CPU."""

from __future__ import annotations

from dflash_pipe.eval import regen_clock
from dflash_pipe.eval.regen_clock import LaunchClock


class _Ev:
    """A recorded event at `t` ms; done once `done` is set."""

    def __init__(self, t: float, done: bool = True):
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: "_Ev") -> float:
        return other.t - self.t


def test_spans_add_up_in_order_and_a_running_launch_waits(monkeypatch):
    times = iter([0.0, 2.0, 10.0, 13.0, 14.0, 20.0])            # launch 1: 0-2-10; launch 2: 13-14-20
    running = {}

    def fake_mark(cuda):
        ev = _Ev(next(times))
        running["last"] = ev
        return ev

    monkeypatch.setattr(regen_clock, "mark", fake_mark)
    clock = LaunchClock(cuda=True)
    for _ in range(2):
        clock.add(clock.mark(), clock.mark())
    running["last"].done = False                                  # launch 2's last step still runs
    clock.account()
    assert clock.seconds == {"prefill": 0.002, "decode": 0.008, "between": 0.0}
    running["last"].done = True
    clock.account()
    assert {k: round(v, 6) for k, v in clock.seconds.items()} == {"prefill": 0.003, "decode": 0.014,
                                                                  "between": 0.003}


def test_the_cpu_clock_counts_host_seconds():
    clock = LaunchClock(cuda=False)
    m0 = clock.mark()
    clock.add(m0, clock.mark())
    clock.add(clock.mark(), clock.mark())
    clock.account()
    assert all(v >= 0 for v in clock.seconds.values()) and sum(clock.seconds.values()) < 1.0
