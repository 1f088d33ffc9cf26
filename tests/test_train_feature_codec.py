"""train --feature-codec fp8: a lossless cache trained as the fp8 codec would store it. The claim the
quality run rests on (one extraction feeds the lossless and the fp8 drafter) is checked against a real
fp8 cache of the same documents: the same losses, step by step, to the bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_pipe.cache.codec import FP8, LOSSLESS, encode_hidden, fp8_roundtrip, planes_to_hidden
from dflash_pipe.config import RunConfig, apply_overrides, normalize
from dflash_pipe.errors import UsageError
from dflash_pipe.train.trainer import run_train
from tests.cache_helpers import fp8_reference, heavy_tailed, write_train_cache


def _cfg(cache, out, feature_codec="stored") -> RunConfig:
    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir = str(cache), str(out)
    cfg.drafter.num_layers, cfg.drafter.block_size = 1, 4
    cfg.train.context_tokens, cfg.train.num_anchors, cfg.train.epochs = 96, 8, 2
    cfg.train.checkpoint_every, cfg.train.keep_checkpoints = 0, 1
    cfg.train.kd_weight = 0.5  # the top-k columns are read as well
    cfg.train.feature_codec = feature_codec
    return normalize(cfg)


def _losses(out):
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]


def test_roundtrip_equals_the_fp8_codec_per_document_and_packed():
    docs = [heavy_tailed(T, 3 * 16, seed) for seed, T in enumerate((5, 17, 9))]
    packed = torch.cat(docs)
    via_cache = torch.cat([planes_to_hidden(FP8, e.planes, e.scale, 3)
                           for e in (encode_hidden(d, FP8, 3) for d in docs)])
    assert torch.equal(fp8_roundtrip(packed, 3).view(torch.int16), via_cache.view(torch.int16))
    lossless = torch.cat([planes_to_hidden(LOSSLESS, encode_hidden(d, LOSSLESS, 3).planes) for d in docs])
    assert torch.equal(lossless.view(torch.int16), packed.view(torch.int16))
    assert not torch.equal(via_cache, packed)  # fp8 does change the features


def test_fp8_quantisation_is_one_ieee_division_and_round_to_nearest_even():
    """The CPU's quantisation equals an independent reference (float64 math, e4m3 code search): so where a
    device's round trip differs from the CPU's (the H200 in session 15), that device is the one that rounds
    otherwise."""
    from dflash_pipe.cache.codec import _fp8_quantize

    x = torch.cat([heavy_tailed(T, 5 * 64, seed) for seed, T in enumerate((300, 1024, 77))])
    q, scale = _fp8_quantize(x.float().view(x.shape[0], 5, 64))
    ref_q, ref_scale = fp8_reference(x, 5)
    assert np.array_equal(scale.numpy(), ref_scale)
    assert np.array_equal(q.float().numpy().astype(np.float64), ref_q)


def test_lossless_cache_with_feature_codec_fp8_trains_as_an_fp8_cache(tmp_path):
    # the same documents, fp8-coded; one row group per shard in both, so the shuffle (which works on row
    # groups, sized in bytes) puts the same documents in the same batches; the helper draws the top-k
    # log-probs from torch's global generator, hence the seeding
    for name, codec in (("lossless", LOSSLESS), ("fp8", FP8)):
        torch.manual_seed(0)
        write_train_cache(tmp_path / name, num_docs=16, seed=2, codec=codec, row_group_bytes=1 << 30)
    as_fp8 = run_train(_cfg(tmp_path / "lossless", tmp_path / "as-fp8", "fp8"))
    fp8 = run_train(_cfg(tmp_path / "fp8", tmp_path / "fp8-run"))
    plain = run_train(_cfg(tmp_path / "lossless", tmp_path / "plain"))
    assert as_fp8["steps"] == fp8["steps"] == plain["steps"] > 2
    assert _losses(tmp_path / "as-fp8") == _losses(tmp_path / "fp8-run")
    assert _losses(tmp_path / "as-fp8") != _losses(tmp_path / "plain")
    resolved = (tmp_path / "as-fp8" / "resolved_config.toml").read_text()
    assert 'feature_codec = "fp8"' in resolved


def test_feature_codec_fp8_on_an_fp8_cache_is_refused(tmp_path):
    write_train_cache(tmp_path / "fp8", num_docs=8, seed=1, codec=FP8)
    with pytest.raises(UsageError, match="already holds fp8"):
        run_train(_cfg(tmp_path / "fp8", tmp_path / "out", "fp8"))


def test_unknown_feature_codec_is_a_usage_error():
    with pytest.raises(UsageError, match="--feature-codec: 'fp4' is not one of stored, fp8"):
        apply_overrides(RunConfig(), {("train", "feature_codec"): "fp4"}, lambda s, k: "--feature-codec")


@pytest.mark.gpu
def test_roundtrip_on_the_gpu_equals_the_fp8_codec_there():
    """Extraction quantises on the GPU, the trainer's --feature-codec fp8 too: the same values. (Not the
    CPU's: on the H200, session 15, the CPU's round trip of the same features differed in some elements,
    so an fp8 cache extracted on one kind of device and a lossless one quantised on another can differ.)"""
    device = torch.device("cuda")
    docs = [heavy_tailed(T, 5 * 64, seed) for seed, T in enumerate((300, 1024, 77))]
    packed = torch.cat(docs).to(device)
    via_cache = torch.cat([planes_to_hidden(FP8, e.planes, e.scale, 5)
                           for e in (encode_hidden(d.to(device), FP8, 5) for d in docs)])
    on_gpu = fp8_roundtrip(packed, 5)
    assert torch.equal(on_gpu.view(torch.int16), via_cache.view(torch.int16))


@pytest.mark.gpu
def test_gpu_quantisation_against_the_reference():
    """Where the GPU's e4m3 quantisation leaves the IEEE / round-to-nearest-even reference (the CPU equals it):
    the scales must agree, and a differing value must be a neighbouring code (one rounding step). The count goes
    to the test's output (pytest -s / -rP). On the H200 in session 16, before the codec divided by a tensor, the
    scales differed (CUDA's division by a Python scalar multiplies by its reciprocal) and 382 of 448,320 values
    with them; with the fix both should be equal: not yet run on a GPU."""
    from dflash_pipe.cache.codec import _fp8_quantize

    x = torch.cat([heavy_tailed(T, 5 * 64, seed) for seed, T in enumerate((300, 1024, 77))])
    q, scale = _fp8_quantize(x.cuda().float().view(x.shape[0], 5, 64))
    ref_q, ref_scale = fp8_reference(x, 5)
    got = q.float().cpu().numpy().astype(np.float64)
    differ = got != ref_q
    print(f"GPU e4m3 quantisation: {int(differ.sum())} of {differ.size} values differ from the reference; "
          f"scales equal: {np.array_equal(scale.cpu().numpy(), ref_scale)}")
    assert np.array_equal(scale.cpu().numpy(), ref_scale)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)
    codes = np.unique(codes[np.isfinite(codes)])    # every finite e4m3 value, sorted (+0 and -0 as one)
    steps = np.abs(np.searchsorted(codes, got[differ]) - np.searchsorted(codes, ref_q[differ]))
    assert (steps <= 1).all()
