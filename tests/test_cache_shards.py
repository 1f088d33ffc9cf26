"""Shards and manifests: round trip, damage detection, fingerprint refusal, path traversal, SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflash_pipe.cache import (MANIFEST_FILE, ShardReader, init_or_check_spec, load_manifest, make_spec,
                               verify_cache)
from dflash_pipe.cache.manifest import committed_shards
from dflash_pipe.errors import CacheError, FingerprintMismatch
from tests.cache_helpers import fields_for, make_docs, write_cache

W, NL = 48, 3


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
def test_roundtrip_all_fields(tmp_path, codec):
    docs = make_docs(11, W, seed=1)
    write_cache(tmp_path, docs, W, NL, codec=codec, num_shards=3)
    man = load_manifest(tmp_path)
    seen = {}
    for entry in man["shards"]:
        r = ShardReader(entry["abs_path"], expect_fingerprint=man["fingerprint"])
        assert r.num_row_groups > 1  # row groups are sized by bytes
        for row in r.iter_rows():
            seen[row.doc_index] = row
    assert sorted(seen) == list(range(11))
    assert man["totals"]["rows"] == 11
    for d in docs:
        row = seen[d["doc_index"]]
        assert row.sample_id == d["sample_id"]
        assert torch.equal(row.input_ids, torch.from_numpy(d["input_ids"]))
        assert torch.equal(row.loss_mask, torch.from_numpy(d["loss_mask"]))
        ids, lps = row.teacher_topk()
        assert torch.equal(ids, d["topk_ids"]) and torch.equal(lps, d["topk_logprobs"])
        h = row.hidden()
        if codec == "lossless":
            assert torch.equal(h.view(torch.int16), d["hidden"].view(torch.int16))
        else:
            rel = (h.float() - d["hidden"].float()).norm() / d["hidden"].float().norm()
            assert rel < 0.07
    assert verify_cache(tmp_path, decode=True)["rows"] == 11


def _flip_byte(path: Path, where: float):
    data = bytearray(path.read_bytes())
    pos = int(len(data) * where)
    data[pos] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_byte_is_detected_and_named(tmp_path):
    write_cache(tmp_path, make_docs(6, W, seed=2), W, NL, num_shards=2)
    man = load_manifest(tmp_path)
    victim = Path(man["shards"][1]["abs_path"])
    _flip_byte(victim, 0.3)
    with pytest.raises(CacheError) as err:
        verify_cache(tmp_path)
    assert victim.name in str(err.value) and "sha256" in str(err.value)
    # reading the damaged page directly names shard, row group and field (page CRC)
    reader = ShardReader(victim)
    with pytest.raises(CacheError) as err2:
        for rg in range(reader.num_row_groups):
            for row in reader.read_row_group(rg):
                row.hidden()
                row.teacher_topk()
    msg = str(err2.value)
    assert victim.name in msg and "row group" in msg and "field" in msg


def test_truncated_shard_is_detected(tmp_path):
    write_cache(tmp_path, make_docs(6, W, seed=3), W, NL, num_shards=2)
    victim = Path(load_manifest(tmp_path)["shards"][0]["abs_path"])
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(CacheError, match=f"{victim.name}.*truncated"):
        verify_cache(tmp_path)
    with pytest.raises(CacheError, match="truncated or damaged"):
        ShardReader(victim)


def test_missing_and_foreign_shards_are_named(tmp_path):
    write_cache(tmp_path, make_docs(6, W, seed=4), W, NL, num_shards=2)
    other = tmp_path / "other"
    write_cache(other, make_docs(4, W, seed=5), W, NL, num_shards=1, fingerprint_fields=fields_for(W, NL, "lossless", 4, "x"))
    foreign = tmp_path / "shard-00009-of-00010.parquet"
    foreign.write_bytes((other / "shard-00000-of-00001.parquet").read_bytes())
    man = load_manifest(tmp_path)
    Path(man["shards"][0]["abs_path"]).unlink()
    with pytest.raises(CacheError) as err:
        verify_cache(tmp_path)
    assert "foreign shard" in str(err.value) and "missing" in str(err.value)
    with pytest.raises(CacheError, match="foreign shard"):
        ShardReader(foreign, expect_fingerprint=man["fingerprint"])


def test_fingerprint_mismatch_lists_differing_fields(tmp_path):
    write_cache(tmp_path, make_docs(4, W), W, NL, num_shards=1)
    fields = fields_for(W, NL, "fp8", 8)
    spec = make_spec(fields, {}, {}, 1, {})
    with pytest.raises(FingerprintMismatch) as err:
        init_or_check_spec(tmp_path, spec)
    assert set(err.value.differing) == {"codec", "topk"}
    assert "codec" in str(err.value) and "--overwrite" in str(err.value)
    assert init_or_check_spec(tmp_path, spec, overwrite=True) == "overwritten"
    assert not (tmp_path / MANIFEST_FILE).exists() and not list(tmp_path.glob("shard-*"))


def test_hand_edited_manifest_is_refused(tmp_path):
    write_cache(tmp_path, make_docs(4, W), W, NL, num_shards=1)
    path = tmp_path / MANIFEST_FILE
    man = json.loads(path.read_text())
    man["fingerprint_fields"]["topk"] = 99
    path.write_text(json.dumps(man))
    with pytest.raises(CacheError, match="edited by hand"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("bad", ["../outside.parquet", "/etc/passwd", "sub/../../x.parquet"])
def test_shard_path_outside_cache_dir_is_refused(tmp_path, bad):
    write_cache(tmp_path, make_docs(4, W), W, NL, num_shards=1)
    path = tmp_path / MANIFEST_FILE
    man = json.loads(path.read_text())
    man["shards"][0]["path"] = bad
    path.write_text(json.dumps(man))
    with pytest.raises(CacheError, match="shards\\[0\\].path"):
        load_manifest(tmp_path)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    import dflash_pipe.cache.writer as writer_mod
    from tests.cache_helpers import make_docs, write_cache
    real_flush = writer_mod.ShardWriter._flush
    calls = [0]
    def flush_then_die(self):
        real_flush(self)
        calls[0] += 1
        if self.index == 1 and calls[0] >= {kill_after}:
            os.kill(os.getpid(), signal.SIGKILL)   # mid-shard: shard 1 has row groups on disk, not committed
    writer_mod.ShardWriter._flush = flush_then_die
    write_cache(Path({cache!r}), make_docs(12, 48, seed=7), 48, 3, num_shards=3)
""")


