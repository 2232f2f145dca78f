"""Free TCP ports on this machine (rendezvous of a process group, a local cluster's services).

A port is picked between Ray's worker ports (10002-19999 by default) and the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 on Linux by default), not by binding port 0:
that returns an ephemeral port, which any process's next outgoing connection may take as its local port
in the moment between our pick and the service binding it. A CI run once lost a `ray start --head`
cluster that way or in a way like it: when any of its services fails, `ray start --block` kills them all.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 20000  # Ray's workers bind 10002..19999 unless told otherwise
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now, outside the ephemeral range where the machine allows (each socket
    is held until all are picked: picks one after another could return the same port twice)."""
    low = _ephemeral_low()
    candidates = list(range(RAY_WORKER_PORTS_END, low)) if low > RAY_WORKER_PORTS_END + 4 * n else []
    random.shuffle(candidates)  # two processes picking at once rarely meet
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind(("", port))
            except OSError:  # in use
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # no room below the ephemeral range: let the kernel choose
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
