"""A real S3 API on loopback for the tests: moto's server, behind a small proxy that fails requests on purpose.

The ranks (other processes) reach the proxy through ``storage_options``; rank 0 sets the faults of a case through the
proxy's control path (``/__faults__``), so a multi-rank test can run several cases in one process group. Only
127.0.0.1 is ever bound or contacted.
"""

import http.client
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

BUCKET = "checkpoints"
#: Credentials of the fake store: distinctive, so that a test can tell they never appear in a message.
KEY = "AKIAFAKEKEYLIGHTNING"
SECRET = "fake-secret-never-in-messages-42"
_REGION = "us-east-1"
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


@dataclass
class _Faults:
    rules: list[dict[str, Any]] = field(default_factory=list)
    get_bytes: int = 0
    requests: int = 0
    fired: int = 0
    first_fired_at: float = 0.0
    """When the first fault since the rules were set was made (``time.time()``: the ranks' clock too); 0: none."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, method: str, range_header: str | None, key: str) -> dict[str, Any] | None:
        """The fault for this request, if a rule matches it (a rule fires ``count`` times, ``-1``: always).

        ``range_header`` is the request's ``Range`` (``None``: none); a rule with ``min_range_bytes`` fires only for
        ranges at least that long, and one with ``"same_range": True`` only for the range of the first request it
        fired for (that range's retries, never another rank's ranges).

        """
        range_bytes = _range_bytes(range_header)
        with self.lock:
            self.requests += 1
            for rule in self.rules:
                if rule.get("method", "GET") != method or (rule.get("ranged", True) and range_bytes is None):
                    continue
                if (range_bytes or 0) < rule.get("min_range_bytes", 0):
                    continue
                if rule.get("key") not in (None, key):
                    continue
                if rule.get("same_range") and rule.setdefault("range", range_header) != range_header:
                    continue
                if rule.get("skip", 0) > 0:
                    rule["skip"] -= 1
                    continue
                if rule["count"] == 0:
                    continue
                rule["count"] -= 1
                self.fired += 1
                self.first_fired_at = self.first_fired_at or time.time()
                return rule
        return None


class FaultProxy:
    """Forwards every request to the S3 server, except those a fault rule fails."""

    def __init__(self, upstream_port: int) -> None:
        self.faults = _Faults()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.startswith("/__"):
                    self._control(body)
                    return
                key = self.path.split("?")[0].lstrip("/").split("/", 1)[-1]
                rule = proxy.faults.take(self.command, self.headers.get("Range"), key)
                if rule is not None and rule["kind"] == "status":
                    self._reply(rule["status"], _error_xml(rule["code"]), {"Content-Type": "application/xml"})
                    return
                if rule is not None and rule["kind"] == "replace":
                    proxy.replace(rule["key"], rule["flip_at"])
                if rule is not None and rule["kind"] == "redirect":  # to another server on loopback
                    proxy.impostor.rule = rule
                    self._reply(307, b"", {"Location": proxy.impostor.url + self.path})
                    return
                if rule is not None and rule["kind"] == "stall":  # accept, read the request, never answer
                    proxy.released.wait(min(float(rule.get("seconds", 30)), 120.0))
                    self.close_connection = True
                    return
                connection = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                if rule is not None and rule["kind"] == "unranged":  # a store that ignores `Range`: the whole object
                    headers = {k: v for k, v in headers.items() if k.lower() != "range"}
                if rule is not None and rule["kind"] == "shifted":  # the range one byte earlier, honestly labelled
                    first, _, last = headers["Range"].removeprefix("bytes=").partition("-")
                    headers["Range"] = f"bytes={int(first) - 1}-{int(last) - 1}"
                connection.request(self.command, self.path, body=body or None, headers=headers)
                response = connection.getresponse()
                data = response.read()
                connection.close()
                kept = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_HEADERS}
                if self.command == "GET":
                    with proxy.faults.lock:
                        proxy.faults.get_bytes += len(data)
                if rule is not None and rule["kind"] == "reset":  # the headers and half of the body, then a reset
                    self.send_response(response.status)
                    for name, value in kept.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.close_connection = True
                    return
                if rule is not None and rule["kind"] == "short":  # a whole answer, one byte short of the range
                    data = data[:-1]
                length = int(response.getheader("Content-Length") or 0) if self.command == "HEAD" else len(data)
                self._reply(response.status, data, kept, length)

            def _control(self, body: bytes) -> None:
                if self.path == "/__faults__":
                    with proxy.faults.lock:
                        proxy.faults.rules = json.loads(body or b"[]")
                        proxy.faults.get_bytes = proxy.faults.requests = proxy.faults.fired = 0
                        proxy.faults.first_fired_at = 0.0
                with proxy.faults.lock:
                    faults = proxy.faults
                    stats = {"get_bytes": faults.get_bytes, "requests": faults.requests, "fired": faults.fired}
                    stats["first_fired_at"] = faults.first_fired_at
                self._reply(200, json.dumps(stats).encode(), {"Content-Type": "application/json"})

            def _reply(self, status: int, data: bytes, headers: dict[str, str], length: int | None = None) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data) if length is None else length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.client: Any = None
        #: Set to end the stalls at once (they end by themselves after their ``seconds``).
        self.released = threading.Event()
        self.impostor = _Impostor()

    def replace(self, key: str, flip_at: float) -> None:
        """Replace the object ``key`` by one of the same size with one byte changed (a new ETag): the byte at the
        fraction ``flip_at`` of its size."""
        data = bytearray(self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        data[int(len(data) * flip_at)] ^= 0xFF
        self.client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))

    def stop(self) -> None:
        self.released.set()
        self.impostor.stop()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


class _Impostor:
    """Another server on loopback, where the proxy's ``redirect`` faults send a request.

    With ``"mirror": True`` in the rule it serves the real object (read from the S3 server), as a mirror would;
    otherwise zeros for the range asked for, with the rule's ``total`` in ``Content-Range`` and its ``etag``, as
    another object under the same name would.

    """

    def __init__(self) -> None:
        self.rule: dict[str, Any] = {}
        self.client: Any = None
        impostor = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                rule = impostor.rule
                first, _, last = (self.headers.get("Range") or "bytes=0-0").removeprefix("bytes=").partition("-")
                if rule.get("mirror"):  # the same object, read with the store's own client
                    bucket, key = self.path.split("?")[0].lstrip("/").split("/", 1)
                    answer = impostor.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={first}-{last}")
                    data = answer["Body"].read()
                    content_range, etag = answer["ContentRange"], answer["ETag"]
                else:
                    data = bytes(int(last) - int(first) + 1)
                    content_range, etag = f"bytes {first}-{last}/{rule['total']}", f'"{rule["etag"]}"'
                self.send_response(206)
                self.send_header("Content-Range", content_range)
                self.send_header("ETag", etag)
                self.send_header("Content-Type", "binary/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def _range_bytes(header: str | None) -> int | None:
    """The length of the range ``bytes=FIRST-LAST`` asks for (``None`` without one; 0 for another form)."""
    if header is None:
        return None
    first, _, last = header.removeprefix("bytes=").partition("-")
    return int(last) - int(first) + 1 if first.isdigit() and last.isdigit() else 0


def _error_xml(code: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{code} (injected by the test'
        f" proxy)</Message><RequestId>0</RequestId></Error>"
    ).encode()


@dataclass
class ObjectStore:
    """The fake store as a test sees it."""

    endpoint: str
    """The moto server itself (uploads go here, never through the faults)."""
    proxy: str
    client: Any

    def storage_options(self) -> dict[str, Any]:
        """What a rank passes to ``load_options(storage_options=...)``: the proxy, fake credentials, and no retries of
        botocore's own (see :func:`without_client_retries` for s3fs's)."""
        return {
            "endpoint_url": self.proxy,
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"region_name": _REGION},
            "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
            "skip_instance_cache": True,
        }

    def upload(self, local: Path, prefix: str) -> str:
        """Upload a file, or every file of a directory, under ``prefix``; return the ``s3://`` URL of ``local``."""
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        base = local.parent if local.is_file() else local
        for file in files:
            self.client.upload_file(str(file), BUCKET, f"{prefix}/{file.relative_to(base).as_posix()}")
        return f"s3://{BUCKET}/{prefix}/{local.name}" if local.is_file() else f"s3://{BUCKET}/{prefix}"


