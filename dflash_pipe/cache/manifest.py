"""Cache provenance: the spec written first, per-shard sidecars, and the manifest written last.

    cache_spec.json            what this cache is (fingerprint + the fields it hashes, target,
                               features, shard count). Written before the first shard; a rerun
                               with a different fingerprint is refused, naming the fields.
    shard-i-of-N.parquet       the data (see schema.py)
    shard-i-of-N.json          sidecar = partial index of one shard, written after its rename
    manifest.json              merge of all sidecars; exists only once every shard is committed.

Like the index of a streaming dataset, the manifest lists every shard with its size, row and
token counts and sha256; it is written after the shards, so its presence means "complete".
Each process merges what it sees (the merge is deterministic and idempotent), refusing
sidecars whose fingerprint or settings disagree with the spec.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import CacheError, FingerprintMismatch
from ..io_utils import atomic_write_json, remove_stale_temps, safe_child, sha256_file, sha256_json
from .schema import FORMAT_VERSION, shard_name
from .writer import ShardInfo

SPEC_FILE = "cache_spec.json"
MANIFEST_FILE = "manifest.json"
HEAD_FILE = "target_head.safetensors"       # the target's embeddings + lm_head (extract writes it when absent)
RESOLVED_FILE = "resolved_config.toml"   # the settings of the last extract run (config.write_resolved)
SPEC_KEYS = ("fingerprint", "fingerprint_fields", "features", "target", "num_shards")
LAYER_CONVENTION = "0-based decoder layer index; feature = that layer's output = HF output_hidden_states[id + 1]"


def fingerprint_of(fields: dict[str, Any]) -> str:
    return sha256_json(fields)


def diff_fields(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    keys = sorted(set(old) | set(new))
    return {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}


def extract_command(cache_dir: Path) -> str:
    """The extract command line that resumes this cache with the settings it was made with."""
    cache_dir = Path(cache_dir)
    if (cache_dir / RESOLVED_FILE).is_file():
        return f"`dflash-pipe extract -m {cache_dir / RESOLVED_FILE} --cache-dir {cache_dir}`"
    return f"`dflash-pipe extract --cache-dir {cache_dir}` with the manifest that made this cache"


def spec_hint(cache_dir: Path) -> str:
    return (f"delete {Path(cache_dir) / SPEC_FILE} and rerun {extract_command(cache_dir)}: it rewrites the spec "
            "and keeps the shards committed under the same settings (or add --overwrite to extract the cache "
            "again from scratch)")


def sidecar_hint(path: Path) -> str:
    return f"delete {path} and rerun {extract_command(path.parent)}: it redoes that one shard"


def manifest_hint(cache_dir: Path) -> str:
    return (f"rerun {extract_command(cache_dir)}: with every shard committed it only rewrites {MANIFEST_FILE} "
            "from the shard sidecars")


def _read_json(path: Path, what: str, hint: str) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CacheError(f"{path}: {what} is not valid JSON ({exc})", hint) from None
    if not isinstance(obj, dict):
        raise CacheError(f"{path}: {what} must be a JSON object", hint)
    return obj


def make_spec(fingerprint_fields: dict, target: dict, features: dict, num_shards: int, extra: dict) -> dict:
    return {"format": "dflash-pipe-cache", "format_version": FORMAT_VERSION, "tool_version": __version__,
            "fingerprint": fingerprint_of(fingerprint_fields), "fingerprint_fields": fingerprint_fields,
            "target": target, "features": features, "num_shards": num_shards, **extra}


def load_spec(cache_dir: str | Path) -> dict | None:
    """The cache spec, or None if there is none; a damaged one (not JSON, a field missing, the
    fingerprint not matching its fields) is refused with a hint that works."""
    cache_dir = Path(cache_dir)
    path = cache_dir / SPEC_FILE
    try:
        spec = _read_json(path, "cache spec", spec_hint(cache_dir))
    except FileNotFoundError:
        return None
    for key in SPEC_KEYS:
        if key not in spec:
            raise CacheError(f"{path}: field '{key}' is missing", spec_hint(cache_dir))
    if not isinstance(spec["fingerprint_fields"], dict) or fingerprint_of(spec["fingerprint_fields"]) != spec["fingerprint"]:
        raise CacheError(f"{path}: field 'fingerprint' does not match 'fingerprint_fields' (edited by hand?)",
                         spec_hint(cache_dir))
    if not isinstance(spec["num_shards"], int) or spec["num_shards"] < 1:
        raise CacheError(f"{path}: field 'num_shards' must be a positive integer, not {spec['num_shards']!r}",
                         spec_hint(cache_dir))
    return spec


def mismatch_error(cache_dir: Path, old_fields: dict, new_fields: dict) -> FingerprintMismatch:
    diff = diff_fields(old_fields, new_fields)
    lines = "\n".join(f"    {k}: cache has {a!r}, this run has {b!r}" for k, (a, b) in diff.items())
    return FingerprintMismatch(
        f"cache {cache_dir} was extracted with different settings:\n{lines}", diff,
        "use a new --cache-dir, or pass --overwrite to delete this cache and extract again")


def init_or_check_spec(cache_dir: str | Path, spec: dict, overwrite: bool = False) -> str:
    """Create the spec, or check the existing one. Returns 'new' | 'match' | 'overwritten'."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        old = load_spec(cache_dir)
    except CacheError:
        if not overwrite:
            raise
        old = {}  # a damaged spec: --overwrite deletes the cache like any other
    if old and old.get("fingerprint") == spec["fingerprint"]:
        if old.get("num_shards") != spec["num_shards"]:
            raise CacheError(f"{cache_dir}: spec says {old.get('num_shards')} shards, this run {spec['num_shards']}")
        return "match"
    if old is not None and not overwrite:
        raise mismatch_error(cache_dir, old.get("fingerprint_fields", {}), spec["fingerprint_fields"])
    status = "new"
    if old is not None:
        delete_cache_files(cache_dir)
        status = "overwritten"
    atomic_write_json(cache_dir / SPEC_FILE, spec)
    return status


