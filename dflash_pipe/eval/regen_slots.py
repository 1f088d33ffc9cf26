"""What the engine backend (regen_backends.EngineBackend) does with its slots besides refilling them: functions of
the backend's state, called from its launch.

History reuse (`reuse_history`, multi-turn): a finished row's slot is held with its K/V (the prompt and the
answer tokens fed so far) until the driver has turned the answer into the conversation's next request. If
that prompt starts with exactly those tokens (the chat template re-renders the history; a re-tokenization
that differs falls back), only the new tokens (the end-of-turn token, the next user message, the assistant
header) are prefilled into the held row, grouped into calls as a refill groups fresh prompts; otherwise, or when
no next request comes within two launches, the slot is freed. Later turns then cost their new tokens instead of
their whole history (session 14's every-turn data: 19 % of the prefilled tokens). The held history's K/V were
written by decode steps instead of one prefill: the same values up to rounding.

Tail compaction (`compact`, off by default): once nothing is left to refill, the live rows move to the lowest
slots (K/V copied) and the steps run on only the first batch/2, /4 or /8 rows while the live ones fit.
"""

from __future__ import annotations

from dataclasses import replace

from ..target.static_forward import to_device
from .regen_refill import plan_refill
from .regen_requests import TurnRequest


def continue_held(be, ready: list[TurnRequest]) -> None:
    """History reuse: the next requests of held rows' conversations go back into their rows, prefilling only
    what follows the tokens already there (grouped into calls as a refill groups fresh prompts); held rows
    whose conversation has no such request are freed (after two launches without one, or at once when the
    request's prompt does not extend them)."""
    by_state = {id(h.state): r for r, h in be.held.items()}
    rows, reqs, taken, drop = [], [], set(), []
    for i, req in enumerate(ready):
        r = by_state.get(id(req.state))
        if r is None:
            continue
        fed = be.held[r].fed
        if len(req.prompt) > len(fed) and req.prompt[:len(fed)] == fed:
            rows.append(r)
            reqs.append(req)
            taken.add(i)
        else:
            drop.append(r)              # the re-rendered history differs: a fresh prefill, elsewhere
    for r, h in be.held.items():
        h.launches += 1
        if r not in rows and r not in drop and (h.state.done or h.launches > 2):
            drop.append(r)
    if drop:
        be._release(drop)
    if not rows:
        return
    deltas = []
    for r, req in zip(rows, reqs):
        fed = be.held.pop(r).fed
        deltas.append(req.prompt[len(fed):])
        be.reused_tokens += len(fed)
        be.slots[r] = req
    ready[:] = [r for i, r in enumerate(ready) if i not in taken]
    n = len(rows)
    appending = replace(be.policy, chunked=False)           # appends to held rows pad (static_forward.py)
    for call in plan_refill(n, [len(d) for d in deltas], n, be.B - n, appending):
        be.delta_prefills += 1
        be._prefill([rows[i] for i in call], [reqs[i] for i in call], [deltas[i] for i in call])


def shrink(be) -> None:
    """Halve the decode width while the live rows fit in half of it (min batch / 8), moving rows down."""
    live = [i for i, s in enumerate(be.slots) if s is not None]
    w = be.width
    while w // 2 >= max(len(live), be.min_width):
        w //= 2
    if w == be.width:
        return
    src = [i for i in live if i >= w]
    dst = [i for i in range(w) if be.slots[i] is None][:len(src)]
    if src:
        be.engine.move_rows(src, dst)
        s = to_device(src, be.engine.device)
        d = to_device(dst, be.engine.device)
        for t in (be.cur, be.active, be.ended, be.n_gen, be.keys, be.out):
            t[d] = t[s]
        be.active.index_fill_(0, s, False)
        for a, b in zip(src, dst):
            be.slots[b], be.slots[a] = be.slots[a], None
    be.width = w
