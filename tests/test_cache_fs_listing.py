"""The local cache filesystem's listing while writers rename temp files into place (cache/fs.py list_sizes)."""

from __future__ import annotations

import os
from pathlib import Path

from dflash_pipe.cache.fs import open_cache_fs


def test_a_file_renamed_between_the_listing_and_its_stat_is_left_out(tmp_path, monkeypatch):
    """The writer's `.shard-*.json.tmp-*` is listed, then renamed into place between two looks at it: the listing
    does not fail (a later listing sees the renamed file). Until session 29 the FileNotFoundError ended a window trainer's
    look for new shards with exit 4 (seen once on a clean-clone CI run, 2 gloo ranks)."""
    (tmp_path / "shard-00000-of-00002.json").write_text("{}")
    temp = tmp_path / ".shard-00001-of-00002.json.tmp-1-2"
    temp.write_text("{}")
    (tmp_path / "sub").mkdir()
    real_stat = Path.stat

    def racing_stat(self, *args, **kwargs):
        st = real_stat(self, *args, **kwargs)
        if self.name == temp.name and os.path.exists(temp):
            os.rename(temp, tmp_path / "shard-00001-of-00002.json")   # the writer commits it right after this look
        return st

    monkeypatch.setattr(Path, "stat", racing_stat)
    sizes = open_cache_fs(tmp_path).list_sizes()             # must not raise
    assert sizes.get("shard-00000-of-00002.json") == 2 and "sub" not in sizes
    monkeypatch.undo()
    assert open_cache_fs(tmp_path).list_sizes().get("shard-00001-of-00002.json") == 2
