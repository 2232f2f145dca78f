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


class LatencyProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target`` (host, port) that holds each request a client sends
    for ``delay_s`` before forwarding it: every round trip to the store (a GET, a HEAD) costs that much
    more, as an object store in another building does (S3 in-region first-byte latency is ~10-50 ms).
    ``endpoint`` is its URL."""

    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        import socket
        import threading

        self.target, self.delay_s = target, delay_s
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src, dst, delayed: bool) -> None:
        import time

        try:
            while data := src.recv(1 << 20):
                if delayed:
                    time.sleep(self.delay_s)  # a request's bytes (a pipelined one's too) wait one round trip
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
