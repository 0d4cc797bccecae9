"""The store of the remote implementations: moto's S3 server on 127.0.0.1, in a process of its own, with counters.

The server runs moto's own WSGI application behind a counting layer: for every request it counts, per node, the
requests and the bytes of the response bodies of ``GET`` requests (what the node fetched), and it keeps the peak
memory and the CPU time of the server process. A node is known by the ``app/bench-node-N`` that botocore appends to
the User-Agent of every request when ``AWS_SDK_UA_APP_ID`` is set in the rank's environment (the runner sets it), so
the count covers every client, this project's and Lightning's alike.

``--s3-server ranged`` adds a **benchmark-only shim** to that server (never used by the tests): moto 5 answers a
ranged ``GET`` by reading the whole object out of its buffer and then slicing it (``FakeKey.value``), so the time of
a client that reads by ranges grows with the object's size times its requests. The shim serves a single range by a
seek and a read of exactly its bytes; everything else (authentication, headers, ETags, errors) is moto's own code.
Every remote row of a run uses the same server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from .output import _log

_BUCKET = "bench"
_KEY = "bench-key"
_SECRET = "bench-secret"
_REGION = "us-east-1"
_COUNTERS = "/__bench__/counters"
_NODE_TAG = re.compile(r"app/bench-node-(\d+)")
#: What the ranks of node ``N`` put into their User-Agent (botocore appends ``app/<value>``).
NODE_APP_ID = "bench-node-{}"
SERVERS = ("stock", "ranged")
#: The implementations that load from the store: lightning-fsdp (its S3 client created during the load, or before the
#: base window), and Lightning master's ``load_checkpoint`` (``cloud_io._load``: every rank downloads the whole file).
REMOTE_IMPLEMENTATIONS = ("s3", "s3-client-in-base", "master-s3")
#: What Lightning master loads from a remote URL: a full checkpoint with ``fabric.load``, a raw state dict in a torch
#: zip or legacy file with ``fabric.load_raw`` (``torch.load`` of the whole object).
MASTER_REMOTE_FORMATS = ("full", "zip", "legacy")


class ObjectStore:
    """The server process as the runner sees it: its URLs, the options that reach it, its counters."""

    def __init__(self, process: subprocess.Popen, endpoint: str, server: str, cgroup: Any = None) -> None:
        self.process = process
        self.endpoint = endpoint
        self.server = server
        self.cgroup = cgroup
        self.urls: dict[str, str] = {}

    @property
    def storage_options(self) -> dict[str, Any]:
        """What lightning-fsdp's ranks pass to ``load_options(storage_options=...)``."""
        return {
            "endpoint_url": self.endpoint,
            "key": _KEY,
            "secret": _SECRET,
            "client_kwargs": {"region_name": _REGION},
        }

    @property
    def environment(self) -> dict[str, str]:
        """The same, as the environment of a client configured the usual way (Lightning's ``get_filesystem(path)``
        passes no options: botocore reads these)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": _KEY,
            "AWS_SECRET_ACCESS_KEY": _SECRET,
            "AWS_DEFAULT_REGION": _REGION,
        }

    def reset(self) -> None:
        """Zero the counters and the server's peak memory (before a load)."""
        _control(self.endpoint, reset=True)

    def counters(self) -> dict[str, Any]:
        """``{"nodes": {node: {"get_bytes", "requests"}}, "peak_rss": bytes, "cpu_seconds": s}`` since the last
        :meth:`reset`."""
        return _control(self.endpoint, reset=False)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.cgroup is not None:
            self.cgroup.close()


