"""Checkpoints in an S3-compatible store (moto on 127.0.0.1): exact resume, fail-fast probes,
no leaked secrets, retention and the hot copy."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
import torch

from conftest import s3_options
from raysc.checkpoint.store import CheckpointStore
from raysc.export.restore import load_run
from raysc.fleet.errors import RunFailed
from raysc.fleet.records import read_jsonl

SECRET = "testing-secret"


def _bucket(s3_server) -> str:
    name = f"raysc-{uuid.uuid4().hex[:10]}"
    s3_server["client"].create_bucket(Bucket=name)
    return name


def test_s3_resume_is_bit_exact_and_secrets_stay_out(ray_session, s3_server, make_cfg, monkeypatch):
    """A run that stopped after step 10 resumes from its S3 checkpoint and continues the uninterrupted
    run's loss curve, schedule, data cursor and parameters bit for bit (the one bit-exact resume test:
    the local store's resume is exercised by the corrupted-checkpoint fallback in test_training)."""
    from raysc.fleet.driver import train

    bucket = _bucket(s3_server)
    opts = s3_options(s3_server["endpoint"])
    full = make_cfg(
        f'checkpoint.uri="s3://{bucket}/full"',
        opts,
        "checkpoint.every_steps=5",
        "checkpoint.keep_last=2",
        "checkpoint.keep_every_steps=10",
        "train.steps=20",
        run="full",
    )
    train(full, progress=False)
    store = CheckpointStore(full.checkpoint_uri, full.checkpoint.storage_options)
    assert store.steps() == [10, 15, 20]  # keep_last=2 plus the keep_every_steps=10 long-term keep
    manifest = store.read_manifest(20)
    assert {f["path"] for f in manifest["files"]} >= {".metadata", "__0_0.distcp", "extra_rank0.safetensors"}
    assert manifest["loader"]["cursor"] == 20 * 8 and manifest["layout"]["world_size"] == 1
    assert len(manifest["detectors"]["spike"]["loss"]) == 20  # the detector's window travels with it
    assert store.verify(20, checksums=True) is None
    ref = {m["step"]: m for m in read_jsonl(Path(full.run_dir) / "metrics.jsonl")}

    # a second run that stopped after step 10 (the checkpoint copied into its own prefix)
    part = make_cfg(
        f'checkpoint.uri="s3://{bucket}/part"', opts, "checkpoint.every_steps=5", "train.steps=20", run="part"
    )
    fs = store.storage.fs
    for f in fs.ls(f"{bucket}/full/step_00000010"):
        fs.copy(f, f.replace("/full/", "/part/"))
    summary = train(part, resume=True, progress=False)
    got = read_jsonl(Path(part.run_dir) / "metrics.jsonl")
    assert [m["step"] for m in got] == list(range(11, 21)) and summary["steps_run"] == 10
    for m in got:  # bit for bit: the same loss curve, schedule and data cursor, and the same final model
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert m[key] == ref[m["step"]][key], (m["step"], key)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # config.toml has them redacted: load_run's
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    a, b = load_run(full.run_dir).model, load_run(part.run_dir).model
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert "resumed" in [e["kind"] for e in read_jsonl(Path(part.run_dir) / "events.jsonl")]

    # secrets appear nowhere the run writes
    for path in [
        Path(full.run_dir) / "config.toml",
        Path(full.run_dir) / "events.jsonl",
        Path(part.run_dir) / "events.jsonl",
    ]:
        assert SECRET not in path.read_text(), path
    assert SECRET not in json.dumps(manifest)


def test_missing_bucket_fails_before_step_one(ray_session, s3_server, make_cfg):
    from raysc.fleet.driver import train

    cfg = make_cfg('checkpoint.uri="s3://no-such-bucket-raysc/run"', s3_options(s3_server["endpoint"]))
    with pytest.raises(RunFailed, match="bucket or directory does not exist"):
        train(cfg, progress=False)
    assert not (Path(cfg.run_dir) / "metrics.jsonl").read_text().strip()


