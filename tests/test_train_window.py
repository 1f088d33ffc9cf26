"""Window mode end to end on CPU: a stand-in extractor (real budget wait, real commit protocol) streams
shards into `train --follow --passes-per-shard 2` within a disk budget; SIGKILLs anywhere, restarts in
either order, every document trained exactly K times and every loss equal to an uninterrupted run's."""

import json
import os
import time
from pathlib import Path

import pytest

from dflash_pipe.cache.budget import GIB
from dflash_pipe.cache.window import load_ledger
from tests.cache_helpers import write_train_cache
from tests.window_helpers import doc_passes, finish, losses, start_extractor, start_trainer

K, SHARDS, DOCS = 2, 4, 24


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    d = tmp_path_factory.mktemp("staged") / "cache"
    write_train_cache(d, num_docs=DOCS, num_shards=SHARDS, seed=5)
    biggest = max(json.loads(p.read_text())["bytes"] for p in d.glob("shard-*.json"))
    return d, 3.3 * biggest / GIB  # room for K + 1 shards: extraction has to wait for the trainer


def _wait_for(path: Path, proc, timeout=120):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _run_pair(staged, tmp, fault_t=None, fault_e=None, kill_extractor_after_trainer=False, trainer_first=True):
    """Start extractor + trainer; restart whichever was killed (without its fault) until both finish."""
    started = []
    import tests.window_helpers as wh

    real = wh._popen

    def tracked(*a, **kw):
        started.append(real(*a, **kw))
        return started[-1]

    wh._popen = tracked
    try:
        return _run_pair_inner(staged, tmp, fault_t, fault_e, kill_extractor_after_trainer, trainer_first)
    finally:
        wh._popen = real
        for p in started:  # a failed assertion must not leave a child running
            if p.poll() is None:
                p.kill()
                p.wait()


def _run_pair_inner(staged, tmp, fault_t, fault_e, kill_extractor_after_trainer, trainer_first):
    cache, budget = staged
    live, out, trace = tmp / "live", tmp / "out", tmp / "trace"
    ext = start_extractor(cache, live, budget, K, fault_e)
    _wait_for(live / "cache_spec.json", ext)
    tr = start_trainer(live, out, K, trace, fault_t)
    logs = []
    if fault_t and kill_extractor_after_trainer:  # both die: the trainer at its point, the extractor meanwhile
        rc, log = finish(tr)
        assert rc != 0, log[-2000:]
        ext.kill()
        finish(ext)
        restart = [lambda: start_trainer(live, out, K, trace), lambda: start_extractor(cache, live, budget, K)]
        first, second = (restart if trainer_first else restart[::-1])
        a = first()
        time.sleep(1.0)  # the first one runs alone for a while (the trainer waits / the extractor fills the room)
        b = second()
        for p in (a, b):
            rc, log = finish(p)
            logs.append(log)
            assert rc == 0, log[-3000:]
        return live, out, trace, logs
    roles = [[ext, fault_e, lambda: start_extractor(cache, live, budget, K)],
             [tr, fault_t, lambda: start_trainer(live, out, K, trace)]]
    deadline = time.time() + 400
    while roles:  # a killed one is restarted at once, the other keeps running (it waits, it must not fail)
        for role in list(roles):
            proc, fault, again = role
            rc = proc.poll()
            if rc is None:
                continue
            log = Path(proc.log_path).read_text()
            if fault:
                assert rc != 0, f"{fault} did not fire: {log[-2000:]}"
                role[0], role[1] = again(), None
            else:
                assert rc == 0, log[-3000:]
                logs.append(log)
                roles.remove(role)
        assert time.time() < deadline, "the pair did not finish"
        time.sleep(0.1)
    return live, out, trace, logs


def _check_consumed(live: Path):
    led = load_ledger(live)
    assert led.finished and [e.state for e in led.shards] == ["deleted"] * SHARDS
    assert not list(live.glob("shard-*.parquet")) and len(list(live.glob("shard-*.json"))) == SHARDS
    assert not [p for p in os.listdir(live) if ".tmp-" in p]


