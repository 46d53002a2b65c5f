"""Proof of 0018-resp-connector-close-without-waiting-on-its-own-loop.patch.

``RemoteBackend.close()`` runs ``RESPConnector.close()`` on the backend's
event loop, and before the patch that awaited the job executor's
*synchronous* ``shutdown()``, which blocks the loop thread on work scheduled
on that same loop: close never returns, so neither does
``LMCacheEngineBuilder.destroy`` of an engine with a ``resp://`` remote.

Real parts: a Valkey server, LMCache's RemoteBackend over its RESP connector
and native client, on an event loop thread as the storage manager runs it.
``CLIENT PAUSE`` holds the GETs in the server, so they are in flight (or
queued behind the connector's four executor workers) when close() is called.
close() runs in a daemon thread with a bound, so a hang fails the test
instead of the run; so do the callers' waits. Each GET must then be resolved
or failed (not left pending), and its staging buffers released.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import time

import pytest

PATCH = "0018-resp-connector-close-without-waiting-on-its-own-loop.patch"
HANG = r"close\(\) did not return within"

pytestmark = pytest.mark.lmcache

CHUNK_TOKENS = 16
# layers, K/V, tokens, heads, head size: 2 * 2 * 16 * 2 * 8 bf16 = 2048 bytes
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 8)
CHUNK_BYTES = 2048
EXECUTOR_WORKERS = 4  # AsyncPQExecutor's default, RESPConnector's executor
CLOSE_BOUND_S = 5.0
# the server holds the GETs much longer than close() may take
PAUSE_MS = 30_000
# RemoteBackend's own GET timeout: far beyond the test, so it is not what
# resolves a GET left pending
BLOCKING_TIMEOUT_S = 120


class Env:
    """A RemoteBackend on resp://, its event loop thread and its allocator."""

    def __init__(self, valkey):
        import torch

        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        self.valkey = valkey
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="backend-loop", daemon=True)
        self.thread.start()
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS,
            local_cpu=False,
            max_local_cpu_size=0.1,
            remote_url=valkey.url,
            remote_serde="naive",
            save_unfull_chunk=False,
            blocking_timeout_secs=BLOCKING_TIMEOUT_S,
            extra_config={"save_chunk_meta": False, "resp_num_threads": 2},
        )
        metadata = LMCacheMetadata(
            model_name="dist-test",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=KV_SHAPE,
            use_mla=False,
            chunk_size=CHUNK_TOKENS,
        )
        self.allocator = PinMemoryAllocator(64 * CHUNK_BYTES)
        self.local = LocalCPUBackend(config, metadata, memory_allocator=self.allocator)
        self.backend = RemoteBackend(config, metadata, self.loop, self.local)
        assert self.backend.connection is not None, "no RESP connection"
        connector = self.backend.connection
        while hasattr(connector, "getWrappedConnector"):
            connector = connector.getWrappedConnector()
        assert type(connector).__name__ == "RESPConnector", type(connector)
        self.connector = connector
        self.baseline = self.usage()

    def key(self, i: int):
        import torch

        from lmcache.utils import CacheEngineKey

        return CacheEngineKey("dist-test", 1, 0, 1000 + i, torch.bfloat16)

    def store(self, i: int) -> None:
        with self.valkey.client() as client:
            client.set(self.key(i).to_string(), bytes([i % 256]) * CHUNK_BYTES)

    def pause_server(self) -> None:
        with self.valkey.client() as client:
            client.client_pause(PAUSE_MS)

    def usage(self) -> tuple[int, int]:
        inner = self.allocator.allocator
        return inner.total_allocated_size, inner.num_active_allocations

    def wait_for_chunks_in_use(self, count: int, what: str) -> None:
        deadline = time.monotonic() + 10.0
        while self.usage()[1] - self.baseline[1] < count:
            assert time.monotonic() < deadline, f"{what} never allocated its buffers"
            time.sleep(0.01)
        time.sleep(0.2)  # allocated, then submitted to the native client

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def assert_back_at_baseline(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.usage() != self.baseline and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.usage() == self.baseline, (
            f"allocator at {self.usage()}, baseline {self.baseline}: the GETs' buffers were not released"
        )

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5.0)


@pytest.fixture
def env(valkey):
    env = Env(valkey)
    yield env
    env.stop()


def unblock(loop_thread: threading.Thread) -> None:
    """Teardown after a hang only (the test has failed by then): the loop
    thread is blocked in the executor's synchronous shutdown(), waiting on a
    concurrent future for work on that same loop. Cancel the futures its
    frames wait on, so that it runs again and a non-daemon loop thread (the
    storage manager's) does not keep the interpreter from exiting."""
    frame = sys._current_frames().get(loop_thread.ident)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, concurrent.futures.Future) and not value.done():
                value.cancel()
        frame = frame.f_back


