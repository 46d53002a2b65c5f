"""Free loopback ports for the servers tests start (Valkey, engines, routers).

Every port is picked below the kernel's ephemeral range
(``net.ipv4.ip_local_port_range``). A client that dials a loopback port in
that range while nothing listens there can be handed that very port as its
own source port: TCP's simultaneous open then connects the socket to itself,
and the server that starts later on the port fails with "Address already in
use". LMCache's RESP workers, retrying a Valkey that is not up yet, make
thousands of such connects; below the range no outgoing connect can take the
port either.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_EPHEMERAL = (32768, 60999)
LOWEST_PICK = 10000   # above the well-known and most registered service ports
_pick = random.SystemRandom()


class NoFreePorts(RuntimeError):
    """No block of free loopback ports was found."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral (outgoing source) port range, inclusive."""
    try:
        low, high = (int(field) for field in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT_EPHEMERAL
    return low, high


def _pick_range(count: int) -> tuple[int, int]:
    """The first and last base a pick may use: outside the ephemeral range."""
    low, high = ephemeral_range()
    if low - LOWEST_PICK >= 1000 + count:
        return LOWEST_PICK, low - count
    if 65535 - high >= 1000 + count:
        return high + 1, 65536 - count
    raise NoFreePorts(f"the ephemeral range {low}-{high} leaves no room for test ports "
                      f"({EPHEMERAL_RANGE_FILE})")


def ports_are_free(base: int, count: int) -> bool:
    """Whether the loopback ports ``base`` .. ``base + count - 1`` can all be bound now."""
    sockets = []
    try:
        for port in range(base, base + count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for sock in sockets:
            sock.close()


def free_port_block(count: int, step: int = 10) -> int:
    """A loopback port B (a multiple of ``step``) with B .. B + count - 1 all free."""
    first, last = _pick_range(count)
    for _ in range(200):
        base = _pick.randrange(first, last + 1) // step * step
        if base >= first and ports_are_free(base, count):
            return base
    raise NoFreePorts(f"no block of {count} free loopback ports found in {first}-{last + count - 1}")


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the ephemeral range."""
    return free_port_block(1, step=1)
