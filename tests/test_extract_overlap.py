"""One long-lived host pipeline per rank: shard commits on the writer thread, slots allocated once.

The multi-shard run must write exactly what one-shard-at-a-time runs write (per-shard stats stay
per shard), a failure on the writer thread while the next shard is being forwarded must leave the
shards committed before it intact and nothing half-written, and the staging slots must be
allocated once for all shards.
"""

import hashlib
import json
import os
import threading

import numpy as np
import pytest
import torch

from dflash_pipe.cache import committed_shards, load_spec, shard_name
from dflash_pipe.cache.schema import shard_meta
from dflash_pipe.cache.writer import ShardWriter
from dflash_pipe.errors import DegenerateFeatures, RuntimeFailure
from dflash_pipe.extract import pipeline, staging
from dflash_pipe.extract.host_pipeline import DocMeta, HostPipeline
from dflash_pipe.extract.pipeline import run_extract
from dflash_pipe.extract.sanity import feature_stats
from tests.test_extract_e2e import contents, small_cfg


def _sidecars(cache, with_timing=False) -> dict[int, dict]:
    out = {}
    for p in sorted(cache.glob("shard-*.json")):
        sc = json.loads(p.read_text())
        if not with_timing:
            sc["stats"].pop("timing")
        out[sc["index"]] = sc
    return out