def close_bounded(close, what: str, loop_thread: threading.Thread,
                  while_: str = "with GETs in flight") -> None:
    """close() in a daemon thread; fail instead of hanging the run."""
    outcome: dict = {}

    def target():
        try:
            close()
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    thread = threading.Thread(target=target, name="closer", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(CLOSE_BOUND_S)
    if thread.is_alive():
        unblock(loop_thread)
        thread.join(CLOSE_BOUND_S)
        pytest.fail(f"{what} close() did not return within {CLOSE_BOUND_S} s ({while_})")
    if "error" in outcome:
        raise outcome["error"]
    assert time.monotonic() - started < CLOSE_BOUND_S


def outcome_of(future: concurrent.futures.Future, what: str) -> str:
    """'result' or 'error: ...' once the caller's wait ends; fails if it does not."""
    try:
        future.result(CLOSE_BOUND_S)
        return "result"
    except concurrent.futures.TimeoutError:
        pytest.fail(f"{what} still pending {CLOSE_BOUND_S} s after close(): its caller waits forever")
    except Exception as e:  # noqa: BLE001 - the outcome is the point
        return f"error: {type(e).__name__}: {e}"


@pytest.mark.fixes(PATCH, fails_with=HANG)
def test_remote_backend_close_returns_with_a_get_in_flight(env):
    for i in range(2):
        env.store(i)
    keys = [env.key(0), env.key(1)]
    env.pause_server()
    # the async prefetch path: the storage manager awaits it on the loop
    prefetch = env.submit(env.backend.batched_get_non_blocking("lookup-0", keys))
    env.wait_for_chunks_in_use(2, "the prefetch GET")
    assert not prefetch.done()

    close_bounded(env.backend.close, "RemoteBackend", env.thread)

    # RemoteBackend logs a failed prefetch and reports no chunk loaded
    assert outcome_of(prefetch, "the prefetch GET") == "result"
    assert prefetch.result() == []
    env.assert_back_at_baseline(timeout=CLOSE_BOUND_S)


@pytest.mark.fixes(PATCH, fails_with=HANG)
def test_connector_close_fails_gets_in_flight_and_queued(env):
    # One GET per executor worker, in flight in the paused server, and two
    # more queued behind them that no worker has started.
    n_gets = EXECUTOR_WORKERS + 2
    for i in range(n_gets):
        env.store(i)
    env.pause_server()
    gets = [env.submit(env.connector.get(env.key(i))) for i in range(n_gets)]
    env.wait_for_chunks_in_use(EXECUTOR_WORKERS, "the in-flight GETs")
    assert env.usage()[1] - env.baseline[1] == EXECUTOR_WORKERS, "expected exactly 4 GETs running"
    assert not any(get.done() for get in gets)

    close_bounded(lambda: env.submit(env.connector.close()).result(), "RESPConnector", env.thread)

    outcomes = [outcome_of(get, f"GET {i}") for i, get in enumerate(gets)]
    # the server never answered them: each fails, none is left waiting
    assert all(o.startswith("error: RuntimeError") for o in outcomes), outcomes
    env.assert_back_at_baseline(timeout=CLOSE_BOUND_S)

    # a GET after close fails at once instead of waiting for a worker
    late = outcome_of(env.submit(env.connector.get(env.key(0))), "a GET after close()")
    assert late.startswith("error: RuntimeError"), late


@pytest.mark.fixes(PATCH, fails_with=HANG)
def test_engine_destroy_returns(valkey):
    """The vLLM shutdown path: LMCacheEngineBuilder.destroy of an engine whose
    L2 is Valkey (resp://) closes its RemoteBackend."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from tests.support.pcp_ranks import CHUNK_SIZE, make_kv_connector, mla_metadata, valkey_engine_config

    config = valkey_engine_config(valkey.url)
    instance_id = f"destroy-{id(valkey)}"
    kv = make_kv_connector(256)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id, config, mla_metadata("destroy", 1, 0), kv, lambda t, src: t, lambda o, src: o
    )
    engine.post_init()
    tokens = [(7 * i + 3) % 30011 for i in range(2 * CHUNK_SIZE)]
    kv.fill(5, len(tokens))
    engine.store(tokens)
    remote = engine.storage_manager.storage_backends["RemoteBackend"]
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
    deadline = time.monotonic() + 10.0
    while not all(remote.contains(key) for key in keys):
        assert time.monotonic() < deadline, "the chunks never reached Valkey"
        time.sleep(0.05)

    storage = engine.storage_manager
    try:
        close_bounded(
            lambda: LMCacheEngineBuilder.destroy(instance_id),
            "LMCacheEngineBuilder.destroy ->",
            storage.thread,
            "idle",
        )
    finally:
        # after a hang, destroy leaves the (non-daemon) loop thread running
        if storage.thread.is_alive():
            storage.loop.call_soon_threadsafe(storage.loop.stop)
            storage.thread.join(CLOSE_BOUND_S)
