"""Whether a Ray node is up, asked of Ray's GCS and of the node's raylet itself: the supervisor's restart
(``raysc.fleet.healing``) and peer heal (``raysc.fleet.peer_healing``) use it to tell a dead worker on a
live node from a lost node without waiting for the GCS's verdict."""

from __future__ import annotations

import socket

import ray

RAYLET_PROBE_S = 0.5


def raylet_answers(node_id: str) -> bool:
    """Whether the raylet of ``node_id`` is alive in Ray's GCS and accepts a TCP connection on its
    node-manager port (within RAYLET_PROBE_S): its node is up. A killed raylet refuses at once."""
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    if node is None or not node.get("Alive"):
        return False
    address = (node["NodeManagerAddress"], node["NodeManagerPort"])
    try:
        socket.create_connection(address, timeout=RAYLET_PROBE_S).close()
    except OSError:
        return False
    return True
