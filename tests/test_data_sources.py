"""Readers, validation, malformed-row accounting, sample ids, selection and the dataset fingerprint."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipe.data import (DataStats, dataset_fingerprint, dataset_identity, iter_conversations,
                              load_conversations, resolve_source)
from dflash_pipe.data.sources import embedded_sharegpt_path
from dflash_pipe.errors import DataError, UsageError

GOOD = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
GOOD_MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]

# (reason, raw JSONL line, field named in the strict error)
BAD_LINES = [
    ("bad_json", b'{"conversations": [}', "<row>"),
    ("invalid_utf8", b'{"text": "caf\xe9 au lait"}', "<row>"),
    ("invalid_utf8", b'{"messages": [{"role": "assistant", "content": "x\\ud800y"}]}', "messages[0].content"),
    ("not_an_object", b'[1, 2, 3]', "<row>"),
    ("missing_field", b'{"prompt": "no known field"}', "conversations|messages|text"),
    ("missing_field", b'{"messages": [{"role": "user"}]}', "messages[0].content"),
    ("bad_message", b'{"conversations": "just a string"}', "conversations"),
    ("bad_message", b'{"conversations": [["human", "hi"]]}', "conversations[0]"),
    ("empty_conversation", b'{"conversations": []}', "conversations"),
    ("unknown_role", b'{"conversations": [{"from": "bing", "value": "x"}, {"from": "gpt", "value": "y"}]}',
     "conversations[0].from"),
    ("non_string_content", b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null}]}',
     "messages[1].content"),
    ("no_assistant_turn", b'{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]}',
     "conversations"),
    ("empty_text", b'{"text": " \\n "}', "text"),
    ("non_string_content", b'{"text": 42}', "text"),
]


def _jsonl(path, lines: list[bytes], final_newline: bool = True):
    path.write_bytes(b"\n".join(lines) + (b"\n" if final_newline else b""))
    return path


def test_each_malformed_reason_is_counted_with_file_and_line(tmp_path):
    good = json.dumps(GOOD).encode()
    lines, expect_lines = [good], []
    for _, raw, _ in BAD_LINES:
        lines += [raw, b"", good]                      # blank lines are not rows
        expect_lines.append(len(lines) - 2)
    lines.append(b'{"conversations": [{"from": "human", "value": "cut')
    path = _jsonl(tmp_path / "rows.jsonl", lines, final_newline=False)
    stats = DataStats(max_examples=100)
    convs = list(iter_conversations(str(path), stats=stats))
    assert len(convs) == len(BAD_LINES) + 1 and all(c.messages == GOOD_MSGS for c in convs)
    expected_counts: dict[str, int] = {"truncated": 1}
    for reason, _, _ in BAD_LINES:
        expected_counts[reason] = expected_counts.get(reason, 0) + 1
    assert stats.malformed == expected_counts
    assert stats.rows == len(BAD_LINES) * 2 + 2 and stats.conversations == len(convs)
    for (reason, _, _), line in zip(BAD_LINES, expect_lines):
        assert any(e.startswith(f"{path}:{line}: {reason}") for e in stats.examples), (reason, line)
    assert stats.examples[-1].startswith(f"{path}:{len(lines)}: truncated")


@pytest.mark.parametrize("reason,raw,field", BAD_LINES, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD_LINES)])
def test_strict_raises_naming_file_line_and_field(tmp_path, reason, raw, field):
    path = _jsonl(tmp_path / "one.jsonl", [json.dumps(GOOD).encode(), b"", raw])
    with pytest.raises(DataError) as exc:
        list(iter_conversations(str(path), strict=True))
    msg = str(exc.value)
    assert f"{path}:3: {reason}" in msg and f"'{field}'" in msg


def test_explicit_format_requires_its_field(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", [json.dumps({"messages": GOOD_MSGS}).encode(), json.dumps(GOOD).encode()])
    stats = DataStats()
    assert [c.line for c in iter_conversations(str(path), format="sharegpt", stats=stats)] == [2]
    assert stats.malformed == {"missing_field": 1}
    with pytest.raises(DataError, match=r"m\.jsonl:1: missing_field in field 'conversations'"):
        list(iter_conversations(str(path), format="sharegpt", strict=True))
    with pytest.raises(UsageError):
        list(iter_conversations(str(path), format="alpaca"))


def test_formats_and_auto_detection_normalise_alike(tmp_path):
    rows = [
        {"id": "s", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "q"},
                                      {"from": "gpt", "value": "a"}]},
        {"id": "o", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "a"}]},
        {"id": "t", "text": "plain document"},
    ]
    path = _jsonl(tmp_path / "mix.jsonl", [json.dumps(r).encode() for r in rows])
    convs = list(iter_conversations(str(path)))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}]
    assert [(c.sample_id, c.messages, c.text, c.line) for c in convs] == [
        ("s", msgs, None, 1), ("o", msgs, None, 2), ("t", [], "plain document", 3)]
    assert convs[2].is_text and not convs[0].is_text


def test_json_array_with_a_broken_element_and_a_truncated_tail(tmp_path):
    body = ("[\n" + json.dumps(GOOD) + ",\n" + '{"conversations": [{"from": "human" "value": "x"}]},\n'
            + json.dumps({**GOOD, "id": "third"}) + ",\n" + '{"conversations": [{"from": "human", "val')
    path = tmp_path / "arr.json"
    path.write_text(body)
    stats = DataStats()
    convs = list(iter_conversations(str(path), stats=stats))
    assert [(c.sample_id, c.line) for c in convs] == [("arr:2", 2), ("third", 4)]
    assert stats.malformed == {"bad_json": 1, "truncated": 1}
    assert [e.split(": ")[0] for e in stats.examples] == [f"{path}:3", f"{path}:5"]


def test_text_files_are_split_into_paragraphs(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"first para\nline two\n\n\n  \nsecond\n\nbad \xff byte\nmore\n\nlast")
    stats = DataStats()
    convs = list(iter_conversations(str(path), stats=stats))
    assert [(c.text, c.line, c.sample_id) for c in convs] == [
        ("first para\nline two", 1, "notes:1"), ("second", 6, "notes:6"), ("last", 11, "notes:11")]
    assert stats.malformed == {"invalid_utf8": 1} and stats.examples[0].startswith(f"{path}:8: invalid_utf8")
    with pytest.raises(UsageError, match="plain text"):
        list(iter_conversations(str(path), format="openai"))


def test_crlf_text_and_parquet_with_both_message_spellings_read_as_their_lf_and_jsonl_twins(tmp_path):
    """Found by session 28's review: CRLF paragraphs kept a '\\r' in every document (tokens trained on), and Parquet
    rows of {role, content} messages beside {from, value} ones came back with from=None and were dropped."""
    (tmp_path / "lf.txt").write_bytes(b"First paragraph,\nline two.\n\nSecond document.\n")
    (tmp_path / "crlf.txt").write_bytes(b"First paragraph,\r\nline two.\r\n\r\nSecond document.\r\n")
    texts = {n: [c.text for c in iter_conversations(str(tmp_path / f"{n}.txt"))] for n in ("lf", "crlf")}
    assert texts["crlf"] == texts["lf"] == ["First paragraph,\nline two.", "Second document."]
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
            {"id": "b", "conversations": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    msg = pa.struct([(k, pa.string()) for k in ("from", "value", "role", "content")])   # every key of the column
    pq.write_table(pa.Table.from_pylist(rows, pa.schema([("id", pa.string()), ("conversations", pa.list_(msg))])),
                   tmp_path / "mixed.parquet")
    got = {n: [(c.sample_id, c.messages) for c in iter_conversations(str(tmp_path / f"mixed.{n}"))]
           for n in ("jsonl", "parquet")}
    assert got["parquet"] == got["jsonl"] and len(got["jsonl"]) == 2


def test_parquet_row_groups_nulls_and_ids(tmp_path):
    conv_type = pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))
    convs = [GOOD["conversations"], None, [{"from": "human", "value": "q"}], GOOD["conversations"], []]
    table = pa.table({"id": ["a", "b", "c", "a", "e"], "conversations": pa.array(convs, conv_type),
                      "text": [None, "doc b", None, None, None]})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=2)
    assert pq.ParquetFile(path).num_row_groups == 3
    stats = DataStats()
    out = list(iter_conversations(str(path), stats=stats))
    assert [(c.sample_id, c.line, c.text) for c in out] == [("a", 1, None), ("b", 2, "doc b"), ("d:4", 4, None)]
    assert out[0].messages == GOOD_MSGS
    assert stats.malformed == {"no_assistant_turn": 1, "empty_conversation": 1}
    raw = pa.array(["fine", "bad??"]).buffers()
    raw_values = raw[2].to_pybytes().replace(b"??", b"\xff\xfe")
    not_utf8 = pa.Array.from_buffers(pa.string(), 2, [None, raw[1], pa.py_buffer(raw_values)])
    pq.write_table(pa.table({"text": not_utf8}), tmp_path / "u.parquet")
    stats = DataStats()
    assert [c.text for c in iter_conversations(str(tmp_path / "u.parquet"), stats=stats)] == ["fine"]
    assert stats.malformed == {"invalid_utf8": 1} and stats.examples[0].startswith(f"{tmp_path}/u.parquet:2:")
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="no 'conversations', 'messages' or 'text' column"):
        list(iter_conversations(str(tmp_path / "bad.parquet")))


def test_directory_order_hidden_files_and_unique_ids(tmp_path):
    root = tmp_path / "data"
    (root / "b").mkdir(parents=True)
    (root / ".hidden").mkdir()
    row = lambda i=None: json.dumps({**GOOD, **({"id": i} if i else {})}).encode()  # noqa: E731
    _jsonl(root / "b" / "x.jsonl", [row("dup"), row()])
    _jsonl(root / "a.jsonl", [row("dup"), row("a:1"), row()])
    _jsonl(root / ".hidden" / "skip.jsonl", [row("never")])
    _jsonl(root / ".a.jsonl.tmp-1-ab", [row("never")])
    (root / "README.md").write_text("not data")
    assert [f.name for f in resolve_source(str(root))] == ["a.jsonl", "b/x.jsonl"]
    ids = [(c.sample_id, c.source, c.line) for c in iter_conversations(str(root))]
    # a.jsonl: 'dup' kept; 'a:1' is a real id; the id-less row 3 -> 'a:3'.
    # b/x.jsonl: 'dup' seen -> fallback 'b/x:1'; id-less row 2 -> 'b/x:2'.
    assert ids == [("dup", f"{root}/a.jsonl", 1), ("a:1", f"{root}/a.jsonl", 2), ("a:3", f"{root}/a.jsonl", 3),
                   ("b/x:1", f"{root}/b/x.jsonl", 1), ("b/x:2", f"{root}/b/x.jsonl", 2)]
    _jsonl(root / "c.jsonl", [row("a:3"), row("a:3")])     # fallbacks collide with earlier ids -> '#k'
    last = [c.sample_id for c in iter_conversations(str(root))][-2:]
    assert last == ["c:1", "c:2"]
    _jsonl(root / "c.jsonl", [row("dup"), row("c:1")])
    (root / "c1.jsonl").write_bytes(row("c:1") + b"\n")
    last = [c.sample_id for c in iter_conversations(str(root))][-3:]
    assert last == ["c:1", "c:2", "c1:1"]


def test_fallback_id_collision_gets_numbered_suffix(tmp_path):
    row = json.dumps({**GOOD, "id": "f:2"}).encode()
    path = _jsonl(tmp_path / "f.jsonl", [row, row])     # second: 'f:2' taken -> fallback 'f:2' taken -> 'f:2#2'
    assert [c.sample_id for c in iter_conversations(str(path))] == ["f:2", "f:2#2"]


def test_select_skip_max_and_ids_independent_of_selection(tmp_path):
    lines = [json.dumps({**GOOD, "id": "same"}).encode() for _ in range(7)] + [b"oops"] * 2
    path = _jsonl(tmp_path / "s.jsonl", lines)
    every = [c.sample_id for c in iter_conversations(str(path))]
    assert len(set(every)) == 7
    for skip, most in [(0, 0), (2, 3), (5, 0), (6, 10), (9, 1)]:
        got = [c.sample_id for c in load_conversations(str(path), skip_samples=skip, max_samples=most)]
        assert got == every[skip: skip + most if most else None]
    with pytest.raises(UsageError):
        list(load_conversations(str(path), skip_samples=-1))


def test_fingerprint_is_content_based_and_selection_sensitive(tmp_path):
    src = tmp_path / "one"
    src.mkdir()
    _jsonl(src / "a.jsonl", [json.dumps(GOOD).encode()])
    (src / "b.txt").write_text("doc")
    fp = dataset_fingerprint(str(src))
    copy = tmp_path / "elsewhere" / "two"
    shutil.copytree(src, copy)
    os.utime(copy / "a.jsonl", (1_000_000, 1_000_000))
    assert dataset_fingerprint(str(copy)) == fp
    assert dataset_fingerprint(str(src), skip_samples=1) != fp
    assert dataset_fingerprint(str(src), max_samples=5) != fp
    assert dataset_fingerprint(str(src), format="text") != fp
    (copy / "b.txt").write_text("dog")                         # same size, different content
    assert dataset_fingerprint(str(copy)) != fp
    ident = dataset_identity(str(src))
    assert [f["name"] for f in ident["files"]] == ["a.jsonl", "b.txt"]
    assert str(tmp_path) not in json.dumps(ident)


def test_embedded_sharegpt_conversations_match_an_independent_parse():
    with open(embedded_sharegpt_path(), "rb") as f:
        prefix = f.read(2 << 20)
    reference = json.loads(prefix[: prefix.rfind(b"\n  }") + 4] + b"\n]")
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    expected = []
    for el in reference:
        turns = el["conversations"]
        if not turns or any(t["from"] not in roles for t in turns):
            continue
        msgs = [{"role": roles[t["from"]], "content": t["value"]} for t in turns]
        if any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
            expected.append((el["id"], msgs))
    got = [(c.sample_id, c.messages) for c in load_conversations("embedded:sharegpt", max_samples=len(expected))]
    assert len(expected) > 40 and got == expected   # (no duplicate ids this early in the file)
    assert got[0][1][0]["content"].startswith("Summarize the main ideas of Jeff Walker")


def test_gzip_jsonl_reads_like_the_plain_file_and_a_cut_stream_is_named(tmp_path):
    import gzip

    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                         {"role": "assistant", "content": f"a{i}"}]} for i in range(50)]
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "plain.jsonl").write_bytes(text)
    (tmp_path / "packed.jsonl.gz").write_bytes(gzip.compress(text))
    plain = [(c.sample_id, c.messages, c.line) for c in iter_conversations(str(tmp_path / "plain.jsonl"))]
    packed = [(c.sample_id, c.messages, c.line) for c in iter_conversations(str(tmp_path / "packed.jsonl.gz"))]
    assert packed == plain and len(plain) == 50
    blob = gzip.compress(text)
    (tmp_path / "cut.jsonl.gz").write_bytes(blob[: len(blob) // 2])   # a copy that stopped half-way
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: the gzip stream is damaged after line \d+"):
        list(iter_conversations(str(tmp_path / "cut.jsonl.gz")))
    (tmp_path / "x.gz").write_bytes(blob)
    with pytest.raises(UsageError, match="unsupported file type"):
        list(iter_conversations(str(tmp_path / "x.gz")))
