"""Reliability: disk full, degenerate target features, uneven ranks, pickle-free loading, remote code."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_pipe.cache import MANIFEST_FILE
from dflash_pipe.errors import CacheError, DegenerateFeatures, RuntimeFailure, UsageError
from tests.cache_helpers import write_train_cache
from tests.test_extract_e2e import small_cfg

ROOT = Path(__file__).resolve().parents[1]


def _enospc_after(monkeypatch, target, attr, calls_before_failure):
    real = getattr(target, attr)
    n = [0]

    def failing(*a, **kw):
        n[0] += 1
        if n[0] > calls_before_failure:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **kw)

    monkeypatch.setattr(target, attr, failing)


def test_disk_full_while_writing_a_shard_is_clean_and_rerun_succeeds(tmp_path, monkeypatch):
    from dflash_pipe.cache import writer as writer_mod
    from dflash_pipe.extract.pipeline import run_extract

    cache = tmp_path / "cache"
    with monkeypatch.context() as m:
        _enospc_after(m, writer_mod._HashingFile, "write", 3)
        with pytest.raises(RuntimeFailure) as err:
            run_extract(small_cfg(cache))
    msg = str(err.value)
    assert "disk full" in msg and str(cache) in msg and "free space" in msg
    assert not (cache / MANIFEST_FILE).exists()
    assert not [p for p in os.listdir(cache) if p.startswith(".")]  # the partial shard was removed
    summary = run_extract(small_cfg(cache))  # space is back
    assert summary.complete


def test_disk_full_while_writing_a_checkpoint_leaves_none_visible(tmp_path, monkeypatch):
    import safetensors.torch as st

    from dflash_pipe.train import checkpoint as ckpt
    from dflash_pipe.train.trainer import run_train
    from tests.cache_helpers import tiny_train_config

    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=16, seed=2)
    cfg = tiny_train_config(cache, tmp_path / "out", checkpoint_every=2)
    with monkeypatch.context() as m:
        _enospc_after(m, ckpt, "save_file", 2)  # the first checkpoint's two files succeed, the second fails
        with pytest.raises(RuntimeFailure) as err:
            run_train(cfg)
    assert "disk full" in str(err.value) and "ckpt-00000004" in str(err.value)
    names = sorted(os.listdir(tmp_path / "out"))
    assert "ckpt-00000002" in names and "ckpt-00000004" not in names
    assert not [n for n in names if n.startswith(".ckpt")]
    assert st.save_file is not None
    result = run_train(cfg)  # resumes from step 2 and finishes
    assert result["steps"] >= 4


@pytest.mark.parametrize("poison", ["zeros", "nan", "constant"])
def test_degenerate_target_features_are_refused_at_write_time(tmp_path, monkeypatch, poison):
    from dflash_pipe.extract.pipeline import run_extract
    from dflash_pipe.target import runner as runner_mod

    real_run = runner_mod.TargetRunner.run

    def bad_run(self, *a, **kw):
        out = real_run(self, *a, **kw)
        h = out.hidden_TD
        H = self.bundle.hidden_size
        with torch.inference_mode():
            if poison == "zeros":
                h[:, H:2 * H] = 0  # one captured layer is all zeros (the serving-engine bug)
            elif poison == "nan":
                h[3, 5] = float("nan")
            else:
                h[:, :H] = h[:1, :H].clone()  # every token carries the same vector
        return out

    monkeypatch.setattr(runner_mod.TargetRunner, "run", bad_run)
    with pytest.raises(DegenerateFeatures) as err:
        run_extract(small_cfg(tmp_path / "cache"))
    msg = str(err.value)
    assert "sample" in msg and "target layer" in msg
    assert {"zeros": "exactly zero", "nan": "non-finite", "constant": "same feature vector"}[poison] in msg
    assert not list((tmp_path / "cache").glob("shard-*.parquet"))


@pytest.mark.slow
def test_two_ranks_with_very_uneven_data_end_cleanly(tmp_path):
    cache = tmp_path / "cache"
    # one row group per shard, 28 documents in one shard and 2 in the other: one rank gets nearly all
    write_train_cache(cache, num_docs=30, num_shards=2, seed=6, max_len=40, row_group_bytes=1 << 30,
                      shard_of=lambda i: 0 if i < 28 else 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "dflash_pipe",
           "train", "--cache-dir", str(cache), "--output-dir", str(tmp_path / "out"), "--drafter-num-layers", "1",
           "--drafter-block-size", "4", "--context-tokens", "200", "--num-anchors", "8", "--epochs", "2",
           "--checkpoint-every", "0", "--loader-workers", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)  # a hang fails by timeout
    assert proc.returncode == 0, proc.stderr[-3000:]
    from dflash_pipe.train.loader import CacheIndex
    from dflash_pipe.train.schedule import build_epoch_schedule

    index = CacheIndex(cache)
    index.refresh()
    per_rank = [len(b) for b in build_epoch_schedule(index.lengths, 2, 0, 0, 200, 256).per_rank]
    assert per_rank[0] != per_rank[1]  # the data really is uneven
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    e0 = min(per_rank)
    e1 = min(len(b) for b in build_epoch_schedule(index.lengths, 2, 0, 1, 200, 256).per_rank)
    assert steps == list(range(e0 + e1))


def test_no_pickle_in_the_package():
    bad = []
    for path in (ROOT / "dflash_pipe").rglob("*.py"):
        text = path.read_text()
        for needle in ("torch.load(", "import pickle", "pickle.load", "torch.save("):
            if needle in text:
                bad.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not bad, bad


def test_head_file_path_from_the_spec_cannot_escape_the_cache(tmp_path):
    from dflash_pipe.train.components import FrozenHead

    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=4)
    (tmp_path / "evil.safetensors").write_bytes(b"x")
    with pytest.raises(CacheError, match="escapes"):
        FrozenHead(cache, "../evil.safetensors", torch.device("cpu"), torch.float32)


def test_remote_code_needs_the_explicit_flag(tmp_path):
    from dflash_pipe.target.loading import load_target

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "evil_custom", "auto_map": {
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}, "architectures": ["EvilForCausalLM"]}))
    (d / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises((UsageError, ValueError, OSError, Exception)) as err:
        load_target(str(d), device="cpu", dtype="float32")
    assert "remote code ran" not in str(err.value)
    assert not isinstance(err.value, SystemExit)


def test_disk_full_while_opening_a_shard_leaves_no_temp_file(tmp_path, monkeypatch):
    """ENOSPC on the Parquet header write (the shard writer's constructor) removes the temp file."""
    from dflash_pipe.cache import make_spec, shard_name
    from dflash_pipe.cache.codec import LOSSLESS
    from dflash_pipe.cache.schema import shard_meta
    from dflash_pipe.cache import writer as writer_mod

    _enospc_after(monkeypatch, writer_mod._HashingFile, "write", 0)
    spec = make_spec({"t": 1}, {}, {}, 1, {})
    with pytest.raises(RuntimeFailure, match="disk full"):
        writer_mod.ShardWriter(tmp_path, shard_name(0, 1), 0, LOSSLESS, 0, shard_meta(LOSSLESS, 0, 8, 1,
                               spec["fingerprint"]))
    assert os.listdir(tmp_path) == []
