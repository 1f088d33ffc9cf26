"""bench/regen_seed.py: a GPU run's new regenerated rows out through $OUT and back into the seed, checked."""

from __future__ import annotations

import importlib.util
import json
import lzma
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "bench" / "regen_seed.py"
_spec = importlib.util.spec_from_file_location("regen_seed", SCRIPT)
rs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rs)


def _rows(n: int, start: int = 0) -> list[bytes]:
    return [(json.dumps({"id": f"c{i}#0", "messages": [{"role": "user", "content": "x" * (i % 7)}]}) + "\n").encode()
            for i in range(start, start + n)]


def _seed(tmp: Path, rows: list[bytes]) -> Path:
    seed = tmp / "seed.jsonl.xz"
    seed.write_bytes(lzma.compress(b"".join(rows)))
    (tmp / "seed.progress.json").write_text(json.dumps({"rows_written": len(rows), "generated_tokens": 1}))
    return seed


def test_out_then_merge_rebuilds_the_run_file_and_refuses_overlaps_and_missing_parts(tmp_path, capsys):
    seed_rows, new_rows = _rows(5), _rows(7, start=5)
    run_file = tmp_path / "regenerated.jsonl"
    run_file.write_bytes(b"".join(seed_rows + new_rows) + b'{"id": "c12#0", "mess')   # a killed writer's half line
    parts = rs.write_parts(run_file, skip=5, out=tmp_path / "out", rows_per_file=3, max_files=2)
    assert [p.name for p in parts] == ["regen_rows_0.jsonl.xz", "regen_rows_1.jsonl.xz"]
    assert "1 rows beyond 2 files stay behind" in capsys.readouterr().err        # 7 rows, 2 files of 3
    parts += rs.write_parts(run_file, skip=11, out=tmp_path / "rest", rows_per_file=3, max_files=1)
    sidecar = tmp_path / "regenerated.jsonl.progress.json"
    sidecar.write_text(json.dumps({"rows_written": 12, "generated_tokens": 99, "settings": {"samples": 1}}))

    seed = _seed(tmp_path, seed_rows)
    with pytest.raises(SystemExit, match="11 rows, but .* says 12"):   # a part left out
        rs.merge(seed, parts[:2], sidecar)
    assert lzma.open(seed).read() == b"".join(seed_rows)                # nothing written on refusal
    rs.merge(seed, parts, sidecar)
    assert lzma.open(seed).read() == b"".join(seed_rows + new_rows)     # the run's complete rows, in order
    assert json.loads((tmp_path / "seed.progress.json").read_text())["rows_written"] == 12
    with pytest.raises(SystemExit, match="7 ids appear twice"):          # merged twice
        rs.merge(seed, parts, sidecar)


def test_merge_into_a_seed_that_does_not_exist_yet_starts_it(tmp_path):
    """A data session's regen-more writes a new file: its rows become a new seed, checked the same way."""
    rows = _rows(4)
    run_file = tmp_path / "regenerated-more.jsonl"
    run_file.write_bytes(b"".join(rows))
    parts = rs.write_parts(run_file, skip=0, out=tmp_path / "out", rows_per_file=3, max_files=5,
                           name="regen_more_rows")
    sidecar = tmp_path / "regenerated-more.jsonl.progress.json"
    sidecar.write_text(json.dumps({"rows_written": 4, "generated_tokens": 40}))
    new = tmp_path / "home" / "sample5.jsonl.xz"
    new.parent.mkdir()
    rs.merge(new, parts, sidecar)
    assert lzma.open(new).read() == b"".join(rows)
    assert json.loads((tmp_path / "home" / "sample5.progress.json").read_text())["rows_written"] == 4


def _run_file(tmp: Path, rows: list[bytes], written: int, tokens: int, name: str = "regenerated-more.jsonl") -> Path:
    """A regenerate output as a watch finds it: `rows` appended, the sidecar counting the first `written`."""
    f = tmp / name
    f.write_bytes(b"".join(rows))
    (tmp / (name + ".progress.json")).write_text(json.dumps({"rows_written": written, "generated_tokens": tokens}))
    return f


