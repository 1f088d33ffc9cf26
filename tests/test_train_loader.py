"""Anchors, labels, the epoch schedule and the streaming loader, against independent references."""

import numpy as np
import pytest
import torch

from dflash_pipe.cache.codec import planes_to_hidden
from dflash_pipe.train.anchors import IGNORE, block_labels, eligible_anchors, sample_anchors
from dflash_pipe.train.loader import BatchLoader, CacheIndex
from dflash_pipe.train.schedule import build_epoch_schedule
from tests.cache_helpers import make_docs, write_cache


def test_eligible_anchors_and_labels_match_loop_reference():
    rng = np.random.default_rng(0)
    for _ in range(50):
        T, B = int(rng.integers(2, 40)), int(rng.integers(2, 9))
        mask = (rng.random(T) < 0.6).astype(np.uint8)
        ids = rng.integers(0, 100, T)
        ref = [t for t in range(T - 1) if mask[t] and mask[t + 1]]
        assert eligible_anchors(mask).tolist() == ref
        got = block_labels(ids, mask, np.array(ref, dtype=np.int64), B)
        for i, a in enumerate(ref):
            for k in range(B):
                want = ids[a + k] if (k > 0 and a + k < T and mask[a + k]) else IGNORE
                assert got[i, k] == want


def test_sample_anchors_caps_without_replacement_and_sorted():
    mask = np.ones(200, np.uint8)
    a = sample_anchors(mask, 17, np.random.default_rng(1))
    assert a.size == 17 and len(set(a.tolist())) == 17 and np.all(np.diff(a) > 0) and a.max() < 199


def _lengths(seed, shards=3, rgs=4):
    rng = np.random.default_rng(seed)
    return {s: [list(rng.integers(1, 60, rng.integers(1, 6))) for _ in range(rgs)] for s in range(shards)}


def test_copyable_matches_a_loop_reference_and_copy_weighted_anchors_favour_it():
    """copyable(t): the 3-gram ending at t occurred earlier (first occurrence ending at j < t) and was followed by
    input_ids[t + 1] there, checked against a plain loop on random documents with repeats. With
    --copy-anchor-weight 20 the sampled anchors hold far more copyable positions than uniform sampling (same
    rng seed, 400 draws), stay eligible, sorted and unique; weight 0 is the uniform path, draw for draw."""
    from dflash_pipe.train.anchors import copyable
    from dflash_pipe.train.loader import block_targets

    rng = np.random.default_rng(3)
    for _ in range(20):
        base = rng.integers(0, 6, size=int(rng.integers(1, 40)))
        ids = np.concatenate([base, base[: rng.integers(0, len(base) + 1)], rng.integers(0, 6, size=5)])
        ref = np.zeros(len(ids), bool)
        for t in range(2, len(ids) - 1):
            firsts = [j for j in range(2, t + 1) if tuple(ids[j - 2:j + 1]) == tuple(ids[t - 2:t + 1])]
            ref[t] = firsts[0] < t and ids[firsts[0] + 1] == ids[t + 1]
        assert np.array_equal(copyable(ids), ref), ids
    doc = np.concatenate([rng.integers(0, 5000, size=300), rng.integers(0, 5000, size=300)])
    doc[450:550] = doc[100:200]                                    # a repeated span: copyable positions
    mask = np.ones(len(doc), bool)
    cop = copyable(doc)
    share = {}
    for w in (0.0, 20.0):
        picks = [block_targets(doc, [mask], [0], 64, 4, 64, np.random.default_rng(s), copy_weight=w)[0]
                 for s in range(400)]
        share[w] = np.mean([cop[a].mean() for a in picks])
        assert all(np.all(np.diff(a) > 0) and mask[a].all() for a in picks)
    assert share[0.0] < 0.25 < 0.6 < share[20.0], share
    uni = block_targets(doc, [mask], [0], 64, 4, 64, np.random.default_rng(7))
    assert np.array_equal(uni[0], block_targets(doc, [mask], [0], 64, 4, 64, np.random.default_rng(7), 0.0)[0])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_schedule_covers_every_document_once(world):
    lengths = _lengths(0)
    sched = build_epoch_schedule(lengths, world, seed=5, epoch=0, context_tokens=100, shuffle_rows=4)
    seen = [(d.shard, d.row_group, d.row) for r in range(world) for b in sched.per_rank[r] for d in b]
    expected = [(s, rg, row) for s in lengths for rg in range(len(lengths[s])) for row in range(len(lengths[s][rg]))]
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen))
    for r in range(world):
        for b in sched.per_rank[r]:
            assert sum(d.num_tokens for d in b) <= 100
    assert sched.dropped_batches == sum(len(b) for b in sched.per_rank) - world * sched.steps


def test_schedule_is_deterministic_and_epoch_dependent():
    lengths = _lengths(1)
    a = build_epoch_schedule(lengths, 2, 5, 0, 100, 4)
    b = build_epoch_schedule(lengths, 2, 5, 0, 100, 4)
    c = build_epoch_schedule(lengths, 2, 5, 1, 100, 4)
    assert a.per_rank == b.per_rank and a.per_rank != c.per_rank


