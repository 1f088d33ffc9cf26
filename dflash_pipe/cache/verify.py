"""`dflash-pipe cache verify`: check every file a cache consists of, naming each problem by file and field.

    cache_spec.json          valid JSON, its fields present, `fingerprint` = hash of `fingerprint_fields`
    manifest.json            the same, its shard list, and the same fingerprint as the spec
    shard-i-of-N.json        every sidecar: valid JSON, the cache's fingerprint, and the size, sha256 and
                             row count the manifest lists for that shard
    target_head.safetensors  readable, the tensors and shapes the spec's target has, the size and
                             sha256 the manifest records (``decode=True``: every value finite)
    resolved_config.toml     valid TOML (the settings of the last extract run; the repair hints use it)
    window.json              a window run's ledger, if any: checksum, fields, the cache's fingerprint
    shard-i-of-N.parquet     present with the recorded size and sha256, the cache's fingerprint in its
                             metadata, the recorded row count; ``decode=True``: every row decodes (page
                             CRCs, zstd frames, lengths). No foreign Parquet files.

Every problem is reported (not just the first) with the action that repairs it; any problem raises
`CacheError` (exit 3). `--recompute K` (extract/recompute.py) additionally reruns K samples through
the target.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..errors import CacheError
from ..io_utils import is_temp_name, safe_child, sha256_file
from .manifest import (MANIFEST_FILE, RESOLVED_FILE, SPEC_FILE, extract_command, load_manifest, load_spec,
                       sidecar_path)
from .reader import ShardReader


@dataclass
class Problem:
    file: Path
    field: str          # "" = the file as a whole
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"{self.file} field '{self.field}'" if self.field else str(self.file)
        return f"{where}: {self.message}\n      fix: {self.fix}"


def verify_cache(cache_dir: str | Path, checksums: bool = True, decode: bool = False) -> dict:
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        raise CacheError(f"{cache_dir}: no such cache directory", "pass the [extract].cache_dir of a run")
    if not (cache_dir / SPEC_FILE).exists() and not (cache_dir / MANIFEST_FILE).exists():
        raise CacheError(f"{cache_dir}: not a dflash-pipe cache (no {SPEC_FILE}, no {MANIFEST_FILE})",
                         "pass the [extract].cache_dir of a run, or run `dflash-pipe extract` first")
    problems: list[Problem] = []
    spec = _spec(cache_dir, problems)
    man = _manifest(cache_dir, spec, problems)
    about = man or spec
    if about is not None:
        _sidecars(cache_dir, about, man, problems)
        head = _head_file(cache_dir, about, man, checksums, decode, problems)
    else:
        head = None
    _resolved_config(cache_dir, problems)
    _window_ledger(cache_dir, spec, problems)
    rows = tokens = 0
    if man is not None:
        rows, tokens = _shards(cache_dir, man, checksums, decode, problems)
    if problems:
        raise CacheError(f"cache {cache_dir} failed verification ({len(problems)} problem(s)):\n  "
                         + "\n  ".join(str(p) for p in problems),
                         "apply each 'fix' above; `dflash-pipe cache verify` again then exits 0")
    return {"shards": len(man["shards"]), "rows": rows, "tokens": tokens, "bytes": man["totals"]["bytes"],
            "fingerprint": man["fingerprint"], "head_file": head,
            "files_checked": [SPEC_FILE, MANIFEST_FILE, RESOLVED_FILE, f"{len(man['shards'])} sidecars",
                              f"{len(man['shards'])} shards"] + ([head["path"]] if head else [])}


def _spec(cache_dir: Path, problems: list[Problem]) -> dict | None:
    path = cache_dir / SPEC_FILE
    try:
        spec = load_spec(cache_dir)
    except CacheError as exc:
        problems.append(Problem(path, _field_of(exc.message), exc.message.split(": ", 1)[-1], exc.hint or ""))
        return None
    if spec is None:
        problems.append(Problem(path, "", "missing", f"rerun {extract_command(cache_dir)}: it rewrites the spec "
                                                     "and keeps the shards committed under the same settings"))
    return spec


def _manifest(cache_dir: Path, spec: dict | None, problems: list[Problem]) -> dict | None:
    path = cache_dir / MANIFEST_FILE
    try:
        man = load_manifest(cache_dir)
    except CacheError as exc:
        problems.append(Problem(path, _field_of(exc.message), exc.message.split(": ", 1)[-1], exc.hint or ""))
        return None
    if spec is not None and spec["fingerprint"] != man["fingerprint"]:
        problems.append(Problem(path, "fingerprint", f"{man['fingerprint'][:12]}... but {SPEC_FILE} has "
                                f"{spec['fingerprint'][:12]}... (the two come from different extractions)",
                                f"rerun {extract_command(cache_dir)} with --overwrite: it extracts the cache again"))
    return man


def _sidecars(cache_dir: Path, about: dict, man: dict | None, problems: list[Problem]) -> None:
    n = about["num_shards"]
    entries = {e.get("index"): e for e in man["shards"]} if man else {}
    for i in range(n):
        path = sidecar_path(cache_dir, i, n)
        redo = f"delete {path} and rerun {extract_command(cache_dir)}: it redoes shard {i} and rewrites the manifest"
        if not path.exists():
            if man is not None:
                problems.append(Problem(path, "", "missing", f"rerun {extract_command(cache_dir)}: it redoes "
                                                             f"shard {i} and rewrites the manifest"))
            continue
        try:
            sc = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(sc, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            problems.append(Problem(path, "", f"not valid JSON ({exc})", redo))
            continue
        if sc.get("fingerprint") != about["fingerprint"]:
            problems.append(Problem(path, "fingerprint", "belongs to a cache with another fingerprint", redo))
            continue
        entry = entries.get(i)
        for key in ("path", "bytes", "sha256", "rows", "tokens"):
            if entry is not None and sc.get(key) != entry.get(key):
                problems.append(Problem(path, key, f"{sc.get(key)!r}, but {MANIFEST_FILE} lists {entry.get(key)!r} "
                                                   f"for shard {i}", redo))


def _head_file(cache_dir: Path, about: dict, man: dict | None, checksums: bool, decode: bool,
               problems: list[Problem]) -> dict | None:
    name = about.get("features", {}).get("head_file")
    if not name:
        return None  # caches written without a head file (synthetic test caches)
    try:
        path = safe_child(cache_dir, name, f"{cache_dir / SPEC_FILE} field features.head_file")
    except CacheError as exc:
        problems.append(Problem(cache_dir / SPEC_FILE, "features.head_file", exc.message, "re-extract the cache "
                                "with --overwrite"))
        return None
    fix = (f"delete {path} and rerun {extract_command(cache_dir)}: it rewrites the head file from the target "
           "and keeps the committed shards")
    if not path.is_file():
        problems.append(Problem(path, "", "missing (stage 2 needs the target's embeddings and lm_head)", fix))
        return None
    before = len(problems)
    size = path.stat().st_size
    record = (man or {}).get("head_file")
    if record is not None:
        if record.get("bytes") != size:
            problems.append(Problem(path, "", f"{size} bytes, {MANIFEST_FILE} field 'head_file.bytes' says "
                                              f"{record.get('bytes')} (truncated or replaced)", fix))
            return None
        if checksums and sha256_file(path) != record.get("sha256"):
            problems.append(Problem(path, "", f"sha256 differs from {MANIFEST_FILE} field 'head_file.sha256' "
                                              "(damaged)", fix))
    _head_tensors(path, about.get("target", {}), decode, fix, problems)
    if len(problems) > before:
        return None
    return {"path": name, "bytes": size, "sha256": (record or {}).get("sha256"),
            "recorded": record is not None}


def _head_tensors(path: Path, target: dict, decode: bool, fix: str, problems: list[Problem]) -> None:
    """The tensors stage 2 reads: embedding [V, H], lm_head [V, H] unless tied, final norm [H]."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as sf:
            meta = sf.metadata() or {}
            shapes = {k: list(sf.get_slice(k).get_shape()) for k in sf.keys()}
            config = json.loads(meta.get("dflash_config", "null"))
            if not isinstance(config, dict):
                problems.append(Problem(path, "dflash_config", "metadata missing: not a dflash-pipe head file", fix))
                return
            V, H = target.get("vocab_size"), target.get("hidden_size")
            want = {"model.embed_tokens.weight": [V, H]}
            if not config.get("tie_word_embeddings", False):
                want["lm_head.weight"] = [V, H]
            if "model.norm.weight" in shapes:
                want["model.norm.weight"] = [H]
            for name, shape in want.items():
                if name not in shapes:
                    problems.append(Problem(path, name, "tensor missing", fix))
                elif None not in shape and shapes[name] != shape:
                    problems.append(Problem(path, name, f"shape {shapes[name]}, the cache's target has {shape}", fix))
            if decode:
                for name in want:
                    if name in shapes and not bool(sf.get_tensor(name).float().isfinite().all()):
                        problems.append(Problem(path, name, "holds NaN or Inf", fix))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a damaged header
        if isinstance(exc, (KeyboardInterrupt, MemoryError)):
            raise
        problems.append(Problem(path, "", f"not a readable safetensors file ({exc})", fix))


