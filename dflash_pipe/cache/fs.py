"""The one filesystem seam of the cache: a local directory or an object-store prefix, through pyarrow.fs.

    open_cache_fs("runs/x/cache")                     plain path (or file:///abs/path): LocalCacheFS
    open_cache_fs("s3://bucket/prefix")               S3 or an S3-compatible server: ObjectCacheFS
    open_cache_fs("s3://bucket/p?endpoint=http://127.0.0.1:9000&region=us-east-1")
    open_cache_fs("gs://bucket/prefix")               pyarrow's GCS client (default credentials)

S3 settings, first found wins: URI query (``endpoint``, ``region``, ``scheme``, ``retries``,
``anonymous=true``), then ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` and ``AWS_REGION`` /
``AWS_DEFAULT_REGION``. Credentials come only from the standard chain (``AWS_ACCESS_KEY_ID`` +
``AWS_SECRET_ACCESS_KEY`` [+ ``AWS_SESSION_TOKEN``], ``AWS_PROFILE`` / ``~/.aws`` files, web identity,
container or instance roles); a URI carrying credentials is refused, and secrets are scrubbed from
every message this module raises, so they never reach manifests, logs or errors.

Whole-object writes: local files keep io_utils' temp + fsync + rename. Objects are written in place
by one PUT or a multipart upload that becomes visible only when it completes. pyarrow's S3 stream
has no abort (apache/arrow#40502: close(), the ``with`` exit and the destructor all *complete* the
upload), so `Upload.abort` stops passing bytes on, lets the stream close and deletes what it made;
a SIGKILL leaves an incomplete multipart upload, invisible to readers (`incomplete_uploads` lists
them for `cache verify`). Shards only count once their sidecar matches, so neither is ever used.

Remote operations retry transient errors (5xx, throttling, connection resets) with backoff, on top
of the AWS SDK's own retries; `ObjectCacheFS.retries` counts ours. The object-store side lives in object_fs.py.
"""

from __future__ import annotations

import logging
import shlex
import stat
import threading
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import UsageError
from ..io_utils import atomic_write_bytes, atomic_write_json, remove_stale_temps, safe_child, sha256_file

log = logging.getLogger("dflash_pipe.cache.fs")
TORN_READ_ATTEMPTS = 4         # reads of one small object that met it being replaced (ObjectCacheFS.read_bytes)
REMOTE_SCHEMES = ("s3", "gs", "gcs")
def is_remote(location: Any) -> bool:
    return (isinstance(location, CacheFS) and not location.is_local) or (
        isinstance(location, str) and urlsplit(location).scheme.lower() in REMOTE_SCHEMES)


def split_location(location: str | Path) -> tuple["CacheFS", str]:
    """(filesystem of the parent, file name) of a file path or object URI."""
    if is_remote(location):
        base = urlsplit(str(location))
        parent, _, name = base.path.rstrip("/").rpartition("/")
        return open_cache_fs(f"{base.scheme}://{base.netloc}{parent}" + (f"?{base.query}" if base.query else "")), name
    p = Path(location)
    return open_cache_fs(p.parent), p.name


class CacheFS:
    """What the cache needs of storage, by name relative to the cache root; nothing more."""

    is_local = True
    uri: str

    def __str__(self) -> str:
        return self.uri

    @property
    def cli_location(self) -> str:
        """This cache as a `--cache-dir` argument for a hint, shell-quoted: an object store's URI keeps its
        query (endpoint, region, ...; credentials are never in it), or the command would miss the server."""
        return shlex.quote(self.uri)

    def display(self, name: str) -> str:
        raise NotImplementedError


class LocalCacheFS(CacheFS):
    """A directory. Behaves exactly as the cache code did before the seam (same files, same bytes)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.uri = str(self.root)

    def path(self, name: str) -> Path:
        return self.root / name

    def display(self, name: str) -> str:
        return str(self.root / name)

    def child(self, relative: str, what: str) -> str:
        """A manifest/sidecar path, checked to stay inside the root; returns its full path."""
        return str(safe_child(self.root, relative, what))

    def ensure_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def exists(self, name: str) -> bool:
        return (self.root / name).exists()

    def size(self, name: str) -> int | None:
        try:
            return (self.root / name).stat().st_size
        except FileNotFoundError:
            return None

    def stat(self, name: str) -> tuple[int, int] | None:
        """(bytes, mtime_ns) of a file, None if there is none."""
        try:
            st = (self.root / name).stat()
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime_ns

    def sha256(self, name: str) -> str:
        return sha256_file(self.root / name)

    def list_sizes(self) -> dict[str, int]:
        """Files directly in the cache dir and their sizes. A file that goes between the listing and its stat (a
        writer's temp file renamed into place, a shard a window run deletes) is left out, as a later listing would."""
        if not self.root.is_dir():
            return {}
        sizes = {}
        for p in self.root.iterdir():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                sizes[p.name] = st.st_size
        return sizes

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def write_bytes(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self.root / name, data)

    def write_json(self, name: str, obj: Any) -> None:
        atomic_write_json(self.root / name, obj)

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def remove_stale_temps(self) -> int:
        return remove_stale_temps(self.root)

    def incomplete_uploads(self) -> list[str] | None:
        return []

    def upload_file(self, name: str, local: Path) -> None:
        if Path(local).resolve() != (self.root / name).resolve():
            atomic_write_bytes(self.root / name, Path(local).read_bytes())

    def fetch_to_local(self, name: str, scratch: Path) -> Path:
        return self.root / name


# -------------------------------------------------------------------- opening
_FS_CACHE: dict[str, CacheFS] = {}   # object-store clients by URI
_ENDPOINTS: dict[str, set[str]] = {}   # query-less URI -> the endpoints it is open on
_FS_LOCK = threading.Lock()


def open_cache_fs(location: "str | Path | CacheFS") -> CacheFS:
    """The filesystem of a cache location. Object-store clients are made once per URI and reused."""
    if isinstance(location, CacheFS):
        return location
    text = str(location)
    parts = urlsplit(text) if isinstance(location, str) else None
    if parts is None or parts.scheme.lower() not in REMOTE_SCHEMES + ("file",):
        return LocalCacheFS(Path(location))
    if parts.scheme.lower() == "file":
        return LocalCacheFS(Path(unquote(parts.path)))   # file:///x/my%20cache is the directory "/x/my cache"
    from .object_fs import open_remote

    with _FS_LOCK:
        if text not in _FS_CACHE:
            fs = open_remote(parts)
            _FS_CACHE[text] = fs
            # its files are named by the URI without the query (fs.display): those resolve to this client
            _FS_CACHE.setdefault(fs.uri, fs)
            _ENDPOINTS.setdefault(fs.uri, set()).add(fs.endpoint_url)
        elif not parts.query and len(_ENDPOINTS.get(text, ())) > 1:
            # a file name (no query) of a bucket/prefix open on two endpoints: which server it means is unknown;
            # refused rather than read from the first one opened
            raise UsageError(f"{text} is open on two endpoints in this process "
                             f"({', '.join(sorted(_ENDPOINTS[text]))}): its files cannot be told apart by name",
                             "use one endpoint per process (e.g. compare or copy two stores in two commands)")
        return _FS_CACHE[text]
