"""Window mode, pure parts: the round schedule, the ledger, the disk budget (no training)."""

import json
import logging
import os
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from dflash_pipe.cache.budget import GIB, DiskBudget, held_bytes
from dflash_pipe.cache.manifest import committed_shards, sidecar_path
from dflash_pipe.cache.window import (DELETED, Ledger, load_ledger, reset_consumed, save_ledger)
from dflash_pipe.errors import CacheError, RuntimeFailure, UsageError
from dflash_pipe.train.schedule import build_round_schedule, retired_after, window_members, window_rounds
from tests.cache_helpers import write_train_cache


def _lengths(n, seed=0, rgs=3, docs=4):
    import numpy as np

    rng = np.random.default_rng(seed)
    return {c: [[int(x) for x in rng.integers(5, 60, size=docs)] for _ in range(rgs)] for c in range(n)}


@pytest.mark.parametrize("n,K", [(1, 1), (5, 1), (5, 2), (3, 4), (7, 3)])
def test_every_document_is_scheduled_exactly_K_times_and_never_after_its_retirement(n, K):
    lengths = _lengths(n)
    order = [(3 * c + 1) % n if n > 1 else 0 for c in range(n)]  # shard index of each commit, not index order
    order = list(dict.fromkeys(order)) + [s for s in range(n) if s not in order]
    seen, retired_at = Counter(), {}
    for r in range(window_rounds(K, n)):
        for c in retired_after(r, K, n):
            retired_at[c] = r
        sched = build_round_schedule(lengths, order, r, K, n, 1, 7, 128, 4)
        for batch in sched.per_rank[0]:
            for d in batch:
                c = order.index(d.shard)
                assert c in window_members(r, K, n)
                seen[(d.shard, d.row_group, d.row, r - c)] += 1
    docs = {(order[c], rg, row) for c in range(n) for rg in range(3) for row in range(4)}
    assert set(seen.values()) == {1}
    assert {k[:3] for k in seen} == docs and {k[3] for k in seen} == set(range(K))  # passes 0..K-1, once each
    assert sorted(retired_at) == list(range(n))
    for c, r in retired_at.items():
        assert r == c + K - 1 or (r == window_rounds(K, n) - 1 and c + K - 1 >= r)


def test_round_schedule_is_deterministic_and_ddp_ranks_get_equal_counts():
    lengths = _lengths(4, seed=1, rgs=5)
    order = [2, 0, 3, 1]
    a = build_round_schedule(lengths, order, 2, 2, 4, 2, 3, 100, 8)
    b = build_round_schedule(lengths, order, 2, 2, 4, 2, 3, 100, 8)
    assert a.per_rank == b.per_rank
    other_seed = build_round_schedule(lengths, order, 2, 2, 4, 2, 4, 100, 8)
    assert other_seed.per_rank != a.per_rank
    assert a.steps == min(len(p) for p in a.per_rank) and a.steps > 0
    # rank r takes every world-th row group: the ranks' documents are disjoint
    docs = [{(d.shard, d.row_group, d.row) for b in p for d in b} for p in a.per_rank]
    assert not docs[0] & docs[1]


def test_ledger_round_trip_and_damage_is_refused_by_name(tmp_path):
    spec = write_train_cache(tmp_path, num_docs=8, num_shards=2)
    led = Ledger(spec["fingerprint"], 2, "/runs/x")
    led.add(1, 100)
    led.add(0, 90)
    led.retire(0, 1)
    save_ledger(tmp_path, led)
    back = load_ledger(tmp_path, spec)
    assert back.order() == [1, 0] and back.entry(1).state == "retired" and back.entry(1).retired_after_round == 1
    raw = json.loads((tmp_path / "window.json").read_text())
    raw["shards"][0]["state"] = "deleted"  # a hand edit: the checksum no longer matches
    (tmp_path / "window.json").write_text(json.dumps(raw))
    with pytest.raises(CacheError, match=r"window\.json.*checksum"):
        load_ledger(tmp_path, spec)
    with pytest.raises(CacheError, match=r"window\.json"):  # extraction's resume refuses it too
        committed_shards(tmp_path, spec)
    (tmp_path / "window.json").write_text('{"shards": [')  # cut by a bad copy
    with pytest.raises(CacheError, match=r"window\.json.*not valid JSON"):
        load_ledger(tmp_path, spec)


