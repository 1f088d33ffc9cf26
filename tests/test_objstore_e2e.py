"""Both stages on object storage, end to end through the CLI, against moto on 127.0.0.1: extraction
SIGKILLed in the middle of a shard's upload and rerun, trained from s3:// like from the local copy,
and no credential string in anything the runs wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_pipe.cache import load_manifest
from dflash_pipe.cache.fs import open_cache_fs
from dflash_pipe.cache.writer import ShardWriter
from dflash_pipe.extract.pipeline import run_extract
from tests.cache_helpers import write_train_cache
from tests.s3_helpers import KEY_ID, SECRET, all_objects, moto_server, s3_env, s3_uri  # noqa: F401
from tests.test_extract_e2e import SMALL, contents, small_cfg

ROOT = Path(__file__).resolve().parents[1]


def no_secrets_in(blobs: dict[str, bytes]) -> list[str]:
    return [k for k, v in blobs.items() if KEY_ID.encode() in v or SECRET.encode() in v]


def same_safetensors(a: bytes, b: bytes) -> bool:
    """Equal tensors and metadata (safetensors writes its metadata map in no fixed order)."""
    from safetensors.torch import load

    def meta(blob: bytes) -> dict:
        n = int.from_bytes(blob[:8], "little")
        return json.loads(blob[8:8 + n])["__metadata__"]
    ta, tb = load(a), load(b)
    return meta(a) == meta(b) and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def local_blobs(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_extract_to_s3_killed_mid_upload_then_rerun_equals_the_local_cache(s3_env, tmp_path):
    local = tmp_path / "local"
    assert run_extract(small_cfg(local)).complete
    uri = s3_uri(s3_env, "e2e/cache")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "DFLASH_FAULT": "extract.upload@2"}
    cmd = [sys.executable, "-m", "dflash_pipe", "extract", "-m", str(ROOT / "manifests" / "tiny-qwen3.5.toml"),
           "--cache-dir", uri, "--device", "cpu", *SMALL]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    fs = open_cache_fs(uri)
    after_kill = fs.list_sizes()
    assert "manifest.json" not in after_kill and "cache_spec.json" in after_kill
    stale = fs.incomplete_uploads()
    assert stale and all(s.endswith(".parquet") for s in stale)  # the killed upload: started, never completed
    assert not any(s.rsplit("/", 1)[1] in after_kill for s in stale)  # ... and not visible
    env.pop("DFLASH_FAULT")
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    got, ref = contents(uri), contents(local)
    assert sorted(got) == sorted(ref)
    for i in ref:
        assert got[i][:3] == ref[i][:3] and all(torch.equal(a, b) for a, b in zip(got[i][3:], ref[i][3:]))
    remote = {k.rsplit("/", 1)[1]: v for k, v in all_objects(s3_env, "e2e/cache").items()}
    for e in load_manifest(local)["shards"]:  # shard objects == the local shard files, byte for byte
        assert remote[e["path"]] == (local / e["path"]).read_bytes()
    assert same_safetensors(remote["target_head.safetensors"], (local / "target_head.safetensors").read_bytes())
    verify = subprocess.run([sys.executable, "-m", "dflash_pipe", "cache", "verify", uri, "--decode"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stderr[-2000:]
    report = json.loads(verify.stdout)
    assert report["rows"] == len(ref) and report["incomplete_uploads"] == stale
    outputs = {**remote, "killed.stderr": killed.stderr.encode(), "rerun.stderr": rerun.stderr.encode(),
               "rerun.stdout": rerun.stdout.encode(), "verify": verify.stdout.encode() + verify.stderr.encode(),
               **local_blobs(tmp_path)}
    assert no_secrets_in(outputs) == []


def test_a_failed_upload_leaves_nothing_under_the_shard_name(s3_env):
    fs = open_cache_fs(s3_uri(s3_env, "abort/cache"))
    w = ShardWriter(fs, "shard-00000-of-00001.parquet", 0, "lossless", 0,
                    {"codec": "lossless", "topk": 0, "width": 8, "num_layers": 1, "fingerprint": "x"}, 1)
    w.abort()  # e.g. a compression worker failed: pyarrow's close() alone would complete a partial object
    assert fs.list_sizes() == {}


@pytest.mark.slow
def test_training_from_s3_runs_exports_and_writes_no_credentials(s3_env, tmp_path):
    """The batches equal the local copy's (test_cache_objstore); here the whole stage 2 on an s3:// cache:
    spec, head file download, loader, export."""
    local = tmp_path / "cache"
    write_train_cache(local, num_docs=24, num_shards=2, seed=7)
    uri = s3_uri(s3_env, "train/cache")
    fs = open_cache_fs(uri)
    for p in sorted(local.iterdir()):  # the "or copy" way: upload a finished cache as it is
        fs.upload_file(p.name, p)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dflash_pipe", "train", "--cache-dir", uri, "--output-dir", str(out),
                           "--epochs", "1", "--drafter-num-layers", "1", "--drafter-block-size", "4",
                           "--context-tokens", "96", "--num-anchors", "8", "--checkpoint-every", "0",
                           "--loader-workers", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) >= 2 and all(r["loss"] == r["loss"] for r in recs)  # finite (NaN != NaN)
    assert (out / "export" / "model.safetensors").exists()
    assert (out / ".cache_head" / "target_head.safetensors").read_bytes() == (local / "target_head.safetensors").read_bytes()
    assert "s3://" in (out / "resolved_config.toml").read_text()
    assert no_secrets_in({"stderr": proc.stderr.encode(), "stdout": proc.stdout.encode(), **local_blobs(out)}) == []


@pytest.mark.slow
def test_a_window_run_streams_through_s3_within_the_budget(s3_env, tmp_path):
    """The real pair on s3://: `extract --max-cache-gib` (room for K + 1 shard objects) and `train --follow
    --passes-per-shard 2` at once. Every document is trained exactly K times, the bucket never holds more shard
    bytes than the budget, retirement deletes the shard objects (their sidecars stay), and no credential leaks."""
    import threading
    from collections import Counter

    from dflash_pipe.cache.budget import GIB
    from dflash_pipe.cache.reader import ShardReader
    from dflash_pipe.config import load_manifest as load_run_manifest, normalize, to_toml
    from dflash_pipe.cache.window import load_ledger
    from tests.window_helpers import WINDOW_TRAIN_ARGS

    K, n, docs = 2, 6, 18
    local = tmp_path / "local"
    ref_cfg = small_cfg(local, num_shards=n)
    ref_cfg.data.max_samples = docs
    assert run_extract(ref_cfg).complete  # the shard sizes, and which document is where
    man = load_manifest(local)
    shard_of = {row.sample_id: e["index"] for e in man["shards"]
                for row in ShardReader(e["abs_path"], man["fingerprint"]).iter_rows()}
    budget = 3.3 * max(e["bytes"] for e in man["shards"]) / GIB
    uri = s3_uri(s3_env, "window-e2e/cache")
    out, trace = tmp_path / "out", tmp_path / "trace"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "DFLASH_TRACE": str(trace)}
    cfg = load_run_manifest(ROOT / "manifests" / "tiny-qwen3.5.toml")
    cfg.train.passes_per_shard = K  # extraction sizes the budget's held shards by it (K + M - 1)
    manifest = tmp_path / "window.toml"
    manifest.write_text(to_toml(normalize(cfg)))
    small = list(SMALL)
    small[small.index("--num-shards") + 1], small[small.index("--data-max-samples") + 1] = str(n), str(docs)
    ext_cmd = [sys.executable, "-m", "dflash_pipe", "extract", "-m", str(manifest), "--cache-dir", uri,
               "--device", "cpu", *small, "--max-cache-gib", str(budget), "--space-wait-timeout-s", "120"]
    trn_cmd = [sys.executable, "-m", "dflash_pipe", "train", "--cache-dir", uri, "--output-dir", str(out),
               "--passes-per-shard", str(K), *WINDOW_TRAIN_ARGS, "--follow-timeout-s", "60"]
    fs = open_cache_fs(uri)
    high, stop = [0], threading.Event()

    def sample():  # the shard objects' bytes (complete ones: an upload in flight is not listed)
        while not stop.is_set():
            sizes = fs.list_sizes()
            high[0] = max(high[0], sum(v for k, v in sizes.items() if k.startswith("shard-") and k.endswith(".parquet")))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with open(tmp_path / "extract.log", "w") as le, open(tmp_path / "train.log", "w") as lt:
        ext = subprocess.Popen(ext_cmd, env=env, stdout=le, stderr=subprocess.STDOUT)
        trn = subprocess.Popen(trn_cmd, env=env, stdout=lt, stderr=subprocess.STDOUT)
        try:
            rc_e, rc_t = ext.wait(timeout=300), trn.wait(timeout=300)
        finally:
            for p in (ext, trn):
                if p.poll() is None:
                    p.kill()
            stop.set()
            sampler.join()
    logs = {"extract": (tmp_path / "extract.log").read_text(), "train": (tmp_path / "train.log").read_text()}
    assert rc_e == 0 and rc_t == 0, logs["extract"][-2000:] + logs["train"][-2000:]
    import re

    waited = float(re.search(r"([\d.]+)s waiting for the window trainer", logs["extract"]).group(1))
    assert waited > 0  # the budget made extraction wait for the trainer's deletions ...
    assert sum(e["bytes"] for e in man["shards"]) > budget * GIB >= high[0] > 0  # ... and held the bucket under it
    led = load_ledger(uri)
    assert led.finished and all(e.state == "deleted" for e in led.shards)
    left = fs.list_sizes()
    assert not [k for k in left if k.startswith("shard-") and k.endswith(".parquet")]
    assert sum(k.startswith("shard-") and k.endswith(".json") for k in left) == n  # the sidecars stay
    seq_of = {shard: c for c, shard in enumerate(led.order())}
    passes = Counter()
    for ln in Path(f"{trace}.rank0").read_text().splitlines():
        rec = json.loads(ln)
        for doc in rec["docs"]:
            passes[(doc, rec["epoch"] - seq_of[shard_of[doc]])] += 1
    assert passes == Counter({(doc, k): 1 for doc in shard_of for k in range(K)})
    outputs = {**{k: v.encode() for k, v in logs.items()}, **all_objects(s3_env, "window-e2e/cache"),
               **local_blobs(out)}
    assert no_secrets_in(outputs) == []
