"""Proof of 0002-redis-connector-missing-key-is-a-miss.patch.

LMCache's native RESP client (``lmcache.lmcache_redis.LMCacheRedisClient``, the
C++ code under ``csrc/storage_backends/redis``) against a real Valkey server.
The client is driven directly, through its eventfd and ``drain_completions()``,
so these tests see exactly what the C++ layer reports: one completion per
batch, with one hit/miss flag per key for GET and EXISTS.

On the pristine tree a GET of a missing key never completes for chunk sizes of
3 digits and more (the worker thread waits forever for a header sized for a
hit), and with 1-digit sizes or any unexpected reply the connection's reply
stream goes out of step. Every wait here is bounded, so those cases fail
instead of hanging; buffers handed to a call that never completed are kept
alive for the rest of the process, since a C++ thread may still write to them.
"""
from __future__ import annotations

import random
import select
import threading
import time

import pytest

PATCH = "0002-redis-connector-missing-key-is-a-miss.patch"

pytestmark = pytest.mark.lmcache

# A miss is one loopback round trip; a hang is forever. Generous for a busy
# 2-core machine, and far below LMCache's own blocking_timeout_secs (10 s).
MISS_BOUND_S = 2.0
# Hits of up to ~100 MB on a busy machine.
HIT_BOUND_S = 60.0
# Three 12.4 MB values, one of them missing.
BATCH_BOUND_S = 15.0

# The write-up's chunk: 256 tokens of GLM-5.3 FP8 KV, about 12.4 MB, whose
# RESP length header "$12400000\r\n" is the 11 bytes the old code waited for.
CHUNK_BYTES = 12_400_000

# Buffers of calls that did not complete in time (pristine tree only).
_BUFFERS_OF_UNFINISHED_CALLS: list = []


class NativeClient:
    """LMCacheRedisClient with bounded waits for its completions."""

    def __init__(self, host: str, port: int, num_workers: int = 1):
        from lmcache.lmcache_redis import LMCacheRedisClient

        self.native = LMCacheRedisClient(host, port, num_workers, "", "")
        self._fd = self.native.event_fd()
        self._done: dict[int, tuple[bool, str, list | None]] = {}

    def _wait(self, future_id: int, timeout: float, keepalive) -> tuple[bool, str, list | None]:
        deadline = time.monotonic() + timeout
        while future_id not in self._done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _BUFFERS_OF_UNFINISHED_CALLS.append(keepalive)
                raise TimeoutError(f"no completion within {timeout} s")
            readable, _, _ = select.select([self._fd], [], [], remaining)
            if readable:
                for fid, ok, error, results in self.native.drain_completions():
                    self._done[int(fid)] = (bool(ok), str(error), results)
        return self._done.pop(future_id)

    def set(self, key: str, payload: bytes, timeout: float = HIT_BOUND_S) -> tuple[bool, str]:
        buf = bytearray(payload)
        fid = self.native.submit_batch_set([key], [memoryview(buf)])
        ok, error, _ = self._wait(fid, timeout, buf)
        return ok, error

    def get(self, keys: list[str], size: int, timeout: float) -> tuple[list[bool], list[bytearray]]:
        bufs = [bytearray(size) for _ in keys]
        fid = self.native.submit_batch_get(keys, [memoryview(b) for b in bufs])
        ok, error, results = self._wait(fid, timeout, bufs)
        assert ok, f"batch GET failed as a whole: {error}"
        assert results is not None and len(results) == len(keys), results
        return [bool(r) for r in results], bufs

    def exists(self, keys: list[str], timeout: float = MISS_BOUND_S) -> list[bool]:
        fid = self.native.submit_batch_exists(keys)
        ok, error, results = self._wait(fid, timeout, None)
        assert ok, f"batch EXISTS failed: {error}"
        return [bool(r) for r in results]

    def close(self, timeout: float = 10.0) -> None:
        # close() joins the worker threads; never let a wedged one hang the run
        closer = threading.Thread(target=self.native.close, daemon=True)
        closer.start()
        closer.join(timeout)


