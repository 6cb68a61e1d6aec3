"""Loopback test servers: a static HTTP file server, a moto S3 server, and a fault-injecting
proxy in front of either that counts GET requests per path.

Everything listens on 127.0.0.1 with a port the OS picks, runs in daemon threads, and is stopped
by the fixture that started it.
"""

from __future__ import annotations

import functools
import http.client
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["FaultPlan", "FaultProxy", "FileServer", "MotoS3"]

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


class _Quiet:
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib's name
        pass


class _FileHandler(_Quiet, SimpleHTTPRequestHandler):
    pass


class _Server:
    """A ThreadingHTTPServer on a free loopback port, served from a daemon thread."""

    def __init__(self, handler: type[BaseHTTPRequestHandler] | functools.partial) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


class FileServer(_Server):
    """Python's own HTTP server serving `root` (GET and HEAD, no ranges)."""

    def __init__(self, root: Path) -> None:
        super().__init__(functools.partial(_FileHandler, directory=str(root)))


@dataclass
class FaultPlan:
    """Which GET requests (numbered from 1 among those whose path ends in `suffix`) fail, and how.

    Args:
        every_503: every k-th such request answers 503 (0: never).
        every_short: every k-th (that is not a 503) sends half its body, then closes.
        resets: request numbers whose connection is reset before any answer.
        stall: every such request is read and never answered (the connection stays open until
            the proxy stops): a server that accepts and hangs.
        stalls: request numbers that stall so (a server that hangs now and then).
        every_wrong: every k-th answers 200 with the full length, one byte of the body changed
            (a wrong body: a cache or middlebox that corrupts what it serves).
        every_truncated: every k-th answers 200 with the first half of the body and a matching
            Content-Length (a short body the server says is whole).
        fail_paths: paths (e.g. "/train-000001.tar") that always answer 503.
        delay: seconds each such request waits before it is answered (a slow store).
        suffix: only paths ending so are counted and faulted (".tar": the shards).
    """

    every_503: int = 0
    every_short: int = 0
    resets: frozenset[int] = frozenset()
    stall: bool = False
    stalls: frozenset[int] = frozenset()
    every_wrong: int = 0
    every_truncated: int = 0
    fail_paths: frozenset[str] = frozenset()
    delay: float = 0.0
    suffix: str = ".tar"
    injected: Counter = field(default_factory=Counter)

    def fault(self, number: int) -> str | None:
        if self.stall or number in self.stalls:
            return "stall"
        if number in self.resets:
            return "reset"
        if self.every_503 and number % self.every_503 == 0:
            return "503"
        if self.every_short and number % self.every_short == 0:
            return "short"
        if self.every_wrong and number % self.every_wrong == 0:
            return "wrong"
        if self.every_truncated and number % self.every_truncated == 0:
            return "truncated"
        return None


class FaultProxy(_Server):
    """Forwards GET/HEAD to `upstream`, injecting `plan`'s faults; counts GETs per path.

    Attributes:
        gets: GET requests per path (query stripped), all of them.
        served: GET requests per path answered in full with a 2xx.
    """

    def __init__(self, upstream: str, plan: FaultPlan | None = None) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.plan = plan or FaultPlan()
        self.gets: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._numbered = 0
        self.released = threading.Event()  # set by stop(): stalled requests end
        super().__init__(functools.partial(_ProxyHandler, self))

    def stop(self) -> None:
        self.released.set()
        super().stop()

    def next_fault(self, path: str) -> str | None:
        with self._lock:
            self.gets[path] += 1
            if not path.endswith(self.plan.suffix):
                return None
            self._numbered += 1
            fault = "503" if path in self.plan.fail_paths else self.plan.fault(self._numbered)
            if fault:
                self.plan.injected[fault] += 1
            return fault


class _ProxyHandler(_Quiet, BaseHTTPRequestHandler):
    def __init__(self, proxy: FaultProxy, *args: object) -> None:
        self.proxy = proxy
        super().__init__(*args)

    def do_HEAD(self) -> None:
        self._forward(None)

    def do_GET(self) -> None:
        self._forward(self.proxy.next_fault(self.path.split("?", 1)[0]))

    def _forward(self, fault: str | None) -> None:
        if fault == "stall":  # never answers; the connection ends when the proxy stops
            self.proxy.released.wait(timeout=300)
            self.close_connection = True
            return
        if self.proxy.plan.delay and self.path.split("?", 1)[0].endswith(self.proxy.plan.suffix):
            time.sleep(self.proxy.plan.delay)
        if fault == "reset":  # SO_LINGER 0: close() sends RST, the client sees ECONNRESET
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if fault == "503":
            body = b"<Error><Code>SlowDown</Code><Message>injected 503</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        conn = http.client.HTTPConnection(self.proxy.upstream, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            conn.request(self.command, self.path, headers=headers)
            response = conn.getresponse()
            body = response.read()
            length = int(response.getheader("Content-Length", len(body)))
            if fault == "wrong" and body:
                at = len(body) // 2 + (self.proxy._numbered * 7919) % max(len(body) // 2, 1)
                at = min(at, len(body) - 1)
                body = body[:at] + bytes([body[at] ^ 0x04]) + body[at + 1 :]
            elif fault == "truncated":
                body = body[: len(body) // 2]
                length = len(body)
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_HEADERS:
                    self.send_header(key, value)
        finally:
            conn.close()
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault == "short":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)
        if 200 <= response.status < 300:
            with self.proxy._lock:
                self.proxy.served[self.path.split("?", 1)[0]] += 1


class MotoS3:
    """moto's S3-compatible server (`moto[server]`, no Docker) on a free loopback port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.url = f"http://{host}:{port}"

    def options(self, endpoint: str | None = None) -> dict:
        """s3fs storage options for this server (or a proxy in front of it), fake credentials.

        botocore's own retries are off: fastdata's retry (fast in the tests) does that job.
        """
        return {
            "endpoint_url": endpoint or self.url,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}},
        }

    def as_environment(self, monkeypatch) -> None:
        """Point every S3 client without storage options (the CLI's, `write_shards`'s) at this
        server through botocore's environment variables, with fake credentials."""
        from s3fs import S3FileSystem

        for name, value in {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(name, value)
        S3FileSystem.clear_instance_cache()  # an earlier instance may hold another endpoint

    def create_bucket(self, name: str) -> None:
        import boto3  # comes with moto

        client = boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)

    def stop(self) -> None:
        self.server.stop()
