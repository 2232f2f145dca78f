"""A wrong cluster address fails in seconds with an error that says how to find the right one
(``raysc.cluster.connect``), as a newcomer meets it: `raysc train` with RAY_ADDRESS pointing where
nothing listens, or at an HTTP server (the dashboard's port given for the GCS's). A fleet the cluster can
never hold stops at once on a Ray the command started itself (``raysc.cluster.fit``): `raysc preflight`
of the Llama 3.2 1B recipe (8 CPUs and a GPU per worker) on this machine's own CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from raysc.cluster.connect import ClusterAddressError, check_address
from raysc.cluster.fit import ClusterTooSmall, require_fleet_fit, shortfall
from raysc.cluster.ports import free_port
from raysc.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RAYSC = str(Path(sys.executable).parent / "raysc")


class _Page(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"a dashboard")

    def log_message(self, *args):
        pass


def _seconds(code: str) -> float:
    """How long a fresh Python process running ``code`` takes on this machine now: what the commands under
    test are timed against, so that a slower or busier machine moves both (issue 62)."""
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", code],
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        check=True,
        capture_output=True,
        timeout=300,
    )
    return time.monotonic() - t0


def test_an_address_where_nothing_listens_or_http_answers_is_refused_and_a_real_gcs_passes(ray_session):
    port = free_port()
    with pytest.raises(
        ClusterAddressError, match=rf"RAY_ADDRESS=127\.0\.0\.1:{port}: nothing answers there.*port 6379"
    ):
        check_address(f"127.0.0.1:{port}")
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ClusterAddressError, match="an HTTP server answers there .*dashboard"):
            check_address(f"127.0.0.1:{http.server_address[1]}")
    finally:
        http.shutdown()
    check_address(ray_session.get_runtime_context().gcs_address)  # the session's own GCS: no error
    for resolved_by_ray in ("auto", "local", "ray://127.0.0.1:10001"):
        check_address(resolved_by_ray)


def test_raysc_train_with_a_wrong_ray_address_fails_within_seconds(tmp_path):
    """The README's `raysc train`, RAY_ADDRESS at a port where nothing listens: exit 2 with the
    address and how to find the right one, long before Ray's own retries would give up (its GCS client
    retries for a minute): within 4 times what importing Ray and torch takes here (~3 s unloaded)."""
    floor = _seconds("import ray, torch")
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{free_port()}"}
    t0 = time.monotonic()
    run = subprocess.run(
        [
            RAYSC,
            "train",
            "jobs/configs/tiny.toml",
            "--no-progress",
            "--set",
            "train.steps=2",
            "--set",
            f'run.dir="{tmp_path / "run"}"',
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - t0
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"RAY_ADDRESS={env['RAY_ADDRESS']}: nothing answers there" in run.stderr and "ray status" in run.stderr
    assert took < 4 * floor, (took, floor)


def test_a_fleet_no_node_can_hold_stops_at_once_on_a_ray_this_process_started(ray_session, monkeypatch):
    """The rule counts whole workers per node (two 4-CPU nodes hold two 3-CPU workers, not three), stops
    on the session's own Ray (started by this process: nothing adds nodes) naming need, have and the fix,
    and on a joined cluster (an autoscaler may add nodes) says what it waits for instead."""
    assert shortfall({"CPU": 3.0}, 3, [{"CPU": 4.0}, {"CPU": 4.0}]) == (
        "3 actor(s) of 3 CPU (9 CPU in all), but the cluster's 2 node(s): 4 CPU, 4 CPU hold 2 (in all 8 CPU)"
    )
    assert shortfall({"CPU": 2.0}, 4, [{"CPU": 4.0}, {"CPU": 4.0}]) == ""
    cpus = int(ray_session.cluster_resources()["CPU"])
    fits = load_config(None, [f"parallel.cpus_per_worker={cpus}"]).parallel
    require_fleet_fit("the run", fits, 1)  # the whole node for one worker: it fits
    big = load_config(None, [f"parallel.cpus_per_worker={cpus + 1}"]).parallel
    with pytest.raises(
        ClusterTooSmall,
        match=rf"the run needs 1 actor\(s\) of {cpus + 1} CPU .* hold 0 .*started its "
        rf"own local Ray.*lower parallel.cpus_per_worker \(now {cpus + 1}",
    ):
        require_fleet_fit("the run", big, 1)
    said = []
    monkeypatch.setattr("raysc.cluster.fit.started_here", lambda: False)
    require_fleet_fit("the run", big, 1, log=said.append)
    assert len(said) == 1 and "waiting for the cluster to add nodes" in said[0]


def test_raysc_preflight_of_a_gpu_recipe_on_this_machines_cpus_stops_within_seconds(tmp_path):
    """A newcomer's `raysc preflight jobs/configs/llama-3.2-1b.toml` with no cluster: it starts a local Ray
    with the machine's own CPUs and stops, before tokenizing anything, with exit 2 and the reason (it used
    to wait out supervisor.start_timeout_s, 300 s, with Ray's autoscaler warnings): within 3 times what a
    trivial program that imports torch and starts and stops a local Ray with the machine's CPUs takes here."""
    floor = _seconds(
        "import os, ray, torch; ray.init(num_cpus=os.cpu_count(), include_dashboard=False); ray.shutdown()"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    run = subprocess.run(
        [RAYSC, "preflight", "jobs/configs/llama-3.2-1b.toml", "--set", f'run.dir="{tmp_path / "run"}"'],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "needs 1 actor(s) of 8 CPU + 1 GPU" in run.stderr and "set parallel.device=cpu" in run.stderr
    assert "data_ready" not in run.stdout
    assert took < 3 * floor, (took, floor)
