"""A manifest.json that is valid JSON but not the shape the readers rely on (a field missing or of the wrong
type, a shard entry that is not an object) is refused by `load_manifest` as damage: `cache verify` and
`cache info` exit 3 naming the file and the field, with the hint that rewrites the manifest (never a
KeyError / TypeError traceback, exit 1)."""

from __future__ import annotations

import json

import pytest

from dflash_pipe.cache import MANIFEST_FILE, load_manifest, load_spec, try_finalize, verify_cache
from dflash_pipe.cli import main
from dflash_pipe.errors import CacheError
from tests.cache_helpers import make_docs, write_cache


def _drop(key):
    return lambda m: m.pop(key)


def _set(key, value):
    return lambda m: m.__setitem__(key, value)


def _shard(i, key, value=None, drop=False):
    def edit(m):
        if drop:
            m["shards"][i].pop(key)
        else:
            m["shards"][i][key] = value
    return edit


# (id, edit of the parsed manifest, the field the error must name)
BROKEN = [
    ("totals missing", _drop("totals"), "totals"),
    ("totals null", _set("totals", None), "totals"),
    ("totals.bytes missing", lambda m: m["totals"].pop("bytes"), "totals.bytes"),
    ("shards null", _set("shards", None), "shards"),
    ("shards an object", _set("shards", {"0": {}}), "shards"),
    ("shard entry a string", lambda m: m["shards"].__setitem__(1, "shard-00001-of-00002.parquet"), "shards[1]"),
    ("shard entry null", lambda m: m["shards"].__setitem__(0, None), "shards[0]"),
    ("shard bytes missing", _shard(1, "bytes", drop=True), "shards[1].bytes"),
    ("shard rows missing", _shard(0, "rows", drop=True), "shards[0].rows"),
    ("shard rows a string", _shard(1, "rows", "12"), "shards[1].rows"),
    ("shard tokens negative", _shard(1, "tokens", -3), "shards[1].tokens"),
    ("shard sha256 missing", _shard(0, "sha256", drop=True), "shards[0].sha256"),
    ("shard path a number", _shard(0, "path", 7), "shards[0].path"),
    ("shard index out of range", _shard(1, "index", 5), "shards[1].index"),
    ("shard index twice", _shard(1, "index", 0), "shards[1].index"),
    ("num_shards a string", _set("num_shards", "2"), "num_shards"),
    ("features null", _set("features", None), "features"),
    ("target a list", _set("target", []), "target"),
    ("stats null", _set("stats", None), "stats"),
    ("head_file a number", _set("head_file", 5), "head_file"),
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    cache = tmp_path_factory.mktemp("manifest-shape") / "cache"
    write_cache(cache, make_docs(6, 16), 16, 2, num_shards=2)
    return cache


@pytest.fixture
def cache(pristine, tmp_path):
    import shutil

    copy = tmp_path / "cache"
    shutil.copytree(pristine, copy)
    return copy


def _break(cache, edit) -> None:
    man = json.loads((cache / MANIFEST_FILE).read_text())
    edit(man)
    (cache / MANIFEST_FILE).write_text(json.dumps(man))


@pytest.mark.parametrize("edit,field", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_load_manifest_names_the_broken_field_with_the_rewrite_hint(cache, edit, field):
    _break(cache, edit)
    with pytest.raises(CacheError) as err:
        load_manifest(cache)
    assert err.value.exit_code == 3
    assert str(cache / MANIFEST_FILE) in err.value.message and f"field '{field}'" in err.value.message
    assert "rewrites manifest.json" in err.value.hint
    # the hint's promise: extract, with every shard committed, rewrites the manifest from the sidecars
    try_finalize(cache, load_spec(cache))
    assert verify_cache(cache, decode=True)["shards"] == 2


@pytest.mark.parametrize("edit,field", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
@pytest.mark.parametrize("command", ["verify", "info"])
def test_cache_verify_and_info_exit_3_naming_the_field(cache, edit, field, command, capsys):
    _break(cache, edit)
    with pytest.raises(SystemExit) as ex:
        main(["cache", command, str(cache)])
    err = capsys.readouterr().err
    assert ex.value.code == 3, err
    assert MANIFEST_FILE in err and f"'{field}'" in err and "rewrites manifest.json" in err
    assert "Traceback" not in err


def test_a_shard_entry_error_names_the_shard_file(cache):
    _break(cache, _shard(1, "bytes", drop=True))
    with pytest.raises(CacheError, match=r"shards\[1\]\.bytes.*shard-00001-of-00002\.parquet"):
        load_manifest(cache)
