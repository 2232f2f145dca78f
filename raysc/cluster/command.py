"""The ``raysc cluster local`` subcommands: start, grow and stop a multi-node Ray cluster on this
machine, with fixed nodes (``raysc.cluster.local``) or nodes that Ray's autoscaler adds and removes
(``--autoscale``: ``raysc.cluster.autoscaling``). ``CLUSTER`` is their entry in the command table of
``raysc.cli``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from raysc.cli_table import JSON, Command, arg

STATE = arg(
    "--state",
    type=Path,
    default=None,
    help="where the cluster's record lives (default: raysc-local-cluster.json in the temp dir)",
)


def _state(args: argparse.Namespace) -> Path:
    from raysc.cluster.local import DEFAULT_STATE

    return args.state or DEFAULT_STATE


def _show(st, what: str, as_json: bool) -> None:
    if as_json:
        from dataclasses import asdict

        print(json.dumps(asdict(st)), flush=True)
        return
    if st.autoscale is None:
        nodes = (
            f"{len(st.nodes)} worker node(s) started + a head without CPUs (a node lost since is still counted; "
            f"`ray status` lists those alive)"
        )
    else:
        a = st.autoscale
        nodes = (
            f"a head without CPUs whose autoscaler adds {a['min_nodes']}..{a['max_nodes']} worker nodes of "
            f"{a['cpus_per_node']:g} CPU when work asks for them and removes them after "
            f"{a['idle_timeout_s']:g} s idle (`ray status --address {st.address}` shows them)"
        )
    print(
        f"{what}: {nodes}\n"
        f'  drivers:   RAY_ADDRESS={st.address} raysc train CONFIG   (or ray.init(address="{st.address}"))\n'
        + (
            f"  jobs:      ray job submit --address {st.dashboard} -- raysc train CONFIG\n"
            f"  dashboard: {st.dashboard}\n"
            f"  metrics:   Prometheus file_sd {st.temp_dir}/prom_metrics_service_discovery.json "
            f"(jobs/prometheus.yml; Grafana board jobs/grafana/raysc_dashboard.json)\n"
            if st.dashboard
            else ""
        )
        + "  stop it:   raysc cluster local down",
        flush=True,
    )


def cmd_cluster_up(args: argparse.Namespace) -> int:
    if args.autoscale:
        from raysc.cluster import autoscaling

        st = autoscaling.up(
            args.max_nodes,
            args.cpus_per_node,
            args.gpus_per_node,
            min_nodes=args.nodes or 0,
            idle_timeout_s=args.idle_timeout_s,
            state=_state(args),
            dashboard=not args.no_dashboard,
        )
    else:
        from raysc.cluster.local import up

        st = up(
            2 if args.nodes is None else args.nodes,
            args.cpus_per_node,
            args.gpus_per_node,
            _state(args),
            dashboard=not args.no_dashboard,
        )
    _show(st, "local cluster up", args.json)
    return 0


def cmd_cluster_add_node(args: argparse.Namespace) -> int:
    from raysc.cluster.local import add_node

    _show(add_node(_state(args)), "node added", args.json)
    return 0


def cmd_cluster_down(args: argparse.Namespace) -> int:
    from raysc.cluster.local import down

    st = down(_state(args), keep_logs=args.keep_logs)
    where = f"its logs kept in {st.temp_dir}" if args.keep_logs else f"{st.temp_dir} removed"
    print(f"local cluster at {st.address} stopped (holder pid {st.pid}; {where})", flush=True)
    return 0


CLUSTER = Command(
    "cluster",
    "a multi-node Ray cluster on this machine, to rehearse a cluster run",
    dest="cluster_cmd",
    sub=(
        Command(
            "local",
            "real Ray nodes (own raylet, object store, node id) on this machine",
            dest="local_cmd",
            sub=(
                Command(
                    "up",
                    "start a head and N worker nodes (or an autoscaler that adds them); prints the address for "
                    "drivers and `ray job submit`",
                    cmd_cluster_up,
                    (
                        arg(
                            "--nodes",
                            type=int,
                            default=None,
                            help="worker nodes (default 2); with --autoscale the fewest kept (default 0)",
                        ),
                        arg(
                            "--autoscale",
                            action="store_true",
                            help="Ray's autoscaler adds worker nodes when work asks for them and removes idle ones "
                            "(jobs/clusters/local-autoscaling.yaml)",
                        ),
                        arg(
                            "--max-nodes",
                            type=int,
                            default=4,
                            help="with --autoscale: the most worker nodes (default 4)",
                        ),
                        arg(
                            "--idle-timeout-s",
                            type=float,
                            default=6.0,
                            help="with --autoscale: seconds a worker node may sit idle before it is removed (default 6)",
                        ),
                        arg(
                            "--cpus-per-node", type=float, default=2.0, help="CPUs each worker node offers (default 2)"
                        ),
                        arg("--gpus-per-node", type=int, default=0, help="GPUs each worker node offers (default 0)"),
                        arg("--no-dashboard", action="store_true", help="no dashboard / job server (faster start)"),
                        STATE,
                        JSON,
                    ),
                ),
                Command(
                    "add-node",
                    "one more worker node, as a replacement joining after a node loss",
                    cmd_cluster_add_node,
                    (STATE, JSON),
                ),
                Command(
                    "down",
                    "stop exactly the cluster `up` started (never `ray stop`) and remove its temp dir",
                    cmd_cluster_down,
                    (
                        STATE,
                        arg(
                            "--keep-logs",
                            action="store_true",
                            help="leave the cluster's temp dir (its Ray session logs)",
                        ),
                    ),
                ),
            ),
        ),
    ),
)
