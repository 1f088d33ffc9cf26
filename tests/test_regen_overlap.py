"""regenerate's overlap mode (regen_staging.py) on the CPU: the same answers as the direct path, through the staging
area, the early snapshot, history reuse and an out-of-memory rerun. The streams themselves are GPU-only
(tests/test_regen_overlap_gpu.py)."""

from __future__ import annotations

import torch

from dflash_pipe.eval import regen_backends
from dflash_pipe.eval.regen_backends import EngineBackend, TurnRequest
from dflash_pipe.eval.regen_sampling import Decoding
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.eval_helpers import drain_backend, llama  # noqa: F401 - pytest fixture
from tests.test_eval_regenerate import NEW, _rows, cfg  # noqa: F401 - pytest fixture

EOS = list(range(2, 49152, 5))          # a fifth of the vocabulary ends an answer: answers end at many steps


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, 49152, (k,), generator=g).tolist() for k in lens]


def _answers(model, prompts, dec, **kw) -> tuple[dict, EngineBackend]:
    be = EngineBackend(model, EOS, batch=4, max_len=96, max_new_tokens=14, dec=dec, check_every=3, **kw)
    return drain_backend(be, prompts, key_offset=100), be


def test_overlap_mode_gives_the_direct_paths_answers_through_the_staging_area(llama):
    """30 prompts, 4 slots, 3 staging rows, the snapshot one step before a launch's end: every answer (sampled,
    sampled for its first 3 tokens then greedy, and greedy) equals the direct path's, and the prefill counters add up: the first fill (nothing decodes yet) and
    the slots the staging area cannot fill prefill straight into the slots, at least half the prompts go through
    the staging area."""
    prompts = _prompts(30, seed=11)
    for dec in (Decoding(temperature=0.9, top_p=0.95, seed=3), Decoding(temperature=1.2, greedy_after=3, seed=1),
                Decoding()):
        direct, _ = _answers(llama.model, prompts, dec)
        over, be = _answers(llama.model, prompts, dec, overlap=True, staging_rows=3, snapshot_lag=1)
        assert sorted(direct) == list(range(30)) and over == direct
        st = be.stats()
        assert st["staged_rows"] == st["staged_landed"], st
        assert st["staged_rows"] >= 15 and st["staged_rows"] + st["prefill_rows"] == 30, st
        assert len(be.staging) == 0 and sorted(be.staging.free) == [0, 1, 2]
    greedy_direct, _ = _answers(llama.model, prompts, Decoding(), snapshot_lag=0)
    assert greedy_direct == direct


def test_the_snapshot_collects_answers_that_end_after_it_one_launch_later(llama):
    """With the snapshot taken 2 steps before a launch's end, the answers come out in other launches than with the
    snapshot at the end, and the same."""
    prompts = _prompts(12, seed=4)
    seen = {}
    for lag in (0, 2):
        be = EngineBackend(llama.model, EOS, batch=4, max_len=96, max_new_tokens=14, dec=Decoding(), check_every=3,
                           overlap=True, staging_rows=4, snapshot_lag=lag)
        ready = [TurnRequest(None, p, key=i, order=i) for i, p in enumerate(prompts)]
        got, when, launches = {}, {}, 0
        while ready or be.busy():
            be.launch(ready)
            launches += 1
            for c in be.collect():
                got[c.request.order], when[c.request.order] = c.tokens, launches
        seen[lag] = (got, when)
    assert seen[0][0] == seen[2][0] and sorted(seen[0][0]) == list(range(12))
    assert seen[0][1] != seen[2][1]


