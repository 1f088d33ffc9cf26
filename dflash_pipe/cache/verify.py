"""`dflash-pipe cache verify`: check a cache against its manifest, naming every problem found.

Checks, cheapest first: manifest structure and fingerprint, every listed shard present with the
recorded size, no foreign Parquet files in the directory, sha256 of every shard, the shard's
embedded metadata and row count, and (``decode=True``) that every row decodes (page CRCs, zstd
frames, lengths). On object storage it also reports incomplete multipart uploads under the prefix
(a killed writer's; invisible to readers, they only cost storage until aborted). `--recompute K`
(in extract/recompute.py) additionally reruns K samples through the target.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from ..errors import CacheError
from ..io_utils import is_temp_name, sha256_file
from .fs import CacheFS, open_cache_fs
from .manifest import load_manifest
from .reader import ShardReader

log = logging.getLogger("dflash_pipe.cache.verify")


def _sha256(fs: CacheFS, name: str, chunk: int = 8 << 20) -> str:
    if fs.is_local:
        return sha256_file(fs.path(name))

    def digest():
        h = hashlib.sha256()
        with fs.fs.open_input_stream(fs.key(name)) as f:
            while block := f.read(chunk):
                h.update(block)
        return h.hexdigest()
    return fs.call(f"reading {fs.display(name)}", digest)


def verify_cache(cache_dir: str | Path | CacheFS, checksums: bool = True, decode: bool = False) -> dict:
    fs = open_cache_fs(cache_dir)
    man = load_manifest(fs)
    problems: list[str] = []
    names = {e["abs_path"]: str(e["path"]) for e in man["shards"]}
    listed = {Path(n).name for n in names.values()}
    sizes = fs.list_sizes()
    for name in sorted(sizes):
        if name.endswith(".parquet") and name not in listed and not is_temp_name(name):
            problems.append(f"{fs.display(name)}: foreign shard (not listed in manifest.json)")
    rows = tokens = 0
    for entry in man["shards"]:
        path, name = entry["abs_path"], names[entry["abs_path"]]
        size = sizes.get(name) if "/" not in name else fs.size(name)
        if size is None:
            problems.append(f"{path}: missing (manifest lists {entry['rows']} rows)")
            continue
        if size != entry["bytes"]:
            problems.append(f"{path}: {size} bytes, manifest says {entry['bytes']} (truncated or replaced)")
            continue
        if checksums and _sha256(fs, name) != entry["sha256"]:
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
    stale = fs.incomplete_uploads()  # reported, not a failure: the data is whole; they only cost storage
    if stale:
        log.warning("%d incomplete upload(s) under %s (killed writers; invisible to readers): %s; abort them or "
                    "set a lifecycle rule (AbortIncompleteMultipartUpload)", len(stale), fs.uri, ", ".join(stale[:5]))
    if problems:
        raise CacheError(f"cache {fs.uri} failed verification ({len(problems)} problem(s)):\n  "
                         + "\n  ".join(problems), "re-extract the damaged shards: delete them and their .json "
                                                   "sidecars and rerun `dflash-pipe extract` (it resumes)")
    report = {"shards": len(man["shards"]), "rows": rows, "tokens": tokens, "bytes": man["totals"]["bytes"],
              "fingerprint": man["fingerprint"]}
    if not fs.is_local:
        report["incomplete_uploads"] = "unknown (listing them needs boto3)" if stale is None else stale
    return report
