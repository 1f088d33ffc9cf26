"""Validation on a held-out cache (train/validation.py): it leaves training untouched, measures the
weights it claims to (recomputed independently from the final checkpoint), and refuses a cache that
does not fit."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_pipe.config import RunConfig, normalize
from dflash_pipe.drafter import AttentionMask, DFlashDrafter, block_positions, default_gamma, draft_loss, summarize_metrics
from dflash_pipe.errors import CacheError, ValidationError
from dflash_pipe.train.components import FrozenHead, build_drafter_config
from dflash_pipe.train.loader import BatchLoader, CacheIndex
from dflash_pipe.train.trainer import run_train
from tests.cache_helpers import write_train_cache


def _cfg(tmp_path, cache, out, val=None) -> RunConfig:
    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir = str(cache), str(out)
    cfg.drafter.num_layers, cfg.drafter.block_size = 1, 4
    cfg.train.context_tokens, cfg.train.num_anchors, cfg.train.epochs = 96, 8, 2
    cfg.train.checkpoint_every, cfg.train.keep_checkpoints = 0, 1
    if val:
        cfg.train.val_cache_dir, cfg.train.val_every, cfg.train.val_batches = str(val), 2, 2
    return normalize(cfg)


def _history(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


def _reference_val(cfg: RunConfig, out) -> dict:
    """The final weights (fp32 checkpoint) on the first val_batches validation batches, written out
    step by step here instead of through the trainer's helpers."""
    from safetensors.torch import load_file

    index = CacheIndex(cfg.train.val_cache_dir)
    spec = CacheIndex(cfg.train.cache_dir).spec
    dcfg = build_drafter_config(cfg, spec, torch.device("cpu"))
    model = DFlashDrafter(dcfg)
    ckpt = sorted(p for p in out.iterdir() if p.name.startswith("ckpt-"))[-1]
    model.load_state_dict(load_file(str(ckpt / "model.safetensors")))
    head = FrozenHead(out.parent / "cache", "target_head.safetensors", torch.device("cpu"), torch.float32)
    loader = BatchLoader(index, rank=0, world=1, seed=cfg.train.seed, context_tokens=96, num_anchors=8,
                         max_anchors_per_doc=cfg.train.max_anchors_per_doc, block_size=4, shuffle_rows=1, workers=1,
                         want_topk=False, pin_memory=False)
    sums = {}
    with torch.no_grad():
        for i, b in enumerate(loader.iterate(0, 0)):
            if i >= cfg.train.val_batches:
                break
            W = index.spec["features"]["width"]
            lo, hi = b.planes[0].to(torch.int32), b.planes[1].to(torch.int32)
            hidden = ((hi << 8) | lo).to(torch.int16).view(torch.bfloat16).t().reshape(96, W).float()
            mask = AttentionMask(b.ctx_doc_S, b.anchor_index_N, b.block_doc_N, b.block_valid_N, 4)
            emb = head.embed_VH[b.anchor_tokens_N]
            blocks = torch.cat([emb[:, None], head.embed_VH[dcfg.mask_token_id].expand(8, 3, -1)], 1).reshape(32, -1)
            out_h = model(hidden, blocks, b.ctx_pos_S, block_positions(b.ctx_pos_S, b.anchor_index_N, 4), mask)
            _, m = draft_loss(out_h, head.lm_head_VH, b.labels_NB, 4, cfg.train.gamma or default_gamma(4),
                              cfg.train.loss_chunk_tokens, None, fused=cfg.train.fused_loss)
            for k, v in m.items():
                sums[k] = sums[k] + v.double() if k in sums else v.double()
    loader.close()
    return {f"val_{k}": v for k, v in summarize_metrics(sums).items()}


def test_validation_leaves_training_unchanged_and_measures_the_final_weights(tmp_path):
    cache, val = tmp_path / "cache", tmp_path / "val"
    write_train_cache(cache, num_docs=16, seed=2)
    write_train_cache(val, num_docs=10, seed=5)  # other documents; same target shape
    plain = run_train(_cfg(tmp_path, cache, tmp_path / "plain"))
    cfg = _cfg(tmp_path, cache, tmp_path / "out", val)
    result = run_train(cfg)
    a, b = _history(tmp_path / "plain" / "metrics.jsonl"), _history(tmp_path / "out" / "metrics.jsonl")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # validation changed nothing in training
    assert plain["steps"] == result["steps"]
    vals = _history(tmp_path / "out" / "val_metrics.jsonl")
    steps = result["steps"]
    assert [r["step"] for r in vals] == [s - 1 for s in range(2, steps, 2)] + [steps - 1]
    ref = _reference_val(cfg, tmp_path / "out")
    got = vals[-1]
    assert got == {"step": steps - 1, **result["val"]}
    for k in ("val_loss", "val_acc", "val_tau", "val_acc_1"):
        assert got[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9), k
    assert got["val_tau"] >= 1.0


def test_validation_cache_of_another_shape_is_refused(tmp_path):
    cache, val = tmp_path / "cache", tmp_path / "val"
    write_train_cache(cache, num_docs=8, seed=2)
    write_train_cache(val, num_docs=6, seed=5, hidden=48)
    with pytest.raises(ValidationError, match="val-cache-dir.*hidden_size"):
        run_train(_cfg(tmp_path, cache, tmp_path / "out", val))


