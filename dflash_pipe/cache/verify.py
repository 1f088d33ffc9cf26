"""`dflash-pipe cache verify`: check a cache against its manifest, naming every problem found.

Checks, cheapest first: manifest structure and fingerprint, every listed shard present with the
recorded size, no foreign Parquet files in the directory, sha256 of every shard, the shard's
embedded metadata and row count, and (``decode=True``) that every row decodes (page CRCs, zstd
frames, lengths). `--recompute K` (in extract/recompute.py) additionally reruns K samples
through the target.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CacheError
from ..io_utils import is_temp_name, sha256_file
from .manifest import load_manifest
from .reader import ShardReader


def verify_cache(cache_dir: str | Path, checksums: bool = True, decode: bool = False) -> dict:
    cache_dir = Path(cache_dir)
    man = load_manifest(cache_dir)
    problems: list[str] = []
    listed = {Path(e["abs_path"]).name for e in man["shards"]}
    for p in sorted(cache_dir.glob("*.parquet")):
        if p.name not in listed and not is_temp_name(p.name):
            problems.append(f"{p}: foreign shard (not listed in manifest.json)")
    rows = tokens = 0
    for entry in man["shards"]:
        path = Path(entry["abs_path"])
        if not path.exists():
            problems.append(f"{path}: missing (manifest lists {entry['rows']} rows)")
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"{path}: {size} bytes, manifest says {entry['bytes']} (truncated or replaced)")
            continue
        if checksums and sha256_file(path) != entry["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest (damaged)")
            continue
        try:
            reader = ShardReader(path, expect_fingerprint=man["fingerprint"])
            if reader.num_rows != entry["rows"]:
                problems.append(f"{path}: {reader.num_rows} rows, manifest says {entry['rows']}")
                continue
            if decode:
                for rg in range(reader.num_row_groups):
                    for row in reader.read_row_group(rg):
                        row.hidden()
                        row.teacher_topk()
            rows += reader.num_rows
            tokens += entry["tokens"]
        except CacheError as exc:
            problems.append(str(exc))
    if problems:
        raise CacheError(f"cache {cache_dir} failed verification ({len(problems)} problem(s)):\n  "
                         + "\n  ".join(problems), "re-extract the damaged shards: delete them and their .json "
                                                   "sidecars and rerun `dflash-pipe extract` (it resumes)")
    return {"shards": len(man["shards"]), "rows": rows, "tokens": tokens, "bytes": man["totals"]["bytes"],
            "fingerprint": man["fingerprint"]}
