"""Proofs of 0003-resp-connector-honour-per-key-get-results.patch and of the
patch after it, 0004-resp-connector-finish-gets-whose-caller-timed-out.patch
(the GETs whose caller timed out: ``TIMEOUT_PATCH``).

LMCache's remote backend with its RESP connector (``resp://``: RESPConnector
over the native RESPClient) against a real Valkey server, through the same
entry points the cache engine uses: ``RemoteBackend.batched_get_blocking``
(synchronous retrieve), ``batched_get_non_blocking`` (async prefetch) and
``get_blocking``, plus the client's own ``batch_get_sync``/``get_sync``.

Chunks are written straight into Valkey under the keys LMCache reads, so a
miss is simply a key that is not there (an evicted chunk). Every staging
buffer comes from one allocator whose usage is checked against its baseline:
a leaked buffer leaves it above, a double free below.

On the pristine tree these fail within bounded time: a GET of a missing key
never completes there (the remote backend times out after
``blocking_timeout_secs`` and leaks the buffers), and a batch GET reports
every buffer as loaded KV. Without TIMEOUT_PATCH a caller's timeout leaks
the GET's buffers and kills one of the connector's executor workers, and a
GET that finishes just as its caller times out leaks its buffers.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time

import pytest

from tests.support.lmcache_tree import has_patch

PATCH = "0003-resp-connector-honour-per-key-get-results.patch"
TIMEOUT_PATCH = "0004-resp-connector-finish-gets-whose-caller-timed-out.patch"
# the teardown closes the backend with close(), on a build that has this
CLOSE_PATCH = "0018-resp-connector-close-without-waiting-on-its-own-loop.patch"

pytestmark = pytest.mark.lmcache

CHUNK_TOKENS = 16
# layers, K/V, tokens, heads, head size: 2 * 2 * 16 * 2 * 8 bf16 = 2048 bytes
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 8)
CHUNK_BYTES = 2048
# A bound on a hang, not on speed: every call here returns within about 2 s on an idle host. Beside
# phases 2 and 3 (three leave-one-out runs, the pristine proofs and phase 2b's wheel builds) a GET's
# own 1 s wait once ran past 10 s before it timed out.
RESULT_BOUND_S = 60.0


def _torch():
    import torch

    return torch


class Env:
    """A RemoteBackend on resp://, its event loop thread and its allocator."""

    def __init__(self, valkey, blocking_timeout_secs: int, caller_timeout_secs: int | None = None):
        torch = _torch()
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        self.valkey = valkey
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS,
            local_cpu=False,
            max_local_cpu_size=0.1,
            remote_url=valkey.url,
            remote_serde="naive",
            save_unfull_chunk=False,
            blocking_timeout_secs=blocking_timeout_secs,
            extra_config={"save_chunk_meta": False, "resp_num_threads": 1},
        )
        self.metadata = LMCacheMetadata(
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
        self.local = LocalCPUBackend(self.config, self.metadata, memory_allocator=self.allocator)
        self.backend = RemoteBackend(self.config, self.metadata, self.loop, self.local)
        assert self.backend.connection is not None, "no RESP connection"
        if caller_timeout_secs is not None:
            # The connector took its native workers' bound (0024: twice blocking_timeout_secs)
            # when it was made; RemoteBackend reads the caller's bound from the config on every
            # GET. Lowering it now gives a caller that always gives up long before the native
            # workers could, however late a loaded host runs it: a configuration forced for the
            # interleaving, the code under test untouched.
            self.config.blocking_timeout_secs = caller_timeout_secs
        self.baseline = self.usage()

    def key(self, i: int):
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey("dist-test", 1, 0, 1000 + i, _torch().bfloat16)

    def store(self, i: int) -> bytes:
        """Write chunk i into Valkey under the key LMCache reads."""
        data = random.Random(i).randbytes(CHUNK_BYTES)
        with self.valkey.client() as client:
            client.set(self.key(i).to_string(), data)
        return data

    def usage(self) -> tuple[int, int]:
        inner = self.allocator.allocator
        return inner.total_allocated_size, inner.num_active_allocations

    def chunks_in_use(self) -> int:
        return self.usage()[1] - self.baseline[1]

    def assert_back_at_baseline(self, timeout: float = 0.0) -> None:
        deadline = time.monotonic() + timeout
        while self.usage() != self.baseline and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.usage() == self.baseline, (
            f"allocator at {self.usage()}, baseline {self.baseline}: "
            "a buffer leaked (above) or was freed twice (below)"
        )

    def run(self, coro, timeout: float = RESULT_BOUND_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        if has_patch(CLOSE_PATCH):
            close = self.backend.close
        else:
            close = lambda: self.run(_close_without_the_close_patch(self.backend), timeout)  # noqa: E731
        closer = threading.Thread(target=close, daemon=True)
        closer.start()
        closer.join(timeout)
        # without CLOSE_PATCH a wedged native client may delay its close
        assert not (closer.is_alive() and has_patch(CLOSE_PATCH)), (
            f"RemoteBackend close() did not return within {timeout} s")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)


async def _close_without_the_close_patch(remote) -> None:
    """On a build without CLOSE_PATCH (pristine, and the leave-one-out variants
    of this file's patches, which leave it out with them) RESPConnector.close()
    runs the executor's synchronous shutdown on the loop thread and never
    returns: close the executor and the native client (which joins its C++
    workers) on the loop as that patch's close does."""
    connector = remote.connection
    while hasattr(connector, "getWrappedConnector"):
        connector = connector.getWrappedConnector()
    await connector.pq_executor.shutdown_async(wait=False)
    connector.client.close()


@pytest.fixture
def make_env(valkey):
    envs: list[Env] = []

    def make(blocking_timeout_secs: int = 3, caller_timeout_secs: int | None = None) -> Env:
        env = Env(valkey, blocking_timeout_secs, caller_timeout_secs)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()


def call_bounded(fn, timeout: float = RESULT_BOUND_S):
    """fn() in a daemon thread; fail instead of hanging the run."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"call did not return within {timeout} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def chunk_bytes(memory_obj) -> bytes:
    view = memory_obj.byte_array
    if not isinstance(view, memoryview):
        view = memoryview(view)
    return view.cast("B").tobytes()


@pytest.mark.fixes(PATCH, fails_with=r"not the loaded prefix")
def test_blocking_batch_get_returns_loaded_prefix_and_frees_the_rest(make_env):
    env = make_env()
    stored = {i: env.store(i) for i in (0, 2, 3)}  # chunk 1 was evicted
    keys = [env.key(i) for i in range(4)]

    loaded = call_bounded(lambda: env.backend.batched_get_blocking(keys))

    present = [obj is not None for obj in loaded]
    assert present == [True, False, False, False], (
        f"blocking batch GET returned {present} for chunks 0..3 with chunk 1 missing: not the loaded prefix")
    assert chunk_bytes(loaded[0]) == stored[0]
    assert loaded[0].get_ref_count() == 1
    assert env.chunks_in_use() == 1, "buffers of chunks 1..3 were not freed"
    loaded[0].ref_count_down()
    env.assert_back_at_baseline()


@pytest.mark.fixes(PATCH, fails_with=r"returned 4 objects for a 2-chunk loaded prefix")
def test_non_blocking_batch_get_returns_loaded_prefix_only(make_env):
    env = make_env()
    stored = {i: env.store(i) for i in (0, 1, 3)}  # chunk 2 was evicted
    keys = [env.key(i) for i in range(4)]

    loaded = env.run(env.backend.batched_get_non_blocking("lookup-0", keys))

    # the storage manager pairs these with keys by position
    assert len(loaded) == 2, f"non-blocking batch GET returned {len(loaded)} objects for a 2-chunk loaded prefix"
    assert [chunk_bytes(obj) for obj in loaded] == [stored[0], stored[1]]
    assert env.chunks_in_use() == 2
    for obj in loaded:
        assert obj.get_ref_count() == 1
        obj.ref_count_down()
    env.assert_back_at_baseline()


@pytest.mark.fixes(PATCH, fails_with=r"GET of a missing chunk returned TensorMemoryObj, not None")
def test_get_blocking_of_a_missing_chunk_is_none_and_frees_its_buffer(make_env):
    env = make_env()
    stored = env.store(0)

    missing = call_bounded(lambda: env.backend.get_blocking(env.key(1)))
    assert missing is None, f"GET of a missing chunk returned {type(missing).__name__}, not None"
    env.assert_back_at_baseline(timeout=1.0)

    # and the next GET on the same (single) connection is a clean hit
    obj = call_bounded(lambda: env.backend.get_blocking(env.key(0)))
    assert obj is not None and chunk_bytes(obj) == stored
    obj.ref_count_down()
    env.assert_back_at_baseline()


def test_full_hit_batch_is_returned_whole(make_env):
    # regression guard: passes on both trees
    env = make_env()
    stored = [env.store(i) for i in range(3)]

    loaded = call_bounded(lambda: env.backend.batched_get_blocking([env.key(i) for i in range(3)]))

    assert [chunk_bytes(obj) for obj in loaded] == stored
    for obj in loaded:
        obj.ref_count_down()
    env.assert_back_at_baseline()


@contextlib.contextmanager
def paused(valkey, native_timeout_s: float):
    """Valkey answers nobody until the block ends: the server process stopped (SIGSTOP), its
    connections open, what is sent to it buffered. The block must end before the native workers
    (0024) give up on their own, ``native_timeout_s`` after a GET was sent, so that a GET whose
    caller timed out completes when the server answers; the time left for that is yielded. The
    test ends the pause once it has seen what it waits for, so a caller that returns late on a
    loaded host still finds the server paused. (CLIENT PAUSE cannot do this: a paused server
    holds the CLIENT UNPAUSE too, until the pause's own end.)"""
    os.kill(valkey.process.pid, signal.SIGSTOP)
    try:
        yield time.monotonic() + native_timeout_s - 0.5
    finally:
        os.kill(valkey.process.pid, signal.SIGCONT)


@pytest.mark.fixes(TIMEOUT_PATCH, fails_with=r"a buffer leaked \(above\) or was freed twice")
@pytest.mark.parametrize("path", ["blocking", "non-blocking"])
def test_timed_out_get_frees_its_buffers_only_once_the_native_get_completes(make_env, path):
    # The caller gives up after 2 s, the native workers (0024) only after 60 s: the margin
    # between the two is how late a caller may return on a loaded host (Env).
    native_timeout_s = 60
    env = make_env(blocking_timeout_secs=native_timeout_s // 2, caller_timeout_secs=2)
    for i in range(3):
        env.store(i)
    keys = [env.key(i) for i in range(3)]
    with paused(env.valkey, native_timeout_s) as pause_ends:  # the GETs wait in the server
        if path == "blocking":
            loaded = call_bounded(lambda: env.backend.batched_get_blocking(keys))
            assert loaded == [None, None, None]
        else:
            loaded = env.run(env.backend.batched_get_non_blocking("lookup-0", keys))
            assert loaded == []

        # The GET goes on after the caller gave up, into buffers C++ workers may
        # write to until the server answers: they must stay allocated meanwhile.
        deadline = min(time.monotonic() + 1.0, pause_ends - 0.5)
        while env.chunks_in_use() < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        in_use = env.chunks_in_use()
        if time.monotonic() >= pause_ends - 0.5:
            pytest.skip("the caller returned so late that the native workers' own timeout was near: "
                        "the GET could not be observed while the server was paused")
        assert in_use == 3

    # once the GET completes nobody holds them any more
    env.assert_back_at_baseline(timeout=10.0)


@pytest.mark.fixes(TIMEOUT_PATCH, fails_with=r"the connector no longer loads: its workers are used up")
def test_timed_out_gets_do_not_use_up_the_connector(make_env):
    # RESPConnector runs loads on an executor of 4 workers. A caller that
    # times out must not take a worker down with it when the load finishes.
    # The caller gives up after 2 s; the native workers (0024) only after 60 s, so every load
    # ends after its caller gave up, when the pause ends. With the native bound at twice the
    # caller's (4 s), a caller run 2 s late on a loaded host saw its load fail first: that
    # load's worker lived, the connector still loaded, and the proof failed for another reason.
    native_timeout_s = 60
    env = make_env(blocking_timeout_secs=native_timeout_s // 2, caller_timeout_secs=2)
    stored = env.store(0)
    for _ in range(4):
        with paused(env.valkey, native_timeout_s):
            assert call_bounded(lambda: env.backend.get_blocking(env.key(0))) is None
        time.sleep(1.0)  # the server answers, the abandoned load ends

    obj = call_bounded(lambda: env.backend.get_blocking(env.key(0)))
    assert obj is not None, "after 4 timed-out GETs the connector no longer loads: its workers are used up"
    assert chunk_bytes(obj) == stored
    obj.ref_count_down()
    env.assert_back_at_baseline()


class _ResultArrivesAsTheWaitEnds:
    """``asyncio`` as remote_backend sees it, with one change that forces the
    interleaving a real run hits only by chance: the caller's
    ``future.result(timeout)`` gives up (TimeoutError) at the moment the GET
    has completed. The GET itself runs on the real connector and Valkey."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def run_coroutine_threadsafe(self, coro, loop):
        return _LateFuture(self._real.run_coroutine_threadsafe(coro, loop))


class _LateFuture:
    def __init__(self, future) -> None:
        self._future = future

    def __getattr__(self, name: str):
        return getattr(self._future, name)

    def result(self, timeout=None):
        if timeout is None:
            return self._future.result()
        self._future.result(RESULT_BOUND_S)  # the GET completes ...
        raise TimeoutError  # ... just as the caller's wait runs out

    def cancel(self) -> bool:
        return self._future.cancel()


@pytest.mark.fixes(TIMEOUT_PATCH, fails_with=r"a buffer leaked \(above\) or was freed twice")
@pytest.mark.parametrize("path", ["get", "batched"])
def test_get_that_completes_as_its_caller_times_out_frees_its_buffers(make_env, monkeypatch, path):
    from lmcache.v1.storage_backend import remote_backend

    env = make_env()
    for i in range(2):
        env.store(i)
    monkeypatch.setattr(remote_backend, "asyncio", _ResultArrivesAsTheWaitEnds(asyncio))

    if path == "get":
        assert call_bounded(lambda: env.backend.get_blocking(env.key(0))) is None
    else:
        keys = [env.key(0), env.key(1)]
        assert call_bounded(lambda: env.backend.batched_get_blocking(keys)) == [None, None]
    env.assert_back_at_baseline(timeout=2.0)


@pytest.mark.fixes(PATCH, fails_with=r"not the loaded prefix|the loaded prefix was not written back")
def test_batch_with_a_miss_writes_the_loaded_prefix_back_to_l1(valkey):
    """A remote batch GET through the storage manager, with chunk 2 evicted
    from Valkey between lookup and load: the chunks before it come back and
    are written back to L1, as a batch without a miss is."""
    import torch

    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from tests.support.pcp_ranks import CHUNK_SIZE, make_kv_connector, mla_metadata, valkey_engine_config

    config = valkey_engine_config(valkey.url)
    instance_id = f"write-back-{id(valkey)}"
    kv = make_kv_connector(1024)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id, config, mla_metadata("write-back", 1, 0), kv, lambda t, src: t, lambda o, src: o
    )
    try:
        engine.post_init()
        storage = engine.storage_manager
        l1 = storage.storage_backends["LocalCPUBackend"]
        remote = storage.storage_backends["RemoteBackend"]
        tokens = [(11 * i + 5) % 30011 for i in range(4 * CHUNK_SIZE)]
        kv.fill(9, len(tokens))
        engine.store(tokens)
        keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
        deadline = time.monotonic() + RESULT_BOUND_S
        while not all(remote.contains(key) for key in keys):
            assert time.monotonic() < deadline, "the chunks never reached Valkey"
            time.sleep(0.05)
        stored = [l1.hot_cache[key].tensor.clone() for key in keys]
        for key in keys:
            l1.remove(key)  # a fresh pod: nothing in L1
        with valkey.client() as client:
            assert client.delete(keys[2].to_string()) == 1  # evicted from L2

        loaded = call_bounded(lambda: storage.batched_get(keys, location="RemoteBackend"))

        present = [obj is not None for obj in loaded]
        assert present == [True, True, False, False], (
            f"batch GET returned {present} for chunks 0..3 with chunk 2 evicted: not the loaded prefix")
        in_l1 = [key in l1.hot_cache for key in keys]
        assert in_l1 == [True, True, False, False], (
            f"L1 holds {in_l1} after a batch that loaded chunks 0 and 1: the loaded prefix was not written back"
        )
        for i in (0, 1):
            assert l1.hot_cache[keys[i]] is loaded[i]
            assert torch.equal(loaded[i].tensor, stored[i])
            loaded[i].ref_count_down()
            assert l1.hot_cache[keys[i]].get_ref_count() == 1  # only L1's reference is left
    finally:
        if engine.storage_manager is not None:
            close_remote_connection(engine.storage_manager.storage_backends.get("RemoteBackend"))
        LMCacheEngineBuilder.destroy(instance_id)


def close_remote_connection(remote) -> None:
    """Before LMCacheEngineBuilder.destroy: on a build without CLOSE_PATCH,
    close the RemoteBackend's RESP connection as Env.close does and detach it
    (RemoteBackend.close() skips a detached connection), or destroy hangs."""
    if remote is None or remote.connection is None or has_patch(CLOSE_PATCH):
        return
    asyncio.run_coroutine_threadsafe(_close_without_the_close_patch(remote), remote.loop).result(RESULT_BOUND_S)
    remote.connection = None


@pytest.mark.fixes(PATCH, fails_with=r"RESP client batch_get reported None, not per-key hits")
def test_resp_client_reports_per_key_hits(make_env):
    # The asyncio API, on the client's loop: the synchronous variants share
    # the result plumbing but, without the 0001 lock, can lose a completion.
    env = make_env()
    from lmcache.v1.storage_backend.native_clients.resp_client import RESPClient

    stored = {i: env.store(i) for i in (0, 2)}
    client = RESPClient(env.valkey.host, env.valkey.port, 1, env.loop)
    bufs = [bytearray(CHUNK_BYTES) for _ in range(3)]
    one = bytearray(CHUNK_BYTES)
    try:
        keys = [env.key(i).to_string() for i in range(3)]
        hits = env.run(client.batch_get(keys, [memoryview(b) for b in bufs]))
        assert hits == [True, False, True], f"RESP client batch_get reported {hits}, not per-key hits"
        assert bytes(bufs[0]) == stored[0] and bytes(bufs[2]) == stored[2]

        assert env.run(client.get(keys[1], memoryview(one))) is False
        assert env.run(client.get(keys[0], memoryview(one))) is True
        assert bytes(one) == stored[0]
    finally:
        closer = threading.Thread(
            target=lambda: env.run(_call_soon(client.close), 10.0), daemon=True
        )
        closer.start()
        closer.join(10.0)


async def _call_soon(fn):
    fn()
