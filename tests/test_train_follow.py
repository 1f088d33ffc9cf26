"""Follow mode: training consumes shards while a (slow) extractor is still committing them."""

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from dflash_pipe.train.loader import CacheIndex
from dflash_pipe.train.schedule import build_epoch_schedule
from tests.cache_helpers import write_train_cache
from tests.fork_cli import run_cli

ROOT = Path(__file__).resolve().parents[1]


def slow_extractor(staged: Path, live: Path, delay: float, trainer_started: Path) -> None:
    """Replay a finished cache into `live` in extract's commit order: spec + head, then each shard
    (data file, then sidecar) with a delay, in a scrambled order, and the manifest last. All but the
    first shard wait until the trainer has started, so it is guaranteed to run ahead of the extractor.
    A cut manifest.json (an earlier run's, damaged: plan says RESUME) is there from the start until the
    real one replaces it, as when run_pipeline.sh starts extract beside `train --follow` to rewrite it."""
    live.mkdir()
    for name in ("cache_spec.json", "target_head.safetensors"):
        shutil.copy(staged / name, live / name)
    text = (staged / "manifest.json").read_text()
    (live / "manifest.json").write_text(text[:len(text) // 2])
    for n, i in enumerate((1, 0, 3, 2)):  # shards commit out of index order, as concurrent ranks do
        time.sleep(delay)
        while n >= 1 and not trainer_started.exists():
            time.sleep(0.1)
        for ext in (".parquet", ".json"):
            name = f"shard-{i:05d}-of-00004{ext}"
            shutil.copy(staged / name, live / f".{name}.tmp-x")
            os.replace(live / f".{name}.tmp-x", live / name)
    time.sleep(delay)
    shutil.copy(staged / "manifest.json", live / "manifest.json")


def test_follow_trains_during_extraction_and_ends_epoch_when_manifest_is_final(tmp_path):
    """Also with a damaged manifest.json in the cache until extraction rewrites it (see slow_extractor)."""
    staged, live, out = tmp_path / "staged", tmp_path / "live", tmp_path / "out"
    write_train_cache(staged, num_docs=48, num_shards=4, seed=5)
    t = threading.Thread(target=slow_extractor, args=(staged, live, 2.0, out / "resolved_config.toml"))
    t.start()
    while not (live / "target_head.safetensors").exists():
        time.sleep(0.05)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = ["train", "--cache-dir", str(live), "--output-dir", str(out),
            "--follow", "--follow-poll-s", "0.2", "--epochs", "1", "--drafter-num-layers", "1",
            "--drafter-block-size", "4", "--context-tokens", "96", "--num-anchors", "8", "--checkpoint-every", "0",
            "--loader-workers", "1"]
    proc = run_cli(argv, env)  # its own process, forked without the interpreter start (tests/fork_cli.py)
    t.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "follow: waiting for extraction" in proc.stderr  # it really ran ahead of the extractor
    assert proc.stderr.count(f"follow: {live / 'manifest.json'} is damaged") == 1  # said once, not exit 3
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    index = CacheIndex(staged)
    index.refresh()
    expect = build_epoch_schedule(index.lengths, 1, 0, 0, 96, 256, follow_first_epoch=True, final=True).steps
    assert steps == list(range(expect))  # the first epoch covered every committed shard, nothing dropped
    assert (out / "export" / "model.safetensors").exists()


def test_follow_refresh_reads_each_sidecar_once_and_grows_only_the_committed_prefix(tmp_path, monkeypatch):
    """Shards commit out of order (1, 0, 3, 2): the index exposes only the committed prefix, and a sidecar once
    in the prefix is never read again (on a store each read is a GET per poll)."""
    from dflash_pipe.cache import manifest

    staged, live = tmp_path / "staged", tmp_path / "live"
    write_train_cache(staged, num_docs=24, num_shards=4, seed=2)
    live.mkdir()
    for name in ("cache_spec.json", "target_head.safetensors"):
        shutil.copy(staged / name, live / name)
    reads = []
    real = manifest._read_json
    monkeypatch.setattr(manifest, "_read_json", lambda fs, name, *a: (reads.append(name), real(fs, name, *a))[1])
    index = CacheIndex(live, follow=True)
    prefixes = []
    for i in (1, 0, 3, 2):
        for ext in (".parquet", ".json"):
            shutil.copy(staged / f"shard-{i:05d}-of-00004{ext}", live / f"shard-{i:05d}-of-00004{ext}")
        index.refresh()
        prefixes.append(sorted(index.lengths))
    assert prefixes == [[], [0, 1], [0, 1], [0, 1, 2, 3]]
    sidecars = [r for r in reads if r.startswith("shard-")]
    # shard 1 is read twice (committed before 0, so outside the prefix at the first look); 3 likewise
    assert sorted(sidecars) == sorted(["shard-00001-of-00004.json"] * 2 + ["shard-00000-of-00004.json"]
                                      + ["shard-00003-of-00004.json"] * 2 + ["shard-00002-of-00004.json"])


def _cut_manifest(cache: Path) -> None:
    text = (cache / "manifest.json").read_text()
    (cache / "manifest.json").write_text(text[:len(text) // 2])


def _manifest_of_another_fingerprint(cache: Path) -> None:
    man = json.loads((cache / "manifest.json").read_text())
    man["fingerprint_fields"]["target"] = "another"
    from dflash_pipe.cache.manifest import fingerprint_of

    man["fingerprint"] = fingerprint_of(man["fingerprint_fields"])
    (cache / "manifest.json").write_text(json.dumps(man))


@pytest.mark.parametrize("damage", [_cut_manifest, _manifest_of_another_fingerprint], ids=["cut", "other fingerprint"])
def test_follow_reads_the_sidecars_while_a_damaged_manifest_waits_for_extract_to_rewrite_it(tmp_path, caplog, damage):
    """plan says RESUME for a complete cache whose manifest.json does not load (or names another fingerprint), and
    run_pipeline.sh starts extract and `train --follow` together: the trainer must not exit 3 on the old manifest
    before extract rewrites it. In follow mode it is treated as not written yet (one warning naming it); once
    rewritten it is used. Without --follow the damage is still exit 3."""
    from dflash_pipe.errors import CacheError

    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=24, num_shards=4, seed=3)
    good = (cache / "manifest.json").read_text()
    damage(cache)
    with pytest.raises(CacheError):
        CacheIndex(cache).refresh()
    index = CacheIndex(cache, follow=True)
    with caplog.at_level(logging.WARNING, logger="dflash_pipe.loader"):
        assert index.refresh() is False and index.refresh() is False
    assert sorted(index.lengths) == [0, 1, 2, 3]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(cache / "manifest.json") in warned[0]
    (cache / "manifest.json").write_text(good)  # extract rewrote it
    assert index.refresh() is True and index.final and sorted(index.lengths) == [0, 1, 2, 3]
    reference = CacheIndex(cache)
    reference.refresh()
    assert index.lengths == reference.lengths


def _stalled_cache(tmp_path: Path, keep: int = 2, num_docs: int = 24) -> tuple[Path, Path]:
    """A 4-shard cache whose extraction died after committing shards 0..keep-1: no manifest, the rest staged
    aside (to be committed by a test's extractor thread)."""
    cache, staged = tmp_path / "cache", tmp_path / "staged"
    write_train_cache(cache, num_docs=num_docs, num_shards=4, seed=3)
    staged.mkdir()
    shutil.move(str(cache / "manifest.json"), staged / "manifest.json")
    for i in range(keep, 4):
        for ext in (".parquet", ".json"):
            name = f"shard-{i:05d}-of-00004{ext}"
            shutil.move(str(cache / name), staged / name)
    return cache, staged


def _follow_loader(cache: Path, timeout_s: float):
    from dflash_pipe.train.loader import BatchLoader

    return BatchLoader(CacheIndex(cache, follow=True), rank=0, world=1, seed=0, context_tokens=96, num_anchors=8,
                       max_anchors_per_doc=4, block_size=4, shuffle_rows=256, workers=1, want_topk=False,
                       pin_memory=False, follow_poll_s=0.05, follow_timeout_s=timeout_s)


def test_plain_follow_gives_up_when_no_shard_comes_for_the_follow_timeout(tmp_path):
    """Until session 29 plain `train --follow` on a cache whose extraction died (no new shard, no manifest) waited
    forever after training on the committed shards: --follow-timeout-s bounded window mode only. Now it is exit 4
    (RuntimeFailure) naming the cache, the shards seen of those expected, and the fix (resume extract)."""
    from dflash_pipe.errors import RuntimeFailure

    cache, _ = _stalled_cache(tmp_path)
    loader = _follow_loader(cache, 1.0)
    t0, batches = time.monotonic(), 0
    try:
        with pytest.raises(RuntimeFailure) as err:
            for _ in loader.iterate(0, 0, follow_first_epoch=True):
                batches += 1
    finally:
        loader.close()
    assert batches > 0  # it trained on what was committed first
    assert 1.0 <= time.monotonic() - t0 < 10
    text = f"{err.value.message} {err.value.hint}"
    assert str(cache) in text and "seen 2 of 4" in text and "extract" in text and "--resume auto" in text


def test_plain_follow_timeout_restarts_at_each_new_shard(tmp_path):
    """A slow but progressing extraction never trips --follow-timeout-s: each shard comes 0.6 s after the last
    (the whole wait, ~1.8 s, is longer than the 1 s limit), and the epoch ends at the manifest."""
    cache, staged = _stalled_cache(tmp_path)

    def extractor():
        for i in (2, 3):
            time.sleep(0.6)
            for ext in (".parquet", ".json"):
                name = f"shard-{i:05d}-of-00004{ext}"
                shutil.copy(staged / name, cache / f".{name}.tmp-x")
                os.replace(cache / f".{name}.tmp-x", cache / name)
        time.sleep(0.6)
        shutil.copy(staged / "manifest.json", cache / "manifest.json")

    loader = _follow_loader(cache, 1.0)
    t = threading.Thread(target=extractor)
    t.start()
    t0 = time.monotonic()
    try:
        batches = sum(1 for _ in loader.iterate(0, 0, follow_first_epoch=True))
    finally:
        loader.close()
        t.join()
    assert time.monotonic() - t0 > 1.5  # it did wait longer than the limit, in all
    assert batches > 0 and loader.index.final and sorted(loader.index.lengths) == [0, 1, 2, 3]


def test_plain_follow_timeout_is_exit_4_from_the_cli_and_checkpoints_the_steps_trained(tmp_path):
    """The trainer passes --follow-timeout-s to the loader in plain follow mode: exit 4 with the message. Until
    session 30 the steps trained since the last checkpoint were lost (here, with --checkpoint-every 0, all of
    them); now a one-process run checkpoints them first, and once extraction finishes `--resume auto` continues
    from that step and ends where a run that never stalled ends, with the same weights."""
    from safetensors.numpy import load_file

    cache, staged = _stalled_cache(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    common = ["--follow", "--follow-poll-s", "0.1", "--epochs", "1", "--drafter-num-layers", "1",
              "--drafter-block-size", "4", "--context-tokens", "96", "--num-anchors", "8", "--checkpoint-every", "0",
              "--loader-workers", "1", "--log-every", "1"]
    out = tmp_path / "out"
    proc = run_cli(["train", "--cache-dir", str(cache), "--output-dir", str(out), "--follow-timeout-s", "1",
                    *common], env, timeout=60)  # until session 29: waited forever (killed here at 60 s)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "no new shard committed" in proc.stderr and "seen 2 of 4" in proc.stderr and str(cache) in proc.stderr
    ckpts = sorted(out.glob("ckpt-*"))
    assert len(ckpts) == 1 and (ckpts[0] / "state.json").exists(), proc.stdout[-2000:]
    stalled_at = json.loads((ckpts[0] / "state.json").read_text())["step"]
    assert stalled_at > 0 and f"checkpointed step {stalled_at}" in proc.stdout

    for f in staged.iterdir():                       # extraction resumes and finishes
        shutil.move(str(f), cache / f.name)
    proc = run_cli(["train", "--cache-dir", str(cache), "--output-dir", str(out), "--resume", "auto", *common], env,
                   timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"at step {stalled_at}" in proc.stdout
    whole = tmp_path / "whole"                       # the same cache, never stalled
    proc = run_cli(["train", "--cache-dir", str(cache), "--output-dir", str(whole), *common], env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = [sorted(d.glob("ckpt-*"))[-1] for d in (out, whole)]
    assert [json.loads((c / "state.json").read_text())["step"] for c in last] == [
        json.loads((last[1] / "state.json").read_text())["step"]] * 2
    a, b = (load_file(str(c / "model.safetensors")) for c in last)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_follow_waits_while_the_head_file_is_damaged_until_extract_rewrites_it(tmp_path):
    """plan RESUMEs a cache whose target head file is damaged and extract rewrites it; `train --follow` started
    beside it waits while the head fails its header check instead of starting on it (and exiting 3 at its load)."""
    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=24, num_shards=4, seed=3)
    head = cache / json.loads((cache / "cache_spec.json").read_text())["features"]["head_file"]
    good = head.read_bytes()
    head.write_bytes(good[:len(good) // 2])  # truncated
    timer = threading.Timer(0.6, lambda: head.write_bytes(good))  # extract rewrites it
    t0 = time.monotonic()
    timer.start()
    try:
        index = CacheIndex(cache, follow=True, wait_s=20)
        waited, head_then = time.monotonic() - t0, head.read_bytes()   # before the timer is joined
    finally:
        timer.join()
    assert waited >= 0.6 and head_then == good
    assert index.refresh() is True and sorted(index.lengths) == [0, 1, 2, 3]


@pytest.mark.slow
def test_two_ranks_that_time_out_at_the_same_step_checkpoint_it_and_resume_to_a_slow_runs_weights(tmp_path):
    """torchrun, 2 gloo ranks, plain --follow on a cache whose extraction stalled: both ranks run out of batches at
    the same step, agree on it through the rendezvous store (no collective) and checkpoint it before exiting; after
    extraction finishes, `--resume auto` ends at the weights of a 2-rank run whose extractor was merely slow (it
    committed the same shards later, while the trainer waited; the same follow-mode step plan). Until session 30
    only a one-process run kept its steps (a rank could be inside a gradient all-reduce, so nobody checkpointed)."""
    import subprocess
    import sys

    from safetensors.numpy import load_file

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    common = ["--follow", "--follow-poll-s", "0.1", "--epochs", "1", "--drafter-num-layers", "1",
              "--drafter-block-size", "4", "--context-tokens", "96", "--num-anchors", "8", "--checkpoint-every", "0",
              "--loader-workers", "1", "--log-every", "1"]

    def torchrun(cache: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "dflash_pipe", "train", "--cache-dir", str(cache), "--output-dir", str(out), *common, *extra]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)

    def commit(staged: Path, cache: Path) -> None:     # the rest of the shards, then the manifest
        for f in sorted(staged.iterdir(), key=lambda f: (f.name == "manifest.json", f.suffix == ".json")):
            shutil.move(str(f), cache / f.name)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cache, staged = _stalled_cache(tmp_path / "a", num_docs=64)
    out = tmp_path / "out"
    proc = torchrun(cache, out, "--follow-timeout-s", "1")
    assert proc.returncode != 0 and "no new shard committed" in proc.stderr, proc.stderr[-3000:]
    ckpts = sorted(out.glob("ckpt-*"))
    assert len(ckpts) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    stalled_at = json.loads((ckpts[0] / "state.json").read_text())["step"]
    assert stalled_at > 0 and f"checkpointed step {stalled_at}" in proc.stdout
    commit(staged, cache)
    proc = torchrun(cache, out, "--resume", "auto")
    assert proc.returncode == 0 and f"at step {stalled_at}" in proc.stdout, proc.stderr[-3000:]

    cache2, staged2 = _stalled_cache(tmp_path / "b", num_docs=64)
    slow = tmp_path / "slow"

    def slow_extractor():
        while not (slow / "metrics.jsonl").exists():   # the trainer is training on the first two shards
            time.sleep(0.05)
        time.sleep(2.0)
        commit(staged2, cache2)

    t = threading.Thread(target=slow_extractor)
    t.start()
    proc = torchrun(cache2, slow, "--follow-timeout-s", "60")
    t.join()
    assert proc.returncode == 0 and "follow: waiting for extraction" in proc.stderr, proc.stderr[-3000:]
    last = [sorted(d.glob("ckpt-*"))[-1] for d in (out, slow)]
    steps = [json.loads((c / "state.json").read_text())["step"] for c in last]
    assert steps[0] == steps[1] > stalled_at
    a, b = (load_file(str(c / "model.safetensors")) for c in last)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