def test_consumed_shards_stay_committed_until_the_run_finishes_then_are_redone(tmp_path):
    spec = write_train_cache(tmp_path, num_docs=8, num_shards=2)
    led = Ledger(spec["fingerprint"], 1, "/runs/x")
    led.add(0, 1)
    led.add(1, 1)
    led.shards[0].state = DELETED
    save_ledger(tmp_path, led)
    (tmp_path / "shard-00000-of-00002.parquet").unlink()
    (tmp_path / "shard-00001-of-00002.parquet").unlink()  # deleted by hand while the ledger holds it
    done = committed_shards(tmp_path, spec)
    assert sorted(done) == [0] and done[0]["deleted"]  # consumed: not redone; hand-deleted: redone
    assert reset_consumed(tmp_path, spec, lambda i: sidecar_path(tmp_path, i, 2)) == []  # run not finished
    led.finished = True
    save_ledger(tmp_path, led)
    assert reset_consumed(tmp_path, spec, lambda i: sidecar_path(tmp_path, i, 2)) == [0]
    assert committed_shards(tmp_path, spec) == {} and not (tmp_path / "window.json").exists()


def test_a_window_group_deletes_a_shard_only_once_every_member_released_it(tmp_path):
    """Two trainers stream one cache (--window-group): each keeps its own ledger; a shard released by one member
    is still held (not consumed, its file counted by extraction) until the other releases it too; a member with
    no ledger yet holds everything; the cache is consumed (and redone) only when both have finished."""
    from dflash_pipe.cache.window import consumed_indices, group_released, ledger_name, load_ledgers

    spec = write_train_cache(tmp_path, num_docs=8, num_shards=2)
    group = sorted(["/runs/a", "/runs/b"])
    a = Ledger(spec["fingerprint"], 1, "/runs/a", group=group)
    for i in (0, 1):
        a.add(i, 1)
    a.shards[0].state = DELETED
    save_ledger(tmp_path, a)
    assert a.file == ledger_name("/runs/a", group) != ledger_name("/runs/b", group) != "window.json"
    assert (tmp_path / a.file).exists() and not (tmp_path / "window.json").exists()
    assert consumed_indices(tmp_path, spec) == set()              # b has no ledger yet: it holds every shard
    assert not group_released(tmp_path, spec, a, 0)
    b = Ledger(spec["fingerprint"], 1, "/runs/b", group=group)
    for i in (1, 0):                                              # its own commit order
        b.add(i, 1)
    save_ledger(tmp_path, b)
    assert consumed_indices(tmp_path, spec) == set() and not group_released(tmp_path, spec, a, 0)
    b.entry(0).state = DELETED
    save_ledger(tmp_path, b)
    assert consumed_indices(tmp_path, spec) == {0} and group_released(tmp_path, spec, a, 0)
    assert group_released(tmp_path, spec, b, 0) and not group_released(tmp_path, spec, b, 1)
    assert [led.owner for led in load_ledgers(tmp_path, spec)] == sorted(["/runs/a", "/runs/b"], key=lambda o:
                                                                            ledger_name(o, group))
    (tmp_path / "shard-00000-of-00002.parquet").unlink()          # the last releaser unlinked it
    assert sorted(committed_shards(tmp_path, spec)) == [0, 1]     # consumed: still committed (not redone)
    a.finished = True
    save_ledger(tmp_path, a)
    assert reset_consumed(tmp_path, spec, lambda i: sidecar_path(tmp_path, i, 2)) == []   # b still runs
    b.finished = True
    save_ledger(tmp_path, b)
    assert reset_consumed(tmp_path, spec, lambda i: sidecar_path(tmp_path, i, 2)) == [0]
    assert not list(tmp_path.glob("window*.json"))


