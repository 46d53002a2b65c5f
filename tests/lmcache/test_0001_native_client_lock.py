"""Proof of 0001-native-clients-hold-one-lock-across-submit-and-drain.patch.

``ConnectorClientBase`` (the Python side of LMCache's native RESP, Aerospike,
... clients) drains completions on its event-loop thread. The pristine
``*_sync`` methods submit to the native client first and register the future
that receives the result afterwards, so a completion the loop drains in
between is dropped and the caller waits forever. The patch holds one lock
across submit+register and across drain+pop (and in the close path).

Three kinds of test:

* A fake native client forces the bad interleaving on demand, for each sync
  operation, next to controls with the normal interleaving. 10 cases: on the
  pristine tree 5 fail (the 4 drain-before-register cases and a sync call on
  a closed client) and the 5 controls pass; on the patched tree all pass.
* A stress run of real sync calls (24,000, 4 threads) through the real native
  RESP client against a real Valkey server, where the loss happens on its
  own: the pristine client loses completions within a few hundred to about a
  thousand calls, and the test reports the blocked threads after 30 s
  without progress.
* close() while a sync GET is inside its C++ worker (the real native client,
  a real Valkey held by CLIENT PAUSE): the pristine client fails the GET's
  future, so its caller may free the buffer, before the native close() has
  joined the worker that receives into it; the patch joins first.

Every call under test runs in a daemon thread that is joined with a bounded
wait, so a lost completion fails the test instead of hanging pytest.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any, Callable

import pytest

from lmcache.v1.storage_backend.native_clients.connector_client_base import (
    ConnectorClientBase,
)
from lmcache.v1.storage_backend.native_clients.resp_client import RESPClient

pytestmark = pytest.mark.lmcache

PATCH = "0001-native-clients-hold-one-lock-across-submit-and-drain.patch"

# How long a single sync call may stay blocked before the test calls it lost.
# A healthy call through the fake returns in milliseconds.
CALL_WAIT_S = 10.0
# How long the fake holds a submission back waiting for the event loop to
# drain its completion (see FakeNativeClient).
DRAIN_GRACE_S = 1.0


# --------------------------------------------------------------------------
# helpers


@pytest.fixture
def loop():
    """An asyncio loop running in its own thread, like LMCache's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="client-loop", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Run ``fn`` on the loop's thread (where the client expects to be built
    and closed) and return its result."""

    async def call():
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout)


def call_in_thread(fn: Callable[[], Any], timeout: float) -> tuple[bool, dict]:
    """Run ``fn`` in a daemon thread, wait at most ``timeout`` seconds.

    Returns ``(finished, box)``; ``box`` holds ``result`` or ``error``."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            box["error"] = exc

    thread = threading.Thread(target=run, name="sync-caller", daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), box


def close_bounded(loop: asyncio.AbstractEventLoop, client, timeout: float = 30.0) -> None:
    """Close a client on its loop thread without ever blocking pytest."""
    try:
        on_loop(loop, client.close, timeout)
    except Exception:  # noqa: BLE001 - best effort in teardown
        pass


# --------------------------------------------------------------------------
# (a) fake native client


