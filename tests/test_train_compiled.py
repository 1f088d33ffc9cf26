"""The trainer with compiled draft layers (`--compile on`) on the CPU: the recompile lock engages after the first
step, validation (another grad mode) still runs under it, checkpoints are written, and the run follows the eager
run's losses. The GPU runs this flow with flex attention (session 17's window; bench/runs/quality19m.env)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import dflash_pipe.train.trainer as trainer
from dflash_pipe.drafter.attention import compilation_locked
from dflash_pipe.train.exporting import export_checkpoint
from dflash_pipe.train.trainer import run_train
from tests.cache_helpers import write_train_cache
from tests.test_train_validation import _cfg


NO_CXX = not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++") if c)


@pytest.mark.slow
@pytest.mark.skipif(NO_CXX, reason="torch.compile on the CPU needs a C++ compiler (g++ / c++ / $CXX)")
def test_compiled_layers_train_and_validate_under_the_lock(tmp_path, monkeypatch):
    locks = []
    real_lock = trainer.lock_compilation
    monkeypatch.setattr(trainer, "lock_compilation", lambda: locks.append(1) or real_lock())
    cache, val = tmp_path / "cache", tmp_path / "val"
    write_train_cache(cache, num_docs=16, seed=2)
    write_train_cache(val, num_docs=10, seed=5)
    runs = {}
    for mode in ("off", "on"):
        cfg = _cfg(tmp_path, cache, tmp_path / mode, val)
        cfg.train.compile, cfg.drafter.attention = mode, "sdpa"
        cfg.train.checkpoint_every = 4
        runs[mode] = run_train(cfg)
        assert bool(locks) == (mode == "on")      # locked after the first compiled step only
        assert not compilation_locked()            # and unlocked again when the run ends
    hist = {m: [json.loads(x) for x in (tmp_path / m / "metrics.jsonl").read_text().splitlines()] for m in runs}
    assert len(hist["on"]) == len(hist["off"]) == runs["on"]["steps"] > 4
    for a, b in zip(hist["off"], hist["on"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), a["step"]
    vals = [json.loads(x) for x in (tmp_path / "on" / "val_metrics.jsonl").read_text().splitlines()]
    assert len(vals) >= 3                          # validation ran several times with the lock on
    assert vals[-1]["val_loss"] == pytest.approx(runs["off"]["val"]["val_loss"], rel=1e-3)
    ckpts = sorted((tmp_path / "on").glob("ckpt-*"))                  # checkpoints written under the lock,
    assert ckpts and export_checkpoint(ckpts[-1], tmp_path / "re-export").is_dir()  # in the drafter's own names
    assert (tmp_path / "on" / "export").is_dir()