def test_writer_killed_mid_shard_leaves_no_visible_shard_and_rerun_completes(tmp_path):
    root = str(Path(__file__).resolve().parents[1])
    cache = tmp_path / "c"
    script = KILL_SCRIPT.format(root=root, kill_after=3, cache=str(cache))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    names = sorted(p.name for p in cache.iterdir())
    assert "shard-00000-of-00003.parquet" in names  # shard 0 finished before the kill
    assert "shard-00001-of-00003.parquet" not in names  # the killed shard is not visible...
    assert any(n.startswith(".shard-00001") for n in names)  # ...only as a temp file
    assert MANIFEST_FILE not in names
    from dflash_pipe.cache import load_spec
    assert sorted(committed_shards(cache, load_spec(cache))) == [0]
    # rerun (the same writes) completes and the cache verifies
    write_cache(cache, make_docs(12, 48, seed=7), 48, 3, num_shards=3)
    from dflash_pipe.io_utils import remove_stale_temps
    remove_stale_temps(cache)
    assert verify_cache(cache, decode=True)["rows"] == 12
    assert not [n for n in os.listdir(cache) if n.startswith(".")]


@pytest.mark.parametrize("sync_row_groups", [True, False])
def test_row_groups_reach_the_disk_before_the_commit(tmp_path, monkeypatch, sync_row_groups):
    """With sync_row_groups (the default) every written row group is fdatasynced as it is written, so the
    commit's fsync covers only the footer; the file size at each sync grows by one row group."""
    from dflash_pipe.cache import shard_name
    from dflash_pipe.cache.codec import encode_hidden
    from dflash_pipe.cache.schema import shard_meta
    from dflash_pipe.cache.writer import ShardWriter, make_row

    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd))[1])
    spec = make_spec(fields_for(W, NL, "lossless", 4), target={}, features={}, num_shards=1, extra={})
    w = ShardWriter(tmp_path, shard_name(0, 1), 0, "lossless", 4, shard_meta("lossless", 4, W, NL, spec["fingerprint"]),
                    2000, sync_row_groups=sync_row_groups)
    for d in make_docs(9, W, seed=2):
        w.add(make_row(d["sample_id"], d["doc_index"], d["input_ids"], d["loss_mask"],
                       encode_hidden(d["hidden"], "lossless", NL), d["topk_ids"], d["topk_logprobs"]))
    info = w.commit()
    if not sync_row_groups:
        assert synced == []
        return
    assert info.row_groups > 2 and len(synced) == info.row_groups
    assert synced == sorted(synced) and len(set(synced)) == len(synced)
    assert synced[-1] < (tmp_path / shard_name(0, 1)).stat().st_size   # the footer came after the last sync


