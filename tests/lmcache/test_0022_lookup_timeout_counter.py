"""Proof of 0022-observability-count-lookups-that-time-out.patch: every lookup
that gives up after ``lookup_timeout_ms`` counts once in
``lmcache:num_lookup_timeouts``, and a lookup answered in time does not.

With async loading (the prefill preset) the scheduler's
LMCacheAsyncLookupClient asks the worker's LMCacheAsyncLookupServer and polls
``lookup_cache``; past ``lookup_timeout_ms`` it logs "still waiting for async
lookup ... returning 0" and vLLM recomputes the prompt. Pristine 0.5.5 counts
nothing there: an operator sees the timeouts only in the log (the write-up's
"3 s lookup timeouts on every request").

Real parts: a valkey-server stopped with SIGSTOP (a wedged shard: connections
stay open, nothing is answered), LMCache's engine with its RESP remote
backend, the real async lookup server and client over ZMQ, and LMCache's
Prometheus counter read from prometheus_client's registry under the
scheduler's labels. The server's remote lookup is bounded by
``blocking_timeout_secs`` (5 s), longer than ``lookup_timeout_ms`` (1.5 s),
so the client gives up first, as in the incident.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.lmcache.test_0019_resp_stalled_lookup import stalled

PATCH = "0022-observability-count-lookups-that-time-out.patch"
NOT_COUNTED = r"lookups gave up after lookup_timeout_ms=\d+ but lmcache:num_lookup_timeouts_total rose by 0"

pytestmark = pytest.mark.lmcache

LOOKUP_TIMEOUT_MS = 1500
BLOCKING_TIMEOUT_S = 5  # the server's bound on its remote lookup (an int in LMCache config)
ANSWER_BOUND_S = 20.0   # a poll loop that gets no answer at all fails here
TIMED_OUT_LOOKUPS = 2
COUNTER = "lmcache:num_lookup_timeouts_total"


def timeouts_counted(scheduler_metadata) -> float:
    """The counter's value under the scheduler's labels (0 while it has no sample)."""
    from prometheus_client import REGISTRY

    from lmcache.observability import PrometheusLogger

    labels = PrometheusLogger.GetOrCreate(scheduler_metadata).labels
    value = REGISTRY.get_sample_value(COUNTER, {k: str(v) for k, v in labels.items()})
    return value or 0.0


def ask(client, tokens: list[int], lookup_id: str) -> tuple[int, float]:
    """Look up as vLLM's scheduler does (lookup_cache, lookup, then lookup_cache
    each step until it is not None): (hit tokens, seconds)."""
    started = time.monotonic()
    assert client.lookup_cache(lookup_id) == -1
    assert client.lookup(tokens, lookup_id=lookup_id) is None
    while (answer := client.lookup_cache(lookup_id)) is None:
        assert time.monotonic() - started < ANSWER_BOUND_S, f"{lookup_id}: no answer and no timeout"
    return answer, time.monotonic() - started


def stop_receiving(listener, wake) -> None:
    """Stop an async lookup client's or server's receive thread before its
    close(): closing a socket another thread blocks in recv() on can leave the
    context's term() waiting forever, so the thread is woken and joined."""
    listener.running = False
    wake()
    listener.thread.join(timeout=5)
    assert not listener.thread.is_alive(), f"{type(listener).__name__}'s receive thread did not stop"