@pytest.fixture(scope="module")
def reference(staged, tmp_path_factory):
    live, out, trace, logs = _run_pair(staged, tmp_path_factory.mktemp("ref"))
    assert any("waiting for space" in log for log in logs)  # the budget really bounded the extractor
    _check_consumed(live)
    from dflash_pipe.train.checkpoint import complete_checkpoints, read_state

    lrs = [json.loads(ln)["lr"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return losses(out), doc_passes(trace, live, SHARDS), lrs, read_state(complete_checkpoints(out)[-1]), out


def test_uninterrupted_window_run_trains_every_document_exactly_K_times(reference):
    got, passes = reference[:2]
    assert set(passes.values()) == {1} and len(passes) == DOCS * K
    assert {p for _, p in passes} == set(range(K))
    assert sorted(got) == list(range(len(got))) and {e for e, *_ in got.values()} == set(range(SHARDS + K - 1))


def test_the_lr_curve_ends_exactly_at_the_last_step_of_a_streamed_run(reference):
    """The shards arrive while training runs (the budget holds K + 1): the step count is unknown at the start,
    yet the cosine reaches its floor after the last step, not before, and the final plan is exact."""
    got, _, lrs, final = reference[:4]
    assert final["step"] == len(got) == final["total_steps"]
    assert min(lrs) > 0 and lrs[-1] < 0.02 * max(lrs)   # each step's own lr: the floor (0) comes after the last


def test_each_round_boundary_is_timed_part_by_part(reference):
    """window_rounds.jsonl (round_clock.py): one line per boundary between rounds, each part timed, the parts within
    the boundary's wall time; a boundary that wrote a checkpoint has a snapshot time; the totals printed at the end
    are the lines' sums. Session 24's H100 pass lost 112 s to boundaries with nothing saying where."""
    from dflash_pipe.train.round_clock import PARTS

    got, out = reference[0], reference[4]
    recs = [json.loads(ln) for ln in (out / "window_rounds.jsonl").read_text().splitlines()]
    rounds = sorted({e for e, *_ in got.values()})
    assert [r["round"] for r in recs] == rounds[1:]                 # every round but the first starts at one
    for r in recs:
        parts = [r[f"{k}_s"] for k in PARTS]
        assert min(parts) >= 0 and sum(parts) <= r["wall_s"] + 1e-3, r
        assert r["snapshot_s"] > 0, r                               # a checkpoint every round (the default)
        first_step = min(s for s, (e, *_) in got.items() if e == r["round"])
        assert r["step"] == first_step
    assert sum(r["collect_s"] for r in recs) > 0                   # shards were deleted between boundaries
    assert f"window: {len(recs)} round boundaries took" in (out.parent / "train.log").read_text()


# each case costs two trainer and two extractor start-ups (~10 s of CPU on an idle runner), so one case kills
# both processes, each at its own point, and restarts whichever died while the other keeps running: mid-round /
# before a sidecar, and after a retirement while writing the round's checkpoint / before a rename (the third
# case, between the boundary checkpoint and the deletions, is `test_both_killed_and_restarted_in_either_order`)
KILLS = [
    pytest.param("train.after_step@7", "extract.before_sidecar@2", id="trainer-mid-round+extractor-before-sidecar"),
    pytest.param("train.checkpoint.before_rename@3", "extract.before_rename@3",
                 id="trainer-after-retire-mid-checkpoint+extractor-before-rename"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fault_t,fault_e", KILLS)
def test_sigkill_and_restart_trains_every_document_K_times_with_the_same_losses(staged, reference, tmp_path,
                                                                                 fault_t, fault_e):
    ref_losses = reference[0]
    live, out, trace, _ = _run_pair(staged, tmp_path, fault_t, fault_e)
    _check_consumed(live)
    passes = doc_passes(trace, live, SHARDS)
    assert set(passes.values()) == {1} and len(passes) == DOCS * K  # every (document, pass) exactly once
    assert losses(out) == ref_losses


@pytest.mark.slow
@pytest.mark.parametrize("trainer_first", [False], ids=["extractor-restarts-first"])
def test_both_killed_and_restarted_in_either_order(staged, reference, tmp_path, trainer_first):
    ref_losses = reference[0]
    live, out, trace, _ = _run_pair(staged, tmp_path, "train.window.before_delete@1", None,
                                    kill_extractor_after_trainer=True, trainer_first=trainer_first)
    _check_consumed(live)
    passes = doc_passes(trace, live, SHARDS)
    assert set(passes.values()) == {1} and len(passes) == DOCS * K
    assert losses(out) == ref_losses


def _copy_shards(src: Path, dst: Path, shards):
    import shutil

    for i in shards:
        for ext in (".parquet", ".json"):  # data first, sidecar last: extract's commit order
            name = f"shard-{i:05d}-of-{SHARDS:05d}{ext}"
            shutil.copy(src / name, dst / f".{name}.tmp-1-x")
            os.replace(dst / f".{name}.tmp-1-x", dst / name)


@pytest.mark.slow
def test_extractor_dead_then_a_shard_deleted_by_hand_then_both_recover(staged, reference, tmp_path):
    """Extractor gone: exit 4 after --follow-timeout-s with a complete checkpoint. A held shard deleted by
    hand: exit 3 naming it. Re-extracting it and rerunning the trainer ends equal to the uninterrupted run."""
    import shutil

    cache, budget = staged
    ref_losses = reference[0]
    live, out, trace = tmp_path / "live", tmp_path / "out", tmp_path / "trace"
    live.mkdir()
    for name in ("target_head.safetensors", "cache_spec.json"):
        shutil.copy(cache / name, live / name)
    _copy_shards(cache, live, [0, 1])  # the extractor committed two shards and died
    rc, log = finish(start_trainer(live, out, K, trace, extra=["--follow-timeout-s", "2"]))
    assert rc == 4, log[-3000:]
    assert "extractor seems gone" in log and "round 2 needs 3 of 4 shards" in log
    ckpts = sorted(p.name for p in out.glob("ckpt-*") if (p / "COMPLETE").exists())
    assert ckpts and json.loads((out / ckpts[-1] / "state.json").read_text())["epoch"] == 2
    assert [e.state for e in load_ledger(live).shards] == ["deleted", "held"]  # retired after round 1, checkpointed

    (live / f"shard-00001-of-{SHARDS:05d}.parquet").unlink()  # by hand, while round 2 still reads it
    _copy_shards(cache, live, [2, 3])
    rc, log = finish(start_trainer(live, out, K, trace))
    assert rc == 3, log[-3000:]
    assert f"shard-00001-of-{SHARDS:05d}.parquet (commit #1) is still in the window" in log and "re-extract" in log

    rc, log = finish(start_extractor(cache, live, budget, K))  # extraction's resume redoes exactly that shard
    assert rc == 0 and (live / f"shard-00001-of-{SHARDS:05d}.parquet").exists(), log[-2000:]
    rc, log = finish(start_trainer(live, out, K, trace))
    assert rc == 0, log[-3000:]
    _check_consumed(live)
    assert losses(out) == ref_losses
    passes = doc_passes(trace, live, SHARDS)
    assert set(passes.values()) == {1} and len(passes) == DOCS * K


@pytest.mark.slow
def test_two_gloo_ranks_read_the_same_window_and_follow_the_schedule(staged, tmp_path):
    from dflash_pipe.train.loader import CacheIndex
    from dflash_pipe.train.schedule import build_round_schedule, window_rounds

    cache, budget = staged
    live, out, trace = tmp_path / "live", tmp_path / "out", tmp_path / "trace"
    ext = start_extractor(cache, live, budget, K)
    _wait_for(live / "cache_spec.json", ext)
    rc, log = finish(start_trainer(live, out, K, trace, nproc=2))  # a hang fails by the timeout
    assert rc == 0, log[-3000:]
    assert finish(ext)[0] == 0
    _check_consumed(live)
    order = load_ledger(live).order()
    index = CacheIndex(cache)
    index.refresh()
    by_seq = {c: index.lengths[s] for c, s in enumerate(order)}
    names = {}  # (shard, row group, row) -> sample id, read from the staged copy
    for s in range(SHARDS):
        r = index.reader(s) if s in index.paths else None
        for rg in range(r.num_row_groups):
            for row in r.read_row_group(rg, with_features=False):
                names[(s, rg, row.row)] = row.sample_id
    step = 0
    for r in range(window_rounds(K, SHARDS)):
        sched = build_round_schedule(by_seq, order, r, K, SHARDS, 2, 0, 96, 256)
        for rank in range(2):
            got = [json.loads(ln) for ln in Path(f"{trace}.rank{rank}").read_text().splitlines()]
            mine = [g for g in got if g["epoch"] == r]
            assert [g["docs"] for g in mine] == [[names[(d.shard, d.row_group, d.row)] for d in b]
                                                 for b in sched.per_rank[rank][:sched.steps]]
        step += sched.steps
    assert max(losses(out)) == step - 1
    from dflash_pipe.train.checkpoint import complete_checkpoints, read_state

    assert read_state(complete_checkpoints(out)[-1])["total_steps"] == step  # exact at the end, on 2 ranks too
    lrs = [json.loads(ln)["lr"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert min(lrs) > 0 and lrs[-1] < 0.05 * max(lrs)   # each step's own lr: the floor (0) comes after the last


@pytest.mark.slow
def test_a_window_group_of_two_trainers_streams_one_extraction_each_as_if_alone(staged, reference, tmp_path):
    """`--window-group A,B`: two drafters (recipe variants) read one extraction within the budget; a shard's file
    goes only once both retired it, each trainer keeps its own ledger, and each one's losses equal the solo
    run's (the same data in the same commit order)."""
    cache, budget = staged
    ref_losses = reference[0]
    live = tmp_path / "live"
    outs = [tmp_path / "a" / "out", tmp_path / "b" / "out"]
    for o in outs:
        o.parent.mkdir()
    group = ["--window-group", ",".join(str(o) for o in outs)]
    ext = start_extractor(cache, live, budget, K)
    _wait_for(live / "cache_spec.json", ext)
    trainers = [start_trainer(live, o, K, o.parent / "trace", extra=group) for o in outs]
    for p in trainers:
        rc, log = finish(p)
        assert rc == 0, log[-3000:]
    rc, log = finish(ext)
    assert rc == 0 and "waiting for space" in log, log[-2000:]       # the budget bounded the extractor
    ledgers = sorted(live.glob("window-*.json"))
    assert len(ledgers) == 2 and not (live / "window.json").exists()
    from dflash_pipe.cache.window import load_ledgers

    for led in load_ledgers(live):
        assert led.finished and [e.state for e in led.shards] == ["deleted"] * SHARDS
    assert not list(live.glob("shard-*.parquet")) and len(list(live.glob("shard-*.json"))) == SHARDS
    for o in outs:
        assert losses(o) == ref_losses
    # a trainer alone cannot join the group's cache while it streams (nor after: the cache is consumed)
    (tmp_path / "solo").mkdir()
    rc, log = finish(start_trainer(live, tmp_path / "solo" / "out", K, tmp_path / "solo-trace"))
    assert rc == 3 and "has consumed this cache" in log and "rerun `dflash-pipe extract`" in log, log[-2000:]


@pytest.mark.slow
def test_grouped_attention_and_compiled_layers_follow_the_window_reference(staged, reference, tmp_path):
    """The two other step paths inside a streamed window, as one window group: the grouped SDPA path (eager) and
    compiled draft layers on the dense path (the recompile lock engages after the first step, on the CPU too).
    Each follows the dense eager solo run's losses, step by step, to rounding."""
    from tests.test_train_compiled import NO_CXX

    if NO_CXX:
        pytest.skip("torch.compile on the CPU needs a C++ compiler")
    cache, budget = staged
    ref_losses = reference[0]
    live = tmp_path / "live"
    outs = {"grouped": tmp_path / "g" / "out", "compiled": tmp_path / "c" / "out"}
    for o in outs.values():
        o.parent.mkdir()
    group = ["--window-group", ",".join(str(o) for o in outs.values())]
    paths = {"grouped": ["--drafter-attention", "sdpa-grouped"],
             "compiled": ["--drafter-attention", "sdpa", "--compile", "on"]}
    ext = start_extractor(cache, live, budget, K)
    _wait_for(live / "cache_spec.json", ext)
    trainers = [start_trainer(live, o, K, o.parent / "trace", extra=group + paths[k]) for k, o in outs.items()]
    for p in trainers:
        rc, log = finish(p)
        assert rc == 0, log[-3000:]
    assert finish(ext)[0] == 0
    for name, o in outs.items():
        got = losses(o)
        assert sorted(got) == sorted(ref_losses), name
        for step, (epoch, loss, acc, _) in got.items():
            ref = ref_losses[step]
            assert epoch == ref[0] and loss == pytest.approx(ref[1], rel=2e-3, abs=1e-4), (name, step)
    assert "attention sdpa-grouped" in (outs["grouped"].parent / "train.log").read_text()
    assert "compile=True" in (outs["compiled"].parent / "train.log").read_text()


def test_a_run_that_ends_before_its_planned_steps_still_logs_its_last_step(staged, reference, tmp_path):
    """--max-steps above what the window gives and --log-every above both: the data ends first, and the step log
    still gets the run's last step (it used to end with no record at all)."""
    cache, budget = staged
    live, out = tmp_path / "live", tmp_path / "out"
    ext = start_extractor(cache, live, budget, K)
    _wait_for(live / "cache_spec.json", ext)
    rc, log = finish(start_trainer(live, out, K, tmp_path / "trace", extra=["--max-steps", "100000",
                                                                           "--log-every", "100000"]))
    assert rc == 0, log[-3000:]
    assert finish(ext)[0] == 0
    got = losses(out)
    ref = reference[0]
    assert list(got) == [max(ref)]                 # one record: the last step, the same step as the reference's