def test_wrong_credentials_fail_before_step_one(ray_session, make_cfg, tmp_path):
    """A store that checks credentials (moto with IAM auth on, in its own process) rejects ours:
    the run stops before step 1 with an error that names the URI and what to check."""
    import subprocess
    import sys

    import boto3

    from raysc.cluster.ports import free_port
    from raysc.fleet.driver import train

    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "1"}  # only the create_bucket below is unauthenticated
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="a", aws_secret_access_key="b", region_name="us-east-1"
        )
        for _ in range(100):
            try:
                client.create_bucket(Bucket="locked")
                break
            except Exception:  # the server is still starting
                time.sleep(0.1)
        cfg = make_cfg('checkpoint.uri="s3://locked/run"', s3_options(endpoint))
        with pytest.raises(RunFailed, match="checkpoint.uri 's3://locked/run': access denied.*credentials"):
            train(cfg, progress=False)
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert (
        not (Path(cfg.run_dir) / "metrics.jsonl").exists()
        or not (Path(cfg.run_dir) / "metrics.jsonl").read_text().strip()
    )  # no step ran
    assert SECRET not in (Path(cfg.run_dir) / "events.jsonl").read_text()


def test_large_files_download_as_parallel_ranges(s3_server, tmp_path):
    """Files above two parts come back as concurrent ranged GETs, byte-exact and checksummed; a
    truncated object is read whole and rejected by size."""
    import hashlib
    import os as _os

    from raysc.checkpoint.storage import MIN_PART
    from raysc.checkpoint.store import CorruptCheckpoint

    bucket = _bucket(s3_server)
    opts = {"endpoint_url": s3_server["endpoint"], "key": "testing", "secret": SECRET, "region_name": "us-east-1"}
    store = CheckpointStore(f"s3://{bucket}/run", opts, concurrency=3)
    assert store.storage.parallel_reads
    payload = _os.urandom(2 * MIN_PART + 12345)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "__0_0.distcp").write_bytes(payload)
    store.commit(1, store.upload(1, tmp_path / "s", ["__0_0.distcp"]), {})
    calls = []
    real = store.storage.fs.cat_ranges
    store.storage.fs.cat_ranges = lambda paths, *a, **k: (calls.append(len(paths)), real(paths, *a, **k))[1]
    store.fetch(1, tmp_path / "f")
    assert calls == [3] and (tmp_path / "f" / "__0_0.distcp").read_bytes() == payload
    assert store.read_manifest(1)["files"][0]["sha256"] == hashlib.sha256(payload).hexdigest()
    store.storage.fs.pipe_file(f"{bucket}/run/step_00000001/__0_0.distcp", payload[:MIN_PART])
    with pytest.raises(CorruptCheckpoint, match="size"):
        store.fetch(1, tmp_path / "g")


def test_unreachable_store_fails_before_step_one(ray_session, make_cfg):
    from raysc.cluster.ports import free_port
    from raysc.fleet.driver import train

    # one try per request: botocore's default retries of a refused connection, with backoff, take
    # 8-11 s on 2 cores and are not what this asserts
    port = free_port()
    options = s3_options(f"http://127.0.0.1:{port}")[:-1] + ", config_kwargs = {retries = {max_attempts = 1}}}"
    cfg = make_cfg('checkpoint.uri="s3://bucket/run"', options)
    # the probe's own verdict (not only the URI, which every probe error names) and the endpoint tried
    with pytest.raises(RunFailed, match=rf"'s3://bucket/run': the store is unreachable .*127\.0\.0\.1:{port}"):
        train(cfg, progress=False)
    # before step one: no worker was started and no step recorded
    kinds = [e["kind"] for e in read_jsonl(Path(cfg.run_dir) / "events.jsonl")]
    assert "run_failed" in kinds and "workers_ready" not in kinds and "data_ready" not in kinds, kinds
    metrics = Path(cfg.run_dir) / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()


