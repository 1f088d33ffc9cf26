"""A step's metrics and gradient norm read one step later (train/step_stats.py): the same numbers on the same
steps as reading them at once, and a non-finite gradient norm still stops training at the step that made
it, before any checkpoint could hold the weights it updated."""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from dflash_pipe.config import RunConfig, normalize
from dflash_pipe.drafter import draft_loss, summarize_metrics
from dflash_pipe.errors import RuntimeFailure
from dflash_pipe.train import trainer
from dflash_pipe.train.master_weights import MasterWeights
from dflash_pipe.train.metrics import StepLogger
from dflash_pipe.train.step_stats import PendingStepStats, StepStats
from tests.cache_helpers import write_train_cache

EPOCH_STEPS = (9, 8)  # the fixture's cache at _cfg's shape
WINDOW_ROUNDS = (4, 8, 5)  # window mode: steps per round
TIMING = {"time", "step_s", "data_wait", "tok_s", "tflops", "mfu", "peak_mem_gib", "shard_wait"}  # wall-clock fields


def _loss_metrics(seed: int, empty: bool = False) -> dict[str, torch.Tensor]:
    """draft_loss's own metrics: float32 sums, int64 counts, per-slot vectors."""
    g = torch.Generator().manual_seed(seed)
    n, b, h, v = 6, 4, 8, 50
    labels = torch.randint(0, v, (n, b), generator=g)
    labels[2, 2:] = -100
    if empty:
        labels[:] = -100  # no valid slot: tau and acc are NaN
    _, metrics = draft_loss(torch.randn(n * b, h, generator=g), torch.randn(v, h, generator=g), labels, b, 4.0, 7)
    return metrics