def test_ship_sends_each_row_once_and_merge_rebuilds_the_file_from_the_parts_that_came_home(tmp_path, capsys):
    """Three watches ship while regen writes; the rows beyond the sidecar's count wait; a ship that has no room
    left sends nothing and loses nothing; merge takes the parts in any order and stops at the last sidecar."""
    rows = _rows(20)
    f = _run_file(tmp_path, rows[:6] + [b'{"id": "c6#0", "mes'], written=5, tokens=50)   # a row being appended
    p1 = rs.ship(f, 0, tmp_path / "call1", "regen_more_rows", rows_per_file=100, max_files=1)
    assert [p.name for p in p1] == ["regen_more_rows_000000000-000000005.tar"]
    assert rs.ship(f, 0, tmp_path / "call1b", "regen_more_rows", 100, 1) == []         # nothing new: nothing sent
    _run_file(tmp_path, rows[:14], written=14, tokens=140)
    assert rs.ship(f, 0, tmp_path / "full", "regen_more_rows", 100, max_files=0) == []  # no room in this $OUT
    p2 = rs.ship(f, 0, tmp_path / "call2", "regen_more_rows", rows_per_file=4, max_files=2)
    assert [p.name for p in p2] == ["regen_more_rows_000000005-000000009.tar", "regen_more_rows_000000009-000000013.tar"]
    assert "1 rows wait for the next ship" in capsys.readouterr().err
    _run_file(tmp_path, rows, written=20, tokens=200)
    p3 = rs.ship(f, 0, tmp_path / "call3", "regen_more_rows", rows_per_file=100, max_files=1)
    assert [p.name for p in p3] == ["regen_more_rows_000000013-000000020.tar"]

    home = tmp_path / "home" / "sample5.jsonl.xz"
    home.parent.mkdir()
    with pytest.raises(SystemExit, match="starts at row 9 and leaves rows 5-9 out"):        # call 2's first part lost
        rs.merge(home, p1 + p2[1:] + p3)
    assert not home.exists()                                                             # nothing written on refusal
    rs.merge(home, p2 + p1)          # calls 1 and 2 home, call 3 lost: up to the last part with its sidecar
    assert lzma.open(home).read() == b"".join(rows[:5])
    assert json.loads((tmp_path / "home" / "sample5.progress.json").read_text())["rows_written"] == 5
    assert "8 rows after row 5 wait for a part with its sidecar" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no part carries its sidecar"):
        rs.merge(home, p2)
    with pytest.raises(SystemExit, match="starts at row 0 and overlaps rows 0-5, which the seed or an earlier part"):
        rs.merge(home, p1 + p2 + p3)
    rs.merge(home, p2 + p3 + p3)     # then the rest (a part given twice counts once): the whole file, in order
    assert lzma.open(home).read() == b"".join(rows)
    assert json.loads((tmp_path / "home" / "sample5.progress.json").read_text())["generated_tokens"] == 200


def test_ship_after_a_seed_skips_the_seed_rows_and_refuses_a_sidecar_ahead_of_the_file(tmp_path):
    rows = _rows(8)
    f = _run_file(tmp_path, rows, written=8, tokens=80, name="regenerated.jsonl")
    parts = rs.ship(f, 6, tmp_path / "out", "regen_rows", 100, 1)          # 6 rows came from the seed
    assert [p.name for p in parts] == ["regen_rows_000000006-000000008.tar"]
    seed = _seed(tmp_path, rows[:6])
    rs.merge(seed, parts)
    assert lzma.open(seed).read() == b"".join(rows)
    with pytest.raises(SystemExit, match="either `ship` parts"):
        rs.merge(seed, parts + [tmp_path / "x.jsonl.xz"], None)
    g = _run_file(tmp_path, rows[:3], written=4, tokens=1, name="broken.jsonl")
    with pytest.raises(SystemExit, match="has 3 complete rows, its sidecar says 4"):
        rs.ship(g, 0, tmp_path / "out2", "regen_rows", 100, 1)
