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
of the AWS SDK's own retries; `ObjectCacheFS.retries` counts ours.
"""

from __future__ import annotations

import json
import logging
import posixpath
import shlex
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

from ..errors import CacheError, RuntimeFailure, UsageError
from ..io_utils import atomic_write_bytes, atomic_write_json, remove_stale_temps, safe_child, sha256_file
from .s3_config import (CRED_HINT, TRANSIENT, chunked_refusal, credentials_refusal,  # noqa: F401
                        list_incomplete_uploads, s3_client, scrub)
from .upload import Upload

log = logging.getLogger("dflash_pipe.cache.fs")
TORN_READ_ATTEMPTS = 4         # reads of one small object that met it being replaced (ObjectCacheFS.read_bytes)
REMOTE_SCHEMES = ("s3", "gs", "gcs")
def is_remote(location: Any) -> bool:
    return isinstance(location, ObjectCacheFS) or (
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


class ObjectCacheFS(CacheFS):
    """A prefix in a bucket (S3, S3-compatible, GCS) through a pyarrow.fs client."""

    is_local = False

    def __init__(self, fs, scheme: str, base: str, attempts: int, backoff_s: float = 0.2, endpoint_url: str = "",
                 region: str = "", query: str = ""):
        self.fs, self.scheme, self.base = fs, scheme, base.strip("/")
        self.endpoint_url, self.region = endpoint_url, region  # for boto3 (incomplete uploads) only
        self.uri = f"{scheme}://{self.base}"
        self.query = query  # the URI's checked parameters, for hints (cli_location)
        self.attempts, self.backoff_s = max(1, attempts), backoff_s
        self.retries = 0  # transient failures retried by this layer (the SDK's own retries come first)
        self.torn_reads = 0  # reads that met an object being replaced, and were repeated
        self._lock = threading.Lock()

    @property
    def cli_location(self) -> str:
        return shlex.quote(f"{self.uri}?{self.query}" if self.query else self.uri)

    # ---------------------------------------------------------------- names
    def key(self, name: str) -> str:
        return f"{self.base}/{name}"

    def display(self, name: str) -> str:
        return f"{self.uri}/{name}"

    def child(self, relative: str, what: str) -> str:
        if not relative or relative.startswith("/") or "\x00" in relative or "\\" in relative:
            raise CacheError(f"{what}: path '{relative}' must be relative to {self.uri}")
        norm = posixpath.normpath(relative)
        if norm.startswith("..") or norm != relative:
            raise CacheError(f"{what}: path '{relative}' escapes the prefix {self.uri}",
                             "the manifest was edited or is malicious; regenerate it with `dflash-pipe extract`")
        return self.display(relative)

    # ---------------------------------------------------------------- retries and errors
    def call(self, what: str, fn: Callable, *args, **kw):
        """fn(*args) with bounded retries of transient errors; others become named DFlash errors."""
        for attempt in range(1, self.attempts + 1):
            try:
                return fn(*args, **kw)
            except FileNotFoundError:
                raise
            except OSError as exc:
                msg = scrub(str(exc))
                refused = credentials_refusal(what, msg) or chunked_refusal(f"{what}: {msg}")
                if refused is not None:
                    raise refused from None
                if not TRANSIENT.search(msg) or attempt == self.attempts:
                    raise RuntimeFailure(f"{what}: {msg}" + (f" (after {attempt} attempts)" if attempt > 1 else ""),
                                         "check the endpoint and the network; rerun (the cache resumes)") from None
                self.note_retry(what, attempt, exc)
        raise AssertionError("unreachable")

    def note_retry(self, what: str, attempt: int, exc: BaseException) -> None:
        """Count one transient failure, log it and back off (0.2 s, 0.4 s, ...) before the retry."""
        with self._lock:
            self.retries += 1
        delay = self.backoff_s * 2 ** (attempt - 1)
        log.warning("%s: transient error, retry %d/%d in %.1fs: %s", what, attempt, self.attempts - 1, delay,
                    scrub(str(exc))[:200])
        time.sleep(delay)

    # ---------------------------------------------------------------- operations
    def ensure_root(self) -> None:
        import pyarrow.fs as pafs

        bucket = self.base.split("/", 1)[0]
        info = self.call(f"looking up bucket {self.scheme}://{bucket}", self.fs.get_file_info, bucket)
        if info.type == pafs.FileType.NotFound:
            raise UsageError(f"{self.uri}: bucket '{bucket}' does not exist (or is not visible with these "
                             "credentials)", "create it first; dflash-pipe never creates buckets")

    def _info(self, name: str):
        return self.call(f"stat {self.display(name)}", self.fs.get_file_info, self.key(name))

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def size(self, name: str) -> int | None:
        import pyarrow.fs as pafs

        info = self._info(name)
        return None if info.type == pafs.FileType.NotFound else info.size

    def stat(self, name: str) -> tuple[int, int] | None:
        """(bytes, last-modified in ns) of an object, None if there is none."""
        import pyarrow.fs as pafs

        info = self._info(name)
        return None if info.type == pafs.FileType.NotFound else (info.size, info.mtime_ns or 0)

    def sha256(self, name: str, chunk: int = 8 << 20) -> str:
        """Streamed through one GET (retried whole on a transient error)."""
        import hashlib

        def digest():
            h = hashlib.sha256()
            with self.fs.open_input_stream(self.key(name)) as f:
                while block := f.read(chunk):
                    h.update(block)
            return h.hexdigest()
        return self.call(f"reading {self.display(name)}", digest)

    def list_sizes(self) -> dict[str, int]:
        """Objects directly under the prefix (pyarrow pages through ListObjectsV2, 1,000 a page)."""
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(self.base, allow_not_found=True, recursive=False)
        infos = self.call(f"listing {self.uri}", self.fs.get_file_info, sel)
        return {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}

    def read_bytes(self, name: str) -> bytes:
        """The whole object, from one version of it. pyarrow reads an object as a HEAD (its size) then a ranged
        GET, so an object replaced in between (window.json and manifest.json are rewritten in place) comes back
        cut to the old version's size: the length is checked against a fresh HEAD and the read repeated (at most
        TORN_READ_ATTEMPTS times; after that the caller's parse and checksum judge the bytes)."""
        key, what = self.key(name), f"reading {self.display(name)}"

        def get():
            with self.fs.open_input_stream(key) as f:
                return f.read()
        data = b""
        for attempt in range(1, TORN_READ_ATTEMPTS + 1):
            data = self.call(what, get)
            if self.call(what, self.fs.get_file_info, key).size == len(data):
                return data
            with self._lock:
                self.torn_reads += 1
            log.info("%s: the object changed while it was read (%d bytes read); reading it again", what, len(data))
            time.sleep(0.05 * attempt)
        return data

    def _put(self, name: str, blocks) -> None:
        """One whole object from `blocks()` (an iterable of bytes): visible only when complete, nothing on failure."""
        up = Upload(self, name)
        try:
            for block in blocks():
                up.write(block)
        except BaseException:
            up.abort()
            raise
        up.commit()

    def write_bytes(self, name: str, data: bytes) -> None:
        """One whole object (a re-PUT of the same bytes is idempotent, so retrying is safe)."""
        self.call(f"writing {self.display(name)}", self._put, name, lambda: [data])

    def write_json(self, name: str, obj: Any) -> None:
        self.write_bytes(name, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))

    def delete(self, name: str) -> None:
        try:
            self.call(f"deleting {self.display(name)}", self.fs.delete_file, self.key(name))
        except FileNotFoundError:
            pass

    def open_input_file(self, name: str):
        return self.call(f"opening {self.display(name)}", self.fs.open_input_file, self.key(name))

    def remove_stale_temps(self) -> int:
        return 0  # objects are written in place: there are no temp names (see incomplete_uploads)

    def incomplete_uploads(self) -> list[str] | None:
        """Multipart uploads under the prefix that were started and never completed (a killed writer).
        pyarrow.fs cannot list them; boto3 can where it is installed. None = cannot tell."""
        if self.scheme != "s3":
            return None
        try:
            import boto3  # noqa: F401 - optional
        except ImportError:
            return None
        bucket, _, prefix = self.base.partition("/")
        return list_incomplete_uploads(bucket, prefix, self.endpoint_url, self.region)

    def upload_file(self, name: str, local: Path) -> None:
        def blocks():
            with open(local, "rb") as f:
                while block := f.read(16 << 20):
                    yield block
        self.call(f"uploading {self.display(name)}", self._put, name, blocks)

    def fetch_to_local(self, name: str, scratch: Path) -> Path:
        """Download `name` into `scratch` (atomically; reused when the size matches)."""
        from ..io_utils import atomic_output

        dest = Path(scratch) / name
        remote_size = self.size(name)
        if remote_size is None:
            raise FileNotFoundError(self.display(name))
        if dest.exists() and dest.stat().st_size == remote_size:
            return dest

        def get():
            with atomic_output(dest) as tmp, self.fs.open_input_stream(self.key(name)) as src, open(tmp, "wb") as out:
                while block := src.read(16 << 20):
                    out.write(block)
        self.call(f"downloading {self.display(name)}", get)
        return dest


