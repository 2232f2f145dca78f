"""Shared pieces of the benchmarks: an S3-compatible server (moto) on 127.0.0.1 with a fresh bucket."""

from __future__ import annotations

import uuid

S3_KEY, S3_SECRET, S3_REGION = "k", "s", "us-east-1"


def start_s3():
    """Start moto on a free loopback port; return (server, endpoint URL, bucket name)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server._server.server_address
    endpoint = f"http://{host}:{port}"
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                 region_name=S3_REGION).create_bucket(Bucket=bucket)
    return server, endpoint, bucket


def s3_options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "key": S3_KEY, "secret": S3_SECRET, "region_name": S3_REGION}


def exported_dtype(folder: str) -> str:
    """The dtype a Hugging Face folder was exported in, as ``raysc serve`` hands it to vLLM (whose own
    ``dtype="auto"`` would serve an fp32 checkpoint in bf16)."""
    import json
    from pathlib import Path

    hf = json.loads((Path(folder) / "config.json").read_text())
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "auto"
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"
