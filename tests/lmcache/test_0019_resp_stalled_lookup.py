"""Proof of 0019-resp-connector-bound-lookups-on-a-stalled-server.patch, and
of 0004 (TIMEOUT_PATCH) for a GET against a Valkey that stops answering.

A stalled Valkey accepts and buffers what it is sent but answers nothing (a
real valkey-server stopped with SIGSTOP: a wedged or swapping host). The
engine's synchronous lookup (``RemoteBackend.batched_contains``, and
``contains`` on the store path) waited for the answer with no bound: the
lookup, and the scheduler step behind it, hung until the server came back.
With the patch a lookup gives up after ``blocking_timeout_secs`` (the bound
RemoteBackend already puts on a GET) and counts as a miss: the request
recomputes. A GET gives up at that bound too; the buffers C++ may still
write into stay allocated until the server answers, then are released, and
the connector's executor workers serve again.

Real parts: a valkey-server process, LMCache's RemoteBackend over its RESP
connector and native client, on an event loop thread. Each call runs in a
daemon thread with a bound, so a hang fails the test instead of the run.
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest

from tests.lmcache.test_0003_resp_per_key_results import TIMEOUT_PATCH, Env, chunk_bytes

PATCH = "0019-resp-connector-bound-lookups-on-a-stalled-server.patch"
# Without 0019 a sync lookup has no bound at all: it hangs on the stalled Valkey, and on the pristine
# tree (without 0001) a lost completion can hang it before the stall, on a Valkey that answers
# (seen in make test's phase 2: a run that never ended). Both are bounded here and named.
STALL = r"did not return within [\d.]+ s (of a stalled Valkey|on a Valkey that answers)"

pytestmark = pytest.mark.lmcache

BLOCKING_TIMEOUT_S = 2  # an int in LMCache config
BOUND_S = 3.0 * BLOCKING_TIMEOUT_S
EXECUTOR_WORKERS = 4  # AsyncPQExecutor's default, RESPConnector's executor


def _env(valkey, blocking_timeout_s: int):
    env = Env(valkey, blocking_timeout_s)
    yield env
    os.kill(valkey.process.pid, signal.SIGCONT)  # if a failed test left it stopped
    env.close()


@pytest.fixture
def env(valkey):
    yield from _env(valkey, BLOCKING_TIMEOUT_S)


@contextmanager
def stalled(valkey):
    """valkey-server stopped: connections stay open, nothing is answered."""
    os.kill(valkey.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(valkey.process.pid, signal.SIGCONT)


def timed(fn, what: str, stalled_now: bool = True, blocking_timeout_s: float = BLOCKING_TIMEOUT_S):
    """(fn(), seconds) from a daemon thread; fails if fn does not return in 3 x blocking_timeout_s
    (BOUND_S at the module's bound)."""
    bound_s = 3.0 * blocking_timeout_s
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(bound_s)
    if thread.is_alive():
        where = "of a stalled Valkey" if stalled_now else "on a Valkey that answers"
        pytest.fail(f"{what} did not return within {bound_s} s {where} "
                    f"(blocking_timeout_secs={blocking_timeout_s})")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"], time.monotonic() - started


@pytest.mark.fixes(PATCH, fails_with=STALL)
def test_sync_lookup_on_a_stalled_valkey_is_a_miss_and_recovers(env):
    keys = [env.key(i) for i in range(3)]
    for i in range(3):
        env.store(i)
    hits, _ = timed(lambda: env.backend.batched_contains(keys), "the lookup before the stall", stalled_now=False)
    assert hits == 3

    with stalled(env.valkey):
        hits, seconds = timed(lambda: env.backend.batched_contains(keys), "the engine's lookup (batched_contains)")
        assert hits == 0, f"a lookup nobody answered reported {hits} hits"
        # it waited the configured bound, not less: a slow answer still counts
        assert seconds >= BLOCKING_TIMEOUT_S - 0.1, seconds

    hits, _ = timed(lambda: env.backend.batched_contains(keys), "the lookup after the server resumed")
    assert hits == 3


@pytest.mark.fixes(PATCH, fails_with=STALL)
def test_contains_on_a_stalled_valkey_is_a_miss_and_recovers(env):
    stored = env.store(0)
    hit, _ = timed(lambda: env.backend.contains(env.key(0)), "contains before the stall", stalled_now=False)
    assert hit is True

    with stalled(env.valkey):
        hit, seconds = timed(lambda: env.backend.contains(env.key(0)), "RemoteBackend.contains")
        assert hit is False
        assert seconds >= BLOCKING_TIMEOUT_S - 0.1, seconds

    hit, _ = timed(lambda: env.backend.contains(env.key(0)), "contains after the server resumed")
    assert hit is True
    # the executor worker the abandoned EXISTS held serves again
    obj, _ = timed(lambda: env.backend.get_blocking(env.key(0)), "a GET after the server resumed")
    assert obj is not None and chunk_bytes(obj) == stored
    obj.ref_count_down()
    env.assert_back_at_baseline()


# The GETs' callers give up after this, the native workers (0024) after twice it: the margin
# between the two is how late a caller may return on a loaded host (five callers, 2 s, once ran
# past the native bound there).
GET_BLOCKING_TIMEOUT_S = 5


@pytest.fixture
def get_env(valkey):
    yield from _env(valkey, GET_BLOCKING_TIMEOUT_S)


@pytest.mark.fixes(TIMEOUT_PATCH, fails_with=r"a buffer leaked \(above\) or was freed twice")
def test_gets_on_a_stalled_valkey_give_up_and_the_connector_recovers(get_env):
    """GETs whose callers give up during a stall, and which the server then answers: 0004's case.
    The stall outlasts the callers' bound (blocking_timeout_secs) but not the native workers' own
    (0024: twice that), so on every build the native GETs complete after their callers
    gave up, rather than failing on their own."""
    env = get_env
    keys = [env.key(i) for i in range(3)]
    stored = [env.store(i) for i in range(3)]

    def gave_up(n: int):
        return timed(lambda: env.backend.batched_get_blocking(keys), f"batched GET {n}",
                     blocking_timeout_s=GET_BLOCKING_TIMEOUT_S)

    with stalled(env.valkey):
        # one more batch than the connector has executor workers, all at once
        with concurrent.futures.ThreadPoolExecutor(EXECUTOR_WORKERS + 1) as pool:
            batches = [pool.submit(gave_up, n) for n in range(EXECUTOR_WORKERS + 1)]
            for batch in batches:
                loaded, seconds = batch.result()
                assert loaded == [None, None, None]
                assert GET_BLOCKING_TIMEOUT_S - 0.1 <= seconds, seconds
        # the native GETs may still write into their buffers: held, not freed
        assert 0 < env.chunks_in_use() <= 3 * (EXECUTOR_WORKERS + 1)

    # once the server answers, nobody holds them any more ...
    env.assert_back_at_baseline(timeout=10.0)
    # ... and the connector loads again
    loaded, _ = timed(lambda: env.backend.batched_get_blocking(keys), "the batched GET after the server resumed",
                      stalled_now=False, blocking_timeout_s=GET_BLOCKING_TIMEOUT_S)
    assert [chunk_bytes(obj) for obj in loaded] == stored
    for obj in loaded:
        obj.ref_count_down()
    env.assert_back_at_baseline(timeout=2.0)


@pytest.mark.fixes(PATCH, fails_with=STALL)
def test_engine_lookup_on_a_stalled_valkey_is_a_miss(valkey):
    """The lookup the scheduler asks for (LMCacheEngine.lookup, through the
    storage manager's L1 then L2), on a pod whose L1 holds nothing."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from tests.lmcache.test_0003_resp_per_key_results import close_remote_connection
    from tests.support.pcp_ranks import CHUNK_SIZE, make_kv_connector, mla_metadata, valkey_engine_config

    config = valkey_engine_config(valkey.url)
    config.blocking_timeout_secs = BLOCKING_TIMEOUT_S
    instance_id = f"stalled-lookup-{id(valkey)}"
    kv = make_kv_connector(256)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id, config, mla_metadata("stalled-lookup", 1, 0), kv, lambda t, src: t, lambda o, src: o
    )
    try:
        engine.post_init()
        storage = engine.storage_manager
        l1 = storage.storage_backends["LocalCPUBackend"]
        remote = storage.storage_backends["RemoteBackend"]
        tokens = [(13 * i + 7) % 30011 for i in range(2 * CHUNK_SIZE)]
        kv.fill(3, len(tokens))
        engine.store(tokens)
        keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
        def reached_valkey() -> bool:
            deadline = time.monotonic() + BOUND_S - 1.0
            while not all(remote.contains(key) for key in keys):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)
            return True

        reached, _ = timed(reached_valkey, "the lookups before the stall", stalled_now=False)
        assert reached, "the chunks never reached Valkey"
        for key in keys:
            l1.remove(key)  # a fresh pod: nothing in L1
        found, _ = timed(lambda: engine.lookup(tokens), "the engine's lookup before the stall", stalled_now=False)
        assert found == len(tokens)

        with stalled(valkey):
            hit_tokens, _ = timed(lambda: engine.lookup(tokens), "LMCacheEngine.lookup")
            assert hit_tokens == 0, f"a lookup nobody answered reported {hit_tokens} tokens"

        hit_tokens, _ = timed(lambda: engine.lookup(tokens), "the engine's lookup after the server resumed")
        assert hit_tokens == len(tokens)
    finally:
        os.kill(valkey.process.pid, signal.SIGCONT)
        if engine.storage_manager is not None:
            close_remote_connection(engine.storage_manager.storage_backends.get("RemoteBackend"))
        LMCacheEngineBuilder.destroy(instance_id)
