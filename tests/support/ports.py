"""Free loopback ports for the servers tests start (Valkey, engines, routers)."""
from __future__ import annotations

import socket


class NoFreePorts(RuntimeError):
    """No block of free loopback ports was found."""


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    for _ in range(200):
        base = free_loopback_port() // step * step
        if 1024 <= base and base + count <= 65535 and ports_are_free(base, count):
            return base
    raise NoFreePorts(f"no block of {count} free loopback ports found")
