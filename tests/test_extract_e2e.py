"""Stage 1 end to end on the CPU with the tiny random Qwen3.5 hybrid and real ShareGPT rows."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from dflash_pipe.cache import load_manifest, load_spec, verify_cache
from dflash_pipe.cache.reader import ShardReader
from dflash_pipe.config import load_manifest as load_run_manifest
from dflash_pipe.config import normalize
from dflash_pipe.errors import FingerprintMismatch, UsageError
from dflash_pipe.extract.pipeline import run_extract
from dflash_pipe.extract.recompute import recompute_check
from tests.fork_cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--data-max-samples", "10", "--max-length", "96", "--token-budget", "256", "--num-shards", "3", "--topk", "4",
         "--num-target-layers", "3", "--row-group-mb", "1"]


def small_cfg(cache_dir: Path, **over):
    cfg = load_run_manifest(ROOT / "manifests" / "tiny-qwen3.5.toml")
    cfg.data.max_samples, cfg.extract.max_length, cfg.extract.token_budget = 10, 96, 256
    cfg.extract.num_shards, cfg.extract.topk, cfg.extract.num_target_layers = 3, 4, 3
    cfg.extract.cache_dir, cfg.extract.device = str(cache_dir), "cpu"
    for k, v in over.items():
        setattr(cfg.extract, k, v)
    return normalize(cfg)


def contents(cache_dir: Path) -> dict:
    man = load_manifest(cache_dir)
    out = {}
    for e in man["shards"]:
        for row in ShardReader(e["abs_path"], man["fingerprint"]).iter_rows():
            ids, lps = row.teacher_topk()
            out[row.doc_index] = (row.sample_id, row.input_ids.tolist(), row.loss_mask.tolist(),
                                  row.hidden().view(torch.int16), ids, lps)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = tmp_path_factory.mktemp("ref") / "cache"
    summary = run_extract(small_cfg(cache))
    assert summary.complete and sorted(summary.shards_done) == [0, 1, 2]
    return cache, contents(cache)


def test_cache_is_complete_verified_and_matches_standalone_forwards(reference):
    cache, docs = reference
    man = load_manifest(cache)
    tok = man["stats"]["data_tokenizer"]
    # every selected sample is either in the cache exactly once or counted as malformed with a reason
    assert man["totals"]["rows"] == len(docs) == tok["samples"]
    assert tok["samples"] + tok["malformed_total"] == 10 and set(tok["malformed"]) <= {"no_supervised_tokens"}
    assert len(set(docs)) == len(docs) and max(docs) <= 9
    assert verify_cache(cache, decode=True)["rows"] == len(docs)
    # packed forward + hooks + codec == a plain unpacked HF forward of each document (bf16 rounding)
    report = recompute_check(cache, k=len(docs), device="cpu")
    assert report["samples"] == len(docs) and report["max_rel_l2"] < 1e-2
    assert man["features"]["layer_convention"].startswith("0-based")
    assert man["target"]["family"] == "qwen3.5" and len(man["features"]["layer_ids"]) == 3
    # the servability override is recorded for stage 2 (off here: the default layers are servable)
    assert load_spec(cache)["extract"]["allow_unservable_layers"] is False


def test_rerun_skips_committed_shards_and_mismatch_is_refused(reference, tmp_path):
    cache, _ = reference
    again = run_extract(small_cfg(cache))
    assert again.status == "match" and again.shards_done == [] and sorted(again.shards_skipped) == [0, 1, 2]
    with pytest.raises(FingerprintMismatch) as err:
        run_extract(small_cfg(cache, topk=8, max_length=80))
    assert set(err.value.differing) == {"topk", "max_length"}


KILL_POINTS = ["extract.forward@3", "extract.compress@5", "extract.before_rename@2", "extract.before_sidecar@2",
               "extract.before_manifest"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", KILL_POINTS)
def test_sigkill_then_rerun_gives_the_uninterrupted_cache(reference, tmp_path, fault):
    _, ref_docs = reference
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_FAULT": fault, "OMP_NUM_THREADS": "1"}
    argv = ["extract", "-m", str(ROOT / "manifests" / "tiny-qwen3.5.toml"), "--cache-dir", str(cache),
            "--device", "cpu", *SMALL]
    killed = run_cli(argv, env)  # a process of its own, forked without the interpreter start (tests/fork_cli.py)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (cache / "manifest.json").exists()
    env.pop("DFLASH_FAULT")
    rerun = run_cli(argv, env)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    got = contents(cache)
    assert sorted(got) == sorted(ref_docs)
    for i, ref in ref_docs.items():
        g = got[i]
        assert g[:3] == ref[:3]
        assert torch.equal(g[3], ref[3]) and torch.equal(g[4], ref[4]) and torch.equal(g[5], ref[5])
    assert not [p for p in os.listdir(cache) if p.startswith(".")]  # no temp files left behind


def test_shard_subsets_from_two_jobs_complete_one_cache(reference, tmp_path):
    _, ref_docs = reference
    cache = tmp_path / "cache"
    first = run_extract(small_cfg(cache, shards="0-0"))
    assert first.shards_done == [0] and not first.complete and not (cache / "manifest.json").exists()
    second = run_extract(small_cfg(cache, shards="1-2"))
    assert sorted(second.shards_done) == [1, 2] and second.complete
    got = contents(cache)
    assert sorted(got) == sorted(ref_docs) and all(torch.equal(got[i][3], ref_docs[i][3]) for i in ref_docs)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_exits_130_and_leaves_a_resumable_cache(tmp_path, sig):
    """Ctrl-C, and SIGTERM sent to extract itself (a scheduler, `kill`; it used to end the process by the signal,
    exit -15, instead of stopping cleanly with 130)."""
    from tests.proc_helpers import interrupt_after_first_shard

    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [a if a != "10" else "40" for a in SMALL]  # more samples, so there is time to interrupt
    argv = ["extract", "-m", str(ROOT / "manifests" / "tiny-qwen3.5.toml"), "--cache-dir", str(cache),
            "--device", "cpu", *args]
    interrupt_after_first_shard(argv, env, cache, "extraction", forked=True, sig=sig)
    assert not (cache / "manifest.json").exists()
    assert not [p for p in os.listdir(cache) if p.startswith(".")]
    rerun = run_cli(argv, env)
    assert rerun.returncode == 0 and (cache / "manifest.json").exists()
    assert verify_cache(cache, decode=True)["rows"] == load_manifest(cache)["stats"]["data_tokenizer"]["samples"]


@pytest.mark.slow
def test_tiny_manifest_runs_every_stage(reference, tmp_path):
    """manifests/tiny-qwen3.5.toml through plan -> extract -> train -> eval on its heldout prompts (the
    stages run_pipeline.sh chains; its shell is tested in test_pipeline_plan.py), at the reference
    cache's sizes so stage 1 finds every shard committed instead of extracting again."""
    import shutil

    from dflash_pipe.eval.runner import run_eval
    from dflash_pipe.plan import make_plan
    from dflash_pipe.train.trainer import run_train

    cache, _ = reference
    live = tmp_path / "cache"
    shutil.copytree(cache, live)
    cfg = small_cfg(live)  # the tiny manifest with the reference's data/extract sizes
    cfg.train.output_dir, cfg.train.device = str(tmp_path / "train"), "cpu"
    cfg.eval.max_prompts, cfg.eval.max_new_tokens, cfg.eval.device = 1, 8, "cpu"
    assert make_plan(cfg).stage1 == "run"  # random target: extract checks the fingerprint itself
    again = run_extract(cfg)
    assert again.complete and again.shards_done == [] and sorted(again.shards_skipped) == [0, 1, 2]
    assert run_train(cfg)["steps"] > 0
    run_eval(cfg)
    report = json.loads((tmp_path / "train" / "eval" / "eval_report.json").read_text())
    assert list(report["sets"]) == ["heldout"] and report["sets"]["heldout"]["prompts"] == 1


def test_padded_attention_layout_extracts_the_standalone_features(tmp_path):
    """extract --attention-layout padded (attention-only target): every cached document equals a plain unpacked
    forward of it, as the packed layout's do; on a Gated DeltaNet target the layout is a usage error."""
    cfg = small_cfg(tmp_path / "cache", attention_layout="padded")
    cfg.target.model = "random:tiny-llama"
    summary = run_extract(cfg)
    assert summary.complete
    rows = load_manifest(tmp_path / "cache")["totals"]["rows"]
    report = recompute_check(tmp_path / "cache", k=rows, device="cpu")
    assert rows >= 5 and report["samples"] == rows and report["max_rel_l2"] < 1e-2
    with pytest.raises(UsageError, match="Gated DeltaNet"):
        run_extract(small_cfg(tmp_path / "hybrid", attention_layout="padded"))
