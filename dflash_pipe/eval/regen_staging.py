"""Prefills under the decode: regenerate's engine backend in overlap mode (`EngineBackend(overlap=True)`).

Session 12's H200 run put regenerate at 0.679 of a bare batched decode loop. Its decode steps alone ran at
0.93 of that loop; what the loop does not pay for is the bucketed prefills (3.6 s of 19.2 s) and the host
gaps between a launch's last step and the next launch's first kernel (~1.6 s), both on the decode's own
stream, so the decode stopped for them. Two changes take them off that path:

* `StagingArea`: waiting prompts are prefilled into the rows of a small engine of their own (`rows` rows,
  batch / 8 by default) on a second, low-priority CUDA stream, while the main stream decodes. The first
  token of each is chosen there too (regen_sampling: the same key and token index 0 as a prefill into the
  slot, so the same token). When slots are free, `land` copies staged rows (K/V up to their call's padded
  length, length, first token) into them on the main stream: a few copy kernels instead of a 30-layer
  forward. A staged group lands once its prefill is done on the device (an event query; the host does not
  wait), or, when at least `min_free` slots idle with nothing landable, after a device-side wait for the
  oldest group. The side stream writes a staging row again only after the main stream's copy of it (an event).
* `Snapshot`: the backend's state (active, tokens generated, ended, answers: ~2 MB at batch 1,024 and 256 new
  tokens) is copied to pinned host memory after step ``check_every - lag`` of a launch (lag 1 by default) and
  the host waits for that copy only, so the last `lag` steps are still queued while the host collects, writes
  and queues the next launch. An answer that ends in those steps is collected one launch later.

On the CPU there is no second stream and no event: the same code runs in order (the tests compare its
answers with the direct path's). An answer depends only on its prompt and key, never on where it was
prefilled or when it was collected, so the output is the direct path's.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..target.static_forward import StaticKVEngine, to_device
from .regen_refill import RefillPolicy, plan_refill
from .regen_sampling import Decoding, next_tokens


def _event(cuda: bool, timing: bool = False):
    """A CUDA event recorded on the current stream; None on the CPU."""
    if not cuda:
        return None
    ev = torch.cuda.Event(enable_timing=timing)
    ev.record()
    return ev


def mark(cuda: bool):
    """A timing mark: a CUDA event, or the host clock on the CPU (where everything runs in order)."""
    return _event(cuda, timing=True) if cuda else time.perf_counter()


def _done(ev) -> bool:
    return ev is None or ev.query()


@dataclass
class _Group:
    """The prompts of one staging prefill call, in staging rows, until they land."""
    rows: list[int]
    reqs: list
    width: int                 # K/V columns to copy: the call's padded token count
    start: object              # timing marks (`mark`): CUDA events, or host seconds on the CPU; on CUDA `end`
    end: object                # is also the event the landing waits for (after the first tokens)


class StagingArea:
    """Prompts prefilled on a side stream into a staging engine, landed into free slots (module docstring)."""

    def __init__(self, model, rows: int, max_len: int, dec: Decoding, *, use_graphs: str = "auto",
                 attention: str = "auto", min_rows: int = 8, budget: int | None = None, min_free: int | None = None):
        self.engine = StaticKVEngine(model, rows, max_len, use_graphs=use_graphs, bucketed_prefill=True,
                                     prefill_min_rows=min_rows, attention=attention, max_prefill_graphs=64,
                                     prefill_layout="padded")    # a landing copies the call's padded width
        dev = self.engine.device
        self.cuda = dev.type == "cuda"
        self.dec = dec
        self.rows = rows
        # top up once a quarter of the rows are free (or the waiting prompts fit: the tail)
        self.policy = RefillPolicy.for_batch(rows, self.cuda, max_len, budget=budget,
                                             min_free=max(1, rows // 4) if min_free is None else min_free,
                                             min_rows=self.engine.prefill_min_rows)
        self.stream = torch.cuda.Stream(device=dev, priority=0) if self.cuda else None   # the lowest priority
        self.free = list(range(rows))
        self.groups: deque[_Group] = deque()
        self.released = None       # event on the main stream after the last landing's copies
        with torch.inference_mode():
            self.first = torch.zeros(rows, dtype=torch.long, device=dev)   # each staged prompt's first token
        self.calls = self.prefilled_rows = self.real_tokens = self.padded_tokens = 0
        self.landed = self.device_waits = 0
        self.device_s = 0.0        # device time of the staging prefills (they overlap the decode)
        self._timed: list[_Group] = []
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())   # the buffers above were made on that one

    def __len__(self) -> int:
        return sum(len(g.rows) for g in self.groups)

    def _side(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    @torch.inference_mode()
    def top_up(self, ready: list) -> None:
        """Prefill prompts from the front of `ready` into free staging rows (removed from `ready`), on the side
        stream: one bucketed call per length bucket, as a refill groups them (regen_refill)."""
        window = [len(r.prompt) for r in ready[:max(len(self.free), self.policy.lookahead)]]
        calls = plan_refill(len(self.free), window, len(ready), live=1, p=self.policy)
        if not calls:
            return
        taken = set()
        with self._side():
            if self.released is not None:
                self.stream.wait_event(self.released)     # the rows landed last time are copied out
            for call in calls:
                rows, reqs = self.free[:len(call)], [ready[i] for i in call]
                del self.free[:len(call)]
                t0 = mark(self.cuda)
                logits = self.engine.prefill([r.prompt for r in reqs], rows)
                keys = to_device([r.key for r in reqs], self.engine.device)
                self.first[to_device(rows, self.engine.device)] = next_tokens(logits, keys, torch.zeros_like(keys),
                                                                              self.dec)
                rb, tb = self.engine.last_prefill_shape
                t1 = mark(self.cuda)
                g = _Group(rows, reqs, tb, t0, t1)
                self.groups.append(g)
                self._timed.append(g)
                taken.update(call)
                self.calls += 1
                self.prefilled_rows += len(reqs)
                self.real_tokens += sum(len(r.prompt) for r in reqs)
                self.padded_tokens += rb * tb
        ready[:] = [r for i, r in enumerate(ready) if i not in taken]

    @torch.inference_mode()
    def land(self, engine: StaticKVEngine, slots: list[int], wait: bool) -> tuple[list[int], list, torch.Tensor]:
        """Copy staged prompts into the empty `slots` of `engine` (on the current stream): the slots filled, their
        requests, their first tokens (on the device). Groups whose prefill is still running on the device are
        left for later unless `wait` and nothing else could land (then the current stream waits for the oldest
        one on the device; the host never waits)."""
        src, reqs, width = [], [], 0
        main = torch.cuda.current_stream() if self.cuda else None
        while self.groups and len(src) < len(slots):
            g = self.groups[0]
            if not _done(g.end if self.cuda else None):
                if not (wait and not src):
                    break
                self.device_waits += 1
            if self.cuda:
                main.wait_event(g.end)                   # free when done; orders the copy after it either way
            n = min(len(g.rows), len(slots) - len(src))
            src += g.rows[:n]
            reqs += g.reqs[:n]
            width = max(width, g.width)
            del g.rows[:n], g.reqs[:n]
            if not g.rows:
                self.groups.popleft()
        if not src:
            return [], [], torch.zeros(0, dtype=torch.long)
        dst = slots[:len(src)]
        engine.copy_rows_from(self.engine, src, dst, width)
        first = self.first[to_device(src, self.engine.device)]
        self.engine.reset(src)
        self.released = _event(self.cuda)
        self.free += src
        self.landed += len(src)
        return dst, reqs, first

    def take_back(self) -> list:
        """The staged requests (to rerun elsewhere); the area is emptied."""
        back = [r for g in self.groups for r in g.reqs]
        self.sync()
        self.groups.clear()
        self._timed.clear()
        self.free = list(range(self.rows))
        self.engine.reset()            # staging rows start empty (a landed row is reset as it lands)
        return back

    def sync(self) -> None:
        """Wait for the side stream (before its buffers are freed, and for exact timing)."""
        if self.cuda:
            self.stream.synchronize()

    def account(self) -> None:
        """Add the device time of the finished staging calls."""
        keep = []
        for g in self._timed:
            if not self.cuda:
                self.device_s += g.end - g.start
            elif g.end.query():
                self.device_s += g.start.elapsed_time(g.end) / 1e3
            else:
                keep.append(g)
        self._timed = keep


class Snapshot:
    """The backend's per-row state copied to host memory mid-launch (module docstring)."""

    def __init__(self, batch: int, width: int, device: torch.device):
        self.B, self.width = batch, width
        self.cuda = device.type == "cuda"
        n = batch * (3 + width) + 1
        self.host = torch.zeros(n, dtype=torch.long, pin_memory=self.cuda)
        self.ready = None          # event after the copy (None: nothing taken, or on the CPU: already there)
        self.taken = False
        self.live_row_steps = 0    # the occupancy counter as of the last copy read

    @torch.inference_mode()
    def take(self, active: torch.Tensor, n_gen: torch.Tensor, ended: torch.Tensor, out: torch.Tensor,
             live_row_steps: torch.Tensor) -> None:
        """Queue the copy of the state as it is after the steps queued so far (no host wait)."""
        packed = torch.cat([active.long(), n_gen, ended.long(), out.reshape(-1), live_row_steps.view(1)])
        self.host.copy_(packed, non_blocking=self.cuda)
        self.ready = _event(self.cuda)
        self.taken = True

    def read(self) -> tuple[list[bool], list[int], list[bool], torch.Tensor] | None:
        """Wait for the last copy (the host waits for it, not for the steps queued after it); None if none."""
        if not self.taken:
            return None
        if self.ready is not None:
            self.ready.synchronize()
        self.taken = False
        B = self.B
        h = self.host
        self.live_row_steps = int(h[-1])
        return (h[:B].bool().tolist(), h[B:2 * B].tolist(), h[2 * B:3 * B].bool().tolist(),
                h[3 * B:-1].view(B, self.width))
