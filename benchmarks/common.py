"""Shared pieces of the benchmarks: an S3-compatible server (moto) on 127.0.0.1 with a fresh bucket, the
exported dtype and a vLLM child runner, and text degraded the way crawled text goes bad."""

from __future__ import annotations

import random
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
    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET, region_name=S3_REGION
    ).create_bucket(Bucket=bucket)
    return server, endpoint, bucket


def s3_options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "key": S3_KEY, "secret": S3_SECRET, "region_name": S3_REGION}


def exported_dtype(folder: str) -> str:
    """The dtype ``raysc serve`` hands vLLM for a Hugging Face folder (``raysc.serve.command.exported_dtype``;
    vLLM's own ``dtype="auto"`` would serve an fp32 checkpoint in bf16)."""
    import json
    from pathlib import Path

    from raysc.serve.command import exported_dtype as from_config

    return from_config(json.loads((Path(folder) / "config.json").read_text()))


def run_vllm_child(script: str, args: list[str], timeout: float) -> dict:
    """Run ``script ARGS`` (a benchmark's vLLM child: vLLM spawns its engine, so it starts under its own
    ``__main__``) with the CPU build's settings; its last JSON line, or {"error": the last stderr lines}."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    p = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"error": "\n".join(p.stderr.strip().splitlines()[-5:])[-800:] or "no output"}
    return json.loads(lines[-1])


LETTERS = "bcdfghjklmnpqrstvwxz"


def degrade(text: str, kind: str, rng: random.Random) -> str:
    """``noise``: a third of the words replaced by random letters (OCR and encoding debris);
    ``salad``: the words shuffled into one line (spun SEO text, word statistics unchanged)."""
    words = text.split()
    if kind == "noise":
        return " ".join("".join(rng.choice(LETTERS) for _ in w) if rng.random() < 1 / 3 else w for w in words)
    rng.shuffle(words)
    return " ".join(words)
