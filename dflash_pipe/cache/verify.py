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
`CacheError` (exit 3). Local directories and object-store prefixes (s3://, gs://) go through the same
checks (cache/fs.py); on a store the head file's header is read by two ranged GETs (``decode=True``
downloads it to a temp dir for the value check), and incomplete multipart uploads under the prefix (a
killed writer's; invisible to readers, they only cost storage until aborted) are reported. `--recompute K`
(extract/recompute.py) additionally reruns K samples through the target.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import CacheError, DFlashError
from ..io_utils import is_temp_name
from .fs import CacheFS, open_cache_fs
from .manifest import (MANIFEST_FILE, RESOLVED_FILE, SPEC_FILE, extract_command, load_manifest, load_spec,
                       sidecar_name)
from .reader import ShardReader

log = logging.getLogger("dflash_pipe.cache.verify")


@dataclass
class Problem:
    file: str           # a local path or an object's URI
    field: str          # "" = the file as a whole
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"{self.file} field '{self.field}'" if self.field else str(self.file)
        return f"{where}: {self.message}\n      fix: {self.fix}"


def verify_cache(cache_dir: str | Path | CacheFS, checksums: bool = True, decode: bool = False) -> dict:
    fs = open_cache_fs(cache_dir)
    if fs.is_local and not fs.root.is_dir():
        raise CacheError(f"{fs.uri}: no such cache directory", "pass the [extract].cache_dir of a run")
    sizes = fs.list_sizes()  # one listing: every name and size (one request per 1,000 objects on a store)
    if SPEC_FILE not in sizes and MANIFEST_FILE not in sizes:
        raise CacheError(f"{fs.uri}: not a dflash-pipe cache (no {SPEC_FILE}, no {MANIFEST_FILE})",
                         "pass the [extract].cache_dir of a run, or run `dflash-pipe extract` first")
    problems: list[Problem] = []
    spec = _spec(fs, problems)
    man = _manifest(fs, spec, problems)
    about = man or spec
    head = None
    if about is not None:
        _sidecars(fs, sizes, about, man, problems)
        head = _head_file(fs, sizes, about, man, checksums, decode, problems)
    _resolved_config(fs, sizes, problems)
    consumed = _window_ledger(fs, spec, problems)
    rows = tokens = 0
    if man is not None:
        rows, tokens = _shards(fs, sizes, man, checksums, decode, problems, consumed)
    stale = fs.incomplete_uploads()  # reported, not a failure: the data is whole; they only cost storage
    if stale:
        log.warning("%d incomplete upload(s) under %s (killed writers; invisible to readers): %s; abort them or "
                    "set a lifecycle rule (AbortIncompleteMultipartUpload)", len(stale), fs.uri, ", ".join(stale[:5]))
    if problems:
        raise CacheError(f"cache {fs.uri} failed verification ({len(problems)} problem(s)):\n  "
                         + "\n  ".join(str(p) for p in problems),
                         "apply each 'fix' above; `dflash-pipe cache verify` again then exits 0")
    report = {"shards": len(man["shards"]), "rows": rows, "tokens": tokens, "bytes": man["totals"]["bytes"],
              "fingerprint": man["fingerprint"], "head_file": head,
              "files_checked": [SPEC_FILE, MANIFEST_FILE, RESOLVED_FILE, f"{len(man['shards'])} sidecars",
                                f"{len(man['shards']) - len(consumed)} shards"] + ([head["path"]] if head else [])}
    if consumed:  # deleted by a window run after training on them: not damage (window.json records it)
        report["consumed_shards"] = sorted(consumed)
    if not fs.is_local:
        report["incomplete_uploads"] = "unknown (listing them needs boto3)" if stale is None else stale
    return report


def _spec(fs: CacheFS, problems: list[Problem]) -> dict | None:
    path = fs.display(SPEC_FILE)
    try:
        spec = load_spec(fs)
    except CacheError as exc:
        problems.append(Problem(path, _field_of(exc.message), exc.message.split(": ", 1)[-1], exc.hint or ""))
        return None
    if spec is None:
        problems.append(Problem(path, "", "missing", f"rerun {extract_command(fs)}: it rewrites the spec "
                                                     "and keeps the shards committed under the same settings"))
    return spec


def _manifest(fs: CacheFS, spec: dict | None, problems: list[Problem]) -> dict | None:
    path = fs.display(MANIFEST_FILE)
    try:
        man = load_manifest(fs)
    except CacheError as exc:
        problems.append(Problem(path, _field_of(exc.message), exc.message.split(": ", 1)[-1], exc.hint or ""))
        return None
    if spec is not None and spec["fingerprint"] != man["fingerprint"]:
        problems.append(Problem(path, "fingerprint", f"{man['fingerprint'][:12]}... but {SPEC_FILE} has "
                                f"{spec['fingerprint'][:12]}... (the two come from different extractions)",
                                f"rerun {extract_command(fs)} with --overwrite: it extracts the cache again"))
    return man


def _sidecars(fs: CacheFS, sizes: dict[str, int], about: dict, man: dict | None, problems: list[Problem]) -> None:
    n = about["num_shards"]
    entries = {e.get("index"): e for e in man["shards"]} if man else {}
    cmd = extract_command(fs)  # once: on a store it looks for resolved_config.toml (a request)
    for i in range(n):
        name = sidecar_name(i, n)
        path = fs.display(name)
        if name not in sizes:
            if man is not None:
                problems.append(Problem(path, "", "missing", f"rerun {cmd}: it redoes "
                                                             f"shard {i} and rewrites the manifest"))
            continue
        redo = f"delete {path} and rerun {cmd}: it redoes shard {i} and rewrites the manifest"
        try:
            sc = json.loads(fs.read_bytes(name).decode("utf-8"))
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


def _head_file(fs: CacheFS, sizes: dict[str, int], about: dict, man: dict | None, checksums: bool, decode: bool,
               problems: list[Problem]) -> dict | None:
    name = about.get("features", {}).get("head_file")
    if not name:
        return None  # caches written without a head file (synthetic test caches)
    try:
        path = fs.child(name, f"{fs.display(SPEC_FILE)} field features.head_file")
    except CacheError as exc:
        problems.append(Problem(fs.display(SPEC_FILE), "features.head_file", exc.message, "re-extract the cache "
                                "with --overwrite"))
        return None
    fix = (f"delete {path} and rerun {extract_command(fs)}: it rewrites the head file from the target "
           "and keeps the committed shards")
    size = sizes.get(name) if "/" not in name else fs.size(name)
    if size is None:
        problems.append(Problem(path, "", "missing (stage 2 needs the target's embeddings and lm_head)", fix))
        return None
    before = len(problems)
    record = (man or {}).get("head_file")
    if record is not None:
        if record.get("bytes") != size:
            problems.append(Problem(path, "", f"{size} bytes, {MANIFEST_FILE} field 'head_file.bytes' says "
                                              f"{record.get('bytes')} (truncated or replaced)", fix))
            return None
        if checksums and fs.sha256(name) != record.get("sha256"):
            problems.append(Problem(path, "", f"sha256 differs from {MANIFEST_FILE} field 'head_file.sha256' "
                                              "(damaged)", fix))
    _head_tensors(fs, name, about.get("target", {}), decode, fix, problems)
    if len(problems) > before:
        return None
    return {"path": name, "bytes": size, "sha256": (record or {}).get("sha256"),
            "recorded": record is not None}


def _head_tensors(fs: CacheFS, name: str, target: dict, decode: bool, fix: str, problems: list[Problem]) -> None:
    """The tensors stage 2 reads: embedding [V, H], lm_head [V, H] unless tied, final norm [H]."""
    from safetensors import safe_open

    path = fs.display(name)
    try:
        if not fs.is_local and not decode:  # the header alone: two ranged GETs, not the whole object
            meta, shapes = _safetensors_header(fs, name)
            _check_head_shapes(path, meta, shapes, target, fix, problems)
            return
        with _local_copy(fs, name) as local, safe_open(str(local), framework="pt") as sf:
            shapes = {k: list(sf.get_slice(k).get_shape()) for k in sf.keys()}
            want = _check_head_shapes(path, sf.metadata() or {}, shapes, target, fix, problems)
            if decode:
                for tensor in want:
                    if tensor in shapes and not bool(sf.get_tensor(tensor).float().isfinite().all()):
                        problems.append(Problem(path, tensor, "holds NaN or Inf", fix))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a damaged header
        if isinstance(exc, (KeyboardInterrupt, MemoryError)) or (isinstance(exc, DFlashError)
                                                                 and not isinstance(exc, CacheError)):
            raise  # the store being down or refusing access is not damage to the file
        problems.append(Problem(path, "", f"not a readable safetensors file ({exc})", fix))


def _check_head_shapes(path: str, meta: dict, shapes: dict[str, list], target: dict, fix: str,
                       problems: list[Problem]) -> dict[str, list]:
    """Problems for missing tensors or wrong shapes; returns the tensors wanted (name -> shape)."""
    config = json.loads(meta.get("dflash_config", "null"))
    if not isinstance(config, dict):
        problems.append(Problem(path, "dflash_config", "metadata missing: not a dflash-pipe head file", fix))
        return {}
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
    return want


def _read_safetensors_header(fs: CacheFS, name: str) -> tuple[int, int, dict]:
    """(file size, header length, header) of a safetensors file: an 8-byte little-endian length, then that many
    bytes of a JSON object. Two reads (ranged GETs on a store), no tensor; ValueError when they do not fit the file."""
    def parse(total: int, at) -> tuple[int, int, object]:
        if total < 8:
            raise ValueError(f"{total} bytes, shorter than a safetensors header")
        n = int.from_bytes(at(8, 0), "little")
        if not 2 <= n <= min(total - 8, 100 << 20):
            raise ValueError(f"header length {n} does not fit a {total}-byte file")
        try:
            return total, n, json.loads(at(n, 8))
        except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"the header is not valid JSON ({exc})") from None

    if fs.is_local:
        with open(fs.path(name), "rb") as f:
            def at(k: int, offset: int) -> bytes:
                f.seek(offset)
                return f.read(k)
            total, n, header = parse(os.fstat(f.fileno()).st_size, at)
    else:
        def read():
            f = fs.open_input_file(name)
            try:
                return parse(f.size(), f.read_at)
            finally:
                f.close()
        total, n, header = fs.call(f"reading {fs.display(name)}", read)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return total, n, header


