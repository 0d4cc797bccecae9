"""The ``s3`` implementation's store: moto's S3 server on 127.0.0.1 (a free port), holding copies of the checkpoints.

The ranks load from ``s3://`` URLs through s3fs with the fake credentials below; the bytes each rank fetched come
from the client's counter (``lightning_fsdp.loading.files.fetched_bytes``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_BUCKET = "bench"
_KEY = "bench-key"
_SECRET = "bench-secret"
_REGION = "us-east-1"


def start_object_store(meta: dict[str, Any]) -> Any:
    """Start the server, upload every checkpoint file (and its parts), and put the URLs into ``meta["remote"]``."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = "http://{}:{}".format(*server.get_host_and_port())
    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=_KEY, aws_secret_access_key=_SECRET, region_name=_REGION
    )
    client.create_bucket(Bucket=_BUCKET)
    meta["remote"] = {}
    for fmt, entry in meta["files"].items():
        path = Path(entry["path"])
        for file in [path, *(Path(part) for part in entry.get("parts", []))]:
            client.upload_file(str(file), _BUCKET, f"{fmt}/{file.name}")
        meta["remote"][fmt] = f"s3://{_BUCKET}/{fmt}/{path.name}"
    meta["storage_options"] = {
        "endpoint_url": endpoint,
        "key": _KEY,
        "secret": _SECRET,
        "client_kwargs": {"region_name": _REGION},
    }
    return server
