"""Bring a GPU run's regenerated rows home and make them the next run's regen seed.

The lent GPU machine's disk is gone once it is given back (or goes cold between calls), so the rows regen wrote
beyond its seed must leave in the call that wrote them, in that call's $OUT (at most 8 files of 16 MiB):

    python bench/regen_seed.py out --file /tmp/quality/regenerated.jsonl --skip 43948 --out "$OUT"
        -> $OUT/regen_rows_0.jsonl.xz (the rows after the first --skip; one file of up to --rows-per-file rows)

and here, with the sidecar that came back in results.tar.gz (quality/regenerated.jsonl.progress.json):

    python bench/regen_seed.py merge --seed bench/data/smollm2_all_turns_greedy4.jsonl.xz \\
        --parts DIR/regen_rows_*.jsonl.xz --sidecar DIR/regenerated.jsonl.progress.json

rewrites the seed (xz) and its .progress.json after checking that the rows are the sidecar's: every id once,
as many rows as it says were written.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import sys
from pathlib import Path


def write_parts(file: Path, skip: int, out: Path, rows_per_file: int, max_files: int,
                name: str = "regen_rows") -> list[Path]:
    """Rows of `file` after the first `skip`, xz-compressed in files of `rows_per_file` rows (at most max_files)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(file, "rb") as f:
        rows = [line for line in f if line.endswith(b"\n")][skip:]   # a partial last line is not a row
    parts = []
    for i, start in enumerate(range(0, len(rows), rows_per_file)):
        if i == max_files:
            print(f"regen_seed: {len(rows) - start} rows beyond {max_files} files stay behind", file=sys.stderr)
            break
        p = out / f"{name}_{i}.jsonl.xz"
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_bytes(lzma.compress(b"".join(rows[start:start + rows_per_file]), preset=3))
        os.replace(tmp, p)
        parts.append(p)
    print(f"regen_seed: {len(rows)} rows after the first {skip} in {len(parts)} file(s): "
          + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in parts))
    return parts


def merge(seed: Path, parts: list[Path], sidecar: Path) -> None:
    """seed rows + parts (in the order given: a shell glob sorts them) -> the seed file, checked against the run's
    sidecar, which replaces the seed's own progress file. A seed that does not exist yet starts empty (the first
    rows of a new regen file, e.g. a data session's regen-more)."""
    rows = lzma.open(seed, "rb").read().splitlines(keepends=True) if seed.exists() else []
    for p in parts:
        rows += lzma.open(p, "rb").read().splitlines(keepends=True)
    state = json.loads(sidecar.read_text(encoding="utf-8"))
    ids = [json.loads(r)["id"] for r in rows]
    if len(set(ids)) != len(ids):
        sys.exit(f"regen_seed: {len(ids) - len(set(ids))} ids appear twice: parts overlap the seed?")
    if len(rows) != state["rows_written"]:
        sys.exit(f"regen_seed: {len(rows)} rows, but {sidecar} says {state['rows_written']} were written "
                 "(a part missing, or the sidecar of another call?)")
    side = seed.with_name(seed.name.split(".jsonl")[0] + ".progress.json")
    tmp = seed.with_name(seed.name + ".tmp")
    with lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.writelines(rows)
    os.replace(tmp, seed)
    side.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"regen_seed: {seed} now holds {len(rows)} rows, {state['generated_tokens']:,} generated tokens; "
          f"{side.name} replaced")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("out", help="on the GPU machine: the new rows into $OUT")
    o.add_argument("--file", type=Path, required=True)
    o.add_argument("--skip", type=int, required=True, help="rows the seed already had")
    o.add_argument("--out", type=Path, required=True)
    o.add_argument("--rows-per-file", type=int, default=40000, help="~10 MiB of xz per 40,000 every-turn rows")
    o.add_argument("--max-files", type=int, default=1, help="$OUT takes 8 files: the report's 6, one per regen job")
    o.add_argument("--name", default="regen_rows", help="file names: <name>_<i>.jsonl.xz")
    m = sub.add_parser("merge", help="here: seed + parts -> the new seed")
    m.add_argument("--seed", type=Path, required=True)
    m.add_argument("--parts", type=Path, nargs="+", required=True)
    m.add_argument("--sidecar", type=Path, required=True)
    a = ap.parse_args()
    if a.cmd == "out":
        write_parts(a.file, a.skip, a.out, a.rows_per_file, a.max_files, a.name)
    else:
        merge(a.seed, a.parts, a.sidecar)


if __name__ == "__main__":
    main()