# -------------------------------------------------------------------- opening
_FS_CACHE: dict[str, ObjectCacheFS] = {}
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
    with _FS_LOCK:
        if text not in _FS_CACHE:
            fs = _open_remote(parts)
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


def _open_remote(parts) -> ObjectCacheFS:
    scheme = parts.scheme.lower()
    safe = f"{scheme}://{parts.hostname or ''}{parts.path}"
    if parts.username or parts.password or "@" in parts.netloc:
        raise UsageError(f"{safe}: credentials in the URI are refused (they would be written to configs and logs)",
                         CRED_HINT)
    if parts.fragment or "#" in parts.path:
        raise UsageError(f"{safe}#{parts.fragment}: a '#' in an object-store location is refused (it ends the path "
                         "there: two locations differing after it would be one)", "name the prefix without '#'")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    for key in ("endpoint", "endpoint_override"):
        if "@" in query.get(key, ""):     # user:password@host (a password may hold '/', which ends a netloc)
            raise UsageError(f"{safe}: credentials in the '{key}' URI parameter are refused (they would be written to "
                             "configs and logs)", CRED_HINT)
    for bad in ("access_key", "secret_key", "session_token"):
        if bad in query:
            raise UsageError(f"{safe}: URI parameter '{bad}' is refused (it would be written to configs and logs)",
                             CRED_HINT)
    allowed = {"endpoint", "endpoint_override", "region", "scheme", "retries", "anonymous"}
    unknown = sorted(set(query) - allowed)
    if unknown:
        raise UsageError(f"{safe}: unknown URI parameter(s) {unknown}; known: {sorted(allowed)}")
    bucket, base = parts.netloc, f"{parts.netloc}{parts.path}"
    if not bucket:
        raise UsageError(f"{safe}: no bucket (expected {scheme}://BUCKET/PREFIX)")
    try:
        attempts = int(query.get("retries", "5"))
    except ValueError:
        raise UsageError(f"{safe}: URI parameter 'retries' must be an integer") from None
    if scheme in ("gs", "gcs"):
        import pyarrow.fs as pafs

        if not hasattr(pafs, "GcsFileSystem"):
            raise UsageError(f"{safe}: this pyarrow build has no GCS support", "install a pyarrow wheel with GCS")
        return ObjectCacheFS(pafs.GcsFileSystem(), "gs", base, attempts, query=parts.query)
    client, endpoint_url, region = s3_client(query, safe)
    return ObjectCacheFS(client, "s3", base, attempts, endpoint_url=endpoint_url, region=region, query=parts.query)