def test_follow_schedule_is_prefix_stable_as_shards_arrive():
    lengths = _lengths(2, shards=4)
    full = build_epoch_schedule(lengths, 2, 3, 0, 90, 3, follow_first_epoch=True, final=True)
    for k in range(1, 4):
        part = build_epoch_schedule({s: lengths[s] for s in range(k)}, 2, 3, 0, 90, 3, follow_first_epoch=True,
                                    final=False)
        for r in range(2):
            assert full.per_rank[r][:len(part.per_rank[r])] == part.per_rank[r]


@pytest.mark.parametrize("codec,release,read_ahead", [  # release: buffers come back and are reused
    ("lossless", False, 4), ("lossless", True, 4), ("fp8", False, 4), ("fp8", True, 4),
    ("lossless", True, 0)])  # read_ahead 0: every row group read on demand by the decode workers
def test_loader_batches_equal_per_document_decode(tmp_path, codec, release, read_ahead):
    W, NL = 24, 2
    docs = make_docs(14, W, seed=3, min_len=3, max_len=30)
    write_cache(tmp_path, docs, W, NL, codec=codec, num_shards=2, row_group_bytes=3000)
    by_id = {d["doc_index"]: d for d in docs}
    index = CacheIndex(tmp_path)
    loader = BatchLoader(index, rank=0, world=1, seed=0, context_tokens=64, num_anchors=12, max_anchors_per_doc=4,
                         block_size=4, shuffle_rows=3, workers=2, want_topk=True, pin_memory=False,
                         prefetch=1 if release else 3, read_ahead=read_ahead)  # 3: assembled concurrently
    seen, batches = set(), 0
    for batch in loader.iterate(epoch=0, start_step=0):
        batches += 1
        hidden = planes_to_hidden(codec, batch.planes, batch.scale, NL)
        assert hidden.shape == (64, W) and batch.labels_NB.shape == (12, 4)
        for j in range(batch.num_docs):
            pos = (batch.ctx_doc_S == j).nonzero().flatten()
            assert torch.equal(pos, torch.arange(pos[0], pos[0] + len(pos)))  # contiguous
            ids = batch.input_ids_S[pos]
            match = [d for d in by_id.values() if len(d["input_ids"]) >= len(pos)
                     and np.array_equal(d["input_ids"][:len(pos)], ids.numpy())]
            assert len(match) == 1
            d = match[0]
            seen.add(d["doc_index"])
            ref = d["hidden"][:len(pos)].float()
            if codec == "lossless":
                assert torch.equal(hidden[pos].float(), ref)
            else:
                assert ((hidden[pos].float() - ref).norm() / ref.norm()) < 0.07
            assert torch.equal(batch.ctx_pos_S[pos], torch.arange(len(pos)))
            assert torch.equal(batch.topk_ids_SK[pos], d["topk_ids"][:len(pos)])
            # every valid block of this doc: labels follow the rule from this doc's own tokens
            for n in (batch.block_doc_N == j).nonzero().flatten().tolist():
                a = int(batch.anchor_index_N[n] - pos[0])
                want = block_labels(d["input_ids"][:len(pos)], d["loss_mask"][:len(pos)], np.array([a]), 4)[0]
                assert batch.labels_NB[n].tolist() == want.tolist()
                assert batch.anchor_tokens_N[n] == d["input_ids"][a]
        assert (batch.ctx_doc_S[batch.tokens:] == -1).all()
        pad = ~batch.block_valid_N
        assert (batch.labels_NB[pad] == IGNORE).all() and (batch.block_doc_N[pad] == -1).all()
        assert (hidden[batch.tokens:] == 0).all()  # padding context is zero, also in a reused buffer
        if release:
            batch.release()
    assert seen == set(by_id)  # world 1, final data: nothing dropped
    if release:
        assert loader.plane_pool.allocated <= loader.prefetch + 1 < batches
    else:
        assert loader.plane_pool.allocated == batches
    rg = loader.rg_cache
    # read-ahead asked for row groups iff it is on (who reads one first, a fetch thread or a decode worker, is a race:
    # on a loaded 2-core box the workers won every one, so reads_ahead alone is not asserted)
    assert (rg.prefetch_calls > 0) == (read_ahead > 0) and rg.reads_ahead <= rg.prefetch_calls
    assert rg.reads_ahead + rg.reads_on_demand >= 3
    loader.close()


