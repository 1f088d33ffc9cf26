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
from typing import Any, Callable

from .. import __version__
from ..errors import CacheError, FingerprintMismatch
from ..io_utils import sha256_json
from .fs import CacheFS, open_cache_fs
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


def extract_command(cache_dir: str | Path | CacheFS) -> str:
    """The extract command line that resumes this cache with the settings it was made with."""
    fs = open_cache_fs(cache_dir)
    if fs.is_local and (fs.root / RESOLVED_FILE).is_file():
        return f"`dflash-pipe extract -m {fs.display(RESOLVED_FILE)} --cache-dir {fs.cli_location}`"
    if not fs.is_local and fs.exists(RESOLVED_FILE):  # -m takes a local file: the settings are in the object
        return (f"`dflash-pipe extract --cache-dir {fs.cli_location}` with the settings in {fs.display(RESOLVED_FILE)} "
                "(download it and pass it as -m)")
    return f"`dflash-pipe extract --cache-dir {fs.cli_location}` with the manifest that made this cache"


def spec_hint(cache_dir: str | Path | CacheFS) -> str:
    fs = open_cache_fs(cache_dir)
    return (f"delete {fs.display(SPEC_FILE)} and rerun {extract_command(fs)}: it rewrites the spec "
            "and keeps the shards committed under the same settings (or add --overwrite to extract the cache "
            "again from scratch)")


def sidecar_hint(fs: CacheFS, name: str) -> str:
    return f"delete {fs.display(name)} and rerun {extract_command(fs)}: it redoes that one shard"


def manifest_hint(cache_dir: str | Path | CacheFS) -> str:
    return (f"rerun {extract_command(cache_dir)}: with every shard committed it only rewrites {MANIFEST_FILE} "
            "from the shard sidecars")


def _read_json(fs: CacheFS, name: str, what: str, hint: Callable[[], str] = str) -> dict:
    """A JSON object; `hint()` (made only on an error: on a store it may cost a request) names the fix."""
    path = fs.display(name)
    try:
        obj = json.loads(fs.read_bytes(name).decode("utf-8"))
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CacheError(f"{path}: {what} is not valid JSON ({exc})", hint()) from None
    if not isinstance(obj, dict):
        raise CacheError(f"{path}: {what} must be a JSON object", hint())
    return obj


def make_spec(fingerprint_fields: dict, target: dict, features: dict, num_shards: int, extra: dict) -> dict:
    return {"format": "dflash-pipe-cache", "format_version": FORMAT_VERSION, "tool_version": __version__,
            "fingerprint": fingerprint_of(fingerprint_fields), "fingerprint_fields": fingerprint_fields,
            "target": target, "features": features, "num_shards": num_shards, **extra}


def load_spec(cache_dir: str | Path | CacheFS) -> dict | None:
    """The cache spec, or None if there is none; a damaged one (not JSON, a field missing, the
    fingerprint not matching its fields) is refused with a hint that works."""
    cache_dir = open_cache_fs(cache_dir)
    path = cache_dir.display(SPEC_FILE)
    try:
        spec = _read_json(cache_dir, SPEC_FILE, "cache spec", lambda: spec_hint(cache_dir))
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


def mismatch_error(cache_dir, old_fields: dict, new_fields: dict) -> FingerprintMismatch:
    diff = diff_fields(old_fields, new_fields)
    lines = "\n".join(f"    {k}: cache has {a!r}, this run has {b!r}" for k, (a, b) in diff.items())
    return FingerprintMismatch(
        f"cache {cache_dir} was extracted with different settings:\n{lines}", diff,
        "use a new --cache-dir, or pass --overwrite to delete this cache and extract again")


def init_or_check_spec(cache_dir: str | Path | CacheFS, spec: dict, overwrite: bool = False) -> str:
    """Create the spec, or check the existing one. Returns 'new' | 'match' | 'overwritten'."""
    fs = open_cache_fs(cache_dir)
    cache_dir = fs.uri
    fs.ensure_root()
    try:
        old = load_spec(fs)
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
        delete_cache_files(fs)
        status = "overwritten"
    fs.write_json(SPEC_FILE, spec)
    return status


def delete_cache_files(cache_dir: str | Path | CacheFS) -> None:
    """Remove what extract writes (and nothing else the user may keep there)."""
    fs = open_cache_fs(cache_dir)
    for name in sorted(fs.list_sizes()):
        # the head file too: extract only writes it when absent, so another target's would be kept
        if name in (SPEC_FILE, MANIFEST_FILE, HEAD_FILE) or (name.startswith("shard-")
                                                             and name.endswith((".parquet", ".json"))):
            fs.delete(name)
    fs.remove_stale_temps()