def _fake_shards(d: Path, sizes):
    d.mkdir(exist_ok=True)
    for i, n in enumerate(sizes):
        (d / f"shard-{i:05d}-of-00009.parquet").write_bytes(b"x" * n)
        (d / f"shard-{i:05d}-of-00009.json").write_text(json.dumps({"bytes": n}))


def test_budget_waits_without_spinning_until_the_trainer_frees_a_shard(tmp_path, monkeypatch, caplog):
    _fake_shards(tmp_path, [1000, 1000, 1000])
    dead = tmp_path / ".shard-00005-of-00009.parquet.tmp-999999999-ab"  # a killed writer's leftover: not held
    dead.write_bytes(b"x" * 5000)
    assert held_bytes(tmp_path, 1000) == (3000, 3, 0)
    sleeps = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (sleeps.append(s), real_sleep(s)))
    budget = DiskBudget(tmp_path, 3500 / GIB, 2, timeout_s=30, poll_s=0.1)  # room for 3 shards, not 4

    def trainer_frees():
        real_sleep(0.6)
        (tmp_path / "shard-00000-of-00009.parquet").unlink()

    t = threading.Thread(target=trainer_frees)
    t.start()
    caplog.set_level(logging.INFO, "dflash_pipe.extract")
    t0 = time.monotonic()
    with budget.room_for_next_shard():
        opened = time.monotonic() - t0
        (tmp_path / f".shard-00003-of-00009.parquet.tmp-{os.getpid()}-cd").write_bytes(b"")
    t.join()
    assert opened >= 0.5 and budget.waited_s >= 0.5
    assert 3 <= len(sleeps) <= opened / 0.1 + 2 and all(s == 0.1 for s in sleeps)  # polls, no busy loop
    assert "waiting for space: 2.79e-06 of 3.26e-06 GiB held by 3 shards still to be trained" in caplog.text
    # a live writer's temp file counts as at least one shard while it grows
    assert held_bytes(tmp_path, 1000) == (3000, 2, 1)


def test_the_next_shard_estimate_scales_with_its_tokens_and_never_falls_below_the_largest_shard():
    from dflash_pipe.cache.budget import shard_estimate

    committed = [(1000, 100), (900, 50)]  # (bytes, tokens): 10 and 18 bytes per token
    assert shard_estimate([], 500) == 0  # nothing committed yet: unknown
    assert shard_estimate(committed) == 1000  # no token count: the largest shard
    assert shard_estimate(committed, 20) == 1000  # a small shard: still the largest (never less)
    assert shard_estimate(committed, 200) == 3600  # more tokens than any before: x the largest bytes/token


def test_budget_smaller_than_the_window_is_a_usage_error_naming_flag_and_shard_size(tmp_path):
    _fake_shards(tmp_path, [4000, 7000])
    with pytest.raises(UsageError) as err:
        with DiskBudget(tmp_path, 10000 / GIB, 1, timeout_s=5).room_for_next_shard():
            pass
    msg = str(err.value)
    assert "--max-cache-gib" in msg and "7000 bytes" in msg and "holds up to 1 shards" in msg
    assert err.value.exit_code == 2


def test_budget_gives_up_when_the_trainer_is_gone(tmp_path):
    _fake_shards(tmp_path, [1000, 1000, 1000])
    budget = DiskBudget(tmp_path, 3500 / GIB, 2, timeout_s=0.3, poll_s=0.05)
    with pytest.raises(RuntimeFailure) as err:
        with budget.room_for_next_shard():
            pass
    assert "trainer seems gone" in str(err.value) and err.value.exit_code == 4
    assert budget.waited_s >= 0.3


