"""The object-store side of the cache's filesystem seam (fs.py): a prefix in a bucket (S3, S3-compatible, GCS)
through a pyarrow.fs client, with bounded retries of transient errors, torn-read repeats of small objects being
replaced, multipart uploads (upload.py) and the URI checks that keep credentials out of configs and logs.
`open_cache_fs` (fs.py) makes one per URI; nothing else constructs it."""

from __future__ import annotations

import json
import posixpath
import shlex
import threading
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs

from ..errors import CacheError, RuntimeFailure, UsageError
from .fs import TORN_READ_ATTEMPTS, CacheFS, log
from .s3_config import CRED_HINT, TRANSIENT, chunked_refusal, credentials_refusal, list_incomplete_uploads, s3_client, scrub
from .upload import Upload


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


def open_remote(parts) -> ObjectCacheFS:
    """The client of an s3:// or gs:// location (urlsplit parts), its URI parameters and refusals checked."""
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
