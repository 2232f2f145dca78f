"""``raysc.cluster.ports``: the ports a local cluster's services and a process group's rendezvous are given."""

from __future__ import annotations

import socket

from raysc.cluster.ports import RAY_WORKER_PORTS_END, _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low = _ephemeral_low()
    assert low > RAY_WORKER_PORTS_END, f"this machine's ephemeral range starts at {low}"
    for _ in range(20):
        ports = free_ports(9)
        assert len(set(ports)) == 9, ports
        # an outgoing connection's local port comes from the ephemeral range; Ray's workers bind below 20000
        assert all(RAY_WORKER_PORTS_END <= p < low for p in ports), ports
    with socket.socket() as s:
        s.bind(("", ports[0]))  # free to bind once picked
