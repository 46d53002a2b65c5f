"""The loopback ports tests pick stay out of the kernel's ephemeral range.

A port picked inside that range can be taken by a client dialing it before
its server starts: TCP simultaneous open connects the client socket to
itself. LMCache's RESP workers retrying a Valkey that is not up yet did this
to a Valkey port in a full test run; the server then failed to bind.
"""
from __future__ import annotations

import socket

import pytest

from tests.support import ports

# Connects that sweep the even and odd halves of a default-sized ephemeral range.
SWEEP_CONNECTS = 30000


def test_picked_ports_are_below_the_ephemeral_range_and_free():
    low, _ = ports.ephemeral_range()
    for _ in range(50):
        port = ports.free_loopback_port()
        assert ports.LOWEST_PICK <= port < low and ports.ports_are_free(port, 1)
    base = ports.free_port_block(4)
    assert base % 10 == 0 and base + 3 < low and ports.ports_are_free(base, 4)


@pytest.mark.parametrize("pick", [ports.free_loopback_port, lambda: ports.free_port_block(1)],
                         ids=["free_loopback_port", "free_port_block"])
def test_dialing_a_picked_port_before_its_server_starts_never_takes_the_port(pick):
    port = pick()
    for attempt in range(SWEEP_CONNECTS):
        with socket.socket() as client:
            try:
                client.connect(("127.0.0.1", port))
            except ConnectionRefusedError:
                continue
            pytest.fail(f"connect {attempt} to closed port {port} connected to {client.getpeername()} "
                        f"from {client.getsockname()}")
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))


def test_a_range_that_leaves_no_room_is_named(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    with pytest.raises(ports.NoFreePorts, match=r"ephemeral range 1024-65535 .*ip_local_port_range"):
        ports.free_loopback_port()
