"""A local multi-node Ray cluster: a head and N worker nodes on this machine, each a real Ray node
(its own raylet, object store and node id), for multi-node tests and laptop rehearsals.

``up`` starts a detached holder process that runs ``ray.cluster_utils.Cluster`` (Ray's own harness
for many nodes on one machine: it starts a node's processes and waits until the GCS has
registered it before the next; two concurrent ``ray start --address`` on a 2-core machine left
one node timed out registering) and keeps it until ``down`` sends it SIGTERM. ``down`` then
kills whatever is left under the cluster's own temp directory — never ``ray stop``, which would
stop every Ray on the machine. ``add_node`` asks the holder (SIGUSR1) for one more worker node,
as a replacement node joining after a node loss.

Drivers join it by address (``RAY_ADDRESS``, printed by ``up``): a bare ``ray.init()`` does not,
so nothing on the machine is left pointing at the cluster once it is down.

The head has no CPUs, so workers land on worker nodes only and the driver and supervisor (which
need none) stay on the head. Node failure is detected in about 2 s (GCS health checks every
0.5 s, 4 misses): local nodes do not suffer network blips, and rehearsals of node loss should
not wait Ray's 15-s default.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from raysc.cluster.ports import free_port

DEFAULT_STATE = Path(tempfile.gettempdir()) / "raysc-local-cluster.json"
HEALTH_CHECKS = {
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 4,
    "health_check_initial_delay_ms": 1000,
}


@dataclass
class ClusterState:
    """What ``up`` wrote: enough to reach the cluster and to stop exactly it."""

    pid: int  # the holder process
    address: str  # the GCS address: RAY_ADDRESS / ray.init(address=...)
    dashboard: str | None  # http://127.0.0.1:PORT (ray job submit --address), None without dashboard
    temp_dir: str
    nodes: list[dict] = field(default_factory=list)  # worker nodes: node_id, cpus, gpus
    # an autoscaling cluster (``raysc.cluster.autoscaling``): its node limits and sizes; None = fixed nodes
    autoscale: dict | None = None

    @classmethod
    def read(cls, path: Path) -> ClusterState:
        if not path.is_file():
            raise FileNotFoundError(
                f"no local cluster recorded at {path}; start one with "
                f"`raysc cluster local up --nodes N --cpus-per-node C`"
            )
        return cls(**json.loads(path.read_text()))

    def write(self, path: Path) -> None:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)  # readers never see half a file

    def env(self) -> dict[str, str]:
        """Environment for a driver or `ray job` command to use this cluster."""
        return {**_ray_env(), "RAY_ADDRESS": self.address}


def _ray_env() -> dict[str, str]:
    """This process's environment without any RAY_ setting but the workers' niceness (a user's
    ``RAY_worker_niceness``: Ray's own default, 15, lets every process at 0 on this machine go first),
    for a loopback-only cluster."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k == "RAY_worker_niceness"}
    env.update(RAY_AUTH_MODE="disabled", RAY_DEDUP_LOGS="0")
    return env


# what Ray's node start raises when the GCS has not registered the node's raylet within its 30 s (hard-coded in
# ray._private.node): on a loaded 2-core machine (a CI lane beside another) a head once did not make it
OVERLOADED_START = "timed out during startup"


def once_more_if_overloaded(start: Callable[[], ClusterState], what: str) -> ClusterState:
    """``start()``, and once more when it failed because Ray's node start timed out on a loaded machine
    (a transient: the second start has found the machine quieter every time this was seen); any other
    failure, or a second timeout, is raised as it is."""
    try:
        return start()
    except RuntimeError as e:
        if OVERLOADED_START not in str(e):
            raise
        print(
            f"[raysc] {what}: a Ray node did not register with its GCS within Ray's 30 s (this machine is "
            f"busy); starting it once more",
            file=sys.stderr,
            flush=True,
        )
    return start()


def up(
    nodes: int,
    cpus_per_node: float,
    gpus_per_node: int = 0,
    state: Path = DEFAULT_STATE,
    dashboard: bool = True,
    timeout_s: float = 180.0,
) -> ClusterState:
    """Start the holder process and wait until every node is up; the cluster's state (started once more
    when Ray's node start timed out on a busy machine: ``once_more_if_overloaded``)."""
    return once_more_if_overloaded(
        lambda: _up(nodes, cpus_per_node, gpus_per_node, state, dashboard, timeout_s), "the local cluster"
    )


def _up(
    nodes: int, cpus_per_node: float, gpus_per_node: int, state: Path, dashboard: bool, timeout_s: float
) -> ClusterState:
    refuse_if_up(state)
    temp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # Ray's socket paths must stay short
    cmd = [
        sys.executable,
        "-m",
        "raysc.cluster.local",
        "--nodes",
        str(nodes),
        "--cpus",
        str(cpus_per_node),
        "--gpus",
        str(gpus_per_node),
        "--state",
        str(state),
        "--temp-dir",
        temp,
    ]
    if not dashboard:
        cmd.append("--no-dashboard")
    env = _ray_env()
    log = open(Path(temp) / "holder.log", "w")
    holder = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not state.is_file():
        if holder.poll() is not None or time.monotonic() > deadline:
            holder.kill()
            _kill_leftovers(temp)
            raise RuntimeError(
                f"the local cluster did not come up within {timeout_s:.0f}s; its log: "
                f"{Path(temp) / 'holder.log'}\n" + (Path(temp) / "holder.log").read_text()[-2000:]
            )
        time.sleep(0.2)
    return ClusterState.read(state)


def refuse_if_up(state: Path) -> None:
    """Refuse to start a cluster where ``state`` records one that is still up; forget a stale record."""
    if state.exists():
        try:
            old = ClusterState.read(state)
        except (TypeError, json.JSONDecodeError):
            old = None
        if old is not None and _alive(old.pid):
            raise RuntimeError(
                f"a local cluster is already up (holder pid {old.pid}, {old.address}); "
                f"`raysc cluster local down` first, or pass another --state"
            )
        state.unlink()  # a stale record of a cluster that is gone


def add_node(state: Path = DEFAULT_STATE, timeout_s: float = 120.0) -> ClusterState:
    """One more worker node (as the others); waits until it has joined."""
    current = ClusterState.read(state)
    if current.autoscale is not None:
        raise RuntimeError(
            f"the cluster at {current.address} autoscales: its autoscaler adds nodes when work "
            f"asks for them (up to {current.autoscale['max_nodes']}); there is no node to add by hand"
        )
    os.kill(current.pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = ClusterState.read(state)
        if len(now.nodes) > len(current.nodes):
            return now
        time.sleep(0.2)
    raise RuntimeError(f"no node joined within {timeout_s:.0f}s; see {current.temp_dir}/holder.log")


def down(state: Path = DEFAULT_STATE, timeout_s: float = 30.0, keep_logs: bool = False) -> ClusterState:
    """Stop the cluster ``up`` recorded at ``state``: its holder, then anything under its temp dir, then
    the temp dir itself (its Ray session logs; ``keep_logs`` leaves it)."""
    current = ClusterState.read(state)
    if _alive(current.pid):
        os.kill(current.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(current.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    _kill_leftovers(current.temp_dir)
    if not keep_logs:
        deadline = time.monotonic() + 10  # a process killed by SIGKILL may still be going away
        while _named(current.temp_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(current.temp_dir, ignore_errors=True)
    _forget_address(current.address)  # in case the holder died before it could
    state.unlink(missing_ok=True)
    return current


def _address_record() -> Path:
    """Ray's machine-wide record of the "current" cluster, which a bare ``ray.init()`` joins."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


def _forget_address(address: str, previous: str | None = None) -> None:
    """Put back Ray's "current cluster" record (``previous``, or none) when it names ``address``.

    ``Cluster`` writes it so that a bare ``ray.init()`` joins the newest local cluster; for a
    rehearsal cluster that is a trap: once the cluster is down, every ``ray.init()`` on the machine
    would wait on a dead address. Drivers get the address explicitly (``RAY_ADDRESS``)."""
    record = _address_record()
    if record.is_file() and record.read_text().strip() == address:
        if previous:
            record.write_text(previous)
        else:
            record.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: reap it when it is our child)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (``up`` ran in another process)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _named(temp_dir: str) -> bool:
    """Whether a process whose command line names ``temp_dir`` still runs."""
    return subprocess.run(["pgrep", "-f", temp_dir], capture_output=True).returncode == 0


def _kill_leftovers(temp_dir: str) -> None:
    """Every process whose command line names this cluster's temp dir (its raylets, GCS, agents)."""
    subprocess.run(["pkill", "-9", "-f", temp_dir], check=False)


def _serve(args: argparse.Namespace) -> None:
    """The holder: run the cluster until SIGTERM; SIGUSR1 adds a node."""
    from ray.cluster_utils import Cluster

    head = {
        "num_cpus": 0,
        "temp_dir": args.temp_dir,
        "_system_config": HEALTH_CHECKS,
        "include_dashboard": args.dashboard,
    }
    dashboard = None
    if args.dashboard:
        port = free_port()
        head.update(dashboard_host="127.0.0.1", dashboard_port=port)
        dashboard = f"http://127.0.0.1:{port}"
    record = _address_record()
    previous = record.read_text() if record.is_file() else None
    cluster = Cluster(initialize_head=True, head_node_args=head)
    _forget_address(cluster.address, previous)
    st = ClusterState(pid=os.getpid(), address=cluster.address, dashboard=dashboard, temp_dir=args.temp_dir)
    wanted = threading.Event()
    stop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: wanted.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def add() -> None:
        node = cluster.add_node(num_cpus=args.cpus, num_gpus=args.gpus)
        st.nodes.append({"node_id": node.node_id, "cpus": args.cpus, "gpus": args.gpus})

    def publish() -> None:
        st.write(Path(args.state))

    for _ in range(args.nodes):
        add()
    publish()  # once every node is up: `up` waits for this file
    while not stop.is_set():
        if wanted.wait(0.5):
            wanted.clear()
            add()
            publish()
    _kill_leftovers(args.temp_dir)  # Cluster.shutdown() drains node by node: tens of seconds, for nothing


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m raysc.cluster.local", description="the local cluster's holder")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--cpus", type=float, required=True)
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--state", required=True)
    p.add_argument("--temp-dir", required=True)
    p.add_argument("--no-dashboard", dest="dashboard", action="store_false")
    _serve(p.parse_args(argv))


if __name__ == "__main__":
    main()
