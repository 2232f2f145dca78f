"""A wrong cluster address fails in seconds with an error that says how to find the right one
(``raysc.cluster.connect``), as a newcomer meets it: `raysc train` with RAY_ADDRESS pointing where
nothing listens, or at an HTTP server (the dashboard's port given for the GCS's)."""

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
from raysc.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RAYSC = str(Path(sys.executable).parent / "raysc")


class _Page(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"a dashboard")

    def log_message(self, *args):
        pass


def test_an_address_where_nothing_listens_or_http_answers_is_refused_and_a_real_gcs_passes(ray_session):
    port = free_port()
    with pytest.raises(ClusterAddressError, match=rf"RAY_ADDRESS=127\.0\.0\.1:{port}: nothing answers there.*port 6379"):
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


def test_raysc_train_with_a_wrong_ray_address_fails_within_15_s(tmp_path):
    """The README's `raysc train`, RAY_ADDRESS at a port where nothing listens: exit 2 with the
    address and how to find the right one, long before Ray's own retries would give up."""
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{free_port()}"}
    t0 = time.monotonic()
    run = subprocess.run([RAYSC, "train", "jobs/configs/tiny.toml", "--no-progress", "--set", "train.steps=2",
                          "--set", f'run.dir="{tmp_path / "run"}"'], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    took = time.monotonic() - t0
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"RAY_ADDRESS={env['RAY_ADDRESS']}: nothing answers there" in run.stderr and "ray status" in run.stderr
    assert took < 15, took