def test_real_disk_full_mid_shard_leaves_nothing_partial(tmp_path):
    """A budget larger than the disk: the real ENOSPC mid-shard on a small tmpfs is a clean exit 4."""
    from dflash_pipe.cache import encode_hidden, shard_name
    from dflash_pipe.cache.schema import shard_meta
    from dflash_pipe.cache.writer import ShardWriter, make_row
    from tests.cache_helpers import make_docs

    mnt = tmp_path / "small"
    mnt.mkdir()
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if rc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {rc.stderr.decode().strip()}")
    try:
        budget = DiskBudget(mnt, 1.0, 1, timeout_s=5)
        with budget.room_for_next_shard():
            w = ShardWriter(mnt, shard_name(0, 1), 0, "lossless", 0, shard_meta("lossless", 0, 256, 2, "f" * 64),
                            row_group_bytes=4000, sync_row_groups=False)
        with pytest.raises(RuntimeFailure) as err:
            for d in make_docs(200, 256, seed=3, topk=0, min_len=30, max_len=60):
                w.add(make_row(d["sample_id"], d["doc_index"], d["input_ids"], d["loss_mask"],
                               encode_hidden(d["hidden"], "lossless", 2)))
            w.commit()
        assert "disk full" in str(err.value) and err.value.exit_code == 4
        w.abort()
        assert [p for p in os.listdir(mnt) if not p.startswith(".window-space")] == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)



def test_resuming_a_checkpoint_older_than_a_deletion_is_refused_by_name(tmp_path):
    import torch

    from dflash_pipe.train.loader import CacheIndex
    from dflash_pipe.train.window_run import WindowCoordinator

    spec = write_train_cache(tmp_path / "c", num_docs=12, num_shards=3)
    index = CacheIndex(tmp_path / "c")
    coord = WindowCoordinator(index, tmp_path / "out", 1, 0, 1, torch.device("cpu"), 0.01, 1.0, 0, 96, 8)
    coord.wait_round(1)
    assert coord.order == [0, 1, 2] and load_ledger(tmp_path / "c", spec).order() == [0, 1, 2]

    class _Loader:
        def forget_shard(self, shard):
            pass

    coord.end_round(0, _Loader())
    assert coord.collect(1) == [0] and not (tmp_path / "c" / "shard-00000-of-00003.parquet").exists()
    with pytest.raises(CacheError, match="already deleted.*older than the deletion"):
        coord.wait_round(0)
    assert [e.state for e in load_ledger(tmp_path / "c", spec).shards] == ["deleted", "held", "held"]


def test_follow_trainer_started_before_extraction_waits_for_the_spec_and_head(tmp_path):
    import shutil

    from dflash_pipe.train.loader import CacheIndex

    write_train_cache(tmp_path / "staged", num_docs=4, num_shards=1)
    live = tmp_path / "live"
    live.mkdir()

    def extraction_starts():
        time.sleep(0.5)  # loading the target
        shutil.copy(tmp_path / "staged" / "cache_spec.json", live / "cache_spec.json")
        time.sleep(0.5)
        shutil.copy(tmp_path / "staged" / "target_head.safetensors", live / "target_head.safetensors")

    t = threading.Thread(target=extraction_starts)
    t.start()
    t0 = time.monotonic()
    index = CacheIndex(live, follow=True, wait_s=30)
    t.join()
    assert index.spec is not None and time.monotonic() - t0 >= 1.0 and (live / "target_head.safetensors").exists()
    with pytest.raises(CacheError, match="no cache_spec.json"):
        CacheIndex(tmp_path / "nothing", follow=True, wait_s=0.2)  # and it does give up


def _window_run_config(staged: Path, cache: Path, out: Path):
    """A 1-layer window run (K = 2, no periodic checkpoints) on a copy of the staged cache."""
    import shutil

    from dflash_pipe.config import RunConfig

    shutil.copytree(staged, cache)
    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir = str(cache), str(out)
    cfg.drafter.num_layers, cfg.drafter.block_size = 1, 4
    cfg.train.context_tokens, cfg.train.num_anchors, cfg.train.checkpoint_every = 96, 8, 0
    cfg.train.follow, cfg.train.passes_per_shard, cfg.train.follow_poll_s = True, 2, 0.05
    cfg.train.loader_workers = 1
    return cfg


