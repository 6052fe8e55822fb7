"""A real S3-compatible server for the tests (``moto_server``, a separate process on 127.0.0.1 at a
free port) and ``FaultProxy``, a small HTTP proxy between it and lowdiff that can drop
connections, answer 500 or 503 SlowDown, stall (no answer until the client's read timeout), or
throttle the bandwidth of request bodies. Every request passes through it as bytes: nothing of
lowdiff or boto3 is mocked."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import socketserver
import subprocess
import threading
import time

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "lowdiff-test", "AWS_SECRET_ACCESS_KEY": "lowdiff-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(**settings: str):
    """The URL of a fresh moto server (small multipart parts allowed, so tests stay small);
    ``settings``: more of moto's environment (``INITIAL_NO_AUTH_ACTION_COUNT``: requests served
    before IAM policies are enforced)."""
    port = free_port()
    env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": "1", **settings}
    process = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if process.poll() is not None:
                    raise RuntimeError("moto_server exited at start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        proxy: FaultProxy = self.server.proxy   # type: ignore[attr-defined]
        stream = self.request.makefile("rb")
        while True:
            request = _read_request(stream, on_expect=lambda: self.request.sendall(b"HTTP/1.1 100 Continue\r\n\r\n"))
            if request is None:
                return
            head, body = request
            action = proxy.take(head)
            if action == "drop":
                return
            if action == "stall":
                time.sleep(proxy.stall_s)
                return
            if action in ("500", "503"):
                code, reason = ("SlowDown", "Slow Down") if action == "503" else ("InternalError", "Internal Error")
                xml = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                self.request.sendall(f"HTTP/1.1 {action} {reason}\r\nContent-Length: {len(xml)}\r\n"
                                     f"Content-Type: application/xml\r\nConnection: close\r\n\r\n".encode() + xml)
                return
            proxy.throttle(len(body))
            with socket.create_connection(proxy.upstream) as upstream:
                upstream.sendall(head + body)
                response = _read_request(upstream.makefile("rb"), head.startswith(b"HEAD "))
            if response is None or action == "lose":   # "lose": done upstream, the answer never comes
                return
            proxy.throttle_download(len(response[1]))
            self.request.sendall(response[0] + response[1])


def _read_request(stream, no_body: bool = False, on_expect=None):
    """(head, body) of the next HTTP message on ``stream`` (a request, or a response: ``no_body``
    for the answer to HEAD); None at the end of the stream. ``on_expect``: answers a request's
    ``Expect: 100-continue`` (which is then not forwarded)."""
    lines = []
    while True:
        line = stream.readline()
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
    head = b"".join(lines)
    if no_body or lines[0].split(b" ")[1:2] in ([b"204"], [b"304"]):
        return head, b""
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (ln.decode("latin-1").partition(":") for ln in lines[1:-1])}
    if on_expect is not None and headers.get("expect", "").lower() == "100-continue":
        on_expect()
        head = b"".join(ln for ln in lines if not ln.lower().startswith(b"expect:"))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size_line = stream.readline()
            body += size_line
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while (trailer := stream.readline()) not in (b"\r\n", b"\n", b""):
                    body += trailer
                return head, body + b"\r\n"
            body += stream.read(size + 2)
    return head, stream.read(int(headers.get("content-length", "0")))


class FaultProxy:
    """A proxy to ``upstream`` on 127.0.0.1 at a free port (``url``). ``fail(action, count, match)``:
    the next ``count`` requests whose first line contains ``match`` get ``action`` ("drop": the
    connection closed unanswered, "lose": forwarded but the answer dropped, "stall", "500", "503");
    ``bytes_per_s``: request bodies forwarded at that rate (None: as fast as possible), each
    connection on its own; ``download_bytes_per_s``: response bodies at that rate, all connections
    sharing it (one link), for the experiments."""

    def __init__(self, upstream_url: str, stall_s: float = 2.0):
        host, port = upstream_url.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.stall_s = stall_s
        self.bytes_per_s: float | None = None
        self.download_bytes_per_s: float | None = None
        self._link = threading.Lock()
        self.rules: list = []
        self.seen: list = []
        self._lock = threading.Lock()
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self   # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def fail(self, action: str, count: int = 1, match: str = "") -> None:
        with self._lock:
            self.rules.append([action, count, match.encode()])

    def take(self, head: bytes) -> str | None:
        first = head.split(b"\r\n", 1)[0]
        ranged = re.search(rb"\r\nrange: *([^\r]*)", head, re.IGNORECASE)
        with self._lock:
            # ("[range bytes=A-B]" after a ranged GET's first line: a part of the object, not all of it)
            self.seen.append(first.decode("latin-1") + (f" [range {ranged.group(1).decode()}]" if ranged else ""))
            for rule in self.rules:
                if rule[1] > 0 and rule[2] in first:
                    rule[1] -= 1
                    return rule[0]
        return None

    def throttle(self, nbytes: int) -> None:
        if self.bytes_per_s:
            time.sleep(nbytes / self.bytes_per_s)

    def throttle_download(self, nbytes: int) -> None:
        if self.download_bytes_per_s:
            with self._link:   # one response at a time: the connections share the link's rate
                time.sleep(nbytes / self.download_bytes_per_s)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def s3_client(endpoint: str):
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint, **{
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"], "region_name": "us-east-1"})


def listing(client, bucket: str, prefix: str = "") -> dict:
    """{key: size} of every object under ``prefix``."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def open_uploads(client, bucket: str) -> list:
    return client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


# One server for every module that takes it from one place (integration's conftest.py): each test
# has a bucket of its own (the s3 fixture), so they need not start a server each.
@pytest.fixture(scope="session")
def s3_server():
    with moto_server() as url:
        yield url


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """A fresh bucket behind a FaultProxy; the environment points boto3 at the proxy. Yields a
    namespace: ``url`` (the proxy), ``server``, ``bucket``, ``proxy``, ``client`` (direct)."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    proxy = FaultProxy(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    client = s3_client(s3_server)
    bucket = f"lowdiff-{abs(hash(request.node.nodeid)) % 10**10:010d}"
    client.create_bucket(Bucket=bucket)

    class NS:
        pass
    ns = NS()
    ns.url, ns.server, ns.bucket, ns.proxy, ns.client = proxy.url, s3_server, bucket, proxy, client
    try:
        yield ns
    finally:
        proxy.close()


# ---------------------------------------------------------------------- a fork server of trainers
class Spawner:
    """A process that imports torch, lowdiff and boto3 once and forks a demo trainer
    (``python -m lowdiff.cli.demo`` arguments) per ``start``: each trial's trainer is a real
    process, killed with a real SIGKILL, without paying the imports each time. The spawner runs
    no torch operation itself (a fork after one could inherit a thread pool's locks)."""

    def __init__(self):
        import sys

        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._process = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=env, text=True, cwd=repo)

    def start(self, argv: list, out: str, env: dict) -> int:
        import json

        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps({"argv": argv, "out": out, "env": env}) + "\n")
        self._process.stdin.flush()
        return int(self._process.stdout.readline())

    def close(self) -> None:
        if self._process.stdin:
            self._process.stdin.close()
        self._process.wait(30)
        if self._process.stdout:
            self._process.stdout.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _spawn_loop() -> None:
    import json
    import signal
    import sys
    import traceback

    import boto3  # noqa: F401  (imported once, here)
    import torch  # noqa: F401

    import lowdiff.cli.demo as demo
    import recovery  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # children are reaped by the kernel
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            fd = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(job["env"])
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 1
            try:
                code = demo.main(job["argv"])
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    _spawn_loop()
