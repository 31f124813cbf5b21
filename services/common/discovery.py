"""Turning configured peer addresses into the replicas behind them.

A 'name:port' entry may resolve to several addresses (compose `--scale`,
Kubernetes headless services); each one is a replica.
"""

import asyncio
import socket


def host_of(entry: str) -> str:
    """'name:port' -> 'name' (what a TLS certificate of the replicas behind it names)."""
    return entry.rpartition(":")[0].strip("[]")


async def resolve(entry: str) -> list[str]:
    """'name:port' -> one 'ip:port' per address the name resolves to (none if it does not)."""
    host, _, port = entry.rpartition(":")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    addresses = []
    for family, _, _, _, sockaddr in infos:
        ip = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
        if f"{ip}:{port}" not in addresses:
            addresses.append(f"{ip}:{port}")
    return addresses


# StreamOutputs' initial metadata key: the detokenizer process's id (new on every start).
INSTANCE_METADATA = "flatwire-instance"


def subscription_health_name(scheduler: str) -> str:
    """The gRPC health service under which a detokenizer reports following `scheduler`'s
    (an 'ip:port' replica) step stream: the gateway sends it requests only once this is SERVING."""
    return f"flatwire.steps/{scheduler}"
