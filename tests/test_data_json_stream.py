"""The incremental JSON reader recovers exactly the complete elements of truncated arrays.

References are built independently of the reader: for synthetic files we serialise each element
ourselves and know its byte extent, so the expected list is ``json.loads`` of the complete ones
re-joined into an array; for the real ShareGPT file we repair a prefix at the last top-level
``"\\n  }"`` (the file is pretty-printed with indent 2, and literal newlines only occur outside
strings) and ``json.loads`` that.
"""

from __future__ import annotations

import io
import json
import random

import pytest

from dflash_pipe.data.json_stream import iter_json_values, open_json_text
from dflash_pipe.data.sources import embedded_sharegpt_path


def _random_element(rng: random.Random, depth: int = 0):
    """Objects / arrays / strings with the characters that trip naive scanners."""
    tricky = ['"', "\\", "{", "}", "[", "]", ",", "\n", "é", "日本", "😀", "\\u00e9", " ", "\t"]

    def text() -> str:
        return "".join(rng.choice(tricky + ["a", "b", "xyz"]) for _ in range(rng.randint(0, 12)))

    kind = rng.choice(["obj", "obj", "arr", "str"]) if depth < 3 else "str"
    if kind == "str":
        return text()
    if kind == "arr":
        return [rng.choice([text(), rng.randint(-10**6, 10**6), rng.random(), True, None])
                if rng.random() < 0.6 else _random_element(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {text(): (_random_element(rng, depth + 1) if rng.random() < 0.4 else rng.randint(-99, 10**9))
            for _ in range(rng.randint(0, 4))}


def _serialise(elements, rng: random.Random) -> tuple[bytes, list[tuple[int, int]]]:
    """File bytes and each element's [start, end) byte extent."""
    out, extents = bytearray(b"[\n"), []
    for i, el in enumerate(elements):
        part = json.dumps(el, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5).encode("utf-8")
        extents.append((len(out), len(out) + len(part)))
        out += part
        out += b",\n" if i + 1 < len(elements) else b"\n"
    out += b"]\n"
    return bytes(out), extents


def _read(data: bytes, chunk_chars: int):
    text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape", newline="")
    return list(iter_json_values(text, chunk_chars=chunk_chars))


@pytest.mark.parametrize("seed", range(6))
def test_truncated_synthetic_arrays_recover_exactly_the_complete_elements(seed):
    rng = random.Random(seed)
    elements = [_random_element(rng) for _ in range(rng.randint(5, 25))]
    data, extents = _serialise(elements, rng)
    cuts = sorted({rng.randint(1, len(data)) for _ in range(25)} | {len(data)} | {e for _, e in extents})
    for cut in cuts:
        complete = [data[s:e].decode("utf-8") for s, e in extents if e <= cut]
        expected = json.loads("[" + ",".join(complete) + "]")
        inside = any(s < cut < e for s, e in extents)
        for chunk in (3, 64, 1 << 16):
            records = _read(data[:cut], chunk)
            values = [r.value for r in records if r.error is None]
            errors = [r.error for r in records if r.error is not None]
            assert values == expected, (seed, cut, chunk)
            assert errors == (["truncated"] if inside else []), (seed, cut, chunk)


def test_line_numbers_and_indices_match_element_starts():
    rng = random.Random(11)
    elements = [_random_element(rng) for _ in range(30)]
    data, extents = _serialise(elements, rng)
    records = _read(data, 5)
    assert [r.index for r in records] == list(range(1, 31))
    assert [r.line for r in records] == [data[:s].count(b"\n") + 1 for s, _ in extents]


def test_scalars_at_chunk_edges_and_lenient_separators():
    data = b'[12345678901234567890, -1.5e-7, "x,]", true, null\n , {"a": [1, 2]} {"b": 3},, ]'
    for chunk in (1, 2, 3, 7, 100):
        values = [r.value for r in _read(data, chunk)]
        assert values == [12345678901234567890, -1.5e-7, "x,]", True, None, {"a": [1, 2]}, {"b": 3}], chunk


def test_broken_element_is_reported_and_reading_continues():
    good1, good2 = {"id": "a", "v": [1, {"k": "}"}]}, {"id": "b"}
    data = ("[" + json.dumps(good1) + ',\n{"id": "x" "missing": "colon"},\n' + json.dumps(good2) + "]").encode()
    for chunk in (4, 1 << 16):
        records = _read(data, chunk)
        assert [(r.error, r.value) for r in records] == [(None, good1), ("bad_json", None), (None, good2)]
        assert records[1].line == 2
    data = b'["ok", "bad \\q escape", {"a": "]"}, 7]'        # a broken bare string ends at its quote
    for chunk in (3, 1 << 16):
        assert [(r.error, r.value) for r in _read(data, chunk)] == [
            (None, "ok"), ("bad_json", None), (None, {"a": "]"}), (None, 7)]


def test_concatenated_values_bom_and_empty_file():
    data = "\ufeff".encode() + b'{"a": 1}\n{"b": 2}\n'
    assert [r.value for r in _read(data, 3)] == [{"a": 1}, {"b": 2}]
    assert [r.error for r in _read(b"  \n", 4)] == ["bad_json"]
    assert [r.error for r in _read(b'[{"a": 1}] trailing', 4)] == [None, "bad_json"]


def test_invalid_bytes_surface_as_surrogates_inside_strings():
    data = b'[{"t": "ok\xff\xfe"}, {"t": "fine"}]'
    values = [r.value for r in _read(data, 4)]
    assert values[1] == {"t": "fine"}
    with pytest.raises(UnicodeEncodeError):
        values[0]["t"].encode("utf-8")


def _sharegpt_prefix(nbytes: int) -> bytes:
    with open(embedded_sharegpt_path(), "rb") as f:
        return f.read(nbytes)


def test_real_sharegpt_prefix_matches_repaired_json(tmp_path):
    prefix = _sharegpt_prefix(3 << 20)
    cut = prefix.rfind(b"\n  }")
    assert cut > 0
    expected = json.loads(prefix[: cut + 4] + b"\n]")
    assert len(expected) > 50
    path = tmp_path / "head.json"
    path.write_bytes(prefix)
    with open_json_text(str(path)) as text:
        records = list(iter_json_values(text, chunk_chars=1 << 16))
    assert [r.value for r in records if r.error is None] == expected
    truncated_tail = prefix[cut + 4:].strip(b",\n ") != b""
    assert [r.error for r in records if r.error] == (["truncated"] if truncated_tail else [])


def test_whole_embedded_file_yields_every_complete_conversation_and_one_truncated_tail():
    data = embedded_sharegpt_path().read_bytes()
    opened, closed = data.count(b"\n  {"), data.count(b"\n  }")
    with open_json_text(str(embedded_sharegpt_path())) as text:
        records = list(iter_json_values(text))
    values = [r for r in records if r.error is None]
    assert len(values) == closed and opened == closed + 1
    assert [r.error for r in records if r.error] == ["truncated"]
    assert records[-1].error == "truncated"
    assert records[-1].line == data[: data.rfind(b"\n  {") + 1].count(b"\n") + 1
    # the ids, in file order, as a plain text search finds them
    import re
    ids = re.findall(rb'\n  \{\n    "id": "([^"]*)"', data)
    assert [r.value["id"].encode() for r in values] == ids[: len(values)]