def test_stale_temp_cleanup_keeps_a_live_writers_files(tmp_path):
    """Two extraction jobs on disjoint --shards share one cache dir: a job starting must not delete the other
    job's temp files (found when bench/extract_parallel.py started two at once: the first job's target head
    lost its temp file before the rename), nor, on several nodes, another host's. Only a writer of this host whose
    pid is gone left stale ones."""
    import subprocess as sp

    from dflash_pipe.io_utils import HOST_TAG, remove_stale_temps, temp_path_for

    live = temp_path_for(tmp_path / "target_head.safetensors")          # this process: alive
    assert f"-{HOST_TAG}-" in live.name
    gone = sp.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f".shard-00001-of-00004.parquet.tmp-{gone.pid}-abcd1234"            # before session 27
    dead_here = tmp_path / f".shard-00002-of-00004.parquet.tmp-{gone.pid}-{HOST_TAG}-abcd1234"
    # a job on another node writing the same shared cache dir: its pid means nothing here, its file stays
    other_host = "0" * 8 if HOST_TAG != "0" * 8 else "1" * 8
    elsewhere = tmp_path / f".shard-00003-of-00004.parquet.tmp-{gone.pid}-{other_host}-ab"
    odd = tmp_path / ".manifest.json.tmp-notapid"
    for p in (live, dead, dead_here, elsewhere, odd):
        p.write_bytes(b"x")
    assert remove_stale_temps(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, elsewhere.name])


def test_a_damaged_num_tokens_chunk_is_named_when_the_trainer_opens_the_cache(tmp_path):
    """The trainer's cache index reads every shard's num_tokens column first: a flipped byte there is a CacheError
    naming shard, row group and field (it was a bare OSError, exit 4, with a hint about permissions and free space)."""
    import pyarrow.parquet as pq

    from dflash_pipe.train.cache_index import CacheIndex

    write_cache(tmp_path, make_docs(14, W, seed=3), W, NL, num_shards=2, row_group_bytes=3000)
    victim = Path(load_manifest(tmp_path)["shards"][0]["abs_path"])
    meta = pq.ParquetFile(victim).metadata.row_group(0)
    col = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == "num_tokens")
    data = bytearray(victim.read_bytes())
    data[col.data_page_offset + col.total_compressed_size - 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CacheError) as err:
        CacheIndex(tmp_path).refresh()
    assert victim.name in str(err.value) and "row group 0, field num_tokens" in str(err.value)
    assert err.value.exit_code == 3 and "rerun extract" in err.value.hint
