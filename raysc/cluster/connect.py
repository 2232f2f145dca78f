"""Joining a Ray cluster by address, failing fast and clearly when the address is wrong.

``ray.init(address=...)`` on an address where nothing listens, or where the Ray dashboard (HTTP)
listens instead of the GCS (gRPC), retries for minutes printing "Failed to connect to GCS". Mixing
up the two addresses that ``raysc cluster local up`` or ``ray start --head`` print is an easy slip,
so before Ray is asked to connect the address is probed with one TCP connection: nothing answering,
or an HTTP server answering, is a ``ClusterAddressError`` naming the address and where the right
one is printed, within ``PROBE_S`` seconds. Ray's own client has no such check to reuse.
"""

from __future__ import annotations

import os
import socket

PROBE_S = 5.0  # per step (connect, first bytes): the whole check stays well under 15 s
HOW_TO_FIND = (
    "The GCS address (default port 6379) is the one `ray start --head` prints after "
    "'ray.init(address=...)', `ray status` shows on the head, and `raysc cluster local up` prints as "
    "RAY_ADDRESS=...; unset RAY_ADDRESS to start a local Ray instead."
)


class ClusterAddressError(ConnectionError):
    """The cluster address answers nothing, or is not a Ray GCS; the message says how to find it."""


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a plain 'host:port' address; None for 'auto', 'local', 'ray://…' and the like."""
    if "://" in address or address in ("auto", "local") or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() else None


def check_address(address: str, source: str = "RAY_ADDRESS") -> None:
    """Raise ``ClusterAddressError`` when nothing listens at ``address`` or an HTTP server does
    (the dashboard's address given for the GCS's). Addresses Ray resolves itself pass unchecked."""
    target = _host_port(address)
    if target is None:
        return
    try:
        conn = socket.create_connection(target, timeout=PROBE_S)
    except OSError as e:
        raise ClusterAddressError(
            f"{source}={address}: nothing answers there ({e.strerror or e}). {HOW_TO_FIND}"
        ) from None
    try:
        conn.settimeout(PROBE_S)
        conn.sendall(b"GET / HTTP/1.0\r\nHost: raysc\r\n\r\n")
        first = conn.recv(16)
    except OSError:
        first = b""  # a gRPC server may say nothing to an HTTP/1 request: not an HTTP server
    finally:
        conn.close()
    if first.startswith(b"HTTP/"):
        raise ClusterAddressError(
            f"{source}={address}: an HTTP server answers there (the Ray dashboard's "
            f"address?), not the cluster's GCS. {HOW_TO_FIND}"
        )


def init_ray(address: str | None = None, **kwargs) -> None:
    """``ray.init`` on ``address`` (default: ``RAY_ADDRESS``, else a new local instance), after
    ``check_address``; does nothing when Ray is already initialised in this process."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        check_address(address, "RAY_ADDRESS" if address == os.environ.get("RAY_ADDRESS") else "address")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address=address, **kwargs)
