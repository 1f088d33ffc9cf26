"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader never sees a half-written file: either the old content (or nothing) or the new one.
Temp files are named ``.<name>.tmp-<pid>-<rand>`` and are ignored (and cleaned) by readers.
Disk-full and other OS errors are re-raised as `RuntimeFailure` naming the path (exit 4), also when
they come from safetensors' writer (a `SafetensorError` carrying "(os error N)"). Appends to a log
file (`append_durably`) are cut back to the file's old length when they fail, so no half line stays.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import DFlashError, RuntimeFailure

TMP_MARK = ".tmp-"
log = logging.getLogger("dflash_pipe.io")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


def _host_tag() -> str:
    """8 hex digits naming this host (its hostname's hash): a temp file's pid means something only here."""
    import socket

    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


HOST_TAG = _host_tag()


def temp_path_for(path: Path) -> Path:
    """`.<name>.tmp-<pid>-<host tag>-<random>` beside `path` (the pid and host say whose it is)."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{HOST_TAG}-{secrets.token_hex(4)}")


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path (a directory fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def os_error_of(exc: BaseException) -> OSError | None:
    """The OS error behind `exc`: itself, or the one safetensors' Rust writer reports in its message."""
    if isinstance(exc, OSError):
        return exc
    if type(exc).__name__ == "SafetensorError":
        m = re.search(r"\(os error (\d+)\)", str(exc))
        if m:
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
    return None


def disk_error(exc: OSError, path: Path, what: str) -> DFlashError:
    from .cache.s3_config import chunked_refusal

    refused = chunked_refusal(f"I/O error while {what} {path}: {exc}")  # a store that takes no aws-chunked uploads
    if refused is not None:
        return refused
    if exc.errno in DISK_FULL_ERRNOS:
        return RuntimeFailure(f"disk full while {what} {path}",
                              "free space on that filesystem and rerun the same command (it resumes); "
                              "nothing partial was left visible")
    return RuntimeFailure(f"I/O error while {what} {path}: {exc}",
                          "check that path (permissions, free space, mount) and rerun the same command")


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temp path to write; on success fsync + rename it onto `path`, else delete it."""
    path = Path(path)
    tmp = temp_path_for(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        os_exc = os_error_of(exc)
        if os_exc is not None:
            raise disk_error(os_exc, path, "writing") from exc
        raise


def append_durably(path: str | Path, data: bytes, fsync: bool = True) -> None:
    """Append `data` to `path` whole or not at all: on an OS error the file is cut back to its old
    length (so a full disk leaves no half line) and `RuntimeFailure` names the path."""
    path = Path(path)
    fd = -1
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        except OSError:
            os.ftruncate(fd, start)
            raise
    except OSError as exc:
        raise disk_error(exc, path, "appending to") from exc
    finally:
        if fd >= 0:
            os.close(fd)


def write_optional(path: str | Path, write: Callable[[Path], object], what: str) -> bool:
    """Atomically write a nice-to-have output (a plot) with `write(temp_path)`; on a disk error warn
    and return False instead of failing the run (nothing partial is left either way)."""
    try:
        with atomic_output(path) as tmp:
            write(tmp)
        return True
    except RuntimeFailure as exc:
        log.warning("%s not written: %s; continuing without it", what, exc.message)
        return False


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


def temp_writer_alive(name: str) -> bool:
    """Whether the process that owns a temp file (its name carries the pid and host, `temp_path_for`) still runs.
    Another host's (e.g. `extract --shards` jobs on several nodes writing one shared cache dir) counts as alive: its
    pid cannot be checked from here, and deleting a live writer's file would fail its commit. A name without a
    readable pid counts as dead; one without a host tag (written before session 27) as this host's."""
    try:
        parts = name.split(TMP_MARK, 1)[1].split("-")
        pid = int(parts[0])
        if len(parts) >= 3 and parts[1] != HOST_TAG:
            return True
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: Path) -> int:
    """Delete temp files left by a killed writer of this host (its pid is gone). A live writer's temp files stay:
    another extraction job writing other shards of the same cache (`--shards`) is mid-write, here or on another node.
    Returns how many were removed."""
    n = 0
    if directory.is_dir():
        for p in directory.iterdir():
            if is_temp_name(p.name) and not temp_writer_alive(p.name):
                p.unlink(missing_ok=True)
                n += 1
    return n
