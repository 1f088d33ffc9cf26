"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader never sees a half-written file: either the old content (or nothing) or the new one.
Temp files are named ``.<name>.tmp-<pid>-<rand>`` and are ignored (and cleaned) by readers.
Disk-full and other OS errors are re-raised as `RuntimeFailure` naming the path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .errors import RuntimeFailure

TMP_MARK = ".tmp-"


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


def temp_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path (a directory fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path


def disk_error(exc: OSError, path: Path, what: str) -> RuntimeFailure:
    if exc.errno == errno.ENOSPC:
        return RuntimeFailure(f"disk full while {what} {path}",
                              "free space on that filesystem and rerun; nothing partial was left visible")
    return RuntimeFailure(f"I/O error while {what} {path}: {exc}")


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temp path to write; on success fsync + rename it onto `path`, else delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise disk_error(exc, path, "writing") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSONL file appended to by a process that may have been killed: a cut or
    non-object line is skipped, not an error."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def safe_child(root: Path, relative: str, what: str) -> Path:
    """Resolve `relative` inside `root`; refuse absolute paths and '..' escapes (path traversal)."""
    from .errors import CacheError

    if os.path.isabs(relative) or "\x00" in relative:
        raise CacheError(f"{what}: path '{relative}' must be relative to {root}")
    resolved = (root / relative).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise CacheError(f"{what}: path '{relative}' escapes the directory {root}",
                         "the manifest was edited or is malicious; regenerate it with `dflash-pipe extract`")
    return resolved


def remove_stale_temps(directory: Path) -> int:
    """Delete temp files left by a killed writer. Returns how many were removed."""
    n = 0
    if directory.is_dir():
        for p in directory.iterdir():
            if is_temp_name(p.name):
                p.unlink(missing_ok=True)
                n += 1
    return n