def test_save_killed_halfway_is_never_loaded(ray_session, s3_server, make_cfg):
    from raysc.fleet.driver import train

    bucket = _bucket(s3_server)
    opts = s3_options(s3_server["endpoint"])
    args = [f'checkpoint.uri="s3://{bucket}/run"', opts, "train.steps=10", "checkpoint.every_steps=5"]
    with pytest.raises(RunFailed, match="died"):
        train(make_cfg(*args, 'supervisor.inject="kill_save@10"', "supervisor.max_restarts=0"), progress=False)
    cfg = make_cfg(*args)
    store = CheckpointStore(cfg.checkpoint_uri, cfg.checkpoint.storage_options)
    # the failing run abandons the save in flight: its uploaded files deleted, never committed
    abandoned = [e for e in read_jsonl(Path(cfg.run_dir) / "events.jsonl") if e["kind"] == "checkpoint_save_abandoned"]
    assert [e["step"] for e in abandoned] == [10] and abandoned[0]["freed_bytes"] > 0, abandoned
    assert store.read_manifest(10) is None and store.steps() == [5]
    # a supervisor that died with its rank (a lost head node) abandons nothing: its upload's files stay
    store.storage.fs.pipe(f"{bucket}/run/step_00000010/__0_0.distcp", b"half an upload")
    assert store.read_manifest(10) is None and store.steps() == [5]  # never committed, never listed
    summary = train(cfg, resume=True, progress=False)
    events = read_jsonl(Path(cfg.run_dir) / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [5]
    assert summary["steps_run"] == 5 and store.steps() == [5, 10]
    assert store.verify(10, checksums=True) is None  # the leftovers were cleared and step 10 saved anew


def test_ckpt_cli_lists_and_verifies(ray_session, s3_server, make_cfg, capsys):
    from raysc.cli import main
    from raysc.fleet.driver import train

    bucket = _bucket(s3_server)
    cfg = make_cfg(
        f'checkpoint.uri="s3://{bucket}/run"',
        s3_options(s3_server["endpoint"]),
        "train.steps=6",
        "checkpoint.every_steps=3",
    )
    train(cfg, progress=False)
    so = json.dumps(cfg.checkpoint.storage_options)
    capsys.readouterr()
    assert main(["ckpt", "list", cfg.checkpoint_uri, "--storage-options", so, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["step"] for r in rows] == [3, 6] and all(r["verified"] == "yes" for r in rows)
    assert main(["ckpt", "verify", cfg.checkpoint_uri, "--storage-options", so]) == 0
    store = CheckpointStore(cfg.checkpoint_uri, cfg.checkpoint.storage_options)
    shard = f"{bucket}/run/step_00000006/__0_0.distcp"
    data = bytearray(store.storage.fs.cat_file(shard))
    data[10] ^= 1
    store.storage.fs.pipe_file(shard, bytes(data))
    capsys.readouterr()
    assert main(["ckpt", "verify", cfg.checkpoint_uri, "--storage-options", so, "--step", "6"]) == 1
    assert "REFUSED: __0_0.distcp: sha256 mismatch" in capsys.readouterr().out


def test_store_down_during_a_save_is_retried_then_skipped(ray_session, s3_server, make_cfg, monkeypatch):
    """The store refuses every upload of step 10 (503): retries with backoff, no manifest for step 10,
    training goes on, the step-15 save succeeds and the older checkpoints still restore."""
    from raysc.export.restore import load_run
    from raysc.fleet.driver import train

    wsgi = s3_server["server"]._server
    original = wsgi.app

    def flaky(environ, start_response):
        if "step_00000010" in environ.get("PATH_INFO", "") and environ["REQUEST_METHOD"] in ("PUT", "POST"):
            start_response("503 Service Unavailable", [("Content-Type", "application/xml")])
            return [b"<Error><Code>ServiceUnavailable</Code><Message>store down</Message></Error>"]
        return original(environ, start_response)

    bucket = _bucket(s3_server)
    options = s3_options(s3_server["endpoint"])[:-1] + ", config_kwargs = {retries = {max_attempts = 1}}}"
    cfg = make_cfg(
        f'checkpoint.uri="s3://{bucket}/run"',
        options,
        "train.steps=15",
        "checkpoint.every_steps=5",
        "checkpoint.upload_retries=2",
        "checkpoint.keep_last=3",
    )
    wsgi.app = flaky
    try:
        summary = train(cfg, progress=False)
    finally:
        wsgi.app = original
    events = read_jsonl(Path(cfg.run_dir) / "events.jsonl")
    retries = [e["detail"].split(" try ")[0] for e in events if e["kind"] == "checkpoint_upload_retry"]
    assert retries and all(retries.count(f) == 2 for f in set(retries))  # upload_retries=2 per file
    failed = [e for e in events if e["kind"] == "checkpoint_save_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 10
    store = CheckpointStore(cfg.checkpoint_uri, cfg.checkpoint.storage_options)
    assert store.steps() == [5, 15] and store.read_manifest(10) is None
    assert summary["steps"] == 15 and summary["final_loss"] > 0
    # config.toml holds no secrets: reading the run back takes credentials from the environment
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    assert load_run(cfg.run_dir, step=5).step == 5 and load_run(cfg.run_dir).step == 15
