"""Stage 2 end to end on CPU: 2 gloo ranks under torchrun, SIGKILL, --resume auto, same losses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cache_helpers import write_train_cache

ROOT = Path(__file__).resolve().parents[1]

TRAIN_ARGS = ["--drafter-num-layers", "1", "--drafter-block-size", "4", "--context-tokens", "96", "--num-anchors",
              "8", "--epochs", "2", "--checkpoint-every", "4", "--log-every", "1", "--loader-workers", "1",
              "--kd-weight", "0.3", "--lr", "3e-3"]


def _train(cache, out, nproc, extra=(), fault=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("DFLASH_FAULT", None)
    if fault:
        env["DFLASH_FAULT"] = fault
    argv = ["train", "--cache-dir", str(cache), "--output-dir", str(out), *TRAIN_ARGS, *extra]
    if nproc == 1:  # one process, forked without the interpreter start (tests/fork_cli.py)
        from tests.fork_cli import run_cli

        return run_cli(argv, env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dflash_pipe", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _losses(out):
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["acc"], r["tau"], r["grad_norm"]) for r in recs}


@pytest.mark.slow
def test_two_rank_resume_after_sigkill_reproduces_losses(tmp_path):
    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=40, seed=3)
    ref = _train(cache, tmp_path / "ref", 2)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses = _losses(tmp_path / "ref")
    total = max(ref_losses) + 1
    assert total >= 8

    killed = _train(cache, tmp_path / "run", 2, fault="train.after_step@6")  # dies 2 steps after ckpt 4
    assert killed.returncode != 0
    ckpts = sorted(p.name for p in (tmp_path / "run").glob("ckpt-*"))
    assert ckpts == ["ckpt-00000004"]
    resumed = _train(cache, tmp_path / "run", 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    got = _losses(tmp_path / "run")
    assert sorted(got) == list(range(total))  # history has each step once (steps 4, 5 were redone)
    for step in range(total):
        assert got[step] == ref_losses[step], f"step {step}: {got[step]} != {ref_losses[step]}"


@pytest.mark.slow
@pytest.mark.parametrize("point", ["train.checkpoint.before_marker", "train.checkpoint.before_rename"])
def test_checkpoint_killed_while_being_written_is_never_loaded(tmp_path, point):
    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=24, seed=4)
    run = _train(cache, tmp_path / "run", 1, fault=f"{point}@2")  # the 2nd checkpoint dies half-written
    assert run.returncode != 0
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert "ckpt-00000004" in names and "ckpt-00000008" not in names
    assert any(n.startswith(".ckpt-00000008") for n in names)  # the partial one is hidden, without marker
    again = _train(cache, tmp_path / "run", 1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at step 4" in again.stdout
    assert not any(n.startswith(".ckpt") for n in os.listdir(tmp_path / "run"))


def test_export_command_equals_the_trainers_own_export_and_resume_refuses_another_cache(tmp_path):
    from safetensors.torch import load_file

    from dflash_pipe.config import RunConfig, normalize
    from dflash_pipe.errors import ValidationError
    from dflash_pipe.train.exporting import export_checkpoint
    from dflash_pipe.train.trainer import run_train

    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=12, seed=8)
    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir = str(cache), str(tmp_path / "out")
    cfg.drafter.num_layers, cfg.drafter.block_size = 1, 4
    cfg.train.context_tokens, cfg.train.num_anchors = 96, 8
    run_train(normalize(cfg))
    out = export_checkpoint(tmp_path / "out", tmp_path / "exported")
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "out" / "export" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (tmp_path / "out" / "export" / "config.json").read_text())
    other = tmp_path / "other"
    write_train_cache(other, num_docs=12, seed=9, num_layers=1)  # another target layer set
    cfg.train.cache_dir = str(other)
    with pytest.raises(ValidationError) as err:
        run_train(normalize(cfg))
    assert "layer_ids" in str(err.value) or "target_layer_ids" in str(err.value)
