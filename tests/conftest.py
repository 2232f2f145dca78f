"""Shared fixtures: one Ray instance per session, one cached tiny corpus, a tiny-config factory."""

from __future__ import annotations

import os

import pytest

from raysc.config import Config, load_config

TINY = [
    "model.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "train.seq_len=64", "train.global_batch=8", "train.steps=20", "train.log_every=10",
    "schedule.warmup_steps=5", "data.max_corpus_mb=1.0", "data.tokenizer_sample_mb=0.5",
    "parallel.cpus_per_worker=1",
    # warm spares cost a process start per rank; on 2 cores that slows every test run, so only the
    # recovery tests that measure or rely on them turn them on
    "supervisor.warm_spares=false",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("raysc-cache"))


@pytest.fixture
def make_cfg(cache_dir, tmp_path):
    """A tiny config whose run directory lives in this test's tmp_path."""

    def make(*overrides: str, run: str = "run") -> Config:
        return load_config(None, [*TINY, f'data.cache_dir="{cache_dir}"', f'run.dir="{tmp_path / run}"',
                                  *overrides])

    return make


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=8, include_dashboard=False, configure_logging=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server (moto) on 127.0.0.1 for the object-store tests; yields its endpoint."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server._server.server_address
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing-secret", region_name="us-east-1")
    yield {"endpoint": endpoint, "client": client, "server": server}
    server.stop()


def s3_options(endpoint: str) -> str:
    return (f'checkpoint.storage_options={{endpoint_url = "{endpoint}", key = "testing", '
            f'secret = "testing-secret", region_name = "us-east-1"}}')
