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
