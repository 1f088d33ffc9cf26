"""Stage 1 reads its source once per rank (shard_docs.py), not once per shard.

The reference is the old path, kept here: every shard re-reads the source and takes every
num_shards-th conversation with `iter_shard`, with its own reader counts. The new reader must
give each shard the same (index, conversation) pairs and the same reader counts, the extraction
must write the same bytes, and the source must be parsed once (or once per memory-bounded group).
"""

import json
from pathlib import Path

import pytest

from dflash_pipe.config import DataConfig
from dflash_pipe.data.sources import load_conversations
from dflash_pipe.data.stats import DataStats
from dflash_pipe.data.tokenize import iter_shard
from dflash_pipe.extract import pipeline, shard_docs
from dflash_pipe.extract.pipeline import run_extract
from dflash_pipe.extract.shard_docs import RankShardReader, ShardDocs
from tests.test_extract_e2e import small_cfg


def _source(path: Path, n: int = 30) -> Path:
    """A JSONL source of embedded ShareGPT chats with malformed rows among them (non-zero reader counts)."""
    lines = []
    for i, conv in enumerate(load_conversations("embedded:sharegpt", max_samples=n)):
        lines.append(json.dumps({"id": conv.sample_id, "messages": conv.messages}))
        if i % 7 == 3:
            lines.append('{"messages": [ broken')  # bad_json
        if i % 11 == 5:
            lines.append(json.dumps({"messages": [{"role": "user", "content": "only a question"}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


class OldPerShardReader:
    """The pre-change data read: a fresh pass over the source for every shard."""

    def __init__(self, data, num_shards, shards, max_held_docs=None):
        self.data, self.num_shards, self.shards = data, num_shards, shards

    @property
    def total_docs(self):
        d = self.data
        n = sum(1 for _ in load_conversations(d.source, d.format, False, DataStats(), d.skip_samples, d.max_samples))
        return sum(len(range(s, n, self.num_shards)) for s in self.shards)

    def take(self, shard):
        d, stats = self.data, DataStats()
        convs = load_conversations(d.source, d.format, d.strict, stats, d.skip_samples, d.max_samples)
        return ShardDocs(shard, list(iter_shard(convs, shard, self.num_shards)), stats)


def _counting(monkeypatch) -> list:
    calls, real = [], shard_docs.load_conversations
    monkeypatch.setattr(shard_docs, "load_conversations", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("cap,passes", [(10_000, 1), (7, 3), (1, 4)])
def test_each_shard_gets_what_a_fresh_per_shard_read_gives(tmp_path, monkeypatch, cap, passes):
    data = DataConfig(source=str(_source(tmp_path / "d.jsonl")), skip_samples=2, max_samples=25)
    mine = [1, 3, 4, 6]  # e.g. one rank's share of 7 shards; sizes 4, 4, 3, 3: cap 7 reads [1], [3, 4], [6]
    calls = _counting(monkeypatch)
    reader = RankShardReader(data, 7, mine, max_held_docs=cap)
    old = OldPerShardReader(data, 7, mine)
    assert reader.total_docs == old.total_docs == sum(len(range(s, 25, 7)) for s in mine)
    for s in mine:
        got, want = reader.take(s), old.take(s)
        assert [(i, c.sample_id, c.messages) for i, c in got.docs] == \
               [(i, c.sample_id, c.messages) for i, c in want.docs], f"shard {s}"
        assert got.stats.to_dict() == want.stats.to_dict()
        assert got.stats.malformed and got.stats.rows > 25  # the whole reader's counts, malformed included
    assert len(calls) == reader.passes == passes  # one parse per group of shards that fits the cap
    with pytest.raises(ValueError, match="already handed out"):
        reader.take(1)


def test_strict_fails_in_the_single_pass_naming_the_row(tmp_path):
    from dflash_pipe.errors import DataError
    data = DataConfig(source=str(_source(tmp_path / "d.jsonl")), strict=True)
    with pytest.raises(DataError, match=r"d\.jsonl:\d+"):
        RankShardReader(data, 4, [0, 1])


def _files(cache: Path) -> dict:
    out = {}
    for p in sorted(cache.glob("shard-*")):
        if p.suffix == ".json":
            sc = json.loads(p.read_text())
            sc["stats"].pop("timing")
            out[p.name] = sc
        else:
            out[p.name] = p.read_bytes()
    return out


def test_cache_is_byte_identical_to_the_per_shard_read_and_parses_the_source_once(tmp_path, monkeypatch):
    src = _source(tmp_path / "d.jsonl", n=16)

    def cfg(cache):
        c = small_cfg(cache, num_shards=4)
        c.data.source, c.data.skip_samples, c.data.max_samples = str(src), 1, 9
        return c

    with monkeypatch.context() as m:
        m.setattr(pipeline, "RankShardReader", OldPerShardReader)
        old = run_extract(cfg(tmp_path / "old"))
    calls = _counting(monkeypatch)
    new = run_extract(cfg(tmp_path / "new"))
    assert old.complete and new.complete and sorted(new.shards_done) == [0, 1, 2, 3]
    assert len(calls) == 1  # one parse for 4 shards (the old path: 4 + 1 for the progress bar)
    a, b = _files(tmp_path / "old"), _files(tmp_path / "new")
    assert sorted(a) == sorted(b) and len(a) == 8
    for name in a:
        assert a[name] == b[name], name
    reader = next(v for k, v in b.items() if k.endswith(".json"))["stats"]["data_reader"]
    assert reader["malformed_total"] > 0