class FakeNativeClient:
    """A deterministic, thread-safe stand-in for a pybind native connector.

    It exists only to force an interleaving that a real run cannot force on
    demand: with ``mode="drain_before_register"`` each submission delivers
    its completion at once (queue + eventfd, as the C++ workers do) and does
    not hand its future id back to the caller until the event loop has
    drained that completion, i.e. the completion is drained *before* the
    submitting thread can register its future. A client that keeps the loop
    out of the drain while a submit+register is in progress never lets that
    happen; the fake then gives up waiting after ``grace_s`` and returns the
    id, and the completion is drained after the future is registered.

    ``mode="drain_after_register"`` is the normal ordering: the completion is
    delivered only once the future is registered. ``mode="never"`` accepts a
    submission and never completes it, which is what the native client does
    after ``close()`` (its workers are gone).
    """

    def __init__(self, mode: str, grace_s: float = DRAIN_GRACE_S):
        assert mode in ("drain_before_register", "drain_after_register", "never")
        self.mode = mode
        self.grace_s = grace_s
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._mu = threading.Lock()
        self._completions: list[tuple[int, bool, str, Any]] = []
        self._next_id = 0
        self._drained = threading.Event()
        # Set by the test: tells whether a future id has been registered.
        self.is_registered: Callable[[int], bool] = lambda fid: False
        self.submitted: list[tuple[str, list[str]]] = []
        self.closed = False

    # -- the native interface used by ConnectorClientBase

    def event_fd(self) -> int:
        return self._efd

    def submit_batch_get(self, keys, memoryviews) -> int:
        assert len(keys) == len(memoryviews)
        return self._submit("get", keys, [True] * len(keys))

    def submit_batch_set(self, keys, memoryviews) -> int:
        assert len(keys) == len(memoryviews)
        return self._submit("set", keys, None)

    def submit_batch_exists(self, keys) -> int:
        return self._submit("exists", keys, [key.startswith("hit") for key in keys])

    def drain_completions(self):
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._mu:
            items, self._completions = self._completions, []
        if items:
            self._drained.set()
        return items

    def close(self) -> None:
        self.closed = True

    # -- internals

    def _deliver(self, fid: int, results) -> None:
        with self._mu:
            self._completions.append((fid, True, "", results))
        os.eventfd_write(self._efd, 1)

    def _deliver_when_registered(self, fid: int, results) -> None:
        deadline = time.monotonic() + CALL_WAIT_S
        while not self.is_registered(fid) and time.monotonic() < deadline:
            time.sleep(0.001)
        self._deliver(fid, results)

    def _submit(self, op: str, keys, results) -> int:
        with self._mu:
            self._next_id += 1
            fid = self._next_id
            self.submitted.append((op, list(keys)))
        if self.mode == "drain_before_register":
            self._drained.clear()
            self._deliver(fid, results)
            self._drained.wait(self.grace_s)
        elif self.mode == "drain_after_register":
            threading.Thread(
                target=self._deliver_when_registered, args=(fid, results), daemon=True
            ).start()
        return fid

    def release(self) -> None:
        os.close(self._efd)


def _buf() -> memoryview:
    return memoryview(bytearray(16))


# name -> (call on the client, check of its result)
SYNC_OPS: dict[str, tuple[Callable[[ConnectorClientBase], Any], Callable[[Any], bool]]] = {
    "exists_sync": (lambda c: c.exists_sync("hit-0"), lambda r: r is True),
    "batch_exists_sync": (
        lambda c: c.batch_exists_sync(["hit-0", "miss-1"]),
        lambda r: r == [True, False],
    ),
    # None from the pristine client; one flag per key once the client returns
    # the native per-key results (0003 in the series).
    "batch_get_sync": (
        lambda c: c.batch_get_sync(["hit-0", "hit-1"], [_buf(), _buf()]),
        lambda r: r is None or r == [True, True],
    ),
    "batch_set_sync": (
        lambda c: c.batch_set_sync(["k-0", "k-1"], [_buf(), _buf()]),
        lambda r: r is None,
    ),
}


@pytest.fixture
def make_fake_client(loop):
    made: list[tuple[ConnectorClientBase, FakeNativeClient]] = []

    def make(mode: str) -> tuple[ConnectorClientBase, FakeNativeClient]:
        native = FakeNativeClient(mode)
        client = on_loop(loop, lambda: ConnectorClientBase(native, loop))
        native.is_registered = lambda fid: fid in client._pending
        made.append((client, native))
        return client, native

    yield make
    for client, native in made:
        # Fails any future still pending, which wakes a caller the pristine
        # client left blocked, and removes the eventfd reader.
        close_bounded(loop, client)
        native.release()


def _check_sync_call(client: ConnectorClientBase, op: str) -> None:
    call, check = SYNC_OPS[op]
    finished, box = call_in_thread(lambda: call(client), CALL_WAIT_S)
    assert finished, (
        f"{op} still blocked after {CALL_WAIT_S:.0f} s: its completion was "
        "drained before its future was registered and was dropped"
    )
    assert "error" not in box, f"{op} raised {box.get('error')!r}"
    assert check(box["result"]), f"{op} returned {box['result']!r}"


@pytest.mark.fixes(PATCH, fails_with=r"AssertionError: \w+ still blocked after \d+ s: "
                   r"its completion was drained before its future was registered")
@pytest.mark.parametrize("op", list(SYNC_OPS))
def test_fake_completion_drained_before_future_registered(make_fake_client, op):
    """The event loop drains the completion before the submitting thread can
    register its future: the call must still return its result."""
    client, native = make_fake_client("drain_before_register")
    _check_sync_call(client, op)
    assert len(native.submitted) == 1