def test_a_landed_row_holds_the_keys_and_values_a_direct_prefill_writes(llama):
    """copy_rows_from: K/V of the first `width` positions and the length, from a staging engine's row into a slot;
    then both engines' next decode steps agree. Engines over other shapes are refused."""
    prompt = _prompts(1, seed=2)[0]
    direct = StaticKVEngine(llama.model, 3, 64, bucketed_prefill=True, prefill_min_rows=1)
    stage = StaticKVEngine(llama.model, 2, 64, bucketed_prefill=True, prefill_min_rows=1)
    main = StaticKVEngine(llama.model, 3, 64, bucketed_prefill=True, prefill_min_rows=1)
    a = direct.prefill([prompt], [2])
    b = stage.prefill([prompt], [1])
    main.copy_rows_from(stage, [1], [2], stage.last_prefill_shape[1])
    n = len(prompt)
    assert torch.equal(a, b) and main.length(2) == direct.length(2) == n
    assert torch.equal(main.k_cache[:, 2, :, :n], direct.k_cache[:, 2, :, :n])
    assert torch.equal(main.v_cache[:, 2, :, :n], direct.v_cache[:, 2, :, :n])
    step = torch.tensor([[5], [5], [7]])
    assert torch.equal(main.forward(step, torch.tensor([0, 0, 1])).logits[2],
                       direct.forward(step, torch.tensor([0, 0, 1])).logits[2])
    import pytest

    from dflash_pipe.errors import UsageError
    with pytest.raises(UsageError, match="copy_rows_from"):
        main.copy_rows_from(stage, [0, 1], [0], 8)


def test_overlap_mode_through_regenerate_with_history_reuse_and_an_out_of_memory_rerun(cfg, llama, tmp_path,
                                                                                       monkeypatch):
    """run_regenerate(overlap=True): every turn, history reuse, sampling: the file equals the direct run's, also
    when a staging prefill at batch 4 runs out of memory (the slots' and the staged requests are rerun at
    batch 2)."""
    kw = dict(max_new_tokens=NEW, device="cpu", bundle=llama, max_turns=0, samples=2, temperature=0.9, seed=5,
              reuse_history=True)
    regen = __import__("dflash_pipe.eval.regenerate", fromlist=["run_regenerate"]).run_regenerate
    regen(cfg, tmp_path / "direct.jsonl", batch_size=4, **kw)
    regen(cfg, tmp_path / "over.jsonl", batch_size=4, overlap=True, **kw)
    assert (tmp_path / "over.jsonl").read_bytes() == (tmp_path / "direct.jsonl").read_bytes()

    from dflash_pipe.eval.regen_staging import StagingArea

    real_top_up, real_take = StagingArea.top_up, EngineBackend.take_back
    backs, fired = [], []

    def top_up_then_oom(self, ready):          # the staging prefill runs out of memory with requests staged
        real_top_up(self, ready)
        if len(self) and not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(StagingArea, "top_up", top_up_then_oom)
    monkeypatch.setattr(EngineBackend, "take_back", lambda self: backs.append(len(self.staging)) or real_take(self))
    regen(cfg, tmp_path / "oom.jsonl", batch_size=4, overlap=True, **kw)
    assert backs == [1] and (tmp_path / "oom.jsonl").read_bytes() == (tmp_path / "direct.jsonl").read_bytes()
    by_id, _ = _rows(tmp_path / "oom.jsonl")
    assert len(by_id) >= 4


def test_collecting_early_without_staging_gives_the_direct_answers_a_launch_later(llama):
    """--collect-early K without --overlap-prefill: no staging area, answers read from the copy taken K steps
    before a launch's end and their slots refilled straight away (the prefill queued behind the last steps): every
    answer (sampled, greedy; padded and chunked prefills; 3 and 5 steps a launch; the copy as a launch starts, the
    host a whole launch ahead) equals the direct path's with the same prefill layout, some
    come out a launch later, and the occupancy counter is the direct path's."""
    prompts = _prompts(30, seed=13)
    for dec in (Decoding(temperature=0.9, top_p=0.95, seed=3), Decoding()):
        for lag, every, layout in ((1, 3, "padded"), (2, 5, "chunks"), (3, 3, "padded")):
            direct, ref = _answers(llama.model, prompts, dec, prefill_layout=layout)
            be = EngineBackend(llama.model, EOS, batch=4, max_len=96, max_new_tokens=14, dec=dec, check_every=every,
                               snapshot_lag=lag, prefill_layout=layout)
            assert be.staging is None and be.lag == lag and f"collect {lag} step{'s' * (lag > 1)} early" in be.describe
            ready = [TurnRequest(None, p, key=100 + i, order=i) for i, p in enumerate(prompts)]
            got, late = {}, 0
            while ready or be.busy():
                be.launch(ready)
                flags = be.active.tolist()                  # what a collect at the launch's end would see
                for c in be.collect():
                    got[c.request.key - 100] = (c.tokens, c.ended, c.end_token)
                late += sum(1 for r, s in enumerate(be.slots) if s is not None and not flags[r])
            assert got == direct, (lag, every, layout)
            assert late > 0
            be.stats()
            assert be.snap.live_row_steps == int(ref.live_row_steps) > 0    # the same decode work, other launches


