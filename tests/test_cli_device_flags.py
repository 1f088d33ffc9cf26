"""Every command's device flag is checked by one validator before anything loads: a bad value is a usage
error (exit 2) naming the flag, never a Python traceback (exit 1)."""

from __future__ import annotations

import os

import pytest
import torch

from dflash_pipe.cli import main
from dflash_pipe.errors import UsageError


def _exit(argv: list[str], capsys) -> tuple[int, str]:
    """Run `dflash-pipe ARGV` in this process; (exit code, stderr). An uncaught exception fails the test."""
    with pytest.raises(SystemExit) as ex:
        main(argv)
    return ex.value.code, capsys.readouterr().err


@pytest.fixture(autouse=True)
def restore_kernel_cache_env(monkeypatch, tmp_path):
    """train / extract point TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR at per-rank dirs (dist.py) before they
    pick the device: undo that for the rest of this process's tests."""
    monkeypatch.setenv("DFLASH_LOCAL_CACHE", str(tmp_path / "kernels"))
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
        if not os.environ[var]:
            monkeypatch.delenv(var)


@pytest.fixture
def synthetic_cache(tmp_path):
    from tests.cache_helpers import make_docs, write_cache

    write_cache(tmp_path / "cache", make_docs(4, 16), 16, 2, num_shards=1)
    return tmp_path / "cache"


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _commands(tmp_path, cache) -> dict[str, list[str]]:
    """Each command with its device flag last (the value is appended)."""
    out = str(tmp_path / "regen.jsonl")
    return {
        "--extract-device": ["plan", "--extract-device"],
        "--device (eval)": ["eval", "--device"],
        "--device (regenerate)": ["regenerate", "-o", out, "--device"],
        "--device (cache verify)": ["cache", "verify", str(cache), "--recompute", "1", "--device"],
        "--device (train)": ["train", "--output-dir", str(tmp_path / "train"), "--device"],
        "--device (extract)": ["extract", "--cache-dir", str(tmp_path / "c2"), "--device"],
    }


@pytest.mark.parametrize("which", ["--extract-device", "--device (eval)", "--device (regenerate)",
                                   "--device (cache verify)", "--device (train)", "--device (extract)"])
@pytest.mark.parametrize("value", ["bogus", "cuda:x", "cpu:0"])
def test_an_unknown_device_is_a_usage_error_naming_the_flag(which, value, tmp_path, synthetic_cache, capsys):
    argv = _commands(tmp_path, synthetic_cache)[which] + [value]
    code, err = _exit(argv, capsys)
    flag = which.split()[0]
    assert code == 2, err
    assert flag in err and f"'{value}'" in err and "auto, cpu, cuda or cuda:N" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("which", ["--extract-device", "--device (eval)", "--device (regenerate)",
                                   "--device (cache verify)", "--device (train)", "--device (extract)"])
@pytest.mark.parametrize("value", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_a_usage_error_naming_the_flag(which, value, tmp_path, synthetic_cache, no_cuda,
                                                              capsys):
    code, err = _exit(_commands(tmp_path, synthetic_cache)[which] + [value], capsys)
    assert code == 2, err
    assert which.split()[0] in err and "no CUDA GPU is visible" in err and "CUDA_VISIBLE_DEVICES" in err


@pytest.mark.parametrize("count", ["-1", "-5"])
def test_a_negative_recompute_count_is_a_usage_error(count, synthetic_cache, capsys):
    code, err = _exit(["cache", "verify", str(synthetic_cache), "--recompute", count], capsys)
    assert code == 2, err
    assert "--recompute" in err and ">= 0" in err and "Traceback" not in err


def test_the_validator_accepts_the_documented_forms_and_names_gpu_counts(monkeypatch):
    from dflash_pipe.dist import check_device

    for ok in ("auto", "cpu"):
        assert check_device(ok, "--device") == ok
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for ok in ("cuda", "cuda:0", "cuda:1"):
        assert check_device(ok, "--device") == ok
    with pytest.raises(UsageError, match=r"--train-device 'cuda:2'.*2 CUDA GPU") as err:
        check_device("cuda:2", "--train-device")
    assert err.value.exit_code == 2 and "cuda:0 .. cuda:1" in err.value.hint