def _safetensors_header(fs: CacheFS, name: str) -> tuple[dict, dict[str, list]]:
    """(metadata, tensor shapes) from a safetensors file's header."""
    header = _read_safetensors_header(fs, name)[2]
    meta = header.pop("__metadata__", None) or {}
    return meta, {k: list(v["shape"]) for k, v in header.items()}


def head_file_damage(fs: CacheFS, name: str) -> str | None:
    """Why the safetensors file `name` (it exists) is damaged: its header does not parse, or the file's size is
    not the one its header's data offsets give (truncated or extended); None when both check out. Reads the
    header only (two ranged GETs on a store), no tensor: `plan` asks it, and extract rewrites a head that fails it."""
    try:
        total, n, header = _read_safetensors_header(fs, name)
    except ValueError as exc:
        return str(exc)
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        off = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(off, list) and len(off) == 2 and all(type(x) is int for x in off)
                and 0 <= off[0] <= off[1]):
            return f"tensor {key!r} has no valid data_offsets in the header"
        end = max(end, off[1])
    if total != 8 + n + end:
        return f"{total} bytes, but its header's tensors end at byte {8 + n + end} (truncated or extended)"
    return None


@contextmanager
def _local_copy(fs: CacheFS, name: str) -> Iterator[Path]:
    """The file itself, or (object storage) a download in a temp dir removed afterwards."""
    if fs.is_local:
        yield fs.path(name)
        return
    with tempfile.TemporaryDirectory(prefix="dflash-verify-") as tmp:
        yield fs.fetch_to_local(name, Path(tmp))


