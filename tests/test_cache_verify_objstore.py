"""`cache verify`'s per-file checks (issue #20) on an s3:// cache (moto on 127.0.0.1, through the fs seam).

A synthetic training cache with a head file is written locally, uploaded object by object, and its
manifest (head-file record included) is made on the store by `try_finalize`; then one file at a time is
damaged on the store and verify must name that object and field, exactly as it does for a directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_pipe.cache import MANIFEST_FILE, SPEC_FILE, load_spec, try_finalize, verify_cache
from dflash_pipe.cache.fs import open_cache_fs
from dflash_pipe.errors import CacheError
from dflash_pipe.io_utils import sha256_file
from tests.cache_helpers import write_train_cache
from tests.s3_helpers import BUCKET, moto_server, s3_env, s3_uri  # noqa: F401

HEAD = "target_head.safetensors"


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("verify_s3") / "cache"
    write_train_cache(cache, num_docs=10, num_shards=2)
    (cache / "resolved_config.toml").write_text('[extract]\ncache_dir = "x"\n')
    return cache


def _upload(local: Path, uri: str) -> str:
    """Every file but the manifest, then the manifest made on the store (it records the head file)."""
    fs = open_cache_fs(uri)
    for p in sorted(local.iterdir()):
        if p.name != MANIFEST_FILE:
            fs.upload_file(p.name, p)
    assert try_finalize(uri, load_spec(uri)) is not None
    return f"s3://{BUCKET}/{uri.split(BUCKET + '/', 1)[1].split('?', 1)[0]}"


def _problems(uri: str, decode: bool = False) -> str:
    with pytest.raises(CacheError) as err:
        verify_cache(uri, decode=decode)
    assert err.value.exit_code == 3
    return str(err.value)


def test_the_manifest_on_s3_records_the_head_file_and_verify_checks_it_both_ways(s3_env, local_cache, monkeypatch):
    uri = s3_uri(s3_env, "v-ok/cache")
    _upload(local_cache, uri)
    fs = open_cache_fs(uri)
    man = json.loads(fs.read_bytes(MANIFEST_FILE))
    assert man["head_file"]["sha256"] == sha256_file(local_cache / HEAD)
    assert man["head_file"]["bytes"] == (local_cache / HEAD).stat().st_size
    # a second finalize keeps the record without hashing the head object again (size and mtime unchanged)
    calls = []
    real = type(fs).sha256
    with monkeypatch.context() as m:  # (not monkeypatch.undo(): that would also drop s3_env's credentials)
        m.setattr(type(fs), "sha256", lambda self, name, *a: calls.append(name) or real(self, name, *a))
        try_finalize(uri, load_spec(uri))
    assert calls == []
    for decode in (False, True):  # header by ranged reads / the whole head downloaded and every value read
        report = verify_cache(uri, decode=decode)
        assert report["head_file"]["recorded"] and report["rows"] == 10 and report["incomplete_uploads"] == []


def test_each_damaged_object_is_named_with_its_field_and_fix(s3_env, local_cache, tmp_path):
    from safetensors.torch import save_file
    import torch

    uri = s3_uri(s3_env, "v-bad/cache")
    base = _upload(local_cache, uri)
    fs = open_cache_fs(uri)
    side = "shard-00001-of-00002.json"
    fs.write_bytes(side, fs.read_bytes(side)[:30])
    fs.write_bytes("resolved_config.toml", b"[extract\n")
    wrong = tmp_path / HEAD
    save_file({"model.embed_tokens.weight": torch.zeros(7, 32)}, str(wrong),
              metadata={"dflash_config": json.dumps({"tie_word_embeddings": False})})
    fs.upload_file(HEAD, wrong)
    msg = _problems(uri)
    assert f"{base}/{side}: not valid JSON" in msg and f"delete {base}/{side} and rerun" in msg
    assert f"{base}/resolved_config.toml: not valid TOML" in msg
    assert f"{base}/{HEAD}: " in msg and "truncated or replaced" in msg  # the manifest's record
    assert "3 problem(s)" in msg and msg.count("fix: ") == 3
    # without the record (an older cache) the tensors are read from the header by ranged GETs
    man = json.loads(fs.read_bytes(MANIFEST_FILE))
    man.pop("head_file")
    fs.write_json(MANIFEST_FILE, man)
    msg = _problems(uri)
    assert f"{base}/{HEAD} field 'model.embed_tokens.weight': shape [7, 32]" in msg
    assert f"{base}/{HEAD} field 'lm_head.weight': tensor missing" in msg
    fs.write_bytes(HEAD, b"\xff" * 64)  # no safetensors header at all
    assert "not a readable safetensors file" in _problems(uri)


def test_a_damaged_spec_on_s3_is_named_by_verify_and_info(s3_env, local_cache, capsys):
    from dflash_pipe.cli import main

    uri = s3_uri(s3_env, "v-spec/cache")
    base = _upload(local_cache, uri)
    fs = open_cache_fs(uri)
    fs.write_bytes(SPEC_FILE, b"{ not json")
    msg = _problems(uri)
    assert f"{base}/{SPEC_FILE}: cache spec is not valid JSON" in msg and f"delete {base}/{SPEC_FILE}" in msg
    for cmd in (["cache", "info", uri], ["cache", "verify", uri]):
        with pytest.raises(SystemExit) as ex:
            main(cmd)
        assert ex.value.code == 3 and SPEC_FILE in capsys.readouterr().err
    fs.delete(SPEC_FILE)
    fs.delete(MANIFEST_FILE)
    with pytest.raises(CacheError, match="not a dflash-pipe cache"):
        verify_cache(uri)


def test_a_local_copy_of_the_same_cache_verifies_the_same(local_cache, tmp_path):
    """The control: the same files in a directory pass, so the s3 failures above are the damage alone."""
    copy = tmp_path / "cache"
    shutil.copytree(local_cache, copy, copy_function=shutil.copy2)
    assert verify_cache(copy, decode=True)["head_file"]["recorded"]