@pytest.fixture
def server(valkey):
    """A single-connection valkey-py client: its own id is stable, so every
    other connection in CLIENT LIST belongs to the native client."""
    import valkey as valkey_py

    client = valkey_py.Valkey(host=valkey.host, port=valkey.port, single_connection_client=True)
    yield client
    client.close()


@pytest.fixture
def native(valkey):
    clients: list[NativeClient] = []

    def make(num_workers: int = 1) -> NativeClient:
        client = NativeClient(valkey.host, valkey.port, num_workers)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def native_connection_ids(server, expected: int = 1, timeout: float = 5.0) -> list[int]:
    """Ids of the native client's connections (all but the test's own)."""
    own = server.client_id()
    deadline = time.monotonic() + timeout
    while True:
        ids = sorted(int(c["id"]) for c in server.client_list() if int(c["id"]) != own)
        if len(ids) == expected or time.monotonic() > deadline:
            return ids
        time.sleep(0.02)


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def assert_serves(client: NativeClient, key: str, size: int, seed: int) -> None:
    """SET, GET and EXISTS on this client answer correctly."""
    data = payload(size, seed)
    ok, error = client.set(key, data)
    assert ok, error
    hits, bufs = client.get([key], size, HIT_BOUND_S)
    assert hits == [True]
    assert bytes(bufs[0]) == data
    assert client.exists([key, key + ":absent"]) == [True, False]


@pytest.mark.fixes(PATCH, fails_with=r"TimeoutError: no completion within")
def test_key_deleted_between_exists_and_get_is_a_miss_on_the_same_connection(server, native):
    client = native(num_workers=1)
    data = payload(CHUNK_BYTES, 1)
    ok, error = client.set("chunk", data)
    assert ok, error
    assert client.exists(["chunk"]) == [True]
    (conn_id,) = native_connection_ids(server)

    # LRU eviction between lookup (EXISTS) and load (GET)
    assert server.delete("chunk") == 1

    hits, _ = client.get(["chunk"], CHUNK_BYTES, MISS_BOUND_S)
    assert hits == [False]

    # the one worker's one connection serves on, in step
    assert native_connection_ids(server) == [conn_id]
    assert_serves(client, "next-chunk", CHUNK_BYTES, 2)
    assert client.exists(["chunk"]) == [False]
    assert native_connection_ids(server) == [conn_id]


@pytest.mark.fixes(PATCH, fails_with=r"TimeoutError: no completion within")
def test_batch_get_of_hit_miss_hit_gives_per_key_results(server, native):
    client = native(num_workers=1)
    stored = {key: payload(CHUNK_BYTES, seed) for seed, key in enumerate(["a", "c"])}
    for key, data in stored.items():
        ok, error = client.set(key, data)
        assert ok, error

    hits, bufs = client.get(["a", "b", "c"], CHUNK_BYTES, BATCH_BOUND_S)

    assert hits == [True, False, True]
    assert bytes(bufs[0]) == stored["a"]
    assert bytes(bufs[2]) == stored["c"]


# value size -> digits of its RESP length header "$<size>\r\n"
SIZES_BY_DIGITS = {
    1: 7,
    2: 42,
    3: 512,
    4: 4_096,
    5: 65_536,
    6: 262_144,
    7: 1_048_576,
    8: CHUNK_BYTES,
    9: 100_000_000,
}


def _size_param(digits: int):
    size = SIZES_BY_DIGITS[digits]
    if digits == 2:
        # "$-1\r\n" is exactly as long as "$NN\r\n": the pristine client reads
        # it whole, reports a mismatch (a miss) and stays in step. A plain
        # regression test: it passes on both trees.
        return pytest.param(size, id=f"{digits}-digits")
    # Pristine: a one-digit header ("$7\r\n") is shorter than "$-1\r\n", so
    # the miss leaves the connection out of step and the next SET reads the
    # wrong reply; wider headers make the GET wait for bytes that never come.
    reason = r"AssertionError: SET: response was not OK" if digits == 1 else r"TimeoutError: no completion within"
    return pytest.param(size, id=f"{digits}-digits", marks=pytest.mark.fixes(PATCH, fails_with=reason))


