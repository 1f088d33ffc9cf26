"""The compiled trainer on the GPU (`--compile on --drafter-attention flex`), the path of bench/runs/quality19o.env:
it trains and validates several times under the recompile lock, writes checkpoints and its export, and follows
the eager dense-mask SDPA run (bf16 on both sides) step for step. tests/test_train_compiled.py covers the same flow
on the CPU with compiled SDPA layers; flex_attention has no CPU backward, so this is the only place it runs."""

from __future__ import annotations

import json

import pytest
import torch

import dflash_pipe.train.trainer as trainer
from dflash_pipe.drafter.attention import compilation_locked
from dflash_pipe.train.trainer import run_train
from tests.cache_helpers import write_train_cache
from tests.test_train_validation import _cfg

pytestmark = pytest.mark.gpu


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def test_compiled_flex_trainer_validates_under_the_lock_and_follows_eager_sdpa(tmp_path, monkeypatch):
    locks = []
    real_lock = trainer.lock_compilation
    monkeypatch.setattr(trainer, "lock_compilation", lambda: locks.append(1) or real_lock())
    cache, val = tmp_path / "cache", tmp_path / "val"
    # hidden 64 with 4 heads: head_dim 16, the smallest flex_attention's Triton kernel takes
    write_train_cache(cache, num_docs=16, hidden=64, seed=2)
    write_train_cache(val, num_docs=10, hidden=64, seed=5)
    runs = {}
    for name, compile_, attention in (("eager", "off", "sdpa"), ("compiled", "on", "flex")):
        cfg = _cfg(tmp_path, cache, tmp_path / name, val)
        cfg.train.device, cfg.train.compile, cfg.drafter.attention = "cuda", compile_, attention
        cfg.train.context_tokens, cfg.train.num_anchors = 128, 8
        cfg.train.checkpoint_every = 4
        cfg.train.profile_steps = "2:4"              # the profiler inside the locked, compiled loop (quality19t)
        locks.clear()
        runs[name] = run_train(cfg)
        assert locks or name == "eager"             # the compiled run locked after its first step (on CUDA the
        # trainer locks after any run's first step, eager too: trainer.py)
        assert not compilation_locked()             # and unlocked again when the run ends
    hist = {m: _lines(tmp_path / m / "metrics.jsonl") for m in runs}
    assert len(hist["compiled"]) == len(hist["eager"]) == runs["compiled"]["steps"] > 4
    for a, b in zip(hist["eager"], hist["compiled"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=3e-2), a["step"]  # bf16 autocast on both sides
    vals = _lines(tmp_path / "compiled" / "val_metrics.jsonl")
    assert len(vals) >= 3                           # validation (no grad: its own compile) ran under the lock
    assert vals[-1]["val_loss"] == pytest.approx(runs["eager"]["val"]["val_loss"], rel=3e-2)
    assert sorted(p.name for p in (tmp_path / "compiled").glob("ckpt-*"))
    assert (tmp_path / "compiled" / "export").is_dir()
    prof = json.loads((tmp_path / "compiled" / "profile" / "steps_2-4.json").read_text())
    assert prof["device_ms"] > 0 and prof["wall_ms"] > 0   # CUDA kernels seen, no recompile under the lock
    threads = json.loads((tmp_path / "compiled" / "thread_times.json").read_text())
    assert 0 <= threads["device_wait_ms_per_step"] <= threads["wall_ms_per_step"]   # timed around the CUDA wait
    assert torch.cuda.is_available()
