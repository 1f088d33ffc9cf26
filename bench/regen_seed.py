"""Bring a GPU run's regenerated rows home and make them the next run's regen seed.

The lent GPU machine's disk is gone once it is given back (or goes cold between calls), so the rows regen wrote
beyond its seed must leave in the calls that run while it writes them, in each call's $OUT (at most 8 files of
16 MiB). On the GPU machine, as often as a call can (bench/quality_gpu.sh: every `watch`, and at a regen job's end):

    python bench/regen_seed.py ship --file /tmp/quality/regenerated-more.jsonl --seed-rows 0 --out "$OUT" \
        --name regen_more_rows
        -> $OUT/regen_more_rows_000000000-000020480.tar: the rows written since the last ship (as far as the
           run's progress sidecar counts them) as rows.jsonl.xz, with that sidecar as progress.json

Rows are shipped once: <file>.shipped remembers how far, under a lock (the daemon's end-of-job ship and a watch's
may race). Here, with every part that came home:

    python bench/regen_seed.py merge --seed bench/data/smollm2_all_turns_sample5_8.jsonl.xz \
        --parts /work/.device/*/regen_more_rows_*.tar

rewrites the seed (xz) and its .progress.json from the parts that continue it without a gap, up to the last one
that carries its sidecar: every id once, as many rows as that sidecar says were written. A lost machine so costs
the rows of its last call, not the session's. (Parts of the older `out` command, <name>_<i>.jsonl.xz with the
sidecar from results.tar.gz: `merge --seed ... --parts ... --sidecar ...`.)
"""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import lzma
import os
import re
import sys
import tarfile
from pathlib import Path


def _complete_rows(file: Path, upto: int | None = None) -> list[bytes]:
    """The first `upto` (None: all) complete lines of `file` (a writer may be appending behind them)."""
    rows = []
    with open(file, "rb") as f:
        for line in f:
            if len(rows) == upto or not line.endswith(b"\n"):
                break
            rows.append(line)
    return rows


