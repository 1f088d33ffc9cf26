"""Disk full on a real filesystem: a small tmpfs, filled up right before the write under test, so the
kernel's own ENOSPC hits the real writer (safetensors' Rust code, pyarrow, Python's appends).

Needs root and a kernel that lets the test mount a tmpfs (skipped otherwise, with the reason).
One tiny extraction and one tiny training run, each interrupted by a full disk at several sites in
turn and resumed after space is freed. The injected version of every site is test_disk_full.py.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

from dflash_pipe.errors import RuntimeFailure

ROOT = Path(__file__).resolve().parents[1]


class SmallDisk:
    """A mounted tmpfs that `fill()` fills to the last byte and `free()` empties again."""

    def __init__(self, root: Path):
        self.root = root
        self.fillers: list[Path] = []

    def fill(self) -> None:
        # pages of deleted files that are still mapped (a replaced checkpoint read through safetensors'
        # mmap) come back when their last reference goes: collect them first, or the disk is not full
        gc.collect()
        path = self.root / f"filler-{len(self.fillers)}"
        self.fillers.append(path)
        block = b"\0" * (1 << 20)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                try:
                    n = os.write(fd, block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    if len(block) == 1:
                        break
                    block = block[:len(block) // 2]   # the last pages, in smaller writes
                    continue
                if n < len(block):
                    block = block[:max(1, len(block) // 2)]
        finally:
            os.close(fd)

    def free(self) -> None:
        for p in self.fillers:
            p.unlink(missing_ok=True)
        self.fillers.clear()


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the injected ENOSPC tests in test_disk_full.py still run)")
    mnt = tmp_path_factory.mktemp("tmpfs")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield SmallDisk(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _temps(d: Path) -> list[str]:
    return [str(p) for p in d.rglob("*") if p.name.startswith(".") and ".tmp-" in p.name]


def _fill_before(monkeypatch, disk: SmallDisk, owner, name: str, on_call: int = 1):
    """Wrap owner.name so that its `on_call`-th call first fills the disk."""
    real = getattr(owner, name)
    calls = [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == on_call:
            disk.fill()
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, wrapped)


def test_full_disk_during_extract_head_file_then_shard_then_rerun_completes(small_disk, monkeypatch, capsys):
    from dflash_pipe.cache import verify_cache
    from dflash_pipe.cache import writer as writer_mod
    from dflash_pipe.cli import main
    from dflash_pipe.extract.pipeline import run_extract
    from dflash_pipe.target import loading
    from tests.test_extract_e2e import SMALL, small_cfg

    cache = small_disk.root / "cache"
    head = cache / "target_head.safetensors"
    # 1. the head file (the traceback): the CLI exits 4 naming it, nothing partial left
    with monkeypatch.context() as m:
        _fill_before(m, small_disk, loading, "save_embeddings_and_head")
        with pytest.raises(SystemExit) as ex:
            main(["extract", "-m", str(ROOT / "manifests" / "tiny-qwen3.5.toml"), "--cache-dir", str(cache),
                  "--device", "cpu", *SMALL])
    err = capsys.readouterr().err
    assert ex.value.code == 4, err
    assert f"disk full while writing {head}" in err and "Traceback" not in err and "rerun" in err
    assert not head.exists() and not _temps(cache)
    small_disk.free()
    # 2. a shard, mid-write (its third write call fills the disk)
    with monkeypatch.context() as m:
        _fill_before(m, small_disk, writer_mod._HashingFile, "write", on_call=3)
        with pytest.raises(RuntimeFailure) as exc:
            run_extract(small_cfg(cache))
    assert exc.value.exit_code == 4 and "disk full" in str(exc.value) and str(cache) in str(exc.value)
    assert head.exists() and not _temps(cache) and not (cache / "manifest.json").exists()
    head_state = (head.stat().st_mtime_ns, head.stat().st_size)
    small_disk.free()
    # 3. space is back: the rerun completes, keeps the head file, and the cache verifies
    summary = run_extract(small_cfg(cache))
    assert summary.complete and (head.stat().st_mtime_ns, head.stat().st_size) == head_state
    report = verify_cache(cache, decode=True)
    assert report["head_file"]["recorded"] and report["rows"] > 0
    assert not _temps(cache)


def test_full_disk_during_training_checkpoint_export_and_plot(small_disk, tmp_path, monkeypatch, caplog):
    from dflash_pipe.config import RunConfig, normalize
    from dflash_pipe.drafter import export as export_mod
    from dflash_pipe.drafter.export import load_exported_drafter
    from dflash_pipe.train import checkpoint as ckpt_mod
    from dflash_pipe.train import trainer as trainer_mod
    from dflash_pipe.train.trainer import run_train
    from tests.cache_helpers import write_train_cache

    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=16, seed=2)
    out = small_disk.root / "train"
    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir = str(cache), str(out)
    cfg.drafter.num_layers, cfg.drafter.block_size = 1, 4
    cfg.train.context_tokens, cfg.train.num_anchors, cfg.train.checkpoint_every = 96, 8, 2
    cfg.train.loader_workers = 1
    normalize(cfg)

    def attempt(owner, name, on_call, names_path):
        with monkeypatch.context() as m:
            _fill_before(m, small_disk, owner, name, on_call)
            with pytest.raises(RuntimeFailure) as exc:
                run_train(cfg)
        assert exc.value.exit_code == 4 and "disk full" in str(exc.value), str(exc.value)
        assert names_path in str(exc.value), str(exc.value)
        assert not _temps(out), _temps(out)
        small_disk.free()

    # the second checkpoint (ckpt-4), at its optimizer file: safetensors' Rust writer hits the real ENOSPC.
    # (A full disk does not fail a small append to metrics.jsonl here: its last page has room. The
    # injected test covers that cut-back.)
    attempt(ckpt_mod, "save_file", 4, str(out / "ckpt-00000004"))
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-00000002"]
    # the export after the final checkpoint
    attempt(export_mod, "save_file", 1, str(out / "export" / "model.safetensors"))
    assert not (out / "export" / "model.safetensors").exists()
    # the PNG after the export only warns; the run ends and the export loads
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
        _fill_before(m, small_disk, trainer_mod, "plot_history")
        result = run_train(cfg)
    small_disk.free()
    assert not (out / "training.png").exists() and not _temps(out), os.listdir(out)
    assert "training plot not written: disk full" in caplog.text, caplog.text
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(result["steps"])) and result["steps"] >= 4  # every step once, in order
    load_exported_drafter(out / "export")
