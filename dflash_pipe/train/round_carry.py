"""Read-ahead across window rounds: the next round's first batches are assembled while the current
round's last ones train.

Once every batch of round r is submitted, the loader asks `peek(r + 1)` for round r + 1's schedule, a
non-blocking, non-collective look (window_run.WindowCoordinator.peek_schedule: None until every shard
that round reads is committed and in the ledger) at most once per `poll_s`, and submits its first
batches into the room the prefetch depth leaves. The look runs on a thread of its own: it lists the
cache, adds new shards to the ledger (an fsynced write, slow while extraction writes on the same disk)
and reads a new shard's footer, none of which may stall the step loop; its answer is picked up by the
next call. When the trainer then starts round r + 1, `take` hands those futures over only if they are
the batches the real schedule (built after the collective look) has at the same steps; anything else
is dropped and its buffers returned. A batch is a function
of (schedule, seed, round, rank, step) alone, so carried batches equal the ones built without it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("dflash_pipe.loader")


class RoundCarry:
    def __init__(self, peek, poll_s: float):
        self.peek, self.poll_s = peek, poll_s
        self.round: int | None = None
        self.sched = None
        self.items: deque = deque()  # (step, future) in step order
        self.next_step = 0
        self._last_peek = float("-inf")
        self.carried = 0  # batches handed over to the next round (for tests and logs)
        self._looker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-peek")
        self._look = None  # (round, future of peek(round)) in flight

    def __len__(self) -> int:
        return len(self.items)

    def top_up(self, round_: int, room: int, submit) -> None:
        """Submit up to `room` more batches of `round_` (`submit(batch docs, round, step)` -> future). The
        look for `round_`'s schedule starts even when there is no room yet, so its answer is there in time."""
        if self.round != round_:
            self.discard()
            sched = self._answer(round_)
            if sched is None or sched.steps == 0:
                return
            self.round, self.sched, self.next_step = round_, sched, 0
        while room > 0 and self.next_step < self.sched.steps:
            s = self.next_step
            self.items.append((s, submit(self.sched, round_, s)))
            self.next_step += 1
            room -= 1

    def _answer(self, round_: int):
        """The schedule a finished look found for `round_`, else None (and a new look started if none is in
        flight and `poll_s` has passed since the last)."""
        if self._look is not None:
            r, fut = self._look
            if not fut.done():
                return None
            self._look = None
            try:
                sched = fut.result()
            except Exception as exc:  # noqa: BLE001 - peek_schedule answers None itself; the real look reports
                log.debug("round %d: read-ahead look failed (%s)", r, exc)
                sched = None
            if r == round_ and sched is not None:
                return sched
        now = time.monotonic()
        if now - self._last_peek >= self.poll_s:
            self._last_peek = now
            self._look = (round_, self._looker.submit(self.peek, round_))
        return None

    def wait_look(self) -> None:
        """Block until the look in flight (if any) has answered (for tests: makes the next top_up see it)."""
        if self._look is not None:
            self._look[1].exception()

    def close(self) -> None:
        self.discard()
        self._looker.shutdown(wait=True, cancel_futures=True)

    def take(self, round_: int, start_step: int, sched, rank: int) -> tuple[deque, int]:
        """(futures of steps start_step.., next step to submit) if they match `sched`, else (empty, start_step)."""
        if self.round != round_ or not self.items:
            self.discard()
            return deque(), start_step
        steps = [s for s, _ in self.items]
        same = (steps[0] == start_step and steps[-1] < sched.steps
                and all(self.sched.batch(rank, s) == sched.batch(rank, s) for s in steps))
        if not same:
            log.warning("round %d: the batches read ahead differ from the round's schedule; rebuilt", round_)
            self.discard()
            return deque(), start_step
        futures = deque(f for _, f in self.items)
        self.carried += len(futures)
        self.items.clear()
        self.round, self.sched = None, None
        return futures, start_step + len(futures)

    def discard(self) -> None:
        """Drop what was read ahead; the plane buffers go back to the pool when each batch is done."""
        for _, f in self.items:
            f.add_done_callback(_release)
        self.items.clear()
        self.round, self.sched = None, None


def _release(future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().release()