def _same(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN == NaN, floats to the bit


@pytest.mark.parametrize("empty", [False, True])
def test_packed_stats_read_back_as_the_values_read_at_once(empty):
    metrics = _loss_metrics(1, empty)
    assert {v.dtype for v in metrics.values()} >= {torch.float32, torch.int64}
    norm = torch.tensor(0.3341834843158722, dtype=torch.float32)
    summary, grad_norm = StepStats.pack(metrics, norm, epoch=0, batch=0).read()
    assert _same(summary, summarize_metrics({k: v.cpu() for k, v in metrics.items()}))  # the code before
    assert grad_norm == float(norm)
    # world > 1: the sums are all-reduced (here: two identical ranks), the norm is not
    doubled, grad_norm = StepStats.pack(metrics, norm, 0, 0, all_reduce=lambda t: t.mul_(2)).read()
    assert _same(doubled, summarize_metrics({k: v.to(torch.float64) * 2 for k, v in metrics.items()}))
    assert grad_norm == float(norm)


def _stats(seed: int, norm: float = 1.5, epoch: int = 0, batch: int = 0) -> StepStats:
    return StepStats.pack(_loss_metrics(seed), torch.tensor(norm), epoch, batch)


def test_push_returns_the_previous_step_and_drain_the_last():
    pending = PendingStepStats(torch.device("cpu"))
    assert pending.push(_stats(0), note="a") is None
    first = pending.push(_stats(1), note="b")
    assert first.note == "a" and _same(first.metrics, _stats(0).read()[0]) and first.seconds >= 0
    last = pending.drain()
    assert last.note == "b" and _same(last.metrics, _stats(1).read()[0])
    assert pending.drain() is None
    now = PendingStepStats(torch.device("cpu"), defer=False)  # the synchronous reference: each step at its push
    assert now.push(_stats(2), note="c").note == "c" and now.drain() is None


def test_a_non_finite_gradient_norm_raises_naming_its_own_step():
    pending = PendingStepStats(torch.device("cpu"))
    pending.push(_stats(0, epoch=2, batch=4))
    assert pending.push(_stats(1, norm=math.inf, epoch=2, batch=5)).note is None  # step (2, 4) read fine
    with pytest.raises(RuntimeFailure, match=r"non-finite gradient norm at epoch 2 batch 5(?!\d)"):
        pending.push(_stats(2, epoch=2, batch=6))  # reads (2, 5)
    assert pending.drain() is None  # the step pushed with the failing read is dropped: nothing after it
    pending.push(_stats(3, norm=math.nan, epoch=3, batch=0))
    with pytest.raises(RuntimeFailure, match=r"at epoch 3 batch 0(?!\d)"):
        pending.drain()


# --- the trainer on CPU --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    base = tmp_path_factory.mktemp("step_stats")
    write_train_cache(base / "cache", num_docs=24, seed=3)
    write_train_cache(base / "val", num_docs=8, seed=4)
    return base / "cache", base / "val"


def _cfg(caches, out, window: bool = False, **train) -> RunConfig:
    """Two epochs; or window mode (`--follow --passes-per-shard 2` over a finished copy of the cache, which the
    run deletes as it goes): 3 rounds, a background checkpoint at each round boundary."""
    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir, cfg.train.val_cache_dir = str(caches[0]), str(out), str(caches[1])
    cfg.train.checkpoint_every, cfg.train.val_every, cfg.train.val_batches = 5, 7, 2
    if window:
        cfg.train.cache_dir = str(shutil.copytree(caches[0], out.parent / f"{out.name}-cache"))
        cfg.train.follow, cfg.train.passes_per_shard, cfg.train.follow_poll_s = True, 2, 0.05
        cfg.train.checkpoint_every = 0  # only the round boundaries' checkpoints
    cfg.drafter.num_layers, cfg.drafter.block_size = 1, 4
    cfg.train.context_tokens, cfg.train.num_anchors, cfg.train.loader_workers = 96, 8, 1
    cfg.train.kd_weight, cfg.train.lr, cfg.train.epochs, cfg.train.log_every = 0.3, 3e-3, 2, 1
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return normalize(cfg)


def _history(out, name="metrics.jsonl") -> list[dict]:
    path = out / name
    return [{k: v for k, v in json.loads(ln).items() if k not in TIMING}
            for ln in (path.read_text().splitlines() if path.exists() else [])]


REAL_TRAIN_STEP, REAL_LOG = trainer._train_step, StepLogger.log


def _run_traced(cfg, monkeypatch, defer: bool) -> tuple[dict, list]:
    """run_train with every step and every log line recorded in order."""
    events = []

    def step(*a, **kw):
        events.append("step")
        return REAL_TRAIN_STEP(*a, **kw)

    def log(self, *a, **kw):
        events.append(kw["step"] if "step" in kw else a[0])
        return REAL_LOG(self, *a, **kw)

    monkeypatch.setattr(trainer, "_train_step", step)
    monkeypatch.setattr(StepLogger, "log", log)
    monkeypatch.setattr(trainer, "PendingStepStats", lambda device: PendingStepStats(device, defer=defer))
    return trainer.run_train(cfg), events


@pytest.mark.parametrize("window, log_every", [(False, 1), (False, 3), (True, 1)], ids=["epochs", "log3", "window"])
def test_deferred_reads_log_the_same_records_on_the_same_steps_as_synchronous_ones(tmp_path, caches, monkeypatch,
                                                                                   window, log_every):
    runs = {}
    for defer in (False, True):
        out = tmp_path / f"defer{defer}"
        runs[defer] = (out, *_run_traced(_cfg(caches, out, window, log_every=log_every), monkeypatch, defer))
    (sync_out, sync_res, sync_events), (lag_out, lag_res, lag_events) = runs[False], runs[True]
    total = sync_res["steps"]
    assert total == lag_res["steps"] == sum(WINDOW_ROUNDS if window else EPOCH_STEPS)
    logged = [s for s in range(total) if (s + 1) % log_every == 0 or s + 1 == total]
    assert [e for e in sync_events if e != "step"] == [e for e in lag_events if e != "step"] == logged
    # synchronous: step k's line right after step k; deferred: after step k+1 ran (the first logged step is
    # neither validated nor checkpointed, so no drain reads it early)
    k = logged[0]
    assert sync_events.index(k) == k + 1 and lag_events.index(k) == k + 2
    for name in ("metrics.jsonl", "val_metrics.jsonl"):
        assert _history(lag_out, name) == _history(sync_out, name), name
    assert [r["step"] for r in _history(lag_out)] == logged and len(_history(lag_out, "val_metrics.jsonl")) >= 2
    assert _same(lag_res["metrics"], sync_res["metrics"]) and _same(lag_res["val"], sync_res["val"])
    ckpts = sorted(p.name for p in lag_out.glob("ckpt-*"))
    assert ckpts == sorted(p.name for p in sync_out.glob("ckpt-*")) and ckpts
    for c in ckpts:
        a, b = load_file(str(lag_out / c / "model.safetensors")), load_file(str(sync_out / c / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a)


def _poison_step(monkeypatch, index: int) -> None:
    """The optimizer step of step `index` (0-based) gets an infinite gradient: the clipped update writes NaN
    into the weights, as a real overflow would."""
    real, calls = MasterWeights.step, [0]

    def step(self, opt, grad_clip):
        if calls[0] == index:
            self.params[0].grad.fill_(math.inf)
        calls[0] += 1
        return real(self, opt, grad_clip)

    monkeypatch.setattr(MasterWeights, "step", step)


# steps 0-8 in epoch 0, 9-16 in epoch 1; checkpoints after steps 5, 10, 15 (counted from 1), validation after 7, 14
@pytest.mark.parametrize("index, read_by", [(5, "the next push"), (6, "the drain before validation"),
                                            (8, "the epoch's last drain"), (9, "the drain before the checkpoint"),
                                            (12, "the next push"), (16, "the last step's drain")])
def test_a_non_finite_gradient_stops_training_before_its_weights_are_checkpointed(tmp_path, caches, monkeypatch,
                                                                                  index, read_by):
    out = tmp_path / "run"
    cfg = _cfg(caches, out)
    _poison_step(monkeypatch, index)
    with pytest.raises(RuntimeFailure) as err:
        trainer.run_train(cfg)
    epoch = int(index >= EPOCH_STEPS[0])
    batch = index - epoch * EPOCH_STEPS[0]
    assert str(err.value).startswith(f"non-finite gradient norm at epoch {epoch} batch {batch}"), read_by
    assert [r["step"] for r in _history(out)] == list(range(index))  # every step before it logged, none after
    assert [r["step"] for r in _history(out, "val_metrics.jsonl")] == [s - 1 for s in (7, 14) if s <= index]
    names = sorted(p.name for p in out.iterdir() if "ckpt-" in p.name)
    assert not any(n.startswith(".") for n in names)  # no checkpoint begun after the poisoned step
    assert [int(n.split("-")[1]) for n in names] == [s for s in (5, 10, 15) if s <= index][-2:]
    for n in names:  # ckpt-N holds steps 0..N-1: all before the poisoned one, all finite
        assert (out / n / "COMPLETE").exists()
        assert all(torch.isfinite(t).all() for t in load_file(str(out / n / "model.safetensors")).values())
    assert not (out / "export").exists()


@pytest.mark.parametrize("index", [3, 11], ids=["round0-last", "round1-last"])
def test_window_mode_a_non_finite_last_step_of_a_round_gets_no_boundary_checkpoint(tmp_path, caches, monkeypatch,
                                                                                   index):
    """The round-boundary checkpoint is written in the background from a snapshot taken right after the round's
    last step: that step is read (and refused) before the snapshot."""
    out = tmp_path / "run"
    cfg = _cfg(caches, out, window=True)
    _poison_step(monkeypatch, index)
    with pytest.raises(RuntimeFailure) as err:
        trainer.run_train(cfg)
    epoch = 0 if index < WINDOW_ROUNDS[0] else 1
    batch = index - epoch * WINDOW_ROUNDS[0]
    assert str(err.value).startswith(f"non-finite gradient norm at epoch {epoch} batch {batch}")
    assert [r["step"] for r in _history(out)] == list(range(index))
    names = sorted(p.name for p in out.iterdir() if "ckpt-" in p.name)
    assert names == (["ckpt-00000004"] if index >= WINDOW_ROUNDS[0] else [])  # round 0's boundary: step 4
    for n in names:
        assert all(torch.isfinite(t).all() for t in load_file(str(out / n / "model.safetensors")).values())


@pytest.mark.gpu
def test_cuda_push_does_not_wait_for_the_device_and_drain_does():
    device = torch.device("cuda")
    pending = PendingStepStats(device)
    metrics = {k: v.to(device) for k, v in _loss_metrics(0).items()}
    norms = [torch.tensor(float(i), device=device) for i in range(4)]  # made now: a host-to-device copy waits
    for norm in norms[:2]:  # two pinned host buffers in the allocator's cache, as after a trainer's first steps
        pending.push(StepStats.pack(metrics, norm, 0, 0))
    pending.drain()
    pending.push(StepStats.pack(metrics, norms[2], 0, 2))
    torch.cuda._sleep(int(2e9))  # about a second of GPU time queued behind step 2, ahead of step 3
    step3 = StepStats.pack(metrics, norms[3], 0, 3)
    t0 = time.perf_counter()
    first = pending.push(step3)  # reads step 2, which finished before the sleep
    pushed_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    last = pending.drain()  # waits for the sleep and step 3's copy
    drained_s = time.perf_counter() - t0
    assert first.grad_norm == 2.0 and last.grad_norm == 3.0
    assert _same(first.metrics, summarize_metrics({k: v.cpu() for k, v in metrics.items()}))
    assert pushed_s < 0.1 < drained_s, (pushed_s, drained_s)
    assert last.seconds > 0.1  # device time from step 2's end to step 3's, the sleep included