def start_object_store(
    meta: dict[str, Any], workdir: Path, server: str = "stock", cap: int | None = None
) -> ObjectStore:
    """Start the server (``stock`` moto, or ``ranged``: with the shim), upload every checkpoint file (and its parts).

    With ``cap``, the server runs in a memory cgroup of that size (stock moto holds a whole object per ranged request).
    """
    import boto3

    ready = workdir / "object_store.port"
    ready.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve().parent), "--_object_store", f"{ready}:{server}"]
    cgroup = None
    if cap is not None:
        from .capacity import CgroupLimit

        cgroup = CgroupLimit(cap)
        command = cgroup.wrap(command)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.is_file() or not ready.read_text().strip():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the S3 server did not start: {process.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    store = ObjectStore(process, f"http://127.0.0.1:{ready.read_text().strip()}", server, cgroup)
    client = boto3.client(
        "s3", endpoint_url=store.endpoint, aws_access_key_id=_KEY, aws_secret_access_key=_SECRET, region_name=_REGION
    )
    client.create_bucket(Bucket=_BUCKET)
    _log(f"S3 server ({server} moto) at {store.endpoint}: uploading the checkpoints")
    for fmt, entry in meta["files"].items():
        path = Path(entry["path"])
        for file in [path, *(Path(part) for part in entry.get("parts", []))]:
            client.upload_file(str(file), _BUCKET, f"{fmt}/{file.name}")
        store.urls[fmt] = f"s3://{_BUCKET}/{fmt}/{path.name}"
    return store


def _control(endpoint: str, reset: bool) -> dict[str, Any]:
    method = "POST" if reset else "GET"
    request = urllib.request.Request(endpoint + _COUNTERS, data=b"" if reset else None, method=method)
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


# The server process (``python benchmarks/bench_load --_object_store PORT_FILE:SERVER``).


def serve(argument: str) -> None:
    """Run moto's S3 server on a free port of 127.0.0.1 until terminated; write the port to the file named."""
    import logging

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    port_file, _, server = argument.rpartition(":")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    if server == "ranged":
        _serve_ranges_by_seek()
    app = _Counting(DomainDispatcherApplication(create_backend_app))
    httpd = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    Path(port_file).write_text(str(httpd.server_address[1]))
    httpd.serve_forever()


class _Counting:
    """WSGI middleware: requests and ``GET`` body bytes per node (from the User-Agent), the process's peak RSS and CPU
    time."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._nodes: dict[str, dict[str, int]] = {}
        self._cpu = _cpu_seconds()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == _COUNTERS:
            return self._control(environ, start_response)
        tag = _NODE_TAG.search(environ.get("HTTP_USER_AGENT", ""))
        node = tag.group(1) if tag else "other"
        with self._lock:
            self._node(node)["requests"] += 1
        body = self._app(environ, start_response)
        if environ.get("REQUEST_METHOD") != "GET":
            return body
        return self._counted(body, node)

    def _node(self, node: str) -> dict[str, int]:
        return self._nodes.setdefault(node, {"get_bytes": 0, "requests": 0})

    def _counted(self, body: Any, node: str) -> Any:
        try:
            for chunk in body:
                with self._lock:
                    self._node(node)["get_bytes"] += len(chunk)
                yield chunk
        finally:
            if hasattr(body, "close"):
                body.close()

    def _control(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        with self._lock:
            answer = {"nodes": self._nodes, "peak_rss": _peak_rss(), "cpu_seconds": _cpu_seconds() - self._cpu}
            if environ.get("REQUEST_METHOD") == "POST":
                self._nodes = {}
                self._cpu = _cpu_seconds()
                with open("/proc/self/clear_refs", "w") as file:  # the peak starts again from the current RSS
                    file.write("5")
        data = json.dumps(answer).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]


def _cpu_seconds() -> float:
    """The CPU time this process has used (user and system, all its threads)."""
    times = os.times()
    return times.user + times.system


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return 1024 * int(line.split()[1])
    return 0


def _serve_ranges_by_seek() -> None:
    """Benchmark-only: let moto answer a ``GET`` with one byte range by reading only that range of the object.

    moto's ``get_object`` returns the whole object (``FakeKey.value`` reads and copies its buffer) and the range is
    sliced out of it afterwards. Here the key's value is, for such a request only, a view whose slice seeks and reads
    the key's buffer under the key's lock; moto's code does everything else, and any other request is unchanged.
    """
    from moto.s3.responses import S3Response

    get_object = S3Response.get_object
    handle_range_header = S3Response._handle_range_header

    def ranged_get_object(self: Any) -> Any:
        spec = self.headers.get("range") or ""
        if not re.fullmatch(r"bytes=\d*-\d*", spec) or "partNumber" in self.querystring:
            return get_object(self)
        get_key = self._get_key

        def get_key_with_view(*args: Any, **kwargs: Any) -> Any:
            key, not_modified = get_key(*args, **kwargs)
            return _KeyWithRangeView(key), not_modified

        self._get_key = get_key_with_view  # this request's instance only (moto makes one per request)
        return get_object(self)

    def ranged_handle_range_header(self: Any, request: Any, headers: Any, content: Any) -> Any:
        status, headers, body = handle_range_header(self, request, headers, content)
        return status, headers, body.whole() if isinstance(body, _RangeView) else body

    S3Response.get_object = ranged_get_object
    S3Response._handle_range_header = ranged_handle_range_header


class _KeyWithRangeView:
    """A moto ``FakeKey`` whose ``value`` is a :class:`_RangeView` (every other attribute is the key's)."""

    def __init__(self, key: Any) -> None:
        self._key = key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._key, name)

    @property
    def value(self) -> _RangeView:
        return _RangeView(self._key)


class _RangeView:
    """The bytes of a key, read only where sliced: ``view[a:b]`` seeks to ``a`` and reads ``b - a`` bytes."""

    def __init__(self, key: Any) -> None:
        self._key = key

    def __len__(self) -> int:
        return self._key.size

    def __getitem__(self, item: slice) -> bytes:
        start, stop, _ = item.indices(len(self))
        with self._key.lock:
            self._key._value_buffer.seek(start)
            return self._key._value_buffer.read(max(0, stop - start))

    def whole(self) -> bytes:
        return self._key.value


def main_server() -> None:
    """The entry point of the server process (from ``__main__``)."""
    serve(sys.argv[2])
    os._exit(0)
