"""[track] on a real run: TensorBoard event files (also copied to the project's S3 server and read
back from there by TensorBoard itself), an MLflow tracking server (``mlflow server`` with a sqlite
store, started and stopped by the test) and W&B in offline mode, all three at once. A worker killed
mid-run makes the supervisor restart from a checkpoint and re-run steps, and three loss spikes make
it roll back; every tracker ends up with exactly one value per step, equal to the run's own
``metrics.jsonl``. ``--resume`` continues the same tracker runs, and the MLflow server is stopped
while the resumed run trains and started again: the run never waits for it and the buffered calls
reach it. (The first run starts while the server is still starting, which also buffers.)"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from raysc.cluster.ports import free_port
from raysc.fleet.records import read_jsonl
from raysc.track.run_tracker import read_track_ids


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a sqlite store in ``root``; stop() and start() again."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        mlflow = str(Path(sys.executable).parent / "mlflow")
        # no job runner (MLflow's GenAI evaluation jobs, a pool of huey consumers): a tracking server only
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(
            [
                mlflow,
                "server",
                "--backend-store-uri",
                f"sqlite:///{self.root / 'mlflow.db'}",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--default-artifact-root",
                str(self.root / "artifacts"),
            ],
            stdout=open(self.root / "server.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )

    def wait_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if requests.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline and self.proc.poll() is None, (self.root / "server.log").read_text()[
                -3000:
            ]
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path)
    server.start()
    yield server
    server.stop()


def _wandb_rows(run_dir: Path, run_id: str) -> list[dict]:
    """History rows of the offline W&B run ``run_id`` (every session's file), read from its
    ``.wandb`` files: W&B's LevelDB-style log (7-byte header, 32 KiB blocks of CRC/length/type
    records) of ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, frag, chunks = 7, b"", []
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
            if left < 7 or (length == 0 and kind == 0):
                pos += left
                continue
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            frag = chunk if kind in (1, 2) else frag + chunk
            if kind in (1, 4):
                chunks.append(frag)
        for chunk in chunks:
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(chunk)
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def _last_per_step(run_dir: Path, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in read_jsonl(run_dir / "metrics.jsonl")}


