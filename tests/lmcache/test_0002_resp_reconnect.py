"""Proof of 0002-redis-connector-missing-key-is-a-miss.patch: reconnecting.

LMCache's native RESP client (``LMCacheRedisClient``) against a real Valkey
server that is down, comes up, is killed and comes back, driven through its
eventfd and ``drain_completions()`` as in test_0002_resp_missing_key.py.

On the pristine tree each C++ worker connects once, when it starts, with a
blocking connect(): if Valkey is down at engine start every worker exits and
no GET or SET ever completes again; a worker whose connection broke keeps the
dead socket for good; and a connect to a server that does not accept waits
for the kernel's SYN retries (about two minutes). With the patch a worker
stays up disconnected, a connect gives up after 2 s, reconnects back off
exponentially up to 2 s, and a command while disconnected fails at once (a
GET is a miss).
"""
from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.lmcache.test_0002_resp_missing_key import NativeClient
from tests.support.ports import free_loopback_port
from tests.support.valkey import start_valkey

PATCH = "0002-redis-connector-missing-key-is-a-miss.patch"

pytestmark = pytest.mark.lmcache

# A GET while the port is closed: one refused connect, or none while backing
# off. Generous for a busy 2-core machine.
MISS_BOUND_S = 2.0
# How long the server stays down while GETs keep failing: long enough for the
# backoff to reach its 2 s cap (0.1, 0.2, ... 1.6, 2 s).
DOWN_S = 5.0
# From the server answering to a SET+GET round trip: at most one capped
# backoff (2 s) and a connect, plus slack.
RECONNECT_BOUND_S = 8.0
# A GET against a server that never accepts: the worker's connect times out
# after 2 s (once when the worker starts, once for the GET), plus slack.
CONNECT_TIMEOUT_BOUND_S = 8.0
VALUE_BYTES = 4096
# How long the client's worker threads may take to open their connections
# (a hang bound: on an idle machine it is milliseconds).
WORKERS_CONNECTED_BOUND_S = 30.0


def _get_miss(client: NativeClient, key: str, why: str) -> float:
    started = time.monotonic()
    try:
        hits, _ = client.get([key], VALUE_BYTES, timeout=MISS_BOUND_S)
    except TimeoutError:
        raise AssertionError(f"GET {why} did not complete within {MISS_BOUND_S} s") from None
    elapsed = time.monotonic() - started
    assert hits == [False], f"GET {why} returned {hits}"
    return elapsed


def _round_trip_within(client: NativeClient, bound_s: float, why: str) -> float:
    """SET then GET one value, retrying until it works; returns the time taken."""
    payload = bytes(range(256)) * (VALUE_BYTES // 256)
    started = time.monotonic()
    attempts = 0
    while time.monotonic() - started < bound_s:
        attempts += 1
        ok, _ = client.set("round-trip", payload, timeout=bound_s)
        if ok:
            hits, bufs = client.get(["round-trip"], VALUE_BYTES, timeout=bound_s)
            if hits == [True]:
                assert bytes(bufs[0]) == payload, "the round trip returned other bytes"
                return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"no SET+GET round trip within {bound_s} s after Valkey {why} ({attempts} attempts)")


def _wait_until_every_worker_is_connected(server, num_workers: int) -> None:
    """Wait until Valkey counts a connection from each of the client's workers.

    Each worker connects when its thread first runs. One that had not yet run
    when the server was killed would connect to the restarted server, and a
    round trip through it would pass for a reconnect on the pristine tree too.
    """
    probe = server.client()
    deadline = time.monotonic() + WORKERS_CONNECTED_BOUND_S
    try:
        while True:
            # the probe's own connection is one of the clients Valkey counts
            others = len(probe.client_list()) - 1
            if others >= num_workers:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{others} of the client's {num_workers} workers connected within {WORKERS_CONNECTED_BOUND_S} s")
            time.sleep(0.02)
    finally:
        probe.close()


@pytest.fixture
def clients():
    made: list[NativeClient] = []
    yield made
    for client in made:
        client.close()


@pytest.fixture
def servers():
    started = []
    yield started
    for server in started:
        server.stop()


@pytest.mark.fixes(PATCH,
                   fails_with=r"AssertionError: GET with Valkey down since the client started did not complete within")
def test_client_started_with_valkey_down_serves_misses_then_reconnects(tmp_path, clients, servers):
    port = free_loopback_port()
    client = NativeClient("127.0.0.1", port, num_workers=2)
    clients.append(client)

    down_since = time.monotonic()
    slowest = 0.0
    n = 0
    while time.monotonic() - down_since < DOWN_S:
        slowest = max(slowest, _get_miss(client, f"k{n}", "with Valkey down since the client started"))
        n += 1
        time.sleep(0.05)

    servers.append(start_valkey(tmp_path, port=port))
    took = _round_trip_within(client, RECONNECT_BOUND_S, "came up")
    print(f"{n} GETs while down, slowest {slowest:.3f} s; round trip {took:.2f} s after Valkey came up")


@pytest.mark.fixes(PATCH,
                   fails_with=r"AssertionError: no SET\+GET round trip within [\d.]+ s after Valkey was restarted")
def test_client_reconnects_after_valkey_is_killed_and_restarted(tmp_path, clients, servers):
    server = start_valkey(tmp_path)
    servers.append(server)
    client = NativeClient(server.host, server.port, num_workers=2)
    clients.append(client)
    _round_trip_within(client, RECONNECT_BOUND_S, "started")
    _wait_until_every_worker_is_connected(server, num_workers=2)

    server.process.kill()
    server.process.wait(timeout=10)
    for n in range(6):
        _get_miss(client, f"k{n}", "after Valkey was killed")
    ok, error = client.set("while-down", b"x" * VALUE_BYTES, timeout=MISS_BOUND_S)
    assert not ok and error, "a SET with Valkey down did not fail"

    servers.append(start_valkey(tmp_path, port=server.port))
    took = _round_trip_within(client, RECONNECT_BOUND_S, "was restarted")
    print(f"round trip {took:.2f} s after Valkey was restarted")


@pytest.mark.fixes(PATCH, fails_with=r"AssertionError: GET against a server that never accepts did not complete within")
def test_connect_to_a_server_that_never_accepts_times_out(clients):
    # listen(0) and one connection already queued: the kernel drops further
    # SYNs, so a connect waits until it gives up (the server never accepts)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port), timeout=2)
    try:
        client = NativeClient("127.0.0.1", port, num_workers=1)
        clients.append(client)
        started = time.monotonic()
        try:
            hits, _ = client.get(["k"], VALUE_BYTES, timeout=CONNECT_TIMEOUT_BOUND_S)
        except TimeoutError:
            raise AssertionError(
                f"GET against a server that never accepts did not complete within {CONNECT_TIMEOUT_BOUND_S} s"
            ) from None
        assert hits == [False], hits
        print(f"GET against a server that never accepts: miss after {time.monotonic() - started:.2f} s")

        # close() joins the worker, which may be inside a connect
        closer = threading.Thread(target=client.native.close, daemon=True)
        started = time.monotonic()
        closer.start()
        closer.join(CONNECT_TIMEOUT_BOUND_S)
        assert not closer.is_alive(), f"close() did not return within {CONNECT_TIMEOUT_BOUND_S} s"
    finally:
        filler.close()
        listener.close()
