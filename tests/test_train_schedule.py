"""The whole-cache trainer's plan: the lr each step logs, where a --max-steps cap leaves the data position, what a
resume may change, and one LR curve for every rank and every restart under --follow. Found by session 28's review."""

import json
import os
import shutil
import socket
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

import dflash_pipe.train.trainer as trainer
from dflash_pipe.errors import UsageError
from tests.cache_helpers import tiny_train_config, write_train_cache


@pytest.fixture
def lrs_used(monkeypatch):
    """The lr of every AdamW step this test runs, read as the step applies it."""
    used = []
    real = torch.optim.AdamW.step

    def spy(self, *a, **kw):
        used.append(self.param_groups[0]["lr"])
        return real(self, *a, **kw)
    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    return used


@pytest.fixture
def batches(monkeypatch):
    """(epoch, documents) of every batch trained in this test."""
    seen = []
    monkeypatch.setattr(trainer, "trace_batch", lambda step, epoch, rank, ids: seen.append((epoch, tuple(ids))))
    return seen


def _cfg(cache, out, epochs=2, max_steps=0):
    cfg = tiny_train_config(cache, out)
    cfg.train.epochs, cfg.train.max_steps, cfg.train.warmup_frac, cfg.train.lr = epochs, max_steps, 0.5, 1e-3
    return cfg


def test_each_step_logs_the_lr_it_used(tmp_path, lrs_used):
    """The log read the scheduler after its step: every record showed the next step's lr (step 0 the peak,
    the last step 0)."""
    write_train_cache(tmp_path / "cache", num_docs=12, seed=5)
    trainer.run_train(_cfg(tmp_path / "cache", tmp_path / "out", epochs=1))
    logged = [json.loads(ln)["lr"] for ln in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == len(lrs_used) >= 3 and logged == lrs_used
    assert logged[0] < max(logged) and logged[-1] > 0            # warmup first; the floor comes after the last step


def test_a_cap_inside_an_epoch_keeps_the_position_and_a_resume_must_keep_the_plan(tmp_path, batches):
    """--max-steps inside an epoch: the checkpoint said 'next epoch, batch 0', so a continued run would skip the rest
    of the epoch. A resume with flags that plan another step count is refused: the LR curve is the checkpoint's
    (before, a continued run without the cap trained on at the old curve's end)."""
    write_train_cache(tmp_path / "cache", num_docs=12, seed=5)
    trainer.run_train(_cfg(tmp_path / "cache", tmp_path / "full"))
    full = list(batches)
    per_epoch = sum(1 for e, _ in full if e == 0)
    assert per_epoch >= 3
    batches.clear()
    trainer.run_train(_cfg(tmp_path / "cache", tmp_path / "cut", max_steps=2))
    assert batches == full[:2]
    state = json.loads(max((tmp_path / "cut").glob("ckpt-*")).joinpath("state.json").read_text())
    assert (state["epoch"], state["step_in_epoch"], state["total_steps"]) == (0, 2, 2)
    with pytest.raises(UsageError, match="belongs to a run of 2 steps; these flags .* plan"):
        trainer.run_train(_cfg(tmp_path / "cache", tmp_path / "cut"))


def test_a_follow_run_resumed_after_more_shards_keeps_its_lr_curve(tmp_path, lrs_used, monkeypatch):
    """--follow sizes its curve from the shards committed at start; a restart after more arrived sized another
    one, though the checkpoint had recorded the first."""
    staged = tmp_path / "staged"
    write_train_cache(staged, num_docs=48, num_shards=4, seed=5)

    def live_with_shard0(live):
        live.mkdir()
        for n in ("cache_spec.json", "target_head.safetensors", "shard-00000-of-00004.parquet",
                  "shard-00000-of-00004.json"):
            shutil.copy(staged / n, live / n)

    def commit_rest(live):
        for n in sorted(p.name for p in staged.glob("shard-0000[123]-*")) + ["manifest.json"]:
            shutil.copy(staged / n, live / n)

    def cfg_for(live, out):
        cfg = tiny_train_config(live, out, checkpoint_every=2)
        cfg.train.follow, cfg.train.follow_poll_s, cfg.train.lr, cfg.train.warmup_frac = True, 0.05, 1e-3, 0.1
        return cfg

    live_with_shard0(tmp_path / "liveA")
    extractor = threading.Thread(target=lambda: (
        [time.sleep(0.05) for _ in iter(lambda: (tmp_path / "outA" / "metrics.jsonl").exists(), True)],
        commit_rest(tmp_path / "liveA")))
    extractor.start()
    trainer.run_train(cfg_for(tmp_path / "liveA", tmp_path / "outA"))
    extractor.join()
    uninterrupted = list(lrs_used)
    lrs_used.clear()

    class Killed(Exception):
        pass

    def die_after_step_2(name, n=[0]):
        if name == "train.after_step":
            n[0] += 1
            if n[0] == 2:
                raise Killed
    live_with_shard0(tmp_path / "liveB")
    with monkeypatch.context() as m:
        m.setattr(trainer, "fault_point", die_after_step_2)
        with pytest.raises(Killed):
            trainer.run_train(cfg_for(tmp_path / "liveB", tmp_path / "outB"))
    commit_rest(tmp_path / "liveB")                 # extraction went on while the trainer was down
    trainer.run_train(cfg_for(tmp_path / "liveB", tmp_path / "outB"))
    assert len(uninterrupted) > 4 and lrs_used == uninterrupted


def _agree_rank(rank: int, port: int, plans: list, out: dict) -> None:
    import torch.distributed as dist

    from dflash_pipe.dist import agree_on_plan

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out[rank] = agree_on_plan(plans[rank], torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_that_counted_different_shards_agree_on_one_plan():
    """--follow, two ranks: a shard committed between their looks gave them different step counts, so each AdamW
    applied its own lr to the averaged gradients and the replicas drifted apart."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = mp.Manager().dict()
    mp.spawn(_agree_rank, args=(port, [[4, 4], [6, 3]], out), nprocs=2, join=True)
    assert out[0] == out[1] == [4, 3]
