"""How `regenerate` turns prompts into answers: continuous batching on the static-KV engine, or HF `generate`.

Both backends take `TurnRequest`s from the front of a ready list (the driver keeps it in input
order) in `launch` and hand back `Completion`s, in any order, from `collect`; between the two the
host is free (the driver tokenizes and writes there while the GPU decodes).

`EngineBackend` (attention-only targets, `dflash_pipe.target.static_forward`): `batch` slots.
Every `launch` first refills free slots from the ready list as `regen_refill.plan_refill` decides
(once enough slots are free; prompts picked by length bucket from a lookahead window; one bucketed
prefill call per length bucket, at most `prefill_tokens` padded tokens a call, a CUDA graph per
padded shape on CUDA: `StaticKVEngine.prefill`), then runs `check_every` decode steps on all slots
at once (a CUDA graph each on CUDA). In the tail (nothing left to refill;
`compact`, off by default, see __init__) the live rows are moved to the lowest slots (K/V copied) and the steps
run on only the first batch/2, /4 or /8 rows while the live ones fit. Token choice, the per-row answer
buffers and the stopping masks (EOS / max_new_tokens) stay on the device; `collect` looks at them
(one sync), frees finished slots and returns their answers. A finished row idles
until then (at most check_every - 1 wasted steps), and costs nothing in attention (its length
stops growing).

History reuse (`reuse_history`, multi-turn) and tail compaction: regen_slots.py. Prompt-lookup speculation
(`lookup_draft` K > 0: K tokens drafted from each row's own history, or from the n-gram table all rows share
(`lookup_shared`), and verified in every step; None = 2 for greedy answers on CUDA graphs): regen_lookup.py.

Collecting early (``snapshot_lag`` K, 1 by default on CUDA): `collect` reads a copy of the per-row state taken K
steps before the launch's end and refills the freed slots at once; the refill's prefills queue behind those last
steps, so the host's work between launches runs while the device still decodes. The same answers; one that ends
in the last K steps of a launch is collected a launch later.

Overlap mode (``overlap=True``, regen_staging.py): once rows decode, waiting prompts are prefilled on a second,
low-priority CUDA stream into a staging engine and copied into free slots as they free up (and answers are
collected early), so neither the prefills nor the host's work between launches stop the decode. The answers are
the direct path's.

`HFBackend` (regen_hf.py; any target, the fallback for hybrid / recurrent ones): `batch` requests at a time in
one left-padded greedy `generate` call, as regenerate did before the engine.

An answer depends only on its prompt and its key (regen_sampling), never on the slot or the batch,
so requests in flight can be handed back and rerun: that is how an out-of-memory error becomes a
smaller batch (the driver's `rebuild`).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..errors import UsageError
from ..target.static_forward import StaticKVEngine, to_device
from .regen_refill import RefillPolicy, plan_refill
from .regen_slots import continue_held, shrink
from .regen_requests import Completion, Held, TurnRequest, auto_batch_size  # noqa: F401 - re-exported
from .regen_sampling import Decoding, next_tokens
from .regen_clock import LaunchClock
from .regen_lookup import LookupDrafts, auto_lookup, check_lookup
from .regen_staging import Snapshot, StagingArea

log = logging.getLogger("dflash_pipe.eval")
GREEDY = Decoding()


class EngineBackend:
    """Continuous batching over a StaticKVEngine (module docstring)."""

    name = "static-KV engine"
    FILL_FROM_UPLOAD = True    # the lookup history from the prefill's own upload (False: from the prompt lists;
                               # bench/regen_throughput.py's +hostfill A/B)

    def __init__(self, model, eos: list[int], batch: int, max_len: int, max_new_tokens: int, dec: Decoding,
                 check_every: int = 8, prefill_tokens: int | None = None, use_graphs: str = "auto",
                 compact: bool | None = None, min_free: int | None = None, attention: str = "auto",
                 reuse_history: bool = False, overlap: bool = False, staging_rows: int | None = None,
                 snapshot_lag: int | None = None, prefill_layout: str = "auto", lookup_draft: int | None = 0,
                 lookup_shared: bool = True):
        cuda = next(model.parameters()).device.type == "cuda"     # padding rows to 8 saves graphs, not CPU time
        self.engine = StaticKVEngine(model, batch, max_len, use_graphs=use_graphs, bucketed_prefill=True,
                                     prefill_min_rows=8 if cuda else 1, attention=attention,
                                     max_prefill_graphs=128 if reuse_history else 64,   # + the appending shapes
                                     prefill_layout=prefill_layout)
        dev = self.engine.device
        self.B, self.max_new, self.dec = batch, max_new_tokens, dec
        self.check_every = max(1, min(check_every, max_new_tokens - 1))   # an answer ends after max_new - 1 steps
        self.policy = RefillPolicy.for_batch(batch, dev.type == "cuda", max_len, budget=prefill_tokens,
                                             min_free=min_free, min_rows=self.engine.prefill_min_rows,
                                             chunked=self.engine.prefill_layout == "chunks")
        self.slots: list[TurnRequest | None] = [None] * batch
        # history reuse (module docstring): the rows kept for their conversations' next turns
        if reuse_history and compact:
            raise UsageError("history reuse keeps finished rows in place; tail compaction moves rows")
        self.reuse_history = reuse_history
        # prompt-lookup speculation (regen_lookup.py): K drafts a row verified in each step (None: auto_lookup)
        lookup_draft = auto_lookup(check_lookup(lookup_draft, overlap, compact), self.engine.use_graphs, dec,
                                   overlap, compact)
        self.lookup = (LookupDrafts(batch, max_len, lookup_draft, self.engine.device, shared=lookup_shared)
                       if lookup_draft else None)
        self.held: dict[int, Held] = {}
        self.reused_tokens = self.delta_prefills = 0
        # tail compaction: with nothing waiting, live rows move down and steps run on the first `width` rows.
        # Off by default: the one H200 run with it on (session 7) regenerated at 18.8 k tok/s against 42.8 k
        # without it and the other changes of that commit; which change cost the time is not measured yet
        self.compact = bool(compact)
        self.width, self.min_width = batch, max(1, batch // 8)
        self.width_row_steps = 0
        with torch.inference_mode():
            self.cur = torch.zeros(batch, dtype=torch.long, device=dev)        # chosen, not yet fed
            self.active = torch.zeros(batch, dtype=torch.bool, device=dev)
            self.ended = torch.zeros(batch, dtype=torch.bool, device=dev)
            self.n_gen = torch.zeros(batch, dtype=torch.long, device=dev)
            self.keys = torch.zeros(batch, dtype=torch.long, device=dev)
            self.out = torch.zeros((batch, max_new_tokens + 1), dtype=torch.long, device=dev)  # + spare column
            self.eos = torch.tensor(sorted(set(eos)), dtype=torch.long, device=dev)
            self.live_row_steps = torch.zeros((), dtype=torch.long, device=dev)   # occupancy, summed per step
        self.decode_steps = 0
        self.idle_slot_launches = 0          # empty slots summed over launches (each idles check_every steps)
        self.host_refill_s = 0.0             # the host's time queuing the refills' prefills (launch_s's first part)
        # --greedy-after K: a row refilled before decode step s0 samples while its token index is < K, i.e. at
        # steps < s0 + K - 1; past the last such step no row samples and the step takes the argmax alone
        # (skipping softmax + the full-vocabulary sort of top-p). The host knows this without a sync.
        self.sample_until = 0
        self.prefill_rows = self.prefill_calls = self.prefill_real = self.prefill_padded = 0
        self.cuda = dev.type == "cuda"
        self.clock = LaunchClock(self.cuda)              # device time of prefills, decode steps, gaps (regen_clock)
        mode = "CUDA graphs" if self.engine.use_graphs else "eager"
        attn = "per-row attention" if self.engine.row_attention(batch) else "SDPA attention"
        # overlap mode (module docstring): staged prefills on a side stream, the decode on a high-priority stream
        self.main = torch.cuda.Stream(device=dev, priority=-1) if overlap and self.cuda else None
        self.staging = self.snap = None
        if overlap:
            self.staging = StagingArea(model, staging_rows or max(self.engine.prefill_min_rows, batch // 8), max_len,
                                       dec, use_graphs=use_graphs, attention=attention,
                                       min_rows=self.engine.prefill_min_rows, budget=prefill_tokens)
        # collecting early (module docstring; by default 1 step on CUDA, 0 = wait for the launch on the CPU):
        # 1.047x on the H100 (BENCHMARKS.md, session 30), answers identical. A row started at a launch's start that
        # runs to max_new ends at that launch's step (max_new - 1) mod check_every (256 new, every 8: step 7 of 8),
        # so with a lag of 2 or more every such answer waits a whole launch more (occupancy 0.932 at lag 1, 0.907
        # at lag 2 on the H100). A lag of check_every takes the copy as a launch starts: the host works a whole
        # launch ahead of the device
        lag = (1 if overlap or self.cuda else 0) if snapshot_lag is None else snapshot_lag
        self.lag = max(0, min(self.check_every, lag))
        if self.lag or overlap:
            self.snap = Snapshot(batch, max_new_tokens + 1, dev)
        if self.main is not None:
            self.main.wait_stream(torch.cuda.current_stream())     # the buffers above were made on this one
        steps = f"collect {self.lag} step{'s' * (self.lag != 1)} early"
        over = (f", prefills under the decode ({self.staging.rows} staging rows, {steps})" if overlap
                else f", {steps}" if self.lag else "")
        self.describe = (f"{self.name} ({mode}, batch {batch}, {attn}, {self.engine.prefill_layout} prefill, "
                         f"check every {self.check_every} steps, "
                         f"refill at {self.policy.min_free} free slots{', history reuse' if reuse_history else ''}"
                         f"{', tail compaction' if self.compact else ''}"
                         f"{f', {lookup_draft} lookup drafts a step' if lookup_draft else ''}"
                         f"{' (shared n-gram table)' if lookup_draft and lookup_shared else ''}{over})")

    def busy(self) -> bool:
        return self._live() or bool(self.staging and len(self.staging))

    def close(self) -> None:
        """Wait for this backend's streams (overlap mode on CUDA): its buffers were made on the default stream, and
        once freed the allocator may hand them to work there while steps queued on the main stream still run."""
        if self.main is not None:
            self.main.synchronize()
        if self.staging is not None:
            self.staging.sync()

    def _on_main(self):
        """The stream all of this backend's device work goes to (overlap mode on CUDA; else the current one)."""
        return torch.cuda.stream(self.main) if self.main is not None else contextlib.nullcontext()

    def _free_rows(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None and i not in self.held]

    def _release(self, rows: list[int]) -> None:
        for r in rows:
            del self.held[r]
        self.engine.reset(rows)

    def take_back(self) -> list[TurnRequest]:
        """The requests in flight (to rerun elsewhere); the slots are emptied."""
        back = [s for s in self.slots if s is not None]
        if self.staging is not None:
            with self._on_main():
                back += self.staging.take_back()
        self.close()                       # the caller frees this backend next (a smaller batch)
        self.slots = [None] * self.B
        self.held.clear()                  # the rerun prefills whole prompts
        return back

    @torch.inference_mode()
    def launch(self, ready: list[TurnRequest]) -> None:
        """Fill free slots from the front of `ready` and queue check_every decode steps (no host sync)."""
        with self._on_main():
            self._launch(ready)

    def _launch(self, ready: list[TurnRequest]) -> None:
        m0 = self.clock.mark()
        if self.held:
            continue_held(self, ready)
        free = self._free_rows()
        if self.staging is not None and free and len(self.staging):
            self._land(free, wait=not self._live() or len(free) >= self.policy.min_free)
            free = self._free_rows()
        # overlap mode: straight into the slots only when nothing decodes (the first fill) or when at least
        # `min_free` slots would still idle (the staging area ran dry: a burst of ends, next turns just queued)
        if self.staging is None or not self._live() or len(free) >= self.policy.min_free:
            t = time.perf_counter()
            self._refill(free, ready)        # takes the slots it fills out of `free`
            self.host_refill_s += time.perf_counter() - t
        if self._live():                     # slots this launch leaves empty (waiting for min_free, or no prompts)
            self.idle_slot_launches += len(free)
        self._decode_launch(m0, ready)
        if self.staging is not None:
            self.staging.top_up(ready)      # on the side stream, under the steps just queued

    def _live(self) -> bool:
        return any(s is not None for s in self.slots)

    def _refill(self, free: list[int], ready: list[TurnRequest]) -> None:
        """Prefill prompts from `ready` straight into the `free` slots, as regen_refill plans it."""
        window = [len(r.prompt) for r in ready[:max(len(free), self.policy.lookahead)]]
        calls = plan_refill(len(free), window, len(ready), self.B - len(free), self.policy)
        if calls:
            taken = set()
            for call in calls:
                rows, reqs = free[:len(call)], [ready[i] for i in call]
                del free[:len(call)]
                for r, req in zip(rows, reqs):
                    self.slots[r] = req
                if max(rows) >= self.width:
                    self.width = self.B    # back to full width (rows past the old width are empty and inactive)
                self._prefill(rows, reqs)
                taken.update(call)
            ready[:] = [r for i, r in enumerate(ready) if i not in taken]

    def _decode_launch(self, m0, ready: list[TurnRequest]) -> None:
        """check_every decode steps on the slots (after tail compaction where it applies); in overlap mode the
        state snapshot after step check_every - lag."""
        if self.compact and not ready and not (self.staging and len(self.staging)):
            shrink(self)
        m1 = self.clock.mark()
        if self._live():
            if self.snap is not None and self.lag == self.check_every:   # the state as this launch starts
                self.snap.take(self.active, self.n_gen, self.ended, self.out, self.live_row_steps)
            for i in range(self.check_every):
                self._decode()
                if self.snap is not None and i == self.check_every - 1 - self.lag:
                    self.snap.take(self.active, self.n_gen, self.ended, self.out, self.live_row_steps)
        self.clock.add(m0, m1)

    def _land(self, free: list[int], wait: bool) -> None:
        """Staged prompts into free slots (regen_staging.StagingArea.land), started like freshly prefilled rows."""
        rows, reqs, first = self.staging.land(self.engine, free, wait)
        if not rows:
            return
        for r, req in zip(rows, reqs):
            self.slots[r] = req
        if max(rows) >= self.width:
            self.width = self.B
        dev = self.engine.device
        self._start(first, to_device(rows, dev), to_device([r.key for r in reqs], dev))
        self.sample_until = max(self.sample_until, self.decode_steps + self.dec.greedy_after - 1)

    def _account(self) -> None:
        """Count the device time of the launches done on the device (in overlap mode the last one may still run)."""
        self.clock.account()
        if self.staging is not None:
            self.staging.account()

    def stats(self) -> dict:
        """Counters of the run so far: decode steps, mean live rows per step, prefill work. One host sync, except in
        overlap mode (the occupancy as of the last snapshot read: exact once every answer is collected)."""
        if self.snap is not None:
            live = self.snap.live_row_steps
        else:
            live = int(self.live_row_steps)
        self._account()
        steps = max(1, self.decode_steps)
        st = self.staging
        staged = {} if st is None else {
            "staged_prefill_calls": st.calls, "staged_rows": st.prefilled_rows, "staged_tokens": st.real_tokens,
            "staged_pad_share": round(1 - st.real_tokens / max(1, st.padded_tokens), 3),
            "staged_landed": st.landed, "staging_device_waits": st.device_waits,
            "device_staged_prefill_s": round(st.device_s, 3)}
        spec = {} if self.lookup is None else self.lookup.stats(live)
        return {"decode_steps": self.decode_steps, "mean_live_rows": round(live / steps, 1), **spec,
                "occupancy": round(live / (steps * self.B), 3),
                "mean_decode_width": round(self.width_row_steps / steps, 1),
                "idle_slot_launches": self.idle_slot_launches, "host_refill_s": round(self.host_refill_s, 3),
                "prefill_calls": self.prefill_calls, "prefill_rows": self.prefill_rows,
                "prefill_tokens": self.prefill_real,
                "prefill_pad_share": round(1 - self.prefill_real / max(1, self.prefill_padded), 3),
                "prefill_graphs": self.engine.prefill_graph_count,
                "history_reused_tokens": self.reused_tokens, "history_prefills": self.delta_prefills,
                "decode_graphs": self.engine.graph_count - self.engine.prefill_graph_count,
                "device_prefill_s": round(self.clock.seconds["prefill"], 3),
                "device_decode_s": round(self.clock.seconds["decode"], 3),
                "device_between_launches_s": round(self.clock.seconds["between"], 3), **staged}

    def _start(self, tok: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Freshly prefilled `rows` start with their first tokens `tok` (chosen at token index 0 by their keys)."""
        hit = (tok[:, None] == self.eos).any(dim=-1)
        self.out[rows, 0] = tok
        self.cur[rows] = tok
        self.keys[rows] = keys
        self.n_gen.index_fill_(0, rows, 1)  # `n_gen[rows] = 1` copies the scalar from the host: a sync on CUDA
        self.ended[rows] = hit
        self.active[rows] = ~hit & (self.max_new > 1)

    def _advance(self, logits, w: int, dec: Decoding) -> None:
        """Next token of every live row of the first `w`; finished rows write to the spare column and stay put."""
        keys, n_gen, active, cur = self.keys[:w], self.n_gen[:w], self.active[:w], self.cur[:w]
        tok = next_tokens(logits, keys, n_gen, dec)
        act = active.clone()
        col = torch.where(act, n_gen, self.max_new)
        self.out[:w].scatter_(1, col[:, None], tok[:, None])
        hit = act & (tok[:, None] == self.eos).any(dim=-1)
        self.ended[:w] |= hit
        n_gen += act.long()
        active.copy_(act & ~hit & (n_gen < self.max_new))
        cur.copy_(torch.where(act, tok, cur))
        self.live_row_steps += act.sum()

    def _prefill(self, rows: list[int], reqs: list[TurnRequest], deltas: list[list[int]] | None = None) -> None:
        """One bucketed prefill call of `reqs` into the empty `rows`, and their first tokens; with `deltas`, the
        rows hold each prompt's first tokens already (history reuse) and only these are appended."""
        dev = self.engine.device
        if deltas is None:
            self.engine.reset(rows)
        tokens = deltas if deltas is not None else [r.prompt for r in reqs]
        logits = self.engine.prefill(tokens, rows)
        keys = to_device([r.key for r in reqs], dev)                                    # no host sync
        up = None if deltas is not None or not self.FILL_FROM_UPLOAD else self.engine.last_uploaded   # on the device
        rows_t = up.prompt_rows if up is not None else to_device(rows, dev)
        first = next_tokens(logits, keys, torch.zeros_like(keys), self.dec)
        self._start(first, rows_t, keys)
        if self.lookup is not None:
            self.lookup.fill(rows_t, [r.prompt for r in reqs], first, up)
        self.sample_until = max(self.sample_until, self.decode_steps + self.dec.greedy_after - 1)
        lens = [len(t) for t in tokens]
        self.prefill_rows += len(reqs)
        self.prefill_calls += 1
        self.prefill_real += sum(lens)
        rb, tb = self.engine.last_prefill_shape
        self.prefill_padded += rb * tb

    @torch.inference_mode()
    def _decode(self) -> None:
        w = self.width
        greedy_now = self.dec.greedy_after and self.decode_steps >= self.sample_until   # no row samples any more
        dec = GREEDY if greedy_now else self.dec
        if self.lookup is not None:
            self.lookup.step(self, w, dec)
        else:
            out = self.engine.forward(self.cur[:w, None], self.active[:w].long())
            self._advance(out.logits[:, 0], w, dec)
        self.decode_steps += 1
        self.width_row_steps += w

    @torch.inference_mode()
    def collect(self) -> list[Completion]:
        """Wait for the queued steps (overlap mode: for the snapshot `lag` steps before their end); the finished
        answers (their slots are freed)."""
        with self._on_main():
            return self._collect()

    def _finished(self) -> list[tuple[int, int, bool, list[int]]]:
        """(row, tokens generated, ended by EOS, the answer buffer's first tokens) of each finished live row."""
        live = [i for i, s in enumerate(self.slots) if s is not None]
        if self.snap is not None:
            snap = self.snap.read()                            # the one host wait of a launch
            if snap is None:
                return []
            active, n_gen, ended, out = snap
            return [(r, n_gen[r], ended[r], out[r, :n_gen[r]].tolist()) for r in live if not active[r]]
        flags = self.active.tolist()                           # the one sync of a step
        done = [i for i in live if not flags[i]]
        if not done:
            return []
        dt = to_device(done, self.engine.device)
        table = torch.cat([self.n_gen[dt, None], self.ended[dt, None].long(), self.out[dt]], dim=1).tolist()
        return [(r, row[0], bool(row[1]), row[2:2 + row[0]]) for r, row in zip(done, table)]

    def _collect(self) -> list[Completion]:
        finished = self._finished()
        self._account()
        if not finished:
            return []
        comps, done = [], []
        for r, n, ended, toks in finished:
            done.append(r)
            req = self.slots[r]
            comps.append(Completion(req, toks[:-1] if ended else toks, ended, toks[-1] if ended else None))
            self.slots[r] = None
            if self.reuse_history:         # the last token chosen is never fed: the K/V hold the prompt + the rest
                self.held[r] = Held(req.state, req.prompt + toks[:-1])
        gone = [r for r in done if r not in self.held]
        self.engine.reset(gone)            # idle rows then attend over nothing until refilled
        return comps
