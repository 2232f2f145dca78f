"""A free TCP port on this machine (rendezvous of a process group, a local cluster's services)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