def without_client_retries() -> None:
    """Let s3fs try each request once (a class attribute, not an option), so the loader's retries are under test."""
    from s3fs import S3FileSystem

    S3FileSystem.retries = 1


def set_faults(proxy: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    """Replace the proxy's fault rules (and zero its counters); return the counters before."""
    return _control(proxy, "/__faults__", rules)


def proxy_stats(proxy: str) -> dict[str, Any]:
    return _control(proxy, "/__stats__", None)


def _control(proxy: str, path: str, payload: Any) -> dict[str, Any]:
    data = None if payload is None else json.dumps(payload).encode()
    with urllib.request.urlopen(urllib.request.Request(proxy + path, data=data, method="POST"), timeout=30) as answer:
        return json.loads(answer.read())


@pytest.fixture(scope="session")
def object_store() -> Iterator[ObjectStore]:
    """moto's S3 server and the fault proxy on 127.0.0.1 (free ports), with one bucket; stopped after the session."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = "http://{}:{}".format(*server.get_host_and_port())
    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name=_REGION
    )
    client.create_bucket(Bucket=BUCKET)
    proxy = FaultProxy(int(endpoint.rsplit(":", 1)[1]))
    proxy.client = proxy.impostor.client = client
    try:
        yield ObjectStore(endpoint, proxy.url, client)
    finally:
        proxy.stop()
        server.stop()