def test_checkpointing_every_M_rounds_trains_the_same_and_deletes_only_after_each_checkpoint(tmp_path, monkeypatch):
    from dflash_pipe.config import normalize
    from dflash_pipe.train import trainer as trainer_mod
    from dflash_pipe.train import window_run
    from dflash_pipe.train.checkpoint import complete_checkpoints, read_state

    write_train_cache(tmp_path / "staged", num_docs=16, num_shards=4, seed=7)
    events = []
    real_ckpt, real_collect = trainer_mod._checkpoint, window_run.WindowCoordinator.collect
    monkeypatch.setattr(trainer_mod, "_checkpoint", lambda *a, **k: (events.append(("ckpt", a[2])), real_ckpt(*a, **k)))
    monkeypatch.setattr(window_run.WindowCoordinator, "collect",
                        lambda self, b: (events.append(("delete", tuple(real_collect(self, b)))), events[-1][1])[1])

    def run(m):
        events.clear()
        cfg = _window_run_config(tmp_path / "staged", tmp_path / f"c{m}", tmp_path / f"out{m}")
        cfg.train.window_checkpoint_rounds = m
        trainer_mod.run_train(normalize(cfg))
        rows = [json.loads(ln) for ln in (tmp_path / f"out{m}" / "metrics.jsonl").read_text().splitlines()]
        final = read_state(complete_checkpoints(tmp_path / f"out{m}")[-1])
        assert final["step"] == len(rows) == final["total_steps"]  # the planned total is exact at the end
        lrs = [r["lr"] for r in rows]  # each step's own lr
        assert min(lrs) > 0 and lrs[-1] < 0.05 * max(lrs)  # the cosine reaches 0 after the last step, not before
        return [(r["loss"], r["grad_norm"], r["lr"]) for r in rows], list(events)

    every, ev1 = run(1)
    sparse, ev2 = run(2)
    assert sparse == every  # when checkpoints happen does not change what is trained (nor the lr curve)
    assert [e for e in ev1 if e[0] == "ckpt"] == [("ckpt", r) for r in (1, 2, 3, 4, 5)]
    assert [e for e in ev2 if e[0] == "ckpt"] == [("ckpt", r) for r in (2, 4, 5)]  # rounds 2, 4 and the end
    # deletions follow each checkpoint: shard c is retired after round c+1, deleted at the next checkpoint
    assert [e[1] for e in ev2 if e[0] == "delete"] == [(0,), (1, 2), (3,)]


def test_a_trainer_outside_a_streaming_window_group_is_refused_by_name(tmp_path, capsys):
    """While a window group streams the cache, a trainer alone (or with another group) would delete shards the
    group still reads: usage error (exit 2) naming the group's ledger and the flag, before any step."""
    from dflash_pipe.cli import main

    spec = write_train_cache(tmp_path / "c", num_docs=8, num_shards=2)
    group = ["/runs/a", "/runs/b"]
    save_ledger(tmp_path / "c", Ledger(spec["fingerprint"], 1, "/runs/a", group=group))
    args = ["train", "--cache-dir", str(tmp_path / "c"), "--output-dir", str(tmp_path / "solo"), "--follow",
            "--passes-per-shard", "1", "--drafter-num-layers", "1", "--drafter-block-size", "4",
            "--context-tokens", "96", "--num-anchors", "8", "--loader-workers", "1", "--follow-timeout-s", "5"]
    with pytest.raises(SystemExit) as err:
        main(args)
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert "window-" in msg and "/runs/a" in msg and "--window-group" in msg
    with pytest.raises(SystemExit) as err:                      # not in its own list
        main(args + ["--window-group", "/runs/a,/runs/b"])
    assert err.value.code == 2 and "does not list this run's --output-dir" in capsys.readouterr().err