def delete_cache_files(cache_dir: Path) -> None:
    """Remove what extract writes (and nothing else the user may keep there)."""
    for p in cache_dir.iterdir():
        # the head file too: extract only writes it when absent, so another target's would be kept
        if p.name in (SPEC_FILE, MANIFEST_FILE, HEAD_FILE) or (p.name.startswith("shard-")
                                                               and p.suffix in (".parquet", ".json")):
            p.unlink()
    remove_stale_temps(cache_dir)


def sidecar_path(cache_dir: Path, index: int, num_shards: int) -> Path:
    return cache_dir / shard_name(index, num_shards).replace(".parquet", ".json")


def write_sidecar(cache_dir: str | Path, spec: dict, info: ShardInfo, stats: dict) -> None:
    cache_dir = Path(cache_dir)
    sidecar = {"fingerprint": spec["fingerprint"], "num_shards": spec["num_shards"], **asdict(info), "stats": stats}
    atomic_write_json(sidecar_path(cache_dir, info.index, spec["num_shards"]), sidecar)


def committed_shards(cache_dir: str | Path, spec: dict) -> dict[int, dict]:
    """Shards whose file and sidecar both exist and agree (size, fingerprint). Others are redone.

    A shard that a window run has consumed (window.json says `deleted`) has only its sidecar left and
    still counts as committed (entry field "deleted": true): extraction must not redo it."""
    from .window import load_ledger

    cache_dir = Path(cache_dir)
    out: dict[int, dict] = {}
    n = spec["num_shards"]
    missing: dict[int, dict] = {}
    for i in range(n):
        side = sidecar_path(cache_dir, i, n)
        if not side.exists():
            continue
        sc = _read_json(side, "shard sidecar", sidecar_hint(side))
        if sc.get("fingerprint") != spec["fingerprint"]:
            raise CacheError(f"{side}: belongs to a cache with another fingerprint",
                             "a foreign shard was copied here; remove it or use --overwrite")
        data = safe_child(cache_dir, sc.get("path", ""), f"{side} field 'path'")
        if data.exists() and data.stat().st_size == sc.get("bytes"):
            out[i] = sc
        elif not data.exists():
            missing[i] = sc
    # read the ledger after looking at the files: the trainer marks a shard deleted before it unlinks it,
    # so every file seen missing above was either consumed by then or never committed
    ledger = load_ledger(cache_dir, spec)
    consumed = ledger.deleted_indices() if ledger is not None else set()
    for i, sc in missing.items():
        if i in consumed:
            out[i] = {**sc, "deleted": True}
    return dict(sorted(out.items()))


