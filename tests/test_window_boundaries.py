"""Cheap window round boundaries (issue #16): the next round read ahead, checkpoints written in the
background, and `cache verify` on a cache a window run consumed. In-process runs on a 4-shard toy cache."""

import json
import shutil

import pytest
import torch

from dflash_pipe.cache.window import Ledger, save_ledger
from tests.cache_helpers import write_train_cache


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    d = tmp_path_factory.mktemp("staged")
    write_train_cache(d / "cache", num_docs=16, num_shards=4, seed=7)
    return d / "cache"


def _run(staged, tmp_path, name, monkeypatch, **train):
    """One window run (K = 2, all shards committed); returns (losses, trace of (round, step, sample ids),
    checkpoint/deletion events, batches handed over by the read-ahead)."""
    from dflash_pipe.config import RunConfig, normalize
    from dflash_pipe.train import round_carry, trainer as trainer_mod
    from dflash_pipe.train import window_run

    cache = tmp_path / f"c-{name}"
    shutil.copytree(staged, cache)
    events, carried = [], []
    real_collect, real_take = window_run.WindowCoordinator.collect, round_carry.RoundCarry.take

    def collect(self, b):
        done = [json.loads((ck / "state.json").read_text())["epoch"] for ck in self.out_dir.glob("ckpt-*")
                if (ck / "COMPLETE").exists()]
        gone = real_collect(self, b)
        events.append(("delete", b, tuple(gone), b in done))  # a COMPLETE checkpoint of that boundary exists
        return gone

    def take(self, *a):
        futures, nxt = real_take(self, *a)
        carried.append(len(futures))
        return futures, nxt

    monkeypatch.setattr(window_run.WindowCoordinator, "collect", collect)
    monkeypatch.setattr(round_carry.RoundCarry, "take", take)
    trace = tmp_path / f"trace-{name}"
    monkeypatch.setenv("DFLASH_TRACE", str(trace))
    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir = str(cache), str(tmp_path / f"out-{name}")
    cfg.drafter.num_layers, cfg.drafter.block_size = 1, 4
    cfg.train.context_tokens, cfg.train.num_anchors, cfg.train.checkpoint_every = 96, 8, 0
    cfg.train.follow, cfg.train.passes_per_shard, cfg.train.follow_poll_s = True, 2, 0.0
    cfg.train.loader_workers = 1
    for k, v in train.items():
        setattr(cfg.train, k, v)
    try:
        trainer_mod.run_train(normalize(cfg))
    finally:
        monkeypatch.undo()
    rows = [json.loads(ln) for ln in (tmp_path / f"out-{name}" / "metrics.jsonl").read_text().splitlines()]
    steps = [json.loads(ln) for ln in open(f"{trace}.rank0").read().splitlines()]
    return ([(r["loss"], r["grad_norm"]) for r in rows], [(s["epoch"], s["step"], s["docs"]) for s in steps],
            events, sum(carried))


def test_read_ahead_and_background_checkpoints_train_the_same_rows_and_losses(staged, tmp_path, monkeypatch):
    plain = _run(staged, tmp_path, "plain", monkeypatch, window_read_ahead=False, window_async_checkpoint=False)
    fast = _run(staged, tmp_path, "fast", monkeypatch)
    assert plain[3] == 0 and fast[3] > 0  # the read-ahead really handed batches across rounds
    assert fast[1] == plain[1]  # same documents in the same steps, in the same order
    assert fast[0] == plain[0]  # bit-equal losses and gradient norms
    # deletions: the same shards at the same boundaries, each after that boundary's checkpoint is complete
    assert fast[2] == plain[2] and all(e[3] for e in fast[2])
    assert [e[1] for e in fast[2] if e[2]] == [2, 3, 4, 5]


def test_read_ahead_stays_within_the_prefetch_depth_and_drops_batches_that_differ(staged):
    from concurrent.futures import Future

    from dflash_pipe.train.round_carry import RoundCarry
    from dflash_pipe.train.schedule import DocRef, EpochSchedule

    def sched(n, shard=0):
        return EpochSchedule([[[DocRef(shard, 0, i, 5)] for i in range(n)]], True)

    looks, released = [], []

    class Batch:
        def release(self):
            released.append(1)

    def submit(s, r, step):
        f = Future()
        f.set_result(Batch())
        return f

    carry = RoundCarry(lambda r: (looks.append(r), sched(5) if len(looks) > 1 else None)[1], poll_s=0.0)
    carry.top_up(3, 0, submit)  # no room yet: the look starts anyway, on the look thread
    carry.wait_look()
    assert looks == [3]
    carry.top_up(3, 2, submit)  # its answer: round 3's shards are not committed yet; a second look starts
    carry.wait_look()
    assert len(carry) == 0 and looks == [3, 3]
    carry.top_up(3, 2, submit)
    carry.top_up(3, 0, submit)
    assert len(carry) == 2 and looks == [3, 3]  # never more than the room the prefetch depth leaves
    futures, nxt = carry.take(3, 0, sched(5), 0)
    assert len(futures) == 2 and nxt == 2 and not released
    carry.top_up(4, 3, submit)
    carry.wait_look()
    carry.top_up(4, 3, submit)
    futures, nxt = carry.take(4, 0, sched(5, shard=1), 0)  # the real schedule differs: rebuilt, buffers back
    assert not futures and nxt == 0 and len(released) == 3
    carry.close()