def sidecar_name(index: int, num_shards: int) -> str:
    return shard_name(index, num_shards).replace(".parquet", ".json")


def sidecar_path(cache_dir: str | Path, index: int, num_shards: int) -> Path:
    return Path(cache_dir) / sidecar_name(index, num_shards)


def write_sidecar(cache_dir: str | Path | CacheFS, spec: dict, info: ShardInfo, stats: dict) -> None:
    sidecar = {"fingerprint": spec["fingerprint"], "num_shards": spec["num_shards"], **asdict(info), "stats": stats}
    open_cache_fs(cache_dir).write_json(sidecar_name(info.index, spec["num_shards"]), sidecar)


def committed_shards(cache_dir: str | Path | CacheFS, spec: dict, skip: frozenset[int] = frozenset()) -> dict[int, dict]:
    """Shards whose file and sidecar both exist and agree (size, fingerprint). Others are redone.
    One listing gives every name and size (one request per 1,000 objects on a store). Indices in
    `skip` are not looked at (the window trainer's repeated looks pass the shards it already knows:
    reading their sidecars again cost the step loop tens of ms at 128 shards).

    A shard that a window run has consumed (window.json says `deleted`) has only its sidecar left and
    still counts as committed (entry field "deleted": true): extraction must not redo it."""
    from .window import consumed_indices, load_ledgers

    fs = open_cache_fs(cache_dir)
    sizes = fs.list_sizes()
    out: dict[int, dict] = {}
    n = spec["num_shards"]
    missing: dict[int, dict] = {}
    for i in range(n):
        side = sidecar_name(i, n)
        if i in skip or side not in sizes:
            continue
        sc = _read_json(fs, side, "shard sidecar", lambda: sidecar_hint(fs, side))
        if sc.get("fingerprint") != spec["fingerprint"]:
            raise CacheError(f"{fs.display(side)}: belongs to a cache with another fingerprint",
                             "a foreign shard was copied here; remove it or use --overwrite")
        rel = str(sc.get("path", ""))
        fs.child(rel, f"{fs.display(side)} field 'path'")  # refuses absolute paths and escapes
        size = sizes.get(rel) if "/" not in rel else fs.size(rel)
        if size is not None and size == sc.get("bytes"):
            out[i] = sc
        elif size is None:
            missing[i] = sc
    # read the ledger after looking at the files: the trainer marks a shard deleted before it unlinks it,
    # so every file seen missing above was either consumed by then or never committed
    # every window ledger's (a group: released by all members); the listing above names the ledgers (a ledger
    # is written before any file it deletes goes, so one missing from it has deleted nothing seen missing)
    consumed = consumed_indices(fs, spec, load_ledgers(fs, spec, names=sizes))
    for i, sc in missing.items():
        if i in consumed:
            out[i] = {**sc, "deleted": True}
    return dict(sorted(out.items()))


def try_finalize(cache_dir: str | Path | CacheFS, spec: dict) -> dict | None:
    """If every shard is committed, merge the sidecars into manifest.json (idempotent)."""
    fs = open_cache_fs(cache_dir)
    shards = committed_shards(fs, spec)
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
        old = _read_json(fs, MANIFEST_FILE, "manifest")
    except (FileNotFoundError, CacheError):
        pass  # none yet, or damaged: it is rewritten from the sidecars below
    head = head_file_record(fs, spec, (old or {}).get("head_file"))
    if head is not None:
        manifest["head_file"] = head
    if old != manifest:
        fs.write_json(MANIFEST_FILE, manifest)
    return manifest


def head_file_record(cache_dir: str | Path | CacheFS, spec: dict, old: dict | None) -> dict | None:
    """Size and sha256 of the target head file for the manifest (`cache verify` checks them). The
    old manifest's sha256 is kept while size and mtime (an object's last-modified time) are unchanged
    (hashing a 27B target's 5 GB head on every finalize would cost seconds per rank, more from a
    store); None for caches without a head file."""
    fs = open_cache_fs(cache_dir)
    name = spec.get("features", {}).get("head_file")
    if not name:
        return None
    fs.child(name, f"{fs.display(SPEC_FILE)} field features.head_file")  # refuses absolute paths and escapes
    st = fs.stat(name)
    if st is None:
        return None
    size, mtime_ns = st
    if (isinstance(old, dict) and old.get("path") == name and old.get("bytes") == size
            and old.get("mtime_ns") == mtime_ns and old.get("sha256")):
        return old
    return {"path": name, "bytes": size, "mtime_ns": mtime_ns, "sha256": fs.sha256(name)}


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