def _resolved_config(cache_dir: Path, problems: list[Problem]) -> None:
    path = cache_dir / RESOLVED_FILE
    if not path.exists():
        return
    try:
        tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        problems.append(Problem(path, "", f"not valid TOML ({exc})",
                                f"delete it and rerun `dflash-pipe extract --cache-dir {cache_dir}` with the manifest "
                                "that made this cache (it rewrites the file and resumes)"))


def _window_ledger(cache_dir: Path, spec: dict | None, problems: list[Problem]) -> None:
    """window.json of a window run (`train --passes-per-shard`): its checksum, fields and fingerprint."""
    from .window import ledger_path, load_ledger

    try:
        load_ledger(cache_dir, spec)
    except CacheError as exc:
        problems.append(Problem(ledger_path(cache_dir), _field_of(exc.message), exc.message.split(": ", 1)[-1],
                                exc.hint or ""))


def _shards(cache_dir: Path, man: dict, checksums: bool, decode: bool, problems: list[Problem]) -> tuple[int, int]:
    listed = {Path(e["abs_path"]).name for e in man["shards"]}
    for p in sorted(cache_dir.glob("*.parquet")):
        if p.name not in listed and not is_temp_name(p.name):
            problems.append(Problem(p, "", f"foreign shard (not listed in {MANIFEST_FILE})",
                                    f"move {p.name} out of {cache_dir}"))
    rows = tokens = 0
    for entry in man["shards"]:
        path = Path(entry["abs_path"])
        side = sidecar_path(cache_dir, entry.get("index", 0), man["num_shards"])
        fix = (f"delete {path} and {side} and rerun {extract_command(cache_dir)}: it redoes that shard "
               "and rewrites the manifest")
        if not path.exists():
            problems.append(Problem(path, "", f"missing (manifest lists {entry['rows']} rows)", fix))
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(Problem(path, "", f"{size} bytes, manifest says {entry['bytes']} (truncated or replaced)",
                                    fix))
            continue
        if checksums and sha256_file(path) != entry["sha256"]:
            problems.append(Problem(path, "", "sha256 differs from the manifest (damaged)", fix))
            continue
        try:
            reader = ShardReader(path, expect_fingerprint=man["fingerprint"])
            if reader.num_rows != entry["rows"]:
                problems.append(Problem(path, "", f"{reader.num_rows} rows, manifest says {entry['rows']}", fix))
                continue
            if decode:
                for rg in range(reader.num_row_groups):
                    for row in reader.read_row_group(rg):
                        row.hidden()
                        row.teacher_topk()
            rows += reader.num_rows
            tokens += entry["tokens"]
        except CacheError as exc:
            problems.append(Problem(path, "", exc.message, fix))
    return rows, tokens


def _field_of(message: str) -> str:
    """The field a manifest/spec error names ("...: field 'x' is missing")."""
    if "field '" in message:
        return message.split("field '", 1)[1].split("'", 1)[0]
    return ""

