"""regenerate's admission of new conversations (regenerate.py): rows go out in input order, so one slow answer
holds every later finished one in flight; at IN_FLIGHT x batch in flight admission stops, and the run counts
those rounds (`in_flight_full_rounds`) instead of silently starving its slots.

A stand-in backend answers without a model: slot 0's first request takes 40 launches, every other request one."""

from __future__ import annotations

import json

from bench.regen_host_work import StandInBackend
from dflash_pipe.config import RunConfig
from dflash_pipe.eval import regenerate as regen_mod
from dflash_pipe.eval.regen_requests import Completion
from tests.eval_helpers import llama  # noqa: F401 - pytest fixture


class SlowFirstBackend(StandInBackend):
    """batch 2: the very first request answers after 40 launches, the others after one (bench/regen_host_work.py's
    stand-in otherwise)."""

    describe = "stand-in (slow first answer)"

    def __init__(self, eos: int):
        super().__init__(2, [], eos, 4)
        self.started = self.launches = 0

    def launch(self, ready) -> None:
        self.launches += 1
        for i in range(self.B):
            if self.slots[i] is None and ready:
                self.slots[i] = (ready.pop(0), self.launches + (40 if self.started == 0 else 1))
                self.started += 1

    def collect(self) -> list[Completion]:
        out = []
        for i, s in enumerate(self.slots):
            if s is not None and s[1] <= self.launches:
                out.append(Completion(s[0], [1000, 1001], True, self.eos))
                self.slots[i] = None
        return out

    def stats(self) -> dict:
        return {"decode_steps": self.launches}


def _run(llama, tmp_path, monkeypatch, in_flight: int):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                                                   {"role": "assistant", "content": "-"}]})
                           + "\n" for i in range(60)))
    cfg = RunConfig()
    cfg.data.source = str(src)
    monkeypatch.setattr(regen_mod, "IN_FLIGHT", in_flight)
    monkeypatch.setattr(regen_mod, "make_backend", lambda *a, **k: SlowFirstBackend(eos=2))
    out = tmp_path / f"out{in_flight}.jsonl"
    state = regen_mod.run_regenerate(cfg, out, max_new_tokens=4, device="cpu", bundle=llama, max_turns=1)
    return [json.loads(line)["id"] for line in out.read_text().splitlines()], state["timing"]


def test_a_slow_first_answer_fills_the_flight_and_the_stall_is_counted(llama, tmp_path, monkeypatch):
    """IN_FLIGHT 8 at batch 2: 16 conversations in flight; the slow first answer holds them, so admission stops
    for rounds (counted) and the fast slot idles; with room for all 60 no round stalls. Both write every row in input
    order."""
    ids, stalled = _run(llama, tmp_path, monkeypatch, 8)
    assert ids == [f"c{i}" for i in range(60)]
    ids, free = _run(llama, tmp_path, monkeypatch, 100)
    assert ids == [f"c{i}" for i in range(60)]
    assert stalled["in_flight_full_rounds"] > 10 and free.get("in_flight_full_rounds", 0) == 0, (stalled, free)
    assert stalled["decode_steps"] > free["decode_steps"]          # launches in which the fast slot had nothing