@pytest.mark.fixes(PATCH, fails_with=NOT_COUNTED)
def test_each_lookup_that_times_out_on_a_stalled_valkey_is_counted_once(valkey):
    import msgspec
    import zmq

    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.lookup_client.async_lookup_message import LookupResponseMsg
    from lmcache.v1.lookup_client.factory import LookupClientFactory
    from lmcache.v1.lookup_client.lmcache_async_lookup_client import (
        LMCacheAsyncLookupClient,
        LMCacheAsyncLookupServer,
    )
    from lmcache.v1.rpc_utils import get_zmq_context, get_zmq_rpc_path_lmcache, get_zmq_socket
    from tests.lmcache.test_0003_resp_per_key_results import close_remote_connection
    from tests.support.pcp_ranks import CHUNK_SIZE, make_kv_connector, mla_metadata, valkey_engine_config

    config = valkey_engine_config(valkey.url)
    config.blocking_timeout_secs = BLOCKING_TIMEOUT_S
    config.enable_async_loading = True
    config.lookup_timeout_ms = LOOKUP_TIMEOUT_MS
    engine_id = f"lookup-timeouts-{os.getpid()}-{id(valkey)}"
    metadata = mla_metadata("lookup-timeouts", 1, 0)
    metadata.engine_id = engine_id  # names the ZMQ sockets
    scheduler_metadata = mla_metadata("lookup-timeouts", 1, 0)
    scheduler_metadata.engine_id = engine_id
    scheduler_metadata.role = "scheduler"

    instance_id = f"lookup-timeouts-{id(valkey)}"
    kv = make_kv_connector(256)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id, config, metadata, kv, lambda t, src: t, lambda o, src: o
    )
    server = client = None
    try:
        server = LookupClientFactory.create_lookup_server(engine, metadata)
        assert isinstance(server, LMCacheAsyncLookupServer)
        engine.post_init(async_lookup_server=server)
        client = LookupClientFactory.create_lookup_client(config, scheduler_metadata)
        assert isinstance(client, LMCacheAsyncLookupClient)

        storage = engine.storage_manager
        l1 = storage.storage_backends["LocalCPUBackend"]
        remote = storage.storage_backends["RemoteBackend"]
        tokens = [(17 * i + 5) % 30011 for i in range(2 * CHUNK_SIZE)]
        kv.fill(7, len(tokens))
        engine.store(tokens)
        keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
        deadline = time.monotonic() + 10.0
        while not all(remote.contains(key) for key in keys):
            assert time.monotonic() < deadline, "the chunks never reached Valkey"
            time.sleep(0.05)

        def fresh_pod() -> None:
            for key in keys:
                l1.remove(key)  # nothing in L1: the lookup reaches Valkey

        start = timeouts_counted(scheduler_metadata)
        fresh_pod()
        hits, _ = ask(client, tokens, "answered-before")
        assert hits == len(tokens), f"the lookup on a healthy Valkey answered {hits} tokens"
        assert timeouts_counted(scheduler_metadata) == start, "a lookup answered in time was counted"

        fresh_pod()
        with stalled(valkey):
            for n in range(TIMED_OUT_LOOKUPS):
                hits, seconds = ask(client, tokens, f"stalled-{n}")
                assert hits == 0, f"a lookup nobody answered reported {hits} tokens"
                # the client gave up on its own bound, before the server's remote lookup did
                assert LOOKUP_TIMEOUT_MS / 1000 <= seconds < BLOCKING_TIMEOUT_S, seconds
            counted = timeouts_counted(scheduler_metadata) - start
            assert counted == TIMED_OUT_LOOKUPS, (
                f"{TIMED_OUT_LOOKUPS} lookups gave up after lookup_timeout_ms={LOOKUP_TIMEOUT_MS} "
                f"but {COUNTER} rose by {counted:g}")

        # the server's late answers to the abandoned lookups count nothing more,
        # and a lookup answered in time after the stall counts nothing
        fresh_pod()
        hits, _ = ask(client, tokens, "answered-after")
        assert hits == len(tokens), f"the lookup after the server resumed answered {hits} tokens"
        assert timeouts_counted(scheduler_metadata) - start == TIMED_OUT_LOOKUPS
    finally:
        os.kill(valkey.process.pid, signal.SIGCONT)
        if server is not None and client is not None:
            stop_receiving(server, lambda: client._send_cleanup_message("close"))
            server.close()
        if client is not None:
            # the client's context is pyzmq's shared instance: term() in its
            # close() waits for this socket too, so it is closed first
            wake = get_zmq_socket(get_zmq_context(use_asyncio=False),
                                  get_zmq_rpc_path_lmcache(engine_id, "lookup_scheduler", 0, 0),
                                  "ipc", zmq.PUSH, "connect")
            try:
                stop_receiving(client, lambda: wake.send(msgspec.msgpack.encode(
                    LookupResponseMsg(lookup_id="close", num_hit_tokens=0))))
            finally:
                wake.close(linger=0)
            client.close()
        if engine.storage_manager is not None:
            close_remote_connection(engine.storage_manager.storage_backends.get("RemoteBackend"))
        LMCacheEngineBuilder.destroy(instance_id)