@pytest.mark.parametrize("size", [_size_param(d) for d in sorted(SIZES_BY_DIGITS)])
def test_every_length_header_width_round_trips_and_misses(server, native, size):
    client = native(num_workers=1)
    data = payload(size, size)
    ok, error = client.set("k", data)
    assert ok, error
    hits, bufs = client.get(["k"], size, HIT_BOUND_S)
    assert hits == [True]
    assert bytes(bufs[0]) == data
    del bufs
    (conn_id,) = native_connection_ids(server)

    assert server.delete("k") == 1
    hits, _ = client.get(["k"], size, MISS_BOUND_S)
    assert hits == [False]

    assert_serves(client, "k", size, size + 1)
    assert native_connection_ids(server) == [conn_id]


EXPECTED_BYTES = 4_096  # "$4096\r\n"


def _store_wrong_type(server, key):
    server.lpush(key, b"x")


def _store_shorter_value(server, key):
    server.set(key, b"s" * (EXPECTED_BYTES // 2))  # "$2048\r\n": same width


def _store_longer_value(server, key):
    server.set(key, b"l" * (EXPECTED_BYTES * 10 + 3))  # "$40963\r\n": wider


@pytest.mark.fixes(PATCH, fails_with=r"AssertionError: SET: response was not OK")
@pytest.mark.parametrize(
    "store",
    [_store_wrong_type, _store_shorter_value, _store_longer_value],
    ids=["wrongtype-error", "shorter-value", "longer-value"],
)
def test_get_reply_that_does_not_parse_reconnects_and_keeps_serving(server, native, store):
    client = native(num_workers=1)
    assert_serves(client, "good", EXPECTED_BYTES, 1)
    (old_id,) = native_connection_ids(server)
    store(server, "bad")

    hits, _ = client.get(["bad"], EXPECTED_BYTES, MISS_BOUND_S)
    assert hits == [False]

    assert_serves(client, "good", EXPECTED_BYTES, 2)
    hits, _ = client.get(["good", "bad", "good"], EXPECTED_BYTES, MISS_BOUND_S)
    assert hits == [True, False, True]
    new_ids = native_connection_ids(server)
    assert len(new_ids) == 1, f"expected one connection, the old one closed: {new_ids}"
    assert new_ids != [old_id], "the out-of-step connection was kept"


@pytest.mark.fixes(PATCH, fails_with=r"assert 'OOM' in 'SET: response was not OK'")
def test_set_error_reply_reconnects_and_keeps_serving(server, native):
    client = native(num_workers=1)
    assert_serves(client, "good", EXPECTED_BYTES, 1)
    server.config_set("maxmemory-policy", "noeviction")
    server.config_set("maxmemory", 1)
    try:
        ok, error = client.set("rejected", payload(EXPECTED_BYTES, 3), timeout=MISS_BOUND_S)
    finally:
        server.config_set("maxmemory", 0)
    assert not ok
    assert "OOM" in error

    assert_serves(client, "good", EXPECTED_BYTES, 4)
    assert len(native_connection_ids(server)) == 1


@pytest.mark.fixes(PATCH, fails_with=r"AssertionError: socket writev failed")
def test_connection_closed_by_server_is_reopened(server, native):
    client = native(num_workers=1)
    assert_serves(client, "good", EXPECTED_BYTES, 1)
    (old_id,) = native_connection_ids(server)
    server.client_kill_filter(_id=old_id)

    # the first command may land on the dead socket; it must complete
    client.get(["good"], EXPECTED_BYTES, MISS_BOUND_S)

    assert_serves(client, "good", EXPECTED_BYTES, 2)
    assert_serves(client, "good", EXPECTED_BYTES, 3)
    new_ids = native_connection_ids(server)
    assert len(new_ids) == 1 and new_ids != [old_id]
