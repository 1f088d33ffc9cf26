"""bench/drafter_parts.py: a drafter export out through $OUT in parts and back, byte for byte, or refused."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "bench" / "drafter_parts.py"
_spec = importlib.util.spec_from_file_location("drafter_parts", SCRIPT)
dp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dp)


@pytest.fixture()
def export(tmp_path) -> Path:
    d = tmp_path / "train" / "export"
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"num_layers": 5}')
    (d / "model.safetensors").write_bytes(os.urandom(280_000))
    (d / "dflash.py").write_text("# model code\n")
    return d


def _same_tree(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all((a / n).read_bytes() == (b / n).read_bytes()
                                                                 for n in names)


def test_pack_then_unpack_restores_the_export_byte_for_byte(export, tmp_path):
    out = tmp_path / "OUT"
    paths = dp.pack(export, out, "lossless", part_mib=0.1)                 # 280 kB + tar headers -> 3 parts of <= 104,857 B
    assert [p.name for p in paths] == [f"drafter_lossless.tar.part-{i}-of-3" for i in range(3)]
    assert all(p.stat().st_size <= int(0.1 * 2 ** 20) for p in paths)
    dest = tmp_path / "fresh" / "train-lossless" / "export"
    index = dp.unpack(out, "lossless", dest)
    assert set(index["files"]) == {"config.json", "model.safetensors", "dflash.py"}
    assert _same_tree(export, dest)
    assert not dest.with_name("export.tmp").exists()
    # a repack (fewer parts) replaces the old parts, so a later unpack cannot mix two packs
    dp.pack(export, out, "lossless", part_mib=1)
    assert sorted(p.name for p in out.iterdir()) == ["drafter_lossless.tar.part-0-of-1"]


def test_missing_mixed_or_damaged_parts_are_refused_and_nothing_is_written(export, tmp_path):
    out = tmp_path / "OUT"
    paths = dp.pack(export, out, "lossless", part_mib=0.1)
    dest = tmp_path / "dest"
    paths[1].rename(tmp_path / paths[1].name)                               # one part left behind
    with pytest.raises(dp.PartsError, match=r"missing drafter_lossless.tar.part-1-of-3"):
        dp.unpack(out, "lossless", dest)
    (tmp_path / paths[1].name).rename(paths[1])
    (out / "drafter_lossless.tar.part-0-of-2").write_bytes(b"x")           # a part of another pack
    with pytest.raises(dp.PartsError, match="different packs"):
        dp.unpack(out, "lossless", dest)
    (out / "drafter_lossless.tar.part-0-of-2").unlink()
    raw = bytearray(paths[2].read_bytes())                                  # one flipped byte inside the weights
    raw[len(raw) // 2] ^= 0xFF
    paths[2].write_bytes(bytes(raw))
    with pytest.raises(dp.PartsError, match="model.safetensors fails its sha256"):
        dp.unpack(out, "lossless", dest)
    assert not dest.exists()
    paths[2].write_bytes(paths[2].read_bytes()[:1000])                      # a truncated part: no tar at all
    with pytest.raises(dp.PartsError):
        dp.unpack(out, "lossless", dest)
    assert not dest.exists()


def test_cli_exit_codes(export, tmp_path, capsys):
    out = tmp_path / "OUT"
    assert dp.main(["pack", "--export", str(export), "--out", str(out), "--name", "lossless"]) == 0
    assert "lossless in 1 part(s)" in capsys.readouterr().out
    assert dp.main(["unpack", "--parts", str(out), "--name", "fp8", "--dest", str(tmp_path / "d")]) == 3
    assert "no drafter_fp8.tar.part-*-of-*" in capsys.readouterr().err
    assert dp.main(["pack", "--export", str(export), "--out", str(out), "--name", "bad name"]) == 2
    (export / "config.json").unlink()
    assert dp.main(["pack", "--export", str(export), "--out", str(out), "--name", "lossless"]) == 3
    assert "not a drafter export" in capsys.readouterr().err


def test_a_kernel_cache_tree_goes_out_and_back_whole_and_a_path_outside_dest_is_refused(tmp_path):
    """--kind kernels: the trainer's Triton + Inductor caches (a tree) restored byte for byte at the same
    relative paths; a member that would land outside dest (a tampered index) is refused, nothing written."""
    cache = tmp_path / "kernels" / "train-rank0"
    files = {"triton/AB12/flex_fwd.cubin": os.urandom(5000), "triton/AB12/flex_fwd.json": b"{}",
             "inductor/fxgraph/x1/entry": os.urandom(3000), "inductor/aotautograd/y/entry": b"\x00" * 10}
    for rel, data in files.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    (cache / "triton" / "link").symlink_to(cache / "triton" / "AB12" / "flex_fwd.json")   # links are not carried
    out = tmp_path / "OUT"
    paths = dp.pack(cache, out, "train_rank0", part_mib=0.005, kind="kernels")
    assert len(paths) > 1 and all(p.name.startswith("kernels_train_rank0.tar.part-") for p in paths)
    dest = tmp_path / "fresh" / "kernels" / "train-rank0"
    index = dp.unpack(out, "train_rank0", dest, kind="kernels")
    assert set(index["files"]) == set(files)
    assert {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()} == files
    bad = tmp_path / "BAD"                                          # a tampered bundle: a member outside dest
    bad.mkdir()
    data, blob = b"x", io.BytesIO()
    with tarfile.open(fileobj=blob, mode="w") as tar:
        for name, payload in ((dp.INDEX, json.dumps({"name": "evil", "files": {"../escape": {
                "bytes": 1, "sha256": hashlib.sha256(data).hexdigest()}}}).encode()), ("../escape", data)):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    (bad / "kernels_evil.tar.part-0-of-1").write_bytes(blob.getvalue())
    with pytest.raises(dp.PartsError, match="not a plain file"):
        dp.unpack(bad, "evil", tmp_path / "d" / "dest", kind="kernels")
    assert not (tmp_path / "d" / "escape").exists() and not (tmp_path / "d" / "dest").exists()
    assert not dp._safe_member("/etc/x", True) and not dp._safe_member("a/../../b", True)
    assert not dp._safe_member("a/b", False) and dp._safe_member("model.safetensors", False)


def _checkpoint(train_dir: Path, step: int, seed: int):
    """A real training checkpoint of a tiny drafter (fp32 masters + AdamW), as the trainer writes it."""
    import torch

    from dflash_pipe.config import RunConfig
    from dflash_pipe.drafter.model import DFlashDrafter
    from dflash_pipe.train.checkpoint import save_checkpoint
    from dflash_pipe.train.components import build_optimizer
    from dflash_pipe.train.master_weights import MasterWeights
    from tests.test_drafter_support import randomize_, tiny_config

    cfg = tiny_config(num_layers=1, hidden_size=32, intermediate_size=64)
    model = DFlashDrafter(cfg)
    randomize_(model, seed=seed, std=0.2)
    weights = MasterWeights(model, torch.float32)
    opt, _ = build_optimizer(weights.masters, RunConfig(), torch.device("cpu"), total_steps=8)
    save_checkpoint(train_dir, step, weights, opt, {"step": step, "total_steps": 8, "drafter_config": cfg.to_dict()})
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_pack_checkpoint_sends_the_newest_checkpoint_once_and_it_restores_as_a_drafter(tmp_path, monkeypatch, capsys):
    train = tmp_path / "train-lossless"
    out, sent = tmp_path / "OUT" / "partial", tmp_path / "partial-lossless.step"
    with pytest.raises(dp.PartsError, match="no complete checkpoint yet"):
        dp.pack_checkpoint(train, out, "lossless", sent)
    _checkpoint(train, 4, seed=1)
    _checkpoint(train, 6, seed=2)                              # the newest of two complete checkpoints
    (train / ".ckpt-00000008.tmp").mkdir()                     # a writer's unfinished temp dir: never taken
    step, paths = dp.pack_checkpoint(train, out, "lossless", sent, part_mib=0.01)
    assert step == 6 and sent.read_text().strip() == "6" and len(paths) > 1
    dest = tmp_path / "fresh" / "train-lossless" / "export"
    dp.unpack(out, "lossless", dest)
    assert json.loads((dest / "PARTIAL.json").read_text())["step"] == 6
    assert json.loads((dest / "PARTIAL.json").read_text())["planned_steps"] == 8
    # the export `dflash-pipe export` writes from checkpoint 6 (and not checkpoint 4's)
    from dflash_pipe.train.exporting import export_checkpoint
    ref6, ref4 = export_checkpoint(train / "ckpt-00000006", tmp_path / "ref6"), export_checkpoint(
        train / "ckpt-00000004", tmp_path / "ref4")
    # (tensor for tensor: safetensors may order its header's metadata differently from one write to the next)
    import torch
    from safetensors.torch import load_file
    assert (dest / "config.json").read_bytes() == (ref6 / "config.json").read_bytes()
    got, want, old = (load_file(str(d / "model.safetensors")) for d in (dest, ref6, ref4))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert not all(torch.equal(got[k], old[k]) for k in got)
    assert dp.pack_checkpoint(train, out, "lossless", sent) is None          # sent already: nothing to do
    # a checkpoint pruned while being copied: the next newest is taken instead
    _checkpoint(train, 7, seed=3)
    real, calls = dp.shutil.copyfile, {"n": 0}

    def pruned_once(src, dst, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise FileNotFoundError(src)
        return real(src, dst, *a, **kw)
    monkeypatch.setattr(dp.shutil, "copyfile", pruned_once)
    assert dp.pack_checkpoint(train, out, "lossless", sent)[0] == 7 and calls["n"] == 4
    monkeypatch.setattr(dp.shutil, "copyfile", real)
    assert dp.main(["pack-checkpoint", "--train-dir", str(train), "--out", str(out), "--name", "lossless",
                    "--sent", str(sent)]) == 0
    assert "sent already" in capsys.readouterr().out
    assert dp.main(["pack-checkpoint", "--train-dir", str(tmp_path / "none"), "--out", str(out), "--name", "x"]) == 3


def test_a_kernel_bundle_is_compressed_capped_and_a_damaged_frame_is_refused(tmp_path):
    """Kernels go out as a zstd-compressed tar (session 24's cache was 109 MiB raw, over the 30 MiB sent home);
    --max-mib applies to the compressed bundle; a corrupted compressed part is a PartsError, nothing written."""
    cache = tmp_path / "cache"
    (cache / "inductor").mkdir(parents=True)
    source = b"".join(b"def k%d(x):\n    return x + %d\n" % (i, i) for i in range(50000))
    (cache / "inductor" / "code.py").write_bytes(source)
    out = tmp_path / "OUT"
    with pytest.raises(dp.PartsError, match="over --max-mib 0.01"):
        dp.pack(cache, out, "k", kind="kernels", max_mib=0.01)
    assert not out.exists() or not list(out.iterdir())
    (part,) = dp.pack(cache, out, "k", kind="kernels", max_mib=1)
    blob = part.read_bytes()
    assert blob[:4] == dp.ZSTD_MAGIC and len(blob) < len(source) / 5
    assert (dp.unpack(out, "k", tmp_path / "dest", kind="kernels")["files"]["inductor/code.py"]["bytes"]
            == len(source)) and (tmp_path / "dest" / "inductor" / "code.py").read_bytes() == source
    part.write_bytes(blob[:4] + bytes(b ^ 0xFF for b in blob[4:40]) + blob[40:])
    with pytest.raises(dp.PartsError, match="carry them again"):
        dp.unpack(out, "k", tmp_path / "dest2", kind="kernels")
    assert not (tmp_path / "dest2").exists()