def load_manifest(cache_dir: str | Path | CacheFS) -> dict:
    """Read and structurally validate manifest.json (paths stay inside the cache dir). Each shard entry
    gets `abs_path`: a local path, or the object's URI."""
    fs = open_cache_fs(cache_dir)
    cache_dir, path = fs.uri, fs.display(MANIFEST_FILE)
    try:
        man = _read_json(fs, MANIFEST_FILE, "manifest", lambda: manifest_hint(fs))
    except FileNotFoundError:
        hint = ("extraction has not finished (or was interrupted): rerun `dflash-pipe extract` to resume"
                if fs.exists(SPEC_FILE) else "run `dflash-pipe extract` first or fix --cache-dir")
        raise CacheError(f"{cache_dir}: no {MANIFEST_FILE}", hint) from None
    for key in ("fingerprint", "fingerprint_fields", "features", "target", "shards", "num_shards", "totals"):
        if key not in man:
            raise CacheError(f"{path}: field '{key}' is missing", manifest_hint(fs))
    if man.get("format_version") != FORMAT_VERSION:
        raise CacheError(f"{path}: format_version {man.get('format_version')} is not {FORMAT_VERSION}",
                         "this cache was written by another dflash-pipe version; re-extract it")
    _check_manifest_shape(man, path, lambda: manifest_hint(fs))
    if fingerprint_of(man["fingerprint_fields"]) != man["fingerprint"]:
        raise CacheError(f"{path}: field 'fingerprint' does not match 'fingerprint_fields' (edited by hand?)",
                         manifest_hint(fs))
    for i, entry in enumerate(man["shards"]):
        entry["abs_path"] = fs.child(str(entry.get("path", "")), f"{path} shards[{i}].path")
    return man


_COUNTS = ("rows", "tokens", "bytes")   # the counts readers of a manifest take from it (totals and each shard)


def _check_manifest_shape(man: dict, path: str, hint: Callable[[], str]) -> None:
    """The types load_manifest's readers rely on (`cache verify`, `cache info`, the trainer's index,
    `--recompute`): a manifest that is valid JSON but of another shape is damage, named by field."""
    def bad(field: str, problem: str, shard: str = "") -> CacheError:
        where = f" ({shard})" if shard else ""
        return CacheError(f"{path}: field '{field}'{where} {problem}", hint())

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(man["fingerprint"], str):
        raise bad("fingerprint", f"must be a string, not {man['fingerprint']!r}")
    for key in ("fingerprint_fields", "features", "target", "totals"):
        if not isinstance(man[key], dict):
            raise bad(key, f"must be a JSON object, not {type(man[key]).__name__}")
    for key in ("stats", "head_file"):   # optional, but an object when present
        if key in man and not isinstance(man[key], dict):
            raise bad(key, f"must be a JSON object, not {type(man[key]).__name__}")
    n = man["num_shards"]
    if not count(n) or n < 1:
        raise bad("num_shards", f"must be a positive integer, not {n!r}")
    for key in _COUNTS:
        if key not in man["totals"]:
            raise bad(f"totals.{key}", "is missing")
        if not count(man["totals"][key]):
            raise bad(f"totals.{key}", f"must be a non-negative integer, not {man['totals'][key]!r}")
    shards = man["shards"]
    if not isinstance(shards, list):
        raise bad("shards", f"must be a list of shard entries, not {type(shards).__name__}")
    if len(shards) != n:
        raise CacheError(f"{path}: lists {len(shards)} shards, field 'num_shards' says {n}", hint())
    seen: set[int] = set()
    for i, entry in enumerate(shards):
        if not isinstance(entry, dict):
            raise bad(f"shards[{i}]", f"must be a JSON object (a shard entry), not {entry!r}")
        name = entry.get("path") if isinstance(entry.get("path"), str) else f"shard {i}"
        for key in ("path", "index", "sha256") + _COUNTS:
            if key not in entry:
                raise bad(f"shards[{i}].{key}", "is missing", name)
        for key in ("path", "sha256"):
            if not isinstance(entry[key], str) or not entry[key]:
                raise bad(f"shards[{i}].{key}", f"must be a non-empty string, not {entry[key]!r}", name)
        for key in _COUNTS:
            if not count(entry[key]):
                raise bad(f"shards[{i}].{key}", f"must be a non-negative integer, not {entry[key]!r}", name)
        index = entry["index"]
        if not count(index) or index >= n:
            raise bad(f"shards[{i}].index", f"must be a shard index 0..{n - 1}, not {index!r}", name)
        if index in seen:
            raise bad(f"shards[{i}].index", f"{index} is listed twice", name)
        seen.add(index)
