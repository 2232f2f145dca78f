"""A full disk or a spent quota: failed saves clean up after themselves, what retrying cannot fix is not
retried, the lag is reported as it grows, and the run never ends "successfully" with its work unsaved."""

from __future__ import annotations

import errno
import json
import time
import uuid
from pathlib import Path

import pytest

from conftest import s3_options
from raysc.checkpoint.failures import PermanentStorageError, permanent_reason
from raysc.checkpoint.store import CheckpointStore
from raysc.fleet.records import read_jsonl


def _client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    err = ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )
    try:  # s3fs passes unknown codes on as an OSError caused by the ClientError
        raise OSError(errno.EIO, "m") from err
    except OSError as e:
        return e


@pytest.mark.parametrize(
    "exc, permanent",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded"),
        (PermissionError("Access Denied"), "permission denied"),
        (FileNotFoundError("The specified bucket does not exist"), "the bucket or directory is missing"),
        (_client_error("QuotaExceeded", 403), "quota exceeded (QuotaExceeded)"),
        (_client_error("XMinioStorageFull", 507), "no space left on the server (XMinioStorageFull)"),
        (_client_error("SlowDown", 503), None),
        (_client_error("InternalError", 500), None),
        (ConnectionResetError("Connection reset by peer"), None),
        (TimeoutError("read timed out"), None),
    ],
)
def test_failures_are_classified(exc, permanent):
    assert permanent_reason(exc) == permanent


def _stage(tmp: Path, step: int) -> tuple[Path, list[str]]:
    local = tmp / f"stage{step}"
    local.mkdir()
    names = ["__0_0.distcp", "__0_1.distcp", ".metadata"]
    for i, name in enumerate(names):
        (local / name).write_bytes(bytes([i]) * 50_000)
    return local, names


def test_a_full_disk_is_not_retried_and_the_failed_save_is_removed(tmp_path):
    """A real ENOSPC from the kernel: one file of the save lands on /dev/full."""
    store = CheckpointStore(str(tmp_path / "ck"))
    local, names = _stage(tmp_path, 5)
    store.commit(5, store.upload(5, local, names), {})
    local, names = _stage(tmp_path, 10)
    (tmp_path / "ck" / "step_00000010").mkdir()
    (tmp_path / "ck" / "step_00000010" / ".metadata").symlink_to("/dev/full")
    retried: list = []
    t0 = time.perf_counter()
    with pytest.raises(PermanentStorageError, match="no space left on the device") as err:
        store.upload(10, local, names, retries=3, backoff_s=5.0, on_retry=lambda *a: retried.append(a))
    # a retry would have slept its backoff first: less than one backoff means none was waited for
    assert time.perf_counter() - t0 < 5.0 and not retried, "a full disk was retried"
    assert ".metadata" in err.value.detail
    freed = store.discard_failed(10)
    assert not (tmp_path / "ck" / "step_00000010").exists() and freed <= 100_000
    assert store.discard_failed(5) == 0 and store.verify(5, checksums=True) is None  # committed: untouched


def test_transient_failures_are_retried_with_backoff(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path / "ck"))
    local, names = _stage(tmp_path, 1)
    real, calls = store.storage.upload_file, []

    def flaky(path, rel, known=None):
        calls.append(rel)
        if rel.endswith(".metadata") and calls.count(rel) <= 2:
            raise ConnectionResetError("Connection reset by peer")
        return real(path, rel, known=known)

    monkeypatch.setattr(store.storage, "upload_file", flaky)
    retried: list = []
    files = store.upload(1, local, names, retries=3, backoff_s=0.01, on_retry=lambda *a: retried.append(a))
    assert len(files) == 3 and [(n, k) for n, k, _ in retried] == [(".metadata", 1), (".metadata", 2)]


@pytest.fixture
def proxy(s3_server):
    from s3_fault_proxy import FaultProxy

    p = FaultProxy(s3_server["endpoint"])
    yield p
    p.close()


def test_quota_on_s3_cleans_up_reports_the_lag_and_exits_non_zero(
    ray_session, s3_server, proxy, make_cfg, tmp_path, capsys
):
    """Through the S3 HTTP protocol: moto behind a proxy that answers like a store whose quota is spent."""
    from raysc.cli import main
    from raysc.config.load import dump_config

    bucket = f"raysc-{uuid.uuid4().hex[:10]}"
    s3_server["client"].create_bucket(Bucket=bucket)
    store_args = [
        f'checkpoint.uri="s3://{bucket}/run"',
        s3_options(proxy.endpoint),
        "checkpoint.every_steps=5",
        "checkpoint.upload_retries=3",
    ]
    # step 5: two throttled answers, then accepted; step 10 (the last): the quota is spent
    proxy.fail(rf"PUT /{bucket}/run/step_00000005/__0_0\.distcp", "SlowDown", status=503, times=2)
    quota = proxy.fail(rf"PUT /{bucket}/run/step_000000(1\d|2\d)/\.metadata", "QuotaExceeded")
    cfg = make_cfg(*store_args, "train.steps=10", run="finish")
    path = tmp_path / "finish.toml"
    path.write_text(dump_config(cfg))
    assert main(["train", str(path), "--no-progress"]) == 3  # every step ran, the last save did not
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["checkpoint_lag_steps"] == 5 and summary["failed_saves"] == 1
    assert "5 steps behind" in err
    store = CheckpointStore.for_config(cfg)
    assert store.steps() == [5] and proxy.count(rf"PUT /{bucket}/run/step_00000005/__0_0\.distcp") >= 3
    assert not store.storage.fs.exists(f"{bucket}/run/step_00000010")  # the failed save's files are gone
    events = read_jsonl(Path(cfg.run_dir) / "events.jsonl")
    failed = [e for e in events if e["kind"] == "checkpoint_save_failed"]
    assert [e["step"] for e in failed] == [10] and failed[0]["failure"] == "permanent: quota exceeded (QuotaExceeded)"
    assert failed[0]["freed_bytes"] is not None
    assert not [e for e in events if e["kind"] == "checkpoint_upload_retry" and e["step"] == 10]
    assert quota.hits == 1  # one attempt, not upload_retries + 1

    # saves keep failing: the lag grows in the events, and the run stops after max_failed_saves in a row
    cfg = make_cfg(
        *store_args,
        "train.steps=40",
        "checkpoint.max_failed_saves=2",
        f'checkpoint.uri="s3://{bucket}/stop"',
        run="stop",
    )
    proxy.fail(rf"PUT /{bucket}/stop/step_000000(1\d|2\d)/\.metadata", "QuotaExceeded")
    path.write_text(dump_config(cfg))
    assert main(["train", str(path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "2 checkpoint save(s) in a row failed" in err and "newest durable checkpoint is step 5" in err
    lag = [
        (e["step"], e["durable_step"], e["steps_at_risk"], e["action"])
        for e in read_jsonl(Path(cfg.run_dir) / "events.jsonl")
        if e["kind"] == "checkpoint_lagging"
    ]
    assert lag == [(10, 5, 5, "keep training; the next checkpoint step tries again"), (15, 5, 10, "stop the run")]
    assert CheckpointStore.for_config(cfg).steps() == [5]