@pytest.mark.parametrize("op", list(SYNC_OPS))
def test_fake_completion_drained_after_future_registered(make_fake_client, op):
    """Control: the normal ordering works on both trees and keeps working."""
    client, native = make_fake_client("drain_after_register")
    _check_sync_call(client, op)
    assert len(native.submitted) == 1


@pytest.mark.fixes(PATCH, fails_with=r"AssertionError: exists_sync on a closed client still blocked")
def test_fake_sync_call_on_closed_client_raises(loop, make_fake_client):
    """After close() the native client accepts a submission but never
    completes it; a sync call must fail instead of waiting forever."""
    client, native = make_fake_client("never")
    on_loop(loop, client.close)
    finished, box = call_in_thread(lambda: client.exists_sync("hit-0"), CALL_WAIT_S)
    assert finished, f"exists_sync on a closed client still blocked after {CALL_WAIT_S:.0f} s"
    assert isinstance(box.get("error"), RuntimeError), box


def test_fake_close_fails_in_flight_sync_call(loop, make_fake_client):
    """Control: close() fails a sync call already waiting for its result."""
    client, native = make_fake_client("never")
    box: dict = {}

    def call():
        try:
            box["result"] = client.exists_sync("hit-0")
        except BaseException as exc:  # noqa: BLE001 - checked below
            box["error"] = exc

    caller = threading.Thread(target=call, name="sync-caller", daemon=True)
    caller.start()
    deadline = time.monotonic() + CALL_WAIT_S
    while not client._pending and time.monotonic() < deadline:
        time.sleep(0.001)
    assert client._pending, "the sync call never registered its future"
    on_loop(loop, client.close)
    caller.join(CALL_WAIT_S)
    assert not caller.is_alive(), "close() left a sync caller blocked"
    assert isinstance(box.get("error"), RuntimeError), box


# --------------------------------------------------------------------------
# (b) real native RESP client against a real Valkey server

STRESS_THREADS = 4
STRESS_CALLS_PER_THREAD = 6_000  # 24,000 sync calls in all
STRESS_NATIVE_WORKERS = 4
# A run is declared hung when no call completes for this long. A healthy
# loopback EXISTS takes well under a millisecond; this only bounds the test.
STRESS_STALL_S = 30.0
STRESS_DEADLINE_S = 540.0


@pytest.mark.fixes(PATCH, fails_with=r"AssertionError: .*threads blocked in a sync call.*a completion was lost")
def test_real_resp_client_sync_calls_do_not_lose_completions(valkey, loop):
    """Sync exists / batch-exists calls from 4 threads through the real native
    RESP client: every call must return. On the pristine client a completion
    is lost within a few thousand calls and its caller blocks forever."""
    valkey.client().set("present", b"1")
    client = on_loop(
        loop, lambda: RESPClient(valkey.host, valkey.port, STRESS_NATIVE_WORKERS, loop)
    )

    done = [0] * STRESS_THREADS
    errors: list[str] = []
    stop = threading.Event()

    def worker(index: int) -> None:
        absent = f"absent-{index}"
        try:
            for n in range(STRESS_CALLS_PER_THREAD):
                if stop.is_set():
                    return
                if n % 2:
                    got = client.exists_sync("present")
                    want: Any = True
                else:
                    got = client.batch_exists_sync(["present", absent])
                    want = [True, False]
                if got != want:
                    errors.append(f"thread {index} call {n}: {got!r} != {want!r}")
                    return
                done[index] += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            if not stop.is_set():
                errors.append(f"thread {index}: {exc!r}")

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"stress-{i}", daemon=True)
        for i in range(STRESS_THREADS)
    ]
    started = time.monotonic()
    for thread in threads:
        thread.start()

    last_total, last_progress = -1, time.monotonic()
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        total = sum(done)
        if total != last_total:
            last_total, last_progress = total, now
        if now - last_progress > STRESS_STALL_S or now - started > STRESS_DEADLINE_S:
            break
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    stuck = [t.name for t in threads if t.is_alive()]
    total = sum(done)

    stop.set()
    # On the pristine tree this fails the lost futures and wakes their callers.
    close_bounded(loop, client)

    print(
        f"stress: {total} sync calls completed over {STRESS_THREADS} threads "
        f"in {elapsed:.1f} s; blocked threads: {stuck or 'none'}"
    )
    assert not stuck, (
        f"{len(stuck)} of {STRESS_THREADS} threads blocked in a sync call "
        f"(no progress for {STRESS_STALL_S:.0f} s) after {total} completed "
        "calls: a completion was lost"
    )
    assert not errors, errors
    assert total == STRESS_THREADS * STRESS_CALLS_PER_THREAD