def test_the_backend_describes_overlap_mode(llama):
    be = EngineBackend(llama.model, [2], batch=16, max_len=64, max_new_tokens=8, dec=Decoding(), overlap=True)
    assert "prefills under the decode (2 staging rows, collect 1 step early)" in be.describe
    assert regen_backends.EngineBackend(llama.model, [2], batch=8, max_len=64, max_new_tokens=8,
                                        dec=Decoding()).staging is None


def test_staged_groups_still_running_on_the_device_wait_or_land_later_and_the_answers_stay_the_same(llama,
                                                                                                    monkeypatch):
    """The CPU has no side stream, so every staged group is ready at once; here a group reports "still running" at
    random (seeded), as on a busy GPU: some landings are put off, some make the decode wait (device_waits), compaction
    and other lags and check intervals mix in, and every answer is still the direct path's."""
    import random

    from dflash_pipe.eval import regen_staging

    prompts = _prompts(40, seed=21)
    dec = Decoding(temperature=0.7, top_p=0.9, seed=9)
    direct, _ = _answers(llama.model, prompts, dec)
    rng = random.Random(0)
    monkeypatch.setattr(regen_staging, "_done", lambda ev: rng.random() < 0.5)
    waits = 0
    for rows, lag, compact in ((2, 1, False), (5, 2, True), (8, 0, False)):
        over, be = _answers(llama.model, prompts, dec, overlap=True, staging_rows=rows, snapshot_lag=lag,
                            compact=compact, min_free=2)
        assert over == direct, (rows, lag, compact)
        waits += be.staging.device_waits
    assert waits > 0


def test_run_regenerate_closes_its_backend_even_when_the_run_fails(cfg, llama, tmp_path, monkeypatch):
    """Overlap mode queues work on its own streams that can outlive a launch; run_regenerate closes the backend (waits
    for them) on the way out, also when the run raises, so no queued step writes into memory freed behind it."""
    from dflash_pipe.eval.regenerate import run_regenerate

    closed = []
    real_close = EngineBackend.close
    monkeypatch.setattr(EngineBackend, "close", lambda self: closed.append(self.staging is not None) or real_close(self))
    run_regenerate(cfg, tmp_path / "a.jsonl", max_new_tokens=NEW, batch_size=4, device="cpu", bundle=llama, overlap=True)
    assert closed == [True]

    def boom(self):
        raise RuntimeError("injected")

    monkeypatch.setattr(EngineBackend, "collect", boom)
    import pytest

    with pytest.raises(RuntimeError, match="injected"):
        run_regenerate(cfg, tmp_path / "b.jsonl", max_new_tokens=NEW, batch_size=4, device="cpu", bundle=llama,
                       overlap=True)
    assert closed == [True, True]


def test_tail_compaction_through_regenerate_gives_the_same_file_and_is_refused_with_history_reuse(cfg, llama,
                                                                                                  tmp_path):
    """run_regenerate(compact=True), with and without overlap mode: the direct run's bytes, and the decode path says
    so; with --reuse-history (several turns) a usage error naming both flags, before anything is written. In float64:
    a narrower step is another GEMM shape, and in float32 its rounding flipped one sampled near-tie of 108 tokens
    (the same run in float64 flips none)."""
    import copy
    import dataclasses

    import pytest

    from dflash_pipe.errors import UsageError
    from dflash_pipe.eval.regenerate import run_regenerate

    bundle = dataclasses.replace(llama, model=copy.deepcopy(llama.model).to(torch.float64))
    kw = dict(max_new_tokens=NEW, device="cpu", bundle=bundle, batch_size=4, max_turns=0, samples=2, temperature=0.9,
              seed=3)
    run_regenerate(cfg, tmp_path / "direct.jsonl", **kw)
    for overlap in (False, True):
        state = run_regenerate(cfg, tmp_path / f"c{overlap}.jsonl", compact=True, overlap=overlap, **kw)
        assert "tail compaction" in state["decode_path"]
        assert (tmp_path / f"c{overlap}.jsonl").read_bytes() == (tmp_path / "direct.jsonl").read_bytes()
    with pytest.raises(UsageError, match="--compact-tail moves rows, --reuse-history"):
        run_regenerate(cfg, tmp_path / "r.jsonl", compact=True, reuse_history=True, **kw)
    assert not (tmp_path / "r.jsonl").exists()