def test_background_checkpoint_snapshots_the_state_and_surfaces_a_write_failure(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from dflash_pipe.errors import RuntimeFailure
    from dflash_pipe.train import checkpoint
    from dflash_pipe.train.checkpoint_writer import BackgroundCheckpoints
    from dflash_pipe.train.master_weights import MasterWeights

    model = torch.nn.Linear(4, 3)
    weights = MasterWeights(model, torch.float32)
    opt = torch.optim.AdamW(weights.masters, lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = {n: p.detach().clone() for n, p in weights.master_state().items()}
    ckw = BackgroundCheckpoints(tmp_path, keep=2)
    real_write = checkpoint.write_snapshot
    gate = __import__("threading").Event()

    def slow_write(*a, **k):
        gate.wait(10)
        return real_write(*a, **k)

    monkeypatch.setattr("dflash_pipe.train.checkpoint_writer.write_snapshot", slow_write)
    assert ckw.submit(1, 1, weights, opt, {"step": 1, "epoch": 1}) is None
    with torch.no_grad():
        for p in weights.masters:
            p.add_(100.0)  # the step loop goes on while the write is in flight
    opt.step()
    assert ckw.done() is None and not list(tmp_path.glob("ckpt-*"))  # invisible until complete
    gate.set()
    assert ckw.wait() == 1
    saved = load_file(str(tmp_path / "ckpt-00000001" / "model.safetensors"))
    assert all(torch.equal(saved[n], before[n]) for n in before)  # the values at the boundary
    assert (tmp_path / "ckpt-00000001" / "COMPLETE").exists()

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("dflash_pipe.train.checkpoint.save_file", full)
    monkeypatch.setattr("dflash_pipe.train.checkpoint_writer.write_snapshot", real_write)
    ckw.submit(2, 2, weights, opt, {"step": 2, "epoch": 2})
    with pytest.raises(RuntimeFailure, match="ckpt-00000002"):
        ckw.wait()
    assert sorted(p.name for p in tmp_path.iterdir() if "ckpt" in p.name) == ["ckpt-00000001"]  # nothing partial


def test_verify_reports_shards_a_window_run_consumed_not_as_damage(staged, tmp_path):
    from dflash_pipe.cache import load_spec, verify_cache
    from dflash_pipe.errors import CacheError

    cache = tmp_path / "cache"
    shutil.copytree(staged, cache)
    spec = load_spec(cache)
    led = Ledger(spec["fingerprint"], 2, "/runs/x")
    for i in range(4):
        led.add(i, (cache / f"shard-{i:05d}-of-00004.parquet").stat().st_size)
    led.shards[0].state = led.shards[1].state = "deleted"
    save_ledger(cache, led)
    for i in (0, 1):
        (cache / f"shard-{i:05d}-of-00004.parquet").unlink()
    report = verify_cache(cache)
    assert report["consumed_shards"] == [0, 1] and "2 shards" in report["files_checked"]
    (cache / "shard-00002-of-00004.parquet").unlink()  # gone, but the ledger says held: damage
    with pytest.raises(CacheError, match=r"shard-00002-of-00004.parquet.*missing") as exc:
        verify_cache(cache)
    assert "shard-00000" not in str(exc.value)


def test_deletions_run_on_the_background_thread_after_complete_and_their_failure_surfaces(tmp_path):
    """after_write (the coordinator's collect) runs off the step loop, sees the COMPLETE checkpoint, is timed,
    and an error in it is raised by the step loop's next look, like a failed write."""
    import threading

    from dflash_pipe.train.checkpoint_writer import BackgroundCheckpoints
    from dflash_pipe.train.master_weights import MasterWeights

    model = torch.nn.Linear(4, 3)
    weights = MasterWeights(model, torch.float32)
    opt = torch.optim.AdamW(weights.masters, lr=0.1)
    gate, seen = threading.Event(), []

    def collect(boundary):
        seen.append((boundary, threading.current_thread().name,
                     (tmp_path / f"ckpt-{boundary:08d}" / "COMPLETE").exists()))
        gate.wait(10)
        if boundary == 2:
            raise OSError(5, "Input/output error", "shard-00002.parquet")

    ckw = BackgroundCheckpoints(tmp_path, keep=3, after_write=collect)
    ckw.submit(1, 1, weights, opt, {"step": 1, "epoch": 1})
    for _ in range(200):  # the write completes and the deletions start; the loop does not wait for them
        if seen:
            break
        threading.Event().wait(0.01)
    assert seen == [(1, "dflash-ckpt", True)] and ckw.done() is None
    gate.set()
    assert ckw.wait() == 1 and ckw.last_after_write_s > 0 and ckw.writes == 1
    ckw.submit(2, 2, weights, opt, {"step": 2, "epoch": 2})
    with pytest.raises(OSError, match="Input/output error"):
        ckw.wait()
    assert [s[0] for s in seen] == [1, 2]