def _resolved_config(fs: CacheFS, sizes: dict[str, int], problems: list[Problem]) -> None:
    if RESOLVED_FILE not in sizes:
        return
    try:
        tomllib.loads(fs.read_bytes(RESOLVED_FILE).decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        problems.append(Problem(fs.display(RESOLVED_FILE), "", f"not valid TOML ({exc})",
                                f"delete it and rerun `dflash-pipe extract --cache-dir {fs.cli_location}` with the manifest "
                                "that made this cache (it rewrites the file and resumes)"))


def _window_ledger(fs: CacheFS, spec: dict | None, problems: list[Problem]) -> set[int]:
    """window.json of a window run (`train --passes-per-shard`): its checksum, fields and fingerprint.
    Returns the shards it records as deleted (consumed), whose missing files are no problem."""
    from .window import consumed_indices, ledger_names, ledger_path, load_ledger

    ledgers, bad = [], False
    for name in ledger_names(fs):                # window.json, or one per member of a window group
        try:
            led = load_ledger(fs, spec, name)
        except CacheError as exc:
            problems.append(Problem(str(ledger_path(fs, name)), _field_of(exc.message),
                                    exc.message.split(": ", 1)[-1], exc.hint or ""))
            bad = True
            continue
        if led is not None:
            ledgers.append(led)
    return set() if bad else consumed_indices(fs, spec, ledgers)


def _shards(fs: CacheFS, sizes: dict[str, int], man: dict, checksums: bool, decode: bool,
            problems: list[Problem], consumed: set[int] = frozenset()) -> tuple[int, int]:
    listed = {str(e["path"]) for e in man["shards"]}
    for name in sorted(sizes):
        if name.endswith(".parquet") and name not in listed and not is_temp_name(name):
            problems.append(Problem(fs.display(name), "", f"foreign shard (not listed in {MANIFEST_FILE})",
                                    f"move {name} out of {fs.uri}"))
    rows = tokens = 0
    cmd = extract_command(fs)
    for entry in man["shards"]:
        path, name = entry["abs_path"], str(entry["path"])
        side = fs.display(sidecar_name(entry.get("index", 0), man["num_shards"]))
        fix = (f"delete {path} and {side} and rerun {cmd}: it redoes that shard "
               "and rewrites the manifest")
        size = sizes.get(name) if "/" not in name else fs.size(name)
        if size is None and entry.get("index") in consumed:
            continue  # a window run trained on it and deleted it (window.json: "deleted")
        if size is None:
            problems.append(Problem(path, "", f"missing (manifest lists {entry['rows']} rows)", fix))
            continue
        if size != entry["bytes"]:
            problems.append(Problem(path, "", f"{size} bytes, manifest says {entry['bytes']} (truncated or replaced)",
                                    fix))
            continue
        if checksums and fs.sha256(name) != entry["sha256"]:
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
