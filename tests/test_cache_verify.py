"""`cache verify` checks every file of a cache, and every repair hint names an action that works.

One tiny real extraction (random tiny Qwen3.5 target) per module; each test damages one file of a
copy, checks that `verify` names that file and field (exit 3), that the commands which read it
refuse with a hint, and then follows the hint literally and checks the cache verifies again.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from dflash_pipe.cache import MANIFEST_FILE, SPEC_FILE, load_manifest, verify_cache
from dflash_pipe.errors import CacheError
from dflash_pipe.extract.pipeline import run_extract
from tests.test_extract_e2e import small_cfg

HEAD = "target_head.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    cache = tmp_path_factory.mktemp("verify") / "cache"
    assert run_extract(small_cfg(cache)).complete
    return cache


@pytest.fixture
def cache(pristine, tmp_path):
    copy = tmp_path / "cache"
    shutil.copytree(pristine, copy, copy_function=shutil.copy2)  # keeps mtimes (the head record's key)
    return copy


def _problems(cache: Path) -> str:
    with pytest.raises(CacheError) as err:
        verify_cache(cache, decode=True)
    assert err.value.exit_code == 3
    return str(err.value)


def _run_hint(hint: str, capsys) -> None:
    """Run the `dflash-pipe extract ...` command a hint names, exactly as written."""
    from dflash_pipe.cli import main

    cmd = re.search(r"`dflash-pipe (extract [^`]*)`", hint)
    assert cmd, hint
    main(shlex.split(cmd.group(1)))  # returns on success, sys.exit(code) otherwise
    capsys.readouterr()


def test_a_complete_cache_verifies_every_file_including_the_head_file(cache):
    report = verify_cache(cache, decode=True)
    assert report["head_file"]["recorded"] and report["head_file"]["path"] == HEAD
    man = load_manifest(cache)
    assert man["head_file"]["bytes"] == (cache / HEAD).stat().st_size and len(man["head_file"]["sha256"]) == 64


def test_invalid_spec_is_named_by_verify_and_info_and_deleting_it_resumes(cache, capsys):
    from dflash_pipe.cache.manifest import init_or_check_spec
    from dflash_pipe.cli import main

    (cache / SPEC_FILE).write_text("{ not json")
    msg = _problems(cache)
    assert f"{cache / SPEC_FILE}: cache spec is not valid JSON" in msg and f"delete {cache / SPEC_FILE}" in msg
    for cmd in (["cache", "info", str(cache)], ["cache", "verify", str(cache)]):
        with pytest.raises(SystemExit) as ex:
            main(cmd)
        assert ex.value.code == 3 and SPEC_FILE in capsys.readouterr().err
    with pytest.raises(CacheError) as err:  # extract refuses -- and says what to do instead of "rerun extract"
        run_extract(small_cfg(cache))
    assert f"delete {cache / SPEC_FILE}" in err.value.hint and "--overwrite" in err.value.hint
    # --overwrite takes a damaged spec like a foreign one (checked without re-extracting everything)
    spare = cache.parent / "spare"
    shutil.copytree(cache, spare)
    assert init_or_check_spec(spare, _fresh_spec(cache), overwrite=True) == "overwritten"
    assert not list(spare.glob("shard-*"))
    # the hint: delete the spec and rerun -> the spec is rewritten, no shard is extracted again
    (cache / SPEC_FILE).unlink()
    again = run_extract(small_cfg(cache))
    assert again.complete and again.shards_done == [] and len(again.shards_skipped) == 3
    verify_cache(cache, decode=True)


def _fresh_spec(cache: Path) -> dict:
    man = json.loads((cache / MANIFEST_FILE).read_text())
    return {k: man[k] for k in ("format", "format_version", "tool_version", "fingerprint", "fingerprint_fields",
                                "target", "features", "num_shards")}


def test_edited_spec_fingerprint_is_named_with_the_field(cache):
    spec = json.loads((cache / SPEC_FILE).read_text())
    spec["fingerprint_fields"]["topk"] = 99
    (cache / SPEC_FILE).write_text(json.dumps(spec))
    msg = _problems(cache)
    assert f"{cache / SPEC_FILE} field 'fingerprint'" in msg and "edited by hand" in msg


def test_damaged_sidecar_is_named_and_deleting_it_redoes_one_shard(cache):
    side = cache / "shard-00001-of-00003.json"
    side.write_text(side.read_text()[:40])
    msg = _problems(cache)
    assert f"{side}: not valid JSON" in msg and f"delete {side}" in msg
    with pytest.raises(CacheError) as err:
        run_extract(small_cfg(cache))
    assert f"delete {side}" in err.value.hint and "redoes that one shard" in err.value.hint
    side.unlink()
    again = run_extract(small_cfg(cache))
    assert again.complete and again.shards_done == [1]
    verify_cache(cache, decode=True)


def test_sidecar_disagreeing_with_the_manifest_names_the_field(cache):
    side = cache / "shard-00002-of-00003.json"
    sc = json.loads(side.read_text())
    sc["sha256"] = "0" * 64
    side.write_text(json.dumps(sc))
    msg = _problems(cache)
    assert f"{side} field 'sha256'" in msg and "manifest.json lists" in msg


def test_damaged_manifest_is_rewritten_by_the_command_its_hint_names(cache, capsys):
    from dflash_pipe.train.loader import CacheIndex

    (cache / MANIFEST_FILE).write_text('{"cut": ')
    msg = _problems(cache)
    assert f"{cache / MANIFEST_FILE}: manifest is not valid JSON" in msg
    with pytest.raises(CacheError) as err:  # what training says
        CacheIndex(cache).refresh()
    assert "resolved_config.toml" in err.value.hint and "rewrites manifest.json" in err.value.hint
    _run_hint(err.value.hint, capsys)
    verify_cache(cache, decode=True)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_head_file_is_named_and_deleting_it_rewrites_it(cache, damage, capsys):
    head = cache / HEAD
    data = bytearray(head.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        head.write_bytes(bytes(data))
        expect = "sha256 differs"
    elif damage == "truncate":
        head.write_bytes(bytes(data[:len(data) // 3]))
        expect = "truncated or replaced"
    else:
        head.unlink()
        expect = "missing"
    msg = _problems(cache)
    assert f"{head}: " in msg and expect in msg and f"delete {head}" in msg
    head.unlink(missing_ok=True)
    hint = msg.split(f"delete {head} and rerun ", 1)[1]
    _run_hint(hint, capsys)
    assert head.exists()
    verify_cache(cache, decode=True)


def test_head_file_with_wrong_tensors_is_named_by_tensor(cache):
    import torch
    from safetensors.torch import save_file

    head = cache / HEAD
    save_file({"model.embed_tokens.weight": torch.zeros(7, 64)}, str(head),
              metadata={"dflash_config": json.dumps({"tie_word_embeddings": False})})
    man = json.loads((cache / MANIFEST_FILE).read_text())
    man.pop("head_file")  # an older cache without the record: the tensors are still checked
    (cache / MANIFEST_FILE).write_text(json.dumps(man))
    msg = _problems(cache)
    assert f"{head} field 'model.embed_tokens.weight': shape [7, 64]" in msg
    assert f"{head} field 'lm_head.weight': tensor missing" in msg


def test_every_problem_is_reported_at_once(cache):
    (cache / SPEC_FILE).write_text("[]")
    (cache / "shard-00000-of-00003.json").write_text("")
    (cache / "resolved_config.toml").write_text("[target\n")
    (cache / "shard-00002-of-00003.parquet").unlink()
    msg = _problems(cache)
    assert "4 problem(s)" in msg
    for name in (SPEC_FILE, "shard-00000-of-00003.json", "resolved_config.toml", "shard-00002-of-00003.parquet"):
        assert str(cache / name) in msg
    assert msg.count("fix: ") == 4


def test_overwrite_also_removes_the_old_targets_head_file(tmp_path):
    """extract writes the head file only when it is absent: --overwrite must not keep another target's."""
    from dflash_pipe.cache import init_or_check_spec, make_spec
    from tests.cache_helpers import fields_for, make_docs, write_cache

    write_cache(tmp_path, make_docs(3, 8), 8, 2, num_shards=1)
    (tmp_path / HEAD).write_bytes(b"the old target's embeddings")
    (tmp_path / "notes.txt").write_text("kept")
    other = make_spec(fields_for(8, 2, "lossless", 4, "another-target"), {}, {}, 1, {})
    assert init_or_check_spec(tmp_path, other, overwrite=True) == "overwritten"
    assert sorted(p.name for p in tmp_path.iterdir()) == [SPEC_FILE, "notes.txt"]