def test_a_failed_ledger_save_in_the_read_ahead_look_leaves_the_order_unfixed_until_a_look_saves_it(tmp_path,
                                                                                                   monkeypatch):
    """The read-ahead's look (peek_schedule, rank 0; its errors are dropped) finds a new shard and fails to save the
    ledger (disk full): the shard must not keep a place in the commit order that only memory knows (until session 27
    it did, and the next look, seeing nothing new, never saved it: a kill then resumed with another order). The next
    look fixes and saves the order once the disk has room; a restarted trainer finds the same order."""
    import errno
    import shutil

    import torch

    from dflash_pipe.io_utils import disk_error
    from dflash_pipe.train import window_run
    from dflash_pipe.train.loader import CacheIndex

    spec = write_train_cache(tmp_path / "staged", num_docs=16, num_shards=4, seed=7)
    live = tmp_path / "live"
    live.mkdir()
    for f in ("cache_spec.json", "target_head.safetensors"):
        shutil.copy(tmp_path / "staged" / f, live / f)

    def commit(i):
        for ext in ("parquet", "json"):
            shutil.copy(tmp_path / "staged" / f"shard-{i:05d}-of-00004.{ext}", live / f"shard-{i:05d}-of-00004.{ext}")

    def coordinator():
        return window_run.WindowCoordinator(CacheIndex(live, follow=True, wait_s=5), tmp_path / "out", 3, 0, 1,
                                            torch.device("cpu"), 0.01, 5.0, 0, 96, 8)

    commit(0)
    coord = coordinator()
    coord.wait_round(0)
    commit(2)                                   # another extract job commits shard 2 before shard 1
    real = window_run.save_ledger
    fails = {"n": 0}

    def disk_full(*a, **kw):
        fails["n"] += 1
        raise disk_error(OSError(errno.ENOSPC, "No space left on device"), live / "window.json", "writing")

    monkeypatch.setattr(window_run, "save_ledger", disk_full)
    with pytest.raises(RuntimeFailure):
        coord.peek_schedule(1)                  # the read-ahead's look (RoundCarry drops this error)
    assert fails["n"] == 1 and coord.ledger.order() == [0] == load_ledger(live, spec).order()
    monkeypatch.setattr(window_run, "save_ledger", real)
    coord.wait_round(1)                         # the next collective look saves what it fixes
    assert coord.order == [0, 2] == load_ledger(live, spec).order()
    commit(1)                                   # a kill now: the restarted trainer keeps the order it trained on
    restarted = coordinator()
    restarted.wait_round(2)
    assert restarted.order == [0, 2, 1]


def test_max_steps_equal_to_the_planned_total_still_ends_the_last_round_and_consumes_the_cache(tmp_path):
    """--max-steps on a round's last step: the round is over all the same (until session 27 the loop stopped at the
    cap before it saw the round's end: no end_round, no finish, a shard left and the ledger never finished)."""
    from dflash_pipe.config import normalize
    from dflash_pipe.train.trainer import run_train

    write_train_cache(tmp_path / "staged", num_docs=16, num_shards=4, seed=7)

    def run(name, max_steps):
        cache = tmp_path / f"c-{name}"
        cfg = _window_run_config(tmp_path / "staged", cache, tmp_path / f"out-{name}")
        cfg.train.max_steps = max_steps
        steps = run_train(normalize(cfg))["steps"]
        led = load_ledger(cache)
        assert led.finished and [e.state for e in led.shards] == [DELETED] * 4
        assert not list(cache.glob("shard-*.parquet"))
        return steps, (tmp_path / f"out-{name}" / "metrics.jsonl").read_text()

    total, free = run("free", 0)
    steps, capped = run("capped", total)   # (the lr curve differs: the cap fixes its length from the first step)
    assert steps == total == len(capped.splitlines()) == len(free.splitlines())
