"""bf16 compute weights + fp32 masters (train/master_weights.py) train exactly like fp32 weights under
bf16 autocast: same losses, same fp32 weights bit for bit, through clipping, chunked optimizer steps and
a checkpoint round trip. CPU autocast (bf16) and the SDPA attention path."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_pipe.config import RunConfig
from dflash_pipe.drafter.masks import AttentionMask, block_positions
from dflash_pipe.drafter.model import DFlashDrafter
from dflash_pipe.errors import ValidationError
from dflash_pipe.train.checkpoint import load_checkpoint, save_checkpoint
from dflash_pipe.train.components import build_optimizer, resolve_param_dtype
from dflash_pipe.train.master_weights import MasterWeights
from tests.test_drafter_support import random_packed_row, randomize_, tiny_config

CFG = tiny_config(num_layers=2, hidden_size=32, intermediate_size=64)


def _inputs(seed: int):
    row = random_packed_row(seed, block_size=CFG.block_size)
    g = torch.Generator().manual_seed(100 + seed)
    feats = torch.randn(row.S, CFG.num_target_features * CFG.hidden_size, generator=g).to(torch.bfloat16)
    embeds = torch.randn(row.N * CFG.block_size, CFG.hidden_size, generator=g)
    mask = AttentionMask(row.ctx_doc, row.anchor_index, row.block_doc, row.block_valid, CFG.block_size)
    target = torch.randn(row.N * CFG.block_size, CFG.hidden_size, generator=g)
    return feats, embeds, row.ctx_pos, block_positions(row.ctx_pos, row.anchor_index, CFG.block_size), mask, target


def _setup(param_dtype: torch.dtype, chunk_elems: int):
    model = DFlashDrafter(CFG)
    randomize_(model, seed=1, std=0.2)
    weights = MasterWeights(model, param_dtype, chunk_elems=chunk_elems)
    cfg = RunConfig()
    cfg.train.lr, cfg.train.weight_decay = 3e-2, 0.1
    opt, sched = build_optimizer(weights.masters, cfg, torch.device("cpu"), total_steps=8)
    return model, weights, opt, sched


def _step(model, weights, opt, sched, seed: int, clip: float) -> tuple[float, float]:
    feats, embeds, cpos, bpos, mask, target = _inputs(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(feats, embeds, cpos, bpos, mask)
    loss = ((out.float() - target) ** 2).mean()
    loss.backward()
    norm = weights.step(opt, clip)
    sched.step()
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    return float(loss), float(norm)


def _fp32_state(weights: MasterWeights) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.float32).clone() for n, t in weights.master_state().items()}


@pytest.mark.parametrize("clip", [0.05, 0.0])  # 0.05: every step is clipped; 0: no clipping
def test_bf16_weights_with_masters_equal_fp32_weights_under_autocast(clip):
    ref = _setup(torch.float32, 1 << 30)
    new = _setup(torch.bfloat16, chunk_elems=3000)  # several optimizer chunks per step
    assert not ref[1].separate and new[1].separate
    lin = new[0].layers[0].mlp.up_proj.weight
    assert lin.dtype == torch.bfloat16 and new[0].norm.weight.dtype == torch.float32
    assert len(new[1]._chunks()) > 2
    for s in range(4):
        l_ref, n_ref = _step(*ref, seed=s, clip=clip)
        l_new, n_new = _step(*new, seed=s, clip=clip)
        assert l_ref == l_new, f"step {s}: loss {l_ref} vs {l_new}"
        assert n_ref == n_new, f"step {s}: grad norm {n_ref} vs {n_new}"
        if clip:
            assert n_ref > clip  # the clip really acted
    a, b = _fp32_state(ref[1]), _fp32_state(new[1])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the compute copy is the master rounded to bf16
    assert torch.equal(lin, new[1].master_state()["layers.0.mlp.up_proj.weight"].to(torch.bfloat16))


def test_checkpoint_round_trip_continues_identically(tmp_path):
    run = _setup(torch.bfloat16, chunk_elems=5000)
    for s in range(2):
        _step(*run, seed=s, clip=0.1)
    save_checkpoint(tmp_path, 2, run[1], run[2], {"step": 2}, keep=2)
    resumed = _setup(torch.bfloat16, chunk_elems=5000)
    load_checkpoint(tmp_path / "ckpt-00000002", resumed[1], resumed[2], torch.device("cpu"))
    resumed[3].last_epoch = 2
    for g in resumed[2].param_groups:
        g["lr"] = run[2].param_groups[0]["lr"]
    for s in range(2, 4):
        assert _step(*run, seed=s, clip=0.1) == _step(*resumed, seed=s, clip=0.1)
    a, b = _fp32_state(run[1]), _fp32_state(resumed[1])
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(run[0].fc.weight, resumed[0].fc.weight)


def test_param_dtype_resolution_and_refusal():
    cfg = RunConfig()
    assert resolve_param_dtype(cfg, "bf16") == torch.bfloat16
    assert resolve_param_dtype(cfg, "fp32") == torch.float32
    cfg.train.param_dtype = "fp32"
    assert resolve_param_dtype(cfg, "bf16") == torch.float32
    cfg.train.param_dtype = "bf16"
    with pytest.raises(ValidationError, match="--param-dtype"):
        resolve_param_dtype(cfg, "fp32")


@pytest.mark.parametrize("damage", ["truncate", "flip_header", "old_marker_flip"])
def test_a_damaged_complete_checkpoint_is_a_named_cache_error(tmp_path, damage):
    """COMPLETE but damaged afterwards (disk, copy): resume names the file and says what to do (exit 3), never a
    traceback. Truncation is caught by the sizes in the marker; a same-size corruption by the loader."""
    from dflash_pipe.errors import CacheError

    run = _setup(torch.float32, 1 << 30)
    _step(*run, seed=0, clip=0.0)
    ck = save_checkpoint(tmp_path, 1, run[1], run[2], {"step": 1})
    marker = json.loads((ck / "COMPLETE").read_text())
    assert marker["step"] == 1 and marker["file_bytes"]["model.safetensors"] == (ck / "model.safetensors").stat().st_size
    f = ck / "model.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        f.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[0:8] = (10 ** 12).to_bytes(8, "little")  # header length far past the file: safetensors refuses it
        f.write_bytes(bytes(data))
        if damage == "old_marker_flip":
            (ck / "COMPLETE").write_text("1\n")     # a checkpoint written before sizes were recorded
    fresh = _setup(torch.float32, 1 << 30)
    with pytest.raises(CacheError) as exc:
        load_checkpoint(ck, fresh[1], fresh[2], torch.device("cpu"))
    assert str(ck) in str(exc.value) and "damaged" in str(exc.value)
    assert "--resume" in exc.value.hint and exc.value.exit_code == 3


@pytest.mark.parametrize("point", ["train.checkpoint.before_rename", "train.checkpoint.between_renames"])
def test_writing_a_step_again_never_leaves_it_without_a_complete_checkpoint(tmp_path, monkeypatch, point):
    """The same step written twice (a rerun that trained nothing; a round boundary after a periodic checkpoint),
    the writer SIGKILLed on the way: the step's complete checkpoint is still found and loads (until session 27 the
    old one was deleted before the new one's rename: a kill there lost the run's only checkpoint)."""
    import os
    import signal

    from dflash_pipe.train.checkpoint import find_resume

    run = _setup(torch.float32, 1 << 30)
    _step(*run, seed=0, clip=0.0)
    first = save_checkpoint(tmp_path, 1, run[1], run[2], {"step": 1, "which": "first"}, keep=1)
    want = _fp32_state(run[1])
    pid = os.fork()
    if pid == 0:  # the child writes step 1 again and is killed at the point
        monkeypatch.setenv("DFLASH_FAULT", point)
        try:
            save_checkpoint(tmp_path, 1, run[1], run[2], {"step": 1, "which": "second"}, keep=1)
        finally:
            os._exit(3)  # not reached: the fault point kills the process
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    if point == "train.checkpoint.between_renames":
        assert not first.exists() and (tmp_path / ".ckpt-00000001.replaced" / "COMPLETE").exists()
    assert find_resume(tmp_path, "auto") == first
    fresh = _setup(torch.float32, 1 << 30)
    state = load_checkpoint(first, fresh[1], fresh[2], torch.device("cpu"))
    assert state["which"] == "first" and all(torch.equal(want[k], _fp32_state(fresh[1])[k]) for k in want)
    # a completed rewrite replaces it and leaves nothing hidden behind
    save_checkpoint(tmp_path, 1, run[1], run[2], {"step": 1, "which": "third"}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "latest.json") == ["ckpt-00000001"]
    assert json.loads((first / "state.json").read_text())["which"] == "third"