def test_follow_trainer_waits_at_the_first_validation_for_a_cache_still_being_extracted(tmp_path, monkeypatch):
    """bench/quality_gpu.sh starts a window trainer beside extract-val: the validation cache has no manifest yet.
    The trainer opens it at the first validation pass, waiting there, and measures what it would have measured
    with the cache complete from the start."""
    import dflash_pipe.train.validation as validation

    cache, val, staged = tmp_path / "cache", tmp_path / "val", tmp_path / "val-staged"
    write_train_cache(cache, num_docs=16, seed=2)
    write_train_cache(staged, num_docs=10, seed=5)
    runs = {}
    cfg = _cfg(tmp_path, cache, tmp_path / "early", staged)
    cfg.train.follow = True
    runs["early"] = run_train(cfg)
    sleeps = []
    real_sleep = validation.time.sleep

    def sleep(s):   # what the wait does while extract-val runs: here the cache completes during the first wait
        sleeps.append(s)
        if not val.exists():
            staged.rename(val)
        real_sleep(0)

    monkeypatch.setattr(validation.time, "sleep", sleep)
    cfg = _cfg(tmp_path, cache, tmp_path / "late", val)
    cfg.train.follow, cfg.train.follow_poll_s = True, 0.01
    runs["late"] = run_train(cfg)
    assert len(sleeps) == 1                      # it did wait, once, at the first validation pass
    a, b = (_history(tmp_path / n / "val_metrics.jsonl") for n in ("early", "late"))
    assert len(a) == len(b) >= 2 and a == b      # every validation pass measured the same numbers
    assert runs["late"]["val"] == runs["early"]["val"]


def test_follow_trainer_waits_while_the_validation_manifest_is_damaged_until_extract_rewrites_it(tmp_path, monkeypatch,
                                                                                                 caplog):
    """plan RESUMEs a validation cache whose manifest.json is damaged and its extract (started beside the trainer)
    rewrites it: `train --follow` waits for that at the first validation pass (one warning) instead of exiting 3,
    and measures what a run on the intact cache measures. Without --follow the damage is exit 3 at once."""
    import logging

    import dflash_pipe.train.validation as validation

    cache, val = tmp_path / "cache", tmp_path / "val"
    write_train_cache(cache, num_docs=16, seed=2)
    write_train_cache(val, num_docs=10, seed=5)
    good = (val / "manifest.json").read_text()
    cfg = _cfg(tmp_path, cache, tmp_path / "intact", val)
    cfg.train.follow = True
    ref = run_train(cfg)
    (val / "manifest.json").write_text(good[:len(good) // 2])
    with pytest.raises(CacheError, match="manifest"):
        run_train(_cfg(tmp_path, cache, tmp_path / "plain", val))
    sleeps = []
    real_sleep = validation.time.sleep

    def sleep(s):   # extract-val rewrites the manifest during the first wait
        sleeps.append(s)
        (val / "manifest.json").write_text(good)
        real_sleep(0)

    monkeypatch.setattr(validation.time, "sleep", sleep)
    cfg = _cfg(tmp_path, cache, tmp_path / "damaged", val)
    cfg.train.follow, cfg.train.follow_poll_s = True, 0.01
    with caplog.at_level(logging.WARNING, logger="dflash_pipe.train.validation"):
        got = run_train(cfg)
    assert len(sleeps) == 1 and got["val"] == ref["val"]
    assert sum("validation cache" in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records) == 1
    a, b = (_history(tmp_path / n / "val_metrics.jsonl") for n in ("intact", "damaged"))
    assert len(a) == len(b) >= 2 and a == b


def test_follow_trainer_names_a_validation_cache_that_never_completes(tmp_path):
    cache, val = tmp_path / "cache", tmp_path / "val"
    write_train_cache(cache, num_docs=8, seed=2)
    cfg = _cfg(tmp_path, cache, tmp_path / "out", val)
    cfg.train.follow, cfg.train.follow_poll_s, cfg.train.follow_timeout_s = True, 0.01, 0.2
    with pytest.raises(CacheError, match=f"--val-cache-dir {val}: no .* at the first validation pass"):
        run_train(cfg)


@pytest.mark.slow
def test_two_ranks_validate_when_one_rank_has_no_validation_batch(tmp_path):
    """--val-batches 1: rank 0 validates the one batch, rank 1 has none and must still join the
    all-reduce (a missing collective would hang: the timeout fails the test)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cache, val = tmp_path / "cache", tmp_path / "val"
    write_train_cache(cache, num_docs=16, seed=2)
    write_train_cache(val, num_docs=6, seed=5, num_shards=1, row_group_bytes=1 << 30)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "dflash_pipe",
           "train", "--cache-dir", str(cache), "--output-dir", str(tmp_path / "out"), "--drafter-num-layers", "1",
           "--drafter-block-size", "4", "--context-tokens", "96", "--num-anchors", "8", "--epochs", "2",
           "--checkpoint-every", "0", "--loader-workers", "1", "--val-cache-dir", str(val), "--val-every", "2",
           "--val-batches", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = len(_history(tmp_path / "out" / "metrics.jsonl"))
    vals = _history(tmp_path / "out" / "val_metrics.jsonl")
    assert [r["step"] for r in vals] == [s - 1 for s in range(2, steps, 2)] + [steps - 1]
    assert all(r["val_tau"] >= 1.0 and r["val_loss"] > 0 for r in vals)
