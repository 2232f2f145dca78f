"""A local autoscaling Ray cluster: Ray's own autoscaler, with its fake multi-node node provider, on this
machine (docs.ray.io, "Testing Autoscaling Locally").

``up`` runs ``RAY_FAKE_CLUSTER=1 ray start --head --block --autoscaling-config=…`` as the holder process:
the head offers no CPUs, and its autoscaler launches worker nodes (each a real raylet, object store and
node id on this machine) when a placement group or task asks for resources the cluster lacks, and removes
them after ``idle_timeout_s`` without work. The config is ``jobs/clusters/local-autoscaling.yaml``'s
(``config`` builds it; a test keeps the two equal) with this cluster's own loopback ports, node count and
sizes. ``ray.cluster_utils.AutoscalingCluster`` is not used: it runs ``ray stop --force`` (every Ray on
the machine) and loads an example config that Ray's wheel does not ship.

Its record is ``raysc.cluster.local``'s ``ClusterState`` (``autoscale`` set), so ``down`` stops it the same
way: SIGTERM to the holder, then whatever still runs under its temp dir (the autoscaler's nodes too).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from raysc.cluster.local import (
    DEFAULT_STATE,
    HEALTH_CHECKS,
    ClusterState,
    _alive,
    _kill_leftovers,
    _ray_env,
    once_more_if_overloaded,
    refuse_if_up,
)
from raysc.cluster.ports import free_ports

WORKER_TYPE = "raysc.worker.cpu"
OBJECT_STORE_BYTES = 200_000_000  # per worker node: a small machine runs several


def config(
    max_nodes: int = 4,
    min_nodes: int = 0,
    cpus_per_node: float = 1.0,
    gpus_per_node: int = 0,
    idle_timeout_s: float = 6.0,
    gcs_address: str = "127.0.0.1:6379",
) -> dict:
    """The autoscaler's cluster config (Ray's cluster-launcher schema, ``fake_multinode`` provider)."""
    worker = {"CPU": cpus_per_node, "object_store_memory": OBJECT_STORE_BYTES}
    if gpus_per_node:
        worker["GPU"] = gpus_per_node
    steps = (
        "initialization_commands",
        "setup_commands",
        "head_setup_commands",
        "worker_setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    )
    return {
        "cluster_name": "raysc-local-autoscaling",
        "max_workers": max_nodes,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {"resources": worker, "node_config": {}, "min_workers": min_nodes, "max_workers": max_nodes},
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        **{k: [] for k in steps},
    }


def up(
    max_nodes: int,
    cpus_per_node: float,
    gpus_per_node: int = 0,
    min_nodes: int = 0,
    idle_timeout_s: float = 6.0,
    state: Path = DEFAULT_STATE,
    dashboard: bool = True,
    timeout_s: float = 120.0,
) -> ClusterState:
    """Start the head and its autoscaler; returns once drivers can connect (and ``min_nodes`` have joined).
    Started once more when Ray's node start timed out on a busy machine (``once_more_if_overloaded``)."""
    if not 0 <= min_nodes <= max_nodes or max_nodes < 1:
        raise ValueError(f"--min-nodes {min_nodes} / --max-nodes {max_nodes}: need 0 <= min <= max and max >= 1")
    return once_more_if_overloaded(
        lambda: _up(max_nodes, cpus_per_node, gpus_per_node, min_nodes, idle_timeout_s, state, dashboard, timeout_s),
        "the autoscaling cluster",
    )


def _up(
    max_nodes: int,
    cpus_per_node: float,
    gpus_per_node: int,
    min_nodes: int,
    idle_timeout_s: float,
    state: Path,
    dashboard: bool,
    timeout_s: float,
) -> ClusterState:
    refuse_if_up(state)
    temp = Path(tempfile.mkdtemp(prefix="ra-", dir="/tmp"))  # Ray's socket paths must stay short
    names = (
        "port",
        "ray-client-server-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
        "node-manager-port",
        "object-manager-port",
        "dashboard-port",
    )
    ports = dict(zip(names, free_ports(len(names))))
    dashboard_port = ports.pop("dashboard-port")
    address = f"127.0.0.1:{ports['port']}"
    cfg = config(max_nodes, min_nodes, cpus_per_node, gpus_per_node, idle_timeout_s, address)
    (temp / "autoscaling.json").write_text(json.dumps(cfg, indent=1))
    cmd = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        "--num-cpus=0",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp}",
        f"--autoscaling-config={temp / 'autoscaling.json'}",
        f"--system-config={json.dumps(HEALTH_CHECKS, separators=(',', ':'))}",
        *[f"--{k}={v}" for k, v in ports.items()],
    ]
    url = None
    if dashboard:
        cmd += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
        url = f"http://127.0.0.1:{dashboard_port}"
    else:
        cmd.append("--include-dashboard=false")
    # the provider refuses to run without RAY_FAKE_CLUSTER; the autoscaler looks every second, not every 5 s
    env = {**_ray_env(), "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    log = open(temp / "holder.log", "w")
    holder = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    st = ClusterState(
        pid=holder.pid,
        address=address,
        dashboard=url,
        temp_dir=str(temp),
        autoscale={
            "min_nodes": min_nodes,
            "max_nodes": max_nodes,
            "cpus_per_node": cpus_per_node,
            "gpus_per_node": gpus_per_node,
            "idle_timeout_s": idle_timeout_s,
            "config": str(temp / "autoscaling.json"),
        },
    )
    deadline = time.monotonic() + timeout_s
    while not (_listening(ports["port"]) and len(alive_worker_nodes(st)) >= min_nodes):
        if not _alive(holder.pid) or time.monotonic() > deadline:
            holder.kill()
            _kill_leftovers(str(temp))
            raise RuntimeError(
                f"the autoscaling cluster did not come up within {timeout_s:.0f}s; its log: "
                f"{temp / 'holder.log'}\n" + (temp / "holder.log").read_text()[-2000:]
            )
        time.sleep(0.5)
    st.write(state)
    return st


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def alive_worker_nodes(st: ClusterState) -> list[str]:
    """The autoscaler's worker nodes that are up now, by node id, from ``ray status`` of the cluster."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "status", f"--address={st.address}"],
        env=_ray_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        return []
    active = out.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
    nodes: list[str] = []
    for line in active.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == WORKER_TYPE and parts[0].isdigit():
            nodes += [WORKER_TYPE] * int(parts[0])
    return nodes
