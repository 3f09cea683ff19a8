"""moto S3 for a lab: a real S3 API bound to the lab bridge's host IP (the lab's nodes reach it there;
nothing else does), one fresh bucket, and the few reads the lab tests make of it."""

from __future__ import annotations

import contextlib
import uuid
from typing import Iterator


@contextlib.contextmanager
def moto_bucket(host_ip: str, prefix: str) -> Iterator[dict]:
    """Yields ``env`` (what a dtrun process needs to reach it), ``bucket``, ``url``, and ``get``,
    ``exists``, ``keys`` (object bytes, a prefix exists, the keys under a prefix); stopped after."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=host_ip, port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
        bucket = f"{prefix}-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(Bucket=bucket)

        def get(key: str) -> bytes:
            return s3.get_object(Bucket=bucket, Key=key)["Body"].read()

        def exists(key: str) -> bool:
            return s3.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount", 0) > 0

        def keys(prefix: str) -> list[str]:
            return [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                    for o in p.get("Contents", [])]

        yield {"env": env, "bucket": bucket, "url": url, "get": get, "exists": exists, "keys": keys}
    finally:
        server.stop()
