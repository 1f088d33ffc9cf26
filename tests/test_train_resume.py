"""Stage 2 end to end on CPU: 2 gloo ranks under torchrun, SIGKILL, --resume auto, same losses."""

import json
import os
import re
import shutil
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


def _drafter_and_optimizer(ckpt):
    from dflash_pipe.drafter import DFlashDrafter, DrafterModelConfig
    from dflash_pipe.train.checkpoint import read_state
    from dflash_pipe.train.master_weights import MasterWeights

    model = DFlashDrafter(DrafterModelConfig.from_dict(read_state(ckpt)["drafter_config"]))
    weights = MasterWeights(model)
    return weights, torch.optim.AdamW(weights.masters, lr=1e-3)


def test_checkpoint_names_are_the_drafters_own_and_old_compiled_names_still_load(tmp_path):
    """Session 24 (H100 quality run, `--compile on`): checkpoints carried compiled layers' `layers.i._orig_mod.`
    names, so `dflash-pipe export` of a checkpoint failed (strict load) and an eager run could not resume one.
    Names are now the plain drafter's; checkpoints written before still export and resume, bit for bit."""
    from safetensors.torch import load_file, save_file

    from dflash_pipe.train.checkpoint import complete_checkpoints, load_checkpoint
    from dflash_pipe.train.exporting import export_checkpoint
    from dflash_pipe.train.trainer import run_train
    from tests.cache_helpers import tiny_train_config

    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=12, seed=8)
    run_train(tiny_train_config(cache, tmp_path / "out", num_layers=2, checkpoint_every=2))
    ckpt = complete_checkpoints(tmp_path / "out")[-1]

    # a layer wrapped by torch.compile (not compiled until called: no C++ compiler needed) keeps its plain name
    from dflash_pipe.drafter import DFlashDrafter, DrafterModelConfig
    from dflash_pipe.train.checkpoint import read_state
    from dflash_pipe.train.master_weights import MasterWeights
    wrapped, _ = _drafter_and_optimizer(ckpt)
    model = DFlashDrafter(DrafterModelConfig.from_dict(read_state(ckpt)["drafter_config"]))
    plain = [n for n, _ in model.named_parameters()]
    for i in range(len(model.layers)):
        model.layers[i] = torch.compile(model.layers[i])
    assert any("_orig_mod" in n for n, _ in model.named_parameters())
    assert MasterWeights(model).names == plain == wrapped.names

    # the same checkpoint as a compiled run wrote it before the fix
    old = tmp_path / "old" / ckpt.name
    shutil.copytree(ckpt, old)
    rename = lambda k: re.sub(r"^(layers\.\d+)\.", r"\1._orig_mod.", k)  # noqa: E731
    for f in ("model.safetensors", "optimizer.safetensors"):
        save_file({rename(k): v for k, v in load_file(str(ckpt / f)).items()}, str(old / f))
    state = json.loads((ckpt / "state.json").read_text())
    state["optimizer"]["scalars"] = {rename(k): v for k, v in state["optimizer"]["scalars"].items()}
    (old / "state.json").write_text(json.dumps(state))
    marker = json.loads((ckpt / "COMPLETE").read_text())
    marker["file_bytes"] = {f.name: f.stat().st_size for f in old.iterdir() if f.name != "COMPLETE"}
    (old / "COMPLETE").write_text(json.dumps(marker))
    assert any("_orig_mod" in k for k in load_file(str(old / "optimizer.safetensors")))

    a = load_file(str(export_checkpoint(ckpt, tmp_path / "exp-new") / "model.safetensors"))
    b = load_file(str(export_checkpoint(old, tmp_path / "exp-old") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loaded = {}
    for name, path in (("new", ckpt), ("old", old)):
        weights, opt = _drafter_and_optimizer(path)
        load_checkpoint(path, weights, opt, torch.device("cpu"))
        loaded[name] = (weights.master_state(), opt.state_dict()["state"])
    (wa, oa), (wb, ob) = loaded["new"], loaded["old"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa.keys() == ob.keys() and len(oa) == len(wa)
    for i in oa:
        assert oa[i].keys() == ob[i].keys() and all(torch.equal(oa[i][k], ob[i][k]) for k in oa[i])