def test_row_groups_read_from_many_threads_equal_serial_reads(tmp_path):
    """Decode workers read row groups of one shard concurrently: each thread gets its own Parquet handle
    (one handle read from two threads crashed pyarrow), and every read equals the serial one."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_pipe.train.loader import RowGroupCache

    W, NL = 24, 2
    write_cache(tmp_path, make_docs(40, W, seed=9, min_len=3, max_len=30), W, NL, num_shards=1, row_group_bytes=600)
    index = CacheIndex(tmp_path)
    index.refresh()
    groups = len(index.lengths[0])
    assert groups >= 10
    serial = {rg: [r.hidden() for r in index.reader(0).read_row_group(rg)] for rg in range(groups)}
    cache = RowGroupCache(index, capacity=1)  # forces re-reads

    def read(job):
        rg = job % groups
        return rg, [r.hidden() for r in cache.rows(0, rg)]

    with ThreadPoolExecutor(8) as pool:
        for rg, rows in pool.map(read, range(groups * 12)):
            assert len(rows) == len(serial[rg]) and all(torch.equal(a, b) for a, b in zip(rows, serial[rg]))
    assert len({k[1] for k in index._readers}) > 1  # several threads, several handles


class _FakeBatch:
    def __init__(self, i):
        self.i, self.released = i, False

    def tensors(self):
        return {"x": torch.full((3,), float(self.i))}

    def release(self):
        self.released = True


@pytest.mark.parametrize("pattern", ["never", "always", "alternate"])
def test_device_feed_hands_out_every_batch_once_in_order_whether_prefetched_or_not(pattern):
    """The trainer prefetches after backward; a batch that was not prefetched is started by next()."""
    from dflash_pipe.train.device_feed import DeviceFeed

    made = [_FakeBatch(i) for i in range(5)]
    pulled = []

    def source():
        for b in made:
            pulled.append(b.i)
            yield b

    feed = DeviceFeed(source(), torch.device("cpu"))
    got = []
    for k, (batch, t) in enumerate(feed):
        assert pulled == list(range(k + 1))  # nothing is read ahead before prefetch() is asked for
        assert [b.released for b in made] == [True] * k + [False] * (5 - k)   # the one in use is not given back
        got.append(int(t["x"][0]))
        if pattern == "always" or (pattern == "alternate" and k % 2 == 0):
            feed.prefetch()
            feed.prefetch()  # idempotent: never skips a batch
            assert pulled == list(range(min(k + 2, 5)))
    assert got == [0, 1, 2, 3, 4]
    assert [b.released for b in made] == [True] * 5  # the last one too once the feed ends (a window run makes a
    # feed per round: a batch never given back made the loader pin and zero a fresh buffer every round)
    assert feed.take_wait_s() >= 0.0 and feed.take_wait_s() == 0.0


def test_shard_subset_trains_on_exactly_those_shards(tmp_path):
    from dflash_pipe.errors import UsageError, ValidationError
    from dflash_pipe.train.components import check_resume_identity

    W, NL = 24, 2
    docs = make_docs(15, W, seed=4, min_len=3, max_len=30)
    spec = write_cache(tmp_path, docs, W, NL, num_shards=3, row_group_bytes=3000)   # shard s holds docs[s::3]
    index = CacheIndex(tmp_path, shards="0,2")
    index.refresh()
    assert sorted(index.lengths) == [0, 2]
    loader = BatchLoader(index, rank=0, world=1, seed=0, context_tokens=64, num_anchors=12, max_anchors_per_doc=4,
                         block_size=4, shuffle_rows=3, workers=2, want_topk=False, pin_memory=False)
    seen = set()
    for batch in loader.iterate(epoch=0, start_step=0):
        for j in range(batch.num_docs):
            ids = batch.input_ids_S[batch.ctx_doc_S == j].numpy()
            seen |= {i for i, d in enumerate(docs) if len(d["input_ids"]) >= len(ids)
                     and np.array_equal(d["input_ids"][:len(ids)], ids)}
    loader.close()
    assert seen == {i for i in range(15) if i % 3 != 1}
    with pytest.raises(UsageError, match="--shards"):
        CacheIndex(tmp_path, shards="0,3")               # the cache has shards 0-2
    state = {"train_shards": [0, 2], "cache_identity": {}}
    with pytest.raises(ValidationError, match="shards"):
        check_resume_identity(state, spec, tmp_path, None, None)   # resuming a subset run on all shards


def test_the_loader_samples_copy_weighted_anchors_when_asked(tmp_path, monkeypatch):
    """BatchLoader(copy_anchor_weight=W) hands W to every row's anchor draw (the trainer passes --copy-anchor-weight;
    validation's loader keeps the default 0), and its batches still hold valid blocks."""
    from dflash_pipe.train import loader as loader_mod

    W, NL = 24, 2
    docs = make_docs(6, W, seed=2, min_len=8, max_len=30)
    write_cache(tmp_path, docs, W, NL, num_shards=1, row_group_bytes=3000)
    index = CacheIndex(tmp_path)
    index.refresh()
    seen = []
    real = loader_mod.block_targets
    monkeypatch.setattr(loader_mod, "block_targets", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    for w in (0.0, 4.0):
        ld = BatchLoader(index, rank=0, world=1, seed=0, context_tokens=64, num_anchors=12, max_anchors_per_doc=4,
                         block_size=4, shuffle_rows=1, workers=1, want_topk=False, pin_memory=False,
                         copy_anchor_weight=w)
        batch = next(iter(ld.iterate(epoch=0, start_step=0)))
        assert int(batch.block_valid_N.sum()) > 0
        ld.close()
    assert seen and set(seen) == {0.0, 4.0}