def _dot_files(cache) -> list[str]:
    return [p for p in os.listdir(cache) if p.startswith(".")]


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    """All three shards in one run (fp8: exercises the per-batch error terms), counting staging
    allocations and pipelines."""
    cache = tmp_path_factory.mktemp("fp8") / "cache"
    allocs, pipes = [], []
    real_alloc, real_init = staging.alloc_slot, HostPipeline.__init__

    def counting_init(self, *a, **kw):
        pipes.append(self)
        real_init(self, *a, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(staging, "alloc_slot", lambda n, pinned: allocs.append(n) or real_alloc(n, pinned))
        m.setattr(HostPipeline, "__init__", counting_init)
        summary = run_extract(small_cfg(cache, codec="fp8"))
    assert summary.complete and sorted(summary.shards_done) == [0, 1, 2]
    return cache, summary, allocs, pipes, contents(cache)


def test_staging_slots_are_allocated_once_for_all_shards(fp8_run):
    cache, summary, allocs, pipes, _ = fp8_run
    cfg = small_cfg(cache, codec="fp8")
    assert len(pipes) == 1  # one pipeline for the rank's three shards
    assert len(allocs) == cfg.extract.queue_batches  # all up front, none grown later
    spec = load_spec(cache)
    width, n = spec["features"]["width"], spec["features"]["num_layers"]
    slot = staging.max_batch_bytes(cfg.extract.token_budget, width, n, "fp8", cfg.extract.topk)
    assert allocs == [slot] * len(allocs)
    assert pipes[0].ring.grown == 0 and pipes[0].shards[-1].committed
    assert summary.writer_wait_s >= 0 and "waiting at the end" in summary.bottleneck


def test_multi_shard_run_writes_what_one_shard_at_a_time_runs_write(fp8_run, tmp_path):
    cache, _, _, _, _ = fp8_run
    single = tmp_path / "single"
    for s in range(3):
        assert run_extract(small_cfg(single, codec="fp8", shards=f"{s}-{s}")).shards_done == [s]
    many, one = _sidecars(cache), _sidecars(single)
    assert sorted(many) == sorted(one) == [0, 1, 2]
    for s in range(3):
        assert many[s] == one[s], f"shard {s}"  # rows, bytes, sha256, reader/tokenizer stats, rms, fp8 error
        fp8 = many[s]["stats"]["fp8_error"]
        assert fp8["tokens"] == many[s]["tokens"] and 0 < fp8["rel_l2_max"] < 0.1
    for sc in _sidecars(cache, with_timing=True).values():
        assert {"seconds", "gpu_blocked_s", "writer_idle_s", "compress_s", "commit_s"} <= set(sc["stats"]["timing"])


@pytest.mark.parametrize("where", ["commit", "sidecar"])
def test_writer_failure_while_the_next_shard_forwards(fp8_run, tmp_path, monkeypatch, where):
    """Shard 1's commit (or sidecar) fails on the writer thread only once shard 2's forwards have
    started: shard 0 stays committed, shards 1 and 2 leave no temp file and no sidecar, and the
    rerun completes the same cache as the uninterrupted run."""
    _, _, _, _, ref_docs = fp8_run
    cache = tmp_path / "cache"
    writers: list[ShardWriter] = []
    shard2_forwarding = threading.Event()

    class TrackingWriter(ShardWriter):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            writers.append(self)

        def commit(self):
            if self.index == 1 and where == "commit":
                assert shard2_forwarding.wait(60)
                raise RuntimeFailure("injected commit failure")
            return super().commit()

    real_sidecar, real_stats = pipeline.write_sidecar, pipeline.feature_stats

    def failing_sidecar(cache_dir, spec, info, stats):
        if info.index == 1:
            assert shard2_forwarding.wait(60)
            raise RuntimeFailure("injected sidecar failure")
        return real_sidecar(cache_dir, spec, info, stats)

    def watching_stats(*a, **kw):  # called right after each forward on the main thread
        if len(writers) == 3:
            shard2_forwarding.set()
        return real_stats(*a, **kw)

    with monkeypatch.context() as m:
        m.setattr(pipeline, "ShardWriter", TrackingWriter)
        m.setattr(pipeline, "write_sidecar", failing_sidecar)
        m.setattr(pipeline, "feature_stats", watching_stats)
        with pytest.raises(RuntimeFailure, match=f"injected {where} failure"):
            run_extract(small_cfg(cache, codec="fp8"))
    assert shard2_forwarding.is_set() and len(writers) == 3
    spec = load_spec(cache)
    assert sorted(committed_shards(cache, spec)) == [0]
    side0 = _sidecars(cache)[0]
    assert hashlib.sha256((cache / side0["path"]).read_bytes()).hexdigest() == side0["sha256"]
    assert not (cache / shard_name(2, 3)).exists() and not _dot_files(cache)
    assert not (cache / "manifest.json").exists()
    rerun = run_extract(small_cfg(cache, codec="fp8"))
    assert rerun.complete and rerun.shards_skipped == [0] and sorted(rerun.shards_done) == [1, 2]
    got = contents(cache)
    assert sorted(got) == sorted(ref_docs)
    for i, ref in ref_docs.items():
        assert got[i][:3] == ref[:3] and all(torch.equal(a, b) for a, b in zip(got[i][3:], ref[3:]))
    assert not _dot_files(cache)


# ---------------------------------------------------------------------------- HostPipeline directly
W_LAYERS, H = 2, 8


def _batch(rng, lens, zero_layer=False):
    hidden = torch.from_numpy(rng.standard_normal((sum(lens), W_LAYERS * H)).astype(np.float32)).to(torch.bfloat16)
    if zero_layer:
        hidden[:, :H] = 0
    docs, start = [], 0
    for T in lens:
        docs.append(DocMeta(f"s{start}", start, rng.integers(0, 100, T).astype(np.int32), np.ones(T, np.uint8)))
        start += T
    return docs, hidden


def _writer(tmp_path, index):
    return ShardWriter(tmp_path, f"shard-{index:05d}-of-00002.parquet", index, "lossless", 0,
                       shard_meta("lossless", 0, W_LAYERS * H, W_LAYERS, "fp"), 1 << 20)


def test_a_batch_larger_than_its_slot_grows_the_slot_and_round_trips(tmp_path):
    from dflash_pipe.cache.reader import ShardReader

    rng = np.random.default_rng(0)
    host = HostPipeline(2, 2, 64, torch.device("cpu"), [0, 1], "lossless")  # 64 bytes: every batch is larger
    batches = [_batch(rng, [5, 7]), _batch(rng, [9]), _batch(rng, [3, 4, 6])]
    handle = host.begin_shard(_writer(tmp_path, 0), 0)
    for docs, hidden in batches:
        lens = [len(d.input_ids) for d in docs]
        host.submit(docs, hidden, lens, W_LAYERS, stats_NL3=feature_stats(hidden, lens, W_LAYERS))
    host.end_shard(lambda h: h.writer.commit())
    host.close()
    assert handle.committed and handle.timers.docs == 6 and len(handle.timers.stats_rows) == 6
    assert host.ring.grown >= 1 and host.ring.allocations == 2 + host.ring.grown
    rows = list(ShardReader(tmp_path / handle.result.path, "fp").iter_rows())
    want = [h[s:s + len(d.input_ids)] for docs, h in batches for d, s in
            zip(docs, np.cumsum([0] + [len(d.input_ids) for d in docs])[:-1])]
    assert len(rows) == 6 and all(torch.equal(r.hidden(), w) for r, w in zip(rows, want))


def test_a_worker_failure_surfaces_on_the_main_thread_and_abort_removes_open_shards(tmp_path):
    rng = np.random.default_rng(1)
    host = HostPipeline(2, 2, 1 << 16, torch.device("cpu"), [0, 1], "lossless")
    ok = host.begin_shard(_writer(tmp_path, 0), 0)
    docs, hidden = _batch(rng, [6, 6])
    host.submit(docs, hidden, [6, 6], W_LAYERS, stats_NL3=feature_stats(hidden, [6, 6], W_LAYERS))
    host.end_shard(lambda h: h.writer.commit())
    host.flush()
    assert ok.committed
    with pytest.raises(DegenerateFeatures, match="exactly zero"):
        host.begin_shard(_writer(tmp_path, 1), 1)
        docs, hidden = _batch(rng, [6], zero_layer=True)
        host.submit(docs, hidden, [6], W_LAYERS, stats_NL3=feature_stats(hidden, [6], W_LAYERS))
        host.end_shard(lambda h: h.writer.commit())
        host.close()
    host.abort()
    assert sorted(os.listdir(tmp_path)) == ["shard-00000-of-00002.parquet"]  # committed one stays