def test_three_trackers_survive_a_restart_a_rollback_a_tracker_outage_and_a_resume(
    ray_session, make_cfg, mlflow_server, s3_server, monkeypatch
):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raysc.fleet.driver import train
    from raysc.track.mlflow_sink import history

    s3_server["client"].create_bucket(Bucket="raysc-tb")
    track = [
        "track.tensorboard=true",
        f'track.mlflow_uri="{mlflow_server.uri}"',
        'track.wandb_project="raysc-test"',
        'track.wandb_mode="offline"',
        "track.retry_max_s=1",
        'track.tensorboard_uri="s3://raysc-tb/runs/tiny"',
        f'track.storage_options={{endpoint_url = "{s3_server["endpoint"]}", key = "testing", '
        f'secret = "testing-secret", region_name = "us-east-1"}}',
        # the server takes ~20 s to answer on this machine: a run's end waits for it
        "track.close_timeout_s=180",
    ]
    spikes = ['supervisor.spike_policy="rollback"', "supervisor.spike_patience=3", "supervisor.spike_min_history=4"]
    cfg = make_cfg(
        "train.steps=20",
        "checkpoint.every_steps=4",
        *spikes,
        "supervisor.restart_backoff_s=0.1",
        'supervisor.inject="kill@7:0,spike@14,spike@15,spike@16"',
        *track,
    )
    run_dir = Path(cfg.run_dir)
    # the run starts while the server is still starting (~20 s here): its first calls wait in the relay
    summary = train(cfg, progress=False)
    assert summary["restarts"] == 1 and summary["rollbacks"] == 1
    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [(e["kind"], e.get("tracker")) for e in events if e["kind"].startswith("track")]
    assert not [k for k in kinds if k[0] == "tracker_undelivered"], kinds
    assert {t for k, t in kinds if k == "tracking"} == {"tensorboard", "mlflow", "wandb"}
    ids = read_track_ids(run_dir)
    losses = _last_per_step(run_dir, "loss")
    assert sorted(losses) == list(range(1, 21))

    # MLflow: one value per step (the re-run's), the rollback marked, config and identity in
    mlflow_server.wait_up()  # up: the run's end waited for the relay to deliver to it
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(ids["mlflow"])
    assert history(client, ids["mlflow"], "train/loss") == pytest.approx(losses, rel=1e-6)
    assert {4, 8, 12, 16, 20} <= history(client, ids["mlflow"], "checkpoint/bytes").keys()
    assert run.data.params["model.dim"] == "64" and run.data.params["train.steps"] == "20"
    assert run.data.params["track.storage_options"] == json.dumps(
        {"endpoint_url": s3_server["endpoint"], "key": "***", "secret": "***", "region_name": "us-east-1"}
    )
    assert run.data.tags["raysc.run_id"] == json.loads((run_dir / "run.json").read_text())["run_id"]
    assert run.data.tags["raysc.corpus_sha256"]
    assert len([k for k in run.data.tags if k.startswith("rollback.")]) == 2  # the restart and the spike rollback
    assert run.info.status == "FINISHED"

    # TensorBoard: the purge on restart leaves the re-run steps only
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 21))
    assert tb == pytest.approx(losses, rel=1e-6)
    # ... and TensorBoard reading the copy in the object store (its own S3 reader, which takes the
    # endpoint from S3_ENDPOINT when tensorboard is first imported: set on the reader itself here)
    from tensorboard.compat.tensorflow_stub.io import gfile

    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(gfile.get_filesystem("s3://raysc-tb"), "_s3_endpoint", s3_server["endpoint"])
    remote = EventAccumulator("s3://raysc-tb/runs/tiny")
    remote.Reload()
    assert {e.step: e.value for e in remote.Scalars("train/loss")} == pytest.approx(losses, rel=1e-6)

    # W&B offline: train/step is the x-axis; the newest row of each step is the re-run's
    rows = [r for r in _wandb_rows(run_dir, ids["wandb"]) if "train/loss" in r]
    assert {r["train/step"]: r["train/loss"] for r in rows} == pytest.approx(losses, rel=1e-6)

    # --resume continues the same tracker runs; the manifest carries their ids
    # --resume, with the MLflow server stopped once the resumed run has opened its MLflow run again,
    # and started again at once: the run goes on, the buffered calls reach the server when it is back
    more = make_cfg("train.steps=24", "checkpoint.every_steps=4", *spikes, "supervisor.restart_backoff_s=0.1", *track)

    def outage():
        deadline = time.monotonic() + 240
        while (
            len(
                [
                    e
                    for e in read_jsonl(run_dir / "events.jsonl")
                    if e["kind"] == "tracking" and e["tracker"] == "mlflow"
                ]
            )
            < 2
        ):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        mlflow_server.stop()
        mlflow_server.start()

    chaos = threading.Thread(target=outage, daemon=True)
    chaos.start()
    train(more, resume=True, progress=False)
    chaos.join(timeout=60)
    resumed = read_jsonl(run_dir / "events.jsonl")[len(events) :]
    kinds = [(e["kind"], e.get("tracker")) for e in resumed if e["kind"].startswith("track")]
    assert ("tracker_degraded", "mlflow") in kinds and ("tracker_recovered", "mlflow") in kinds, kinds
    assert not [k for k in kinds if k[0] == "tracker_undelivered"], kinds
    assert read_track_ids(run_dir) == ids
    from raysc.fleet.status import run_status

    # raysc status: each tracker, its run id, and that it caught up after the outage
    assert {k: (t["state"], t["run_id"]) for k, t in run_status(run_dir)["trackers"].items()} == {
        k: ("ok", v) for k, v in ids.items()
    }
    from raysc.checkpoint.store import CheckpointStore

    assert CheckpointStore.for_config(more).read_manifest(24)["trackers"] == ids
    losses = _last_per_step(run_dir, "loss")
    assert history(client, ids["mlflow"], "train/loss") == pytest.approx(losses, rel=1e-6)
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 25))
    rows = [r for r in _wandb_rows(run_dir, ids["wandb"]) if "train/loss" in r]
    assert {r["train/step"]: r["train/loss"] for r in rows} == pytest.approx(losses, rel=1e-6)