def write_parts(file: Path, skip: int, out: Path, rows_per_file: int, max_files: int,
                name: str = "regen_rows") -> list[Path]:
    """Rows of `file` after the first `skip`, xz-compressed in files of `rows_per_file` rows (at most max_files)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = _complete_rows(file)[skip:]                   # a partial last line is not a row
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


def ship(file: Path, seed_rows: int, out: Path, name: str, rows_per_file: int, max_files: int) -> list[Path]:
    """The rows of `file` written since the last ship (or since its first `seed_rows`), up to what its progress
    sidecar counts, into `out` as <name>_<start>-<end>.tar parts; the last part of a ship that reached the sidecar's
    count carries the sidecar. Safe beside a running regenerate (it appends whole rows, then updates the sidecar)
    and beside another ship (a lock; <file>.shipped says how far)."""
    side = file.with_name(file.name + ".progress.json")
    if max_files < 1 or not side.exists():
        return []
    marker = file.with_name(file.name + ".shipped")
    with open(file.with_name(file.name + ".ship.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state_bytes = side.read_bytes()                  # replaced atomically by regenerate: one consistent state
        written = int(json.loads(state_bytes)["rows_written"])
        start = int(marker.read_text()) if marker.exists() else seed_rows
        if written <= start:
            return []
        rows = _complete_rows(file, written)[start:]
        if len(rows) != written - start:
            sys.exit(f"regen_seed: {file} has {start + len(rows)} complete rows, its sidecar says {written}")
        out.mkdir(parents=True, exist_ok=True)
        parts = []
        for i in range(0, len(rows), rows_per_file):
            if len(parts) == max_files:
                print(f"regen_seed: {len(rows) - i} rows wait for the next ship ({max_files} file(s) this time)",
                      file=sys.stderr)
                break
            chunk = rows[i:i + rows_per_file]
            a, b = start + i, start + i + len(chunk)
            p = out / f"{name}_{a:09d}-{b:09d}.tar"
            tmp = p.with_name(p.name + ".tmp")
            with tarfile.open(tmp, "w") as t:
                members = [("rows.jsonl.xz", lzma.compress(b"".join(chunk), preset=3))]
                if b == written:
                    members.append(("progress.json", state_bytes))
                for member, data in members:
                    info = tarfile.TarInfo(member)
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
            os.replace(tmp, p)
            parts.append(p)
            marker.write_text(str(b))                        # shipped: a later ship starts after it
        print(f"regen_seed: shipped rows {start}-{b} of {file.name} (the sidecar counts {written}) in "
              f"{len(parts)} file(s): " + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in parts))
        return parts


def _part_range(p: Path) -> tuple[int, int]:
    m = re.search(r"_(\d{9})-(\d{9})\.tar$", p.name)
    if not m:
        sys.exit(f"regen_seed: {p}: not a part of `ship` (<name>_<start>-<end>.tar)")
    return int(m.group(1)), int(m.group(2))


def _read_tar_parts(parts: list[Path], first: int) -> tuple[list[bytes], dict]:
    """Rows of the `ship` parts that continue row `first` without a gap, up to the last one with its sidecar."""
    rows, state, at = [], None, first
    pending: list[bytes] = []
    seen: dict[tuple[int, int], bytes] = {}
    for p in sorted(parts, key=_part_range):
        a, b = _part_range(p)
        blob = p.read_bytes()
        if seen.get((a, b)) == blob:
            continue                                     # the same part twice (two copies of one call's $OUT)
        seen[(a, b)] = blob
        if a != at:
            what = (f"overlaps rows {a}-{min(b, at)}, which the seed or an earlier part holds" if a < at
                    else f"leaves rows {at}-{a} out (a part missing?)")
            sys.exit(f"regen_seed: {p} starts at row {a} and {what} (the seed has {first} rows)")
        with tarfile.open(fileobj=io.BytesIO(blob)) as t:
            chunk = lzma.decompress(t.extractfile("rows.jsonl.xz").read()).splitlines(keepends=True)
            names = t.getnames()
            side = json.loads(t.extractfile("progress.json").read()) if "progress.json" in names else None
        if len(chunk) != b - a:
            sys.exit(f"regen_seed: {p.name} holds {len(chunk)} rows, its name says {b - a}")
        pending += chunk
        at = b
        if side is not None:
            rows, pending, state = rows + pending, [], side
    if state is None:
        sys.exit("regen_seed: no part carries its sidecar (progress.json): nothing can be merged yet")
    if pending:
        print(f"regen_seed: {len(pending)} rows after row {at - len(pending)} wait for a part with its sidecar",
              file=sys.stderr)
    return rows, state


def merge(seed: Path, parts: list[Path], sidecar: Path | None = None) -> None:
    """seed rows + parts -> the seed file, checked against the run's sidecar, which replaces the seed's own
    progress file. `ship` parts (.tar) carry their sidecars and row ranges; `out` parts (.jsonl.xz, in the order
    given: a shell glob sorts them) need the run's sidecar. A seed that does not exist yet starts empty (the first
    rows of a new regen file, e.g. a data session's regen-more)."""
    rows = lzma.open(seed, "rb").read().splitlines(keepends=True) if seed.exists() else []
    tars = [p for p in parts if p.name.endswith(".tar")]
    if tars and len(tars) != len(parts):
        sys.exit("regen_seed: merge either `ship` parts (.tar) or `out` parts (.jsonl.xz), not both")
    if tars:
        new, state = _read_tar_parts(tars, len(rows))
        rows += new
    else:
        if sidecar is None:
            sys.exit("regen_seed: `out` parts (.jsonl.xz) need --sidecar (the run's regenerated*.progress.json)")
        for p in parts:
            rows += lzma.open(p, "rb").read().splitlines(keepends=True)
        state = json.loads(sidecar.read_text(encoding="utf-8"))
    ids = [json.loads(r)["id"] for r in rows]
    if len(set(ids)) != len(ids):
        sys.exit(f"regen_seed: {len(ids) - len(set(ids))} ids appear twice: parts overlap the seed?")
    if len(rows) != state["rows_written"]:
        sys.exit(f"regen_seed: {len(rows)} rows, but the sidecar says {state['rows_written']} were written "
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
    sh = sub.add_parser("ship", help="on the GPU machine: the rows written since the last ship into $OUT")
    sh.add_argument("--file", type=Path, required=True, help="the run's regenerated*.jsonl")
    sh.add_argument("--seed-rows", type=int, default=0, help="rows the seed already had (never shipped)")
    sh.add_argument("--out", type=Path, required=True)
    sh.add_argument("--name", default="regen_rows", help="file names: <name>_<start>-<end>.tar")
    sh.add_argument("--rows-per-file", type=int, default=40000, help="~10 MiB of xz per 40,000 every-turn rows")
    sh.add_argument("--max-files", type=int, default=1, help="what the call's $OUT has room for (8 files in all)")
    o = sub.add_parser("out", help="(older) the rows after --skip into $OUT, without their sidecar")
    o.add_argument("--file", type=Path, required=True)
    o.add_argument("--skip", type=int, required=True, help="rows the seed already had")
    o.add_argument("--out", type=Path, required=True)
    o.add_argument("--rows-per-file", type=int, default=40000, help="~10 MiB of xz per 40,000 every-turn rows")
    o.add_argument("--max-files", type=int, default=1, help="$OUT takes 8 files: the report's 6, one per regen job")
    o.add_argument("--name", default="regen_rows", help="file names: <name>_<i>.jsonl.xz")
    m = sub.add_parser("merge", help="here: seed + parts -> the new seed")
    m.add_argument("--seed", type=Path, required=True)
    m.add_argument("--parts", type=Path, nargs="+", required=True)
    m.add_argument("--sidecar", type=Path, help="the run's sidecar (only for `out` parts; `ship` parts carry it)")
    a = ap.parse_args()
    if a.cmd == "ship":
        ship(a.file, a.seed_rows, a.out, a.name, a.rows_per_file, a.max_files)
    elif a.cmd == "out":
        write_parts(a.file, a.skip, a.out, a.rows_per_file, a.max_files, a.name)
    else:
        merge(a.seed, a.parts, a.sidecar)


if __name__ == "__main__":
    main()
