"""The cache on object storage: s3:// against a real S3-protocol server (moto) on 127.0.0.1, through
pyarrow's own S3 client. Local caches are covered by the other cache tests, unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_pipe.cache import load_manifest, load_spec, verify_cache
from dflash_pipe.cache.fs import open_cache_fs
from dflash_pipe.cache.object_fs import ObjectCacheFS
from dflash_pipe.cache.reader import ShardReader
from dflash_pipe.errors import CacheError, UsageError
from dflash_pipe.train.loader import CacheIndex
from tests.cache_helpers import make_docs, write_cache
from tests.s3_helpers import (BUCKET, KEY_ID, SECRET, FaultProxy, all_objects, moto_server, s3_env,  # noqa: F401
                              s3_uri)

ROOT = Path(__file__).resolve().parents[1]
WIDTH, LAYERS = 64, 2


def rows_of(location) -> dict:
    """doc_index -> (sample id, ids, mask, hidden bits, top-k) read back through the cache reader."""
    man = load_manifest(location)
    out = {}
    for e in man["shards"]:
        for row in ShardReader(e["abs_path"], man["fingerprint"]).iter_rows():
            ids, lps = row.teacher_topk()
            out[row.doc_index] = (row.sample_id, row.input_ids.tolist(), row.loss_mask.tolist(),
                                  row.hidden().view(torch.int16), ids, lps)
    return out


def assert_same_rows(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) and a
    for i in a:
        assert a[i][:3] == b[i][:3]
        assert all(torch.equal(x, y) for x, y in zip(a[i][3:], b[i][3:]))


def local_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_round_trip_through_s3_is_bit_identical_to_the_local_cache(s3_env, tmp_path):
    docs = make_docs(14, WIDTH, seed=3)
    local = tmp_path / "cache"
    write_cache(local, docs, WIDTH, LAYERS, num_shards=3)
    uri = s3_uri(s3_env, "roundtrip/cache")
    write_cache(uri, docs, WIDTH, LAYERS, num_shards=3)
    remote = {k.split("/", 2)[2]: v for k, v in all_objects(s3_env, "roundtrip/cache").items()}
    assert remote == local_files(local)  # every object: spec, shards, sidecars, manifest, byte for byte
    assert_same_rows(rows_of(uri), rows_of(local))
    report = verify_cache(uri, decode=True)
    assert report["rows"] == 14 and report["incomplete_uploads"] == []
    index = CacheIndex(uri)
    assert index.refresh() and sorted(index.paths) == [0, 1, 2]
    assert all(str(p).startswith(f"s3://{BUCKET}/roundtrip/cache/shard-") for p in index.paths.values())
    ref = CacheIndex(local)
    ref.refresh()
    assert index.lengths == ref.lengths


def test_a_corrupted_object_is_a_named_checksum_error_and_is_not_re_read(s3_env, tmp_path):
    uri = s3_uri(s3_env, "corrupt/cache")
    write_cache(uri, make_docs(6, WIDTH, seed=4), WIDTH, LAYERS, num_shards=1, row_group_bytes=10 ** 9)
    fs = open_cache_fs(uri)
    name = load_manifest(uri)["shards"][0]["path"]
    data = bytearray(fs.read_bytes(name))
    data[len(data) // 3] ^= 0x40  # inside the feature column chunk
    fs.write_bytes(name, bytes(data))
    retries = fs.retries
    with pytest.raises(CacheError, match=r"sha256 differs from the manifest") as err:
        verify_cache(uri)
    assert name in str(err.value)
    with pytest.raises(CacheError, match=r"row group 0, field hidden_|row group 0, field ") as err:
        ShardReader(fs.display(name)).read_row_group(0)
    assert f"s3://{BUCKET}/corrupt/cache/{name}" in str(err.value)
    assert fs.retries == retries  # a checksum mismatch is not a transient error


def test_listing_pages_past_1000_objects(s3_env):
    boto3 = pytest.importorskip("boto3")  # comes with moto; one PUT per object (pyarrow's stream makes three)
    from concurrent.futures import ThreadPoolExecutor

    client = boto3.client("s3", endpoint_url=s3_env.endpoint, region_name="us-east-1")
    names = [f"obj-{i:05d}.json" for i in range(1010)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: client.put_object(Bucket=BUCKET, Key=f"many/{n}", Body=b"{}"), names))
    listed = open_cache_fs(s3_uri(s3_env, "many")).list_sizes()
    assert sorted(listed) == names and set(listed.values()) == {2}


def test_missing_credentials_are_a_usage_error_naming_what_to_set(moto_server, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    uri = s3_uri(moto_server, "nocreds/cache")
    with pytest.raises(UsageError) as err:
        open_cache_fs(uri)
    assert "no S3 credentials" in str(err.value)
    assert "AWS_ACCESS_KEY_ID" in str(err.value) and "AWS_SECRET_ACCESS_KEY" in str(err.value)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "dflash_pipe", "cache", "info", uri], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "AWS_ACCESS_KEY_ID" in proc.stderr, proc.stderr[-1500:]


def test_credentials_in_a_uri_are_refused_without_echoing_them(s3_env):
    for uri in (f"s3://{KEY_ID}:{SECRET.replace('/', '%2F')}@{BUCKET}/x", f"s3://{BUCKET}/x?secret_key=abcdEFGH1234"):
        with pytest.raises(UsageError, match="refused") as err:
            open_cache_fs(uri)
        assert SECRET not in str(err.value) and "abcdEFGH1234" not in str(err.value)
        assert SECRET.replace("/", "%2F") not in str(err.value)


def test_hints_name_the_store_with_its_endpoint_shell_quoted(s3_env):
    """A hint's `--cache-dir` must reach the same server: the URI's query (endpoint) stays, quoted for the shell."""
    import shlex

    from dflash_pipe.cache.manifest import committed_shards, sidecar_name

    uri = s3_uri(s3_env, "hint/cache")
    write_cache(uri, make_docs(4, WIDTH, seed=2), WIDTH, LAYERS, num_shards=2)
    fs = open_cache_fs(uri)
    fs.write_bytes(sidecar_name(1, 2), b"{not json")
    with pytest.raises(CacheError) as err:
        committed_shards(fs, load_spec(fs))
    hint = err.value.hint
    assert f"--cache-dir {shlex.quote(uri)}" in hint and "?endpoint=" in hint
    argv = shlex.split(hint.split("`")[1])  # the command in the hint's backticks, as the shell splits it
    again = argv[argv.index("--cache-dir") + 1]
    assert again == uri and open_cache_fs(again) is fs  # the same store, the same client


def test_transient_503s_and_connection_resets_are_retried(s3_env, tmp_path):
    proxy = FaultProxy(s3_env.port).start()
    try:
        docs = make_docs(8, WIDTH, seed=6)
        uri = s3_uri(proxy, "flaky/cache")
        puts = lambda method, path: method == "PUT"  # noqa: E731
        ranged_gets = lambda method, path: method == "GET" and "/shard-" in path  # noqa: E731
        proxy.fail(2, "503", puts)
        proxy.fail(1, "reset", puts)
        write_cache(uri, docs, WIDTH, LAYERS, num_shards=2)
        assert proxy.failed == {"503": 2, "reset": 1, "403": 0, "400": 0}  # each was retried: the writes all landed
        # more failures in a row than the SDK's 3 attempts: this layer's backoff retries take over
        proxy.fail(4, "503", ranged_gets)
        proxy.fail(2, "reset", ranged_gets)
        fs = open_cache_fs(uri)
        before = fs.retries
        got = rows_of(uri)
        assert proxy.failed == {"503": 6, "reset": 3, "403": 0, "400": 0}
        assert fs.retries - before >= 1
        local = tmp_path / "cache"
        write_cache(local, docs, WIDTH, LAYERS, num_shards=2)
        assert_same_rows(got, rows_of(local))
    finally:
        proxy.stop()


def test_retries_are_bounded_and_name_the_object(s3_env):
    proxy = FaultProxy(s3_env.port).start()
    try:
        uri = s3_uri(proxy, "down/cache") + "&retries=2"
        fs = open_cache_fs(uri)
        assert isinstance(fs, ObjectCacheFS) and fs.attempts == 2
        proxy.fail(10 ** 6, "503")  # the store stays down
        with pytest.raises(Exception) as err:
            fs.read_bytes("cache_spec.json")
        assert getattr(err.value, "exit_code", None) == 4 and "cache_spec.json" in str(err.value)
        assert "after 2 attempts" in str(err.value) and fs.retries == 1
    finally:
        proxy.stop()


def test_an_object_replaced_between_its_head_and_get_is_read_again_whole(s3_env):
    """pyarrow reads an object as HEAD (size) + ranged GET: window.json rewritten in between came back cut to the
    old size (a real failure of the s3 window test: 'not valid JSON'). The proxy rewrites it, straight at moto,
    just before forwarding the first GET: the read is repeated and returns the new version whole."""
    import json

    proxy = FaultProxy(s3_env.port).start()
    try:
        direct = open_cache_fs(s3_uri(s3_env, "torn/cache"))
        direct.write_json("window.json", {"v": 1})
        longer = {"v": 2, "pad": "x" * 500}
        replaced = []

        def replace_before_the_first_get(method, path):
            if method == "GET" and "window.json" in path and not replaced:
                direct.write_json("window.json", longer)
                replaced.append(path)
            return False                                  # no fault: the GET is forwarded, now to the new object
        proxy.fail(1, "503", replace_before_the_first_get)
        via = open_cache_fs(s3_uri(proxy, "torn/cache"))
        assert json.loads(via.read_bytes("window.json")) == longer
        assert len(replaced) == 1 and via.torn_reads == 1
        assert json.loads(via.read_bytes("window.json")) == longer and via.torn_reads == 1   # a quiet read: once
    finally:
        proxy.stop()


def test_the_loader_reads_the_same_batches_from_s3_with_read_ahead(s3_env, tmp_path):
    from dflash_pipe.train.loader import BatchLoader
    from tests.cache_helpers import write_train_cache

    local = tmp_path / "cache"
    write_train_cache(local, num_docs=30, num_shards=2, seed=9, row_group_bytes=3000)
    uri = s3_uri(s3_env, "loader/cache")
    fs = open_cache_fs(uri)
    for p in sorted(local.iterdir()):
        fs.upload_file(p.name, p)

    def batches(location):
        index = CacheIndex(location)
        loader = BatchLoader(index, rank=0, world=1, seed=1, context_tokens=96, num_anchors=8, max_anchors_per_doc=4,
                             block_size=4, shuffle_rows=4, workers=2, want_topk=True, pin_memory=False, read_ahead=3)
        try:
            return [b.tensors() for b in loader.iterate(0, 0)], loader
        finally:
            loader.close()
    got, s3_loader = batches(uri)
    ref, local_loader = batches(local)
    for loader in (s3_loader, local_loader):  # both read row groups ahead (GETs; local: decompression)
        assert loader.rg_cache.reads_ahead > 0
    assert len(got) == len(ref) >= 3
    for g, r in zip(got, ref):
        assert g.keys() == r.keys() and all(torch.equal(g[k], r[k]) for k in r)


def test_window_ledger_budget_and_shard_deletion_work_on_s3(s3_env):
    from dflash_pipe.cache.budget import GIB, DiskBudget
    from dflash_pipe.cache.manifest import committed_shards, sidecar_name
    from dflash_pipe.cache.schema import shard_name
    from dflash_pipe.cache.window import (DELETED, Ledger, delete_shard_file, load_ledger, reset_consumed,
                                          save_ledger, window_status)
    from dflash_pipe.errors import RuntimeFailure

    uri = s3_uri(s3_env, "window/cache")
    spec = write_cache(uri, make_docs(9, WIDTH, seed=8), WIDTH, LAYERS, num_shards=3, finalize=False)
    fs = open_cache_fs(uri)
    sizes = fs.list_sizes()
    led = Ledger(spec["fingerprint"], 2, "/runs/x")
    for i in (1, 0, 2):
        led.add(i, sizes[shard_name(i, 3)])
    save_ledger(uri, led)
    assert load_ledger(uri, spec).order() == [1, 0, 2]
    led.retire(0, after_round=1)
    led.shards[0].state = DELETED  # shard 1 (commit #0): ledger first, then the object
    save_ledger(uri, led)
    delete_shard_file(uri, shard_name(1, 3))
    assert shard_name(1, 3) not in fs.list_sizes() and sidecar_name(1, 3) in fs.list_sizes()
    done = committed_shards(uri, spec)
    assert sorted(done) == [0, 1, 2] and done[1].get("deleted") and not done[0].get("deleted")
    status = window_status(uri, spec)
    assert status["deleted"] == [1] and status["shard_files_on_disk"] == 2
    held = sizes[shard_name(0, 3)] + sizes[shard_name(2, 3)]
    biggest = max(sizes[shard_name(i, 3)] for i in range(3))
    roomy = DiskBudget(uri, (held + 3 * biggest) / GIB, 1, timeout_s=5, poll_s=0.05)
    with roomy.room_for_next_shard():  # held objects + the next shard fit: no wait
        pass
    full = DiskBudget(uri, 1.0, 1, timeout_s=0.3, poll_s=0.05)
    full.limit = held + biggest - 1  # one byte short of the next shard (still more than K + 1 = 2 shards)
    with pytest.raises(RuntimeFailure, match="the trainer seems gone"):
        with full.room_for_next_shard():
            pass
    # this job's previous shard, still uploading (no listing shows it), counts at its estimate until listed
    pend = DiskBudget(uri, 1.0, 1, timeout_s=0.3, poll_s=0.05)
    pend.limit = held + 2 * biggest - 1  # room for one more shard, not two
    with pend.room_for_next_shard(0, "shard-x.parquet"):
        pass
    with pytest.raises(RuntimeFailure, match="the trainer seems gone"):
        with pend.room_for_next_shard(0, "shard-y.parquet"):
            pass
    fs.write_bytes("shard-x.parquet", b"12345")  # its upload completed: counted by the listing from now on
    with pend.room_for_next_shard(0, "shard-y.parquet"):
        pass
    fs.delete("shard-x.parquet")
    fs.write_bytes("shard-y.json", b"{}")  # y committed and consumed between two looks: only its sidecar is left
    with pend.room_for_next_shard(0, "shard-z.parquet"):  # y's reservation ended with its sidecar (else: no room)
        pass
    fs.delete("shard-y.json")
    led.finished = True
    save_ledger(uri, led)
    assert reset_consumed(uri, spec, lambda i: sidecar_name(i, 3)) == [1]
    left = fs.list_sizes()
    assert sidecar_name(1, 3) not in left and "window.json" not in left and sidecar_name(0, 3) in left


@pytest.mark.parametrize("how", ["403", "400"])
def test_credentials_refused_mid_read_are_a_usage_error_not_a_damaged_shard(s3_env, how):
    """The store starts refusing the credentials while a trainer reads (a bucket policy changes): a UsageError (exit
    2) with the credentials hint, not a CacheError whose hint says to delete the shard (session 27's review found
    that), nor retries as a network error. An expired session token (S3's 400 ExpiredToken) reaches pyarrow's GET as
    'AWS Error UNKNOWN (HTTP status 400)' with no code: a 400 is never transient, so it is refused the same way
    (until session 28 it was retried as a network error, then called a damaged shard)."""
    proxy = FaultProxy(s3_env.port).start()
    try:
        uri = s3_uri(proxy, f"denied-{how}/cache")
        write_cache(uri, make_docs(6, WIDTH, seed=2), WIDTH, LAYERS, num_shards=1)
        man = load_manifest(uri)
        reader = ShardReader(man["shards"][0]["abs_path"], man["fingerprint"])
        proxy.fail(100, how, lambda method, path: method == "GET" and "shard-" in path)
        # a 400 with its code parsed (ExpiredToken) reads as access denied; without it, as a refused bad request
        refused = "access denied" if how == "403" else r"(access denied|the store refused the request as bad)"
        with pytest.raises(UsageError, match="row group 0: " + refused) as err:
            reader.read_row_group(0)
        assert "AWS_ACCESS_KEY_ID" in err.value.hint and "delete" not in err.value.hint
        assert proxy.failed[how] <= 3                     # not the network path's 5 retries of every column
        with pytest.raises(UsageError, match="footer: " + refused):
            ShardReader(man["shards"][0]["abs_path"], man["fingerprint"])
    finally:
        proxy.stop()


def test_object_store_locations_with_a_fragment_endpoint_credentials_or_two_endpoints_are_refused(s3_env, tmp_path):
    """Found by session 27's review: '#' cut the prefix short, a user:password@ endpoint passed, and a shard named
    without its endpoint was read from whichever endpoint of that bucket/prefix was opened first."""
    proxy = FaultProxy(s3_env.port).start()     # a second endpoint in front of the same server
    try:
        with pytest.raises(UsageError, match="a '#' in an object-store location"):
            open_cache_fs(f"s3://{BUCKET}/runs/exp#1/cache?endpoint={s3_env.endpoint}")
        with pytest.raises(UsageError, match="credentials in the 'endpoint' URI parameter") as err:
            open_cache_fs(f"s3://{BUCKET}/c?endpoint=http://{KEY_ID}:{SECRET}@127.0.0.1:{s3_env.port}")
        assert SECRET not in str(err.value) + err.value.hint
        write_cache(s3_uri(s3_env, "mirror/cache"), make_docs(4, WIDTH, seed=1), WIDTH, LAYERS, num_shards=1)
        open_cache_fs(s3_uri(proxy, "mirror/cache"))   # the same bucket/prefix on a second endpoint
        shard = load_manifest(s3_uri(s3_env, "mirror/cache"))["shards"][0]["abs_path"]   # named without the endpoint
        with pytest.raises(UsageError, match="open on two endpoints in this process"):
            ShardReader(shard)                          # it used to read the first endpoint's, silently
    finally:
        proxy.stop()
    spaced = tmp_path / "my cache"
    assert open_cache_fs(spaced.as_uri()).root == spaced   # file:// URIs are percent-decoded