# --------------------------------------------------------------------------
# (c) close() with a GET in flight: real native RESP client, real Valkey

# CLIENT PAUSE holds every command of the other clients this long: the GET
# below stays inside its C++ worker (blocked in recv) until close() stops it.
PAUSE_MS = 5_000
GET_BYTES = 64 * 1024


class JoinRecordingNative:
    """The real ``LMCacheRedisClient``, every call passed through unchanged,
    plus a record of what the Python client still held when the native
    ``close()`` (which stops and joins the C++ workers) ran and when it
    returned. It observes the order only; it forces nothing."""

    def __init__(self, native):
        self._native = native
        self.client: ConnectorClientBase | None = None
        self.pending_when_close_started: int | None = None
        self.workers_joined = threading.Event()

    def event_fd(self) -> int:
        return self._native.event_fd()

    def submit_batch_get(self, keys, bufs) -> int:
        return self._native.submit_batch_get(keys, bufs)

    def submit_batch_set(self, keys, bufs) -> int:
        return self._native.submit_batch_set(keys, bufs)

    def submit_batch_exists(self, keys) -> int:
        return self._native.submit_batch_exists(keys)

    def drain_completions(self):
        return self._native.drain_completions()

    def close(self) -> None:
        assert self.client is not None
        self.pending_when_close_started = len(self.client._pending)
        self._native.close()
        self.workers_joined.set()


@pytest.mark.fixes(PATCH, fails_with=r"AssertionError: the in-flight GET's future was failed "
                   r"before the native workers were joined")
def test_real_close_joins_workers_before_failing_in_flight_get(valkey, loop):
    """close() while a sync GET is inside its C++ worker (the server is
    paused): the GET's future may fail, and its caller free the buffer, only
    after the native close() has joined the worker; until then the pending
    entry keeps the buffer referenced."""
    from lmcache.lmcache_redis import LMCacheRedisClient

    valkey.client().set("in-flight", b"\x5a" * GET_BYTES)
    native = JoinRecordingNative(LMCacheRedisClient(valkey.host, valkey.port, 1, "", ""))
    client = on_loop(loop, lambda: ConnectorClientBase(native, loop))
    native.client = client
    admin = valkey.client()
    assert admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL") in (True, b"OK")
    order: list[tuple[str, bool]] = []
    box: dict = {}
    buf = bytearray(GET_BYTES)

    def call() -> None:
        try:
            box["result"] = client.batch_get_sync(["in-flight"], [memoryview(buf)])
        except BaseException as exc:  # noqa: BLE001 - checked below
            box["error"] = exc

    caller = threading.Thread(target=call, name="sync-get", daemon=True)
    try:
        caller.start()
        deadline = time.monotonic() + CALL_WAIT_S
        while not client._pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert client._pending, "the sync GET never registered its future"
        fut = next(iter(client._pending.values()))[0]
        # concurrent.futures runs done callbacks inside set_exception(), i.e.
        # at the moment close() fails the future
        fut.add_done_callback(lambda _: order.append(("future failed", native.workers_joined.is_set())))
        time.sleep(0.3)  # the worker has sent its GET and waits in recv
        assert not fut.done(), "the GET finished although the server is paused"
        started = time.monotonic()
        on_loop(loop, client.close)
        close_s = time.monotonic() - started
        caller.join(CALL_WAIT_S)
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")

    assert not caller.is_alive(), "close() left the sync GET blocked"
    assert native.workers_joined.is_set(), "close() never closed the native client"
    assert close_s < PAUSE_MS / 1000 / 2, f"close() took {close_s:.1f} s: it waited for the paused server"
    assert order == [("future failed", True)], (
        f"the in-flight GET's future was failed before the native workers were joined ({order}): "
        "its caller could free the buffer a C++ worker was still receiving into"
    )
    assert native.pending_when_close_started == 1, (
        f"{native.pending_when_close_started} pending entries when the native close started: "
        "the in-flight GET's buffer was no longer referenced while its worker ran"
    )
    assert isinstance(box.get("error"), RuntimeError) and "Client closed" in str(box["error"]), box