class _FakeStream:
    """Stands in for torch.cuda.Stream on the CPU (work runs in order anyway); counts the cross-stream waits."""
    waits = 0

    def __init__(self, *a, **k):
        pass

    def wait_event(self, ev):
        assert isinstance(ev, _FakeEvent) and ev.recorded
        _FakeStream.waits += 1

    def wait_stream(self, s):
        pass

    def synchronize(self):
        pass


class _FakeEvent:
    """torch.cuda.Event on the CPU: recorded, then "done" from its third query on (a prefill still running at the
    first looks: the timing account's and the landing's)."""

    def __init__(self, enable_timing=False):
        self.recorded, self.queries = False, 0

    def record(self, stream=None):
        self.recorded = True

    def query(self):
        self.queries += 1
        return self.queries > 2

    def synchronize(self):
        assert self.recorded

    def elapsed_time(self, other):
        return 1.0


def test_the_cuda_branches_of_overlap_mode_run_with_stand_in_streams_and_events(llama, monkeypatch):
    """The CUDA-only branches (streams, events, timing, the snapshot's event) on the CPU with stand-ins for
    torch.cuda's Stream / Event / stream(): the answers are the direct path's, the main stream waited for staged
    groups (cross-stream waits counted), some groups were still 'running' at their first look, and the device
    times add up from the events."""
    import contextlib

    from dflash_pipe.eval import regen_staging

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _FakeStream())
    prompts = _prompts(24, seed=13)
    dec = Decoding(temperature=0.8, seed=4)
    direct, _ = _answers(llama.model, prompts, dec)
    be = EngineBackend(llama.model, EOS, batch=4, max_len=96, max_new_tokens=14, dec=dec, check_every=3,
                       overlap=True, staging_rows=3)
    be.cuda = be.staging.cuda = be.snap.cuda = be.clock.cuda = True          # the CUDA branches, on CPU tensors
    be.main, be.staging.stream = _FakeStream(), _FakeStream()
    _FakeStream.waits = 0
    got = drain_backend(be, prompts, key_offset=100)
    st = be.stats()
    assert got == direct
    assert _FakeStream.waits >= st["staged_landed"] // 3 > 0 and st["staging_device_waits"] > 0
    assert regen_staging._done(None)
    assert st["device_decode_s"] > 0 and st["device_staged_prefill_s"] > 0
    # each fake event pair spans 1 ms: every launch adds 1 ms of decode, every launch after the first 1 ms between
    assert st["device_between_launches_s"] == round(st["device_decode_s"] - 0.001, 3)


def test_collect_early_and_steps_per_launch_flags_reach_the_backend_and_refuse_bad_values(llama, tmp_path,
                                                                                         monkeypatch):
    """`regenerate --collect-early K --steps-per-launch N` reach run_regenerate (-1 = the mode's default, None);
    K outside [0, N) or N < 1 is a usage error naming the flag, raised before any engine is built."""
    import pytest
    from typer.testing import CliRunner

    from dflash_pipe.cli import app
    from dflash_pipe.errors import UsageError
    from dflash_pipe.eval import regenerate as regen_mod

    seen = {}
    monkeypatch.setattr(regen_mod, "run_regenerate", lambda cfg, out, **kw: seen.update(
        early=kw["collect_early"], every=kw["steps_per_launch"]))
    out = str(tmp_path / "o.jsonl")
    assert CliRunner().invoke(app, ["regenerate", "-o", out]).exit_code == 0 and seen == {"early": None, "every": 8}
    res = CliRunner().invoke(app, ["regenerate", "-o", out, "--collect-early", "2", "--steps-per-launch", "16"])
    assert res.exit_code == 0 and seen == {"early": 2, "every": 16}
    monkeypatch.setattr(regen_backends, "EngineBackend", lambda *a, **k: pytest.fail("engine built"))
    for early, every, flag in ((9, 8, "--collect-early"), (-2, 8, "--collect-early"), (0, 0, "^--steps-per-launch")):
        with pytest.raises(UsageError, match=flag):
            regen_mod.make_backend(llama, [2], 0, 4, 64, 8, Decoding(), "static", collect_early=early,
                                   steps_per_launch=every)