def try_finalize(cache_dir: str | Path, spec: dict) -> dict | None:
    """If every shard is committed, merge the sidecars into manifest.json (idempotent)."""
    cache_dir = Path(cache_dir)
    shards = committed_shards(cache_dir, spec)
    if len(shards) < spec["num_shards"]:
        return None
    entries = [shards[i] for i in range(spec["num_shards"])]
    totals: dict[str, Any] = {k: sum(e[k] for e in entries)
                              for k in ("rows", "tokens", "supervised_tokens", "bytes", "raw_feature_bytes")}
    totals["compression_ratio"] = totals["bytes"] / max(1, totals["raw_feature_bytes"])
    stats = merge_stats([e.get("stats", {}) for e in entries])
    # every shard's pass reads the whole input, so reader-level counts are the same in each sidecar
    if "data_reader" in entries[0].get("stats", {}):
        stats["data_reader"] = entries[0]["stats"]["data_reader"]
    rms = stats.get("feature_rms", {})
    if rms:
        stats["feature_rms_mean"] = {k.replace("_rms_x_tokens", ""): v / max(1, totals["tokens"])
                                     for k, v in rms.items()}
    manifest = {**spec, "complete": True, "layer_convention": LAYER_CONVENTION,
                "shards": [{k: e[k] for k in ("path", "index", "rows", "tokens", "supervised_tokens", "bytes",
                                              "sha256", "row_groups", "raw_feature_bytes", "doc_indices_sha256")}
                           for e in entries],
                "totals": totals, "stats": stats}
    old = None
    try:
        old = _read_json(cache_dir / MANIFEST_FILE, "manifest", "")
    except (FileNotFoundError, CacheError):
        pass  # none yet, or damaged: it is rewritten from the sidecars below
    head = head_file_record(cache_dir, spec, (old or {}).get("head_file"))
    if head is not None:
        manifest["head_file"] = head
    if old != manifest:
        atomic_write_json(cache_dir / MANIFEST_FILE, manifest)
    return manifest


def head_file_record(cache_dir: Path, spec: dict, old: dict | None) -> dict | None:
    """Size and sha256 of the target head file for the manifest (`cache verify` checks them). The
    old manifest's sha256 is kept while size and mtime are unchanged (hashing a 27B target's 5 GB head
    on every finalize would cost seconds per rank); None for caches without a head file."""
    name = spec.get("features", {}).get("head_file")
    if not name:
        return None
    path = safe_child(cache_dir, name, f"{cache_dir / SPEC_FILE} field features.head_file")
    if not path.is_file():
        return None
    st = path.stat()
    if (isinstance(old, dict) and old.get("path") == name and old.get("bytes") == st.st_size
            and old.get("mtime_ns") == st.st_mtime_ns and old.get("sha256")):
        return old
    return {"path": name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


def merge_stats(parts: list[dict]) -> dict:
    """Sum counters, take min/max of *_min/*_max, concatenate short example lists."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            if isinstance(v, dict):
                out[k] = merge_stats([out.get(k, {}), v])
            elif isinstance(v, list):
                out[k] = (out.get(k, []) + v)[:20]
            elif k.endswith("_min"):
                out[k] = min(out.get(k, v), v)
            elif k.endswith("_max"):
                out[k] = max(out.get(k, v), v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    return out


def load_manifest(cache_dir: str | Path) -> dict:
    """Read and structurally validate manifest.json (paths stay inside the cache dir)."""
    cache_dir = Path(cache_dir)
    path = cache_dir / MANIFEST_FILE
    try:
        man = _read_json(path, "manifest", manifest_hint(cache_dir))
    except FileNotFoundError:
        hint = ("extraction has not finished (or was interrupted): rerun `dflash-pipe extract` to resume"
                if (cache_dir / SPEC_FILE).exists() else "run `dflash-pipe extract` first or fix --cache-dir")
        raise CacheError(f"{cache_dir}: no {MANIFEST_FILE}", hint) from None
    for key in ("fingerprint", "fingerprint_fields", "features", "target", "shards", "num_shards"):
        if key not in man:
            raise CacheError(f"{path}: field '{key}' is missing", manifest_hint(cache_dir))
    if man.get("format_version") != FORMAT_VERSION:
        raise CacheError(f"{path}: format_version {man.get('format_version')} is not {FORMAT_VERSION}",
                         "this cache was written by another dflash-pipe version; re-extract it")
    if fingerprint_of(man["fingerprint_fields"]) != man["fingerprint"]:
        raise CacheError(f"{path}: field 'fingerprint' does not match 'fingerprint_fields' (edited by hand?)",
                         manifest_hint(cache_dir))
    if len(man["shards"]) != man["num_shards"]:
        raise CacheError(f"{path}: lists {len(man['shards'])} shards, field 'num_shards' says {man['num_shards']}",
                         manifest_hint(cache_dir))
    for i, entry in enumerate(man["shards"]):
        entry["abs_path"] = str(safe_child(cache_dir, str(entry.get("path", "")), f"{path} shards[{i}].path"))
    return man
