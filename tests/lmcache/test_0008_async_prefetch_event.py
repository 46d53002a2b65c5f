"""Proof of 0008-async-loading-take-prefetch-event-once.patch.

A real LMCacheEngine on CPU with async loading and an L1 (LocalCPUBackend),
driven the way vLLM's connector drives it: the lookup server prefetches
(``async_lookup_and_prefetch``), the worker retrieves (``retrieve`` with the
request id) and then unpins (``lookup_unpin`` from ``wait_for_save``). The
GPU KV cache is a CPU tensor (tests/support/pcp_ranks.py); the scheduler's
ZMQ channel is a recorder.

* Pristine: ``retrieve`` leaves the prefetch event in place, so
  ``lookup_unpin`` -> ``cleanup_memory_objs`` releases every chunk a second
  time; an L1 chunk loses the cache's own reference and goes back to the
  allocator while L1 still maps its key to it, so the next store overwrites
  cached KV.
* Pristine: a request whose prefetch found nothing has no event, and
  ``retrieve`` raises AssertionError in ``get_event_future``.
* Without the release of the unused chunks' pins: the lookup server
  prefetches with ``pin=True``; a prefetched chunk the retrieve does not use
  (masked by vLLM's own prefix, or past the capped load) kept its pin
  (pin_count 1 at ref_count 1) until the pin monitor's timeout, and L1 could
  not evict it.

The prefetches go through LMCache's real lookup path: the scheduler's
``LMCacheAsyncLookupClient`` sends the request over ZMQ to the worker's
``LMCacheAsyncLookupServer`` (both made by ``LookupClientFactory``), which
calls ``async_lookup_and_prefetch(pin=True)``; the storage layer answers the
client through the server.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch

from tests.support.pcp_ranks import CHUNK_SIZE, HEAD_SIZE, NUM_LAYERS, make_kv_connector, mla_metadata

pytestmark = pytest.mark.lmcache

PATCH = "0008-async-loading-take-prefetch-event-once.patch"
_ids = itertools.count()


@pytest.fixture
def engine_kv():
    """A worker's engine with its real async lookup server, and the
    scheduler's real lookup client talking to it over ZMQ."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.lookup_client.factory import LookupClientFactory
    from lmcache.v1.lookup_client.lmcache_async_lookup_client import LMCacheAsyncLookupServer

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE,
        local_cpu=True,
        max_local_cpu_size=0.02,
        save_unfull_chunk=False,
        enable_async_loading=True,
    )
    instance_id = f"async-event-{os.getpid()}-{next(_ids)}"
    metadata = mla_metadata("async-event-test", 1, 0)
    metadata.engine_id = instance_id  # names the ZMQ sockets
    kv = make_kv_connector(4096)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id,
        config,
        metadata,
        kv,
        lambda tensor, src: tensor,  # one rank: a broadcast is the identity
        lambda obj, src: obj,
    )
    server = LookupClientFactory.create_lookup_server(engine, metadata)
    assert isinstance(server, LMCacheAsyncLookupServer)
    engine.post_init(async_lookup_server=server)
    client = LookupClientFactory.create_lookup_client(config, metadata)
    try:
        yield engine, kv, client
    finally:
        stop_lookup_channel(client, server)
        LMCacheEngineBuilder.destroy(instance_id)


def stop_lookup_channel(client, server) -> None:
    """Stop both receive threads before closing their sockets. Their close()
    closes a socket another thread may be blocked in recv() on, which aborts
    the process in ZMQ; in vLLM that happens at process exit. Each thread is
    woken with one message of the kind it expects and leaves its loop."""
    client.running = False
    server.running = False
    client._send_cleanup_message("stop")  # a cleanup of an unknown lookup: a no-op
    server.send_response_to_scheduler("stop", 0)
    for thread in (client.thread, server.thread):
        thread.join(10)
        assert not thread.is_alive(), f"{thread.name} did not stop"
    client.close()
    server.close()


def prefetch(client, tokens, lookup_id: str, timeout: float = 30.0) -> int:
    """What the scheduler's get_num_new_matched_tokens does under async
    loading: ask once, then poll until the workers have answered."""
    assert client.lookup_cache(lookup_id) == -1  # first time: no result cached
    assert client.lookup(tokens, lookup_id=lookup_id) is None
    deadline = time.monotonic() + timeout
    while (hits := client.lookup_cache(lookup_id)) is None:
        assert time.monotonic() < deadline, f"no prefetch answer for {lookup_id}"
    return hits


def tokens_of(seed: int, num_chunks: int) -> list[int]:
    return [(seed * 1009 + 7 * i) % 30011 for i in range(num_chunks * CHUNK_SIZE)]


def l1_chunks(engine, tokens):
    backend = engine.storage_manager.storage_backends["LocalCPUBackend"]
    out = []
    for start, end, key in engine.token_database.process_tokens(tokens=tokens):
        out.append((start, end, backend.hot_cache[key]))
    return out


@pytest.mark.fixes(PATCH, fails_with=r"a prefetched L1 chunk was released twice")
def test_retrieve_then_unpin_releases_each_prefetched_chunk_once(engine_kv):
    engine, kv, client = engine_kv
    tokens = tokens_of(1, 4)
    kv.fill(1, len(tokens))
    engine.store(tokens)
    cached = l1_chunks(engine, tokens)
    refs_before = [obj.get_ref_count() for _, _, obj in cached]

    assert prefetch(client, tokens, "req-1") == len(tokens)
    kv.kv.zero_()
    mask = engine.retrieve(tokens, req_id="req-1")
    assert int(mask.sum()) == len(tokens)
    engine.lookup_unpin("req-1")  # wait_for_save does this in the same step

    assert [obj.get_ref_count() for _, _, obj in cached] == refs_before, (
        "a prefetched L1 chunk was released twice"
    )
    # The freed memory would be handed to the next store: cached KV must survive it.
    expected = kv.kv.clone()
    other = tokens_of(2, 4)
    kv.fill(2, len(other))
    engine.store(other)
    for start, end, obj in cached:
        assert torch.equal(obj.tensor.reshape(1, NUM_LAYERS, end - start, HEAD_SIZE), expected[:, :, start:end, :]), (
            f"L1 chunk at {start} was overwritten by a later store"
        )


@pytest.mark.fixes(PATCH, fails_with=r"Event req-miss of type EventType.LOADING is not done or not found")
def test_retrieve_after_a_prefetch_that_found_nothing_loads_nothing(engine_kv):
    engine, kv, client = engine_kv
    tokens = tokens_of(3, 3)
    assert prefetch(client, tokens, "req-miss") == 0
    mask = engine.retrieve(tokens, req_id="req-miss")
    assert int(mask.sum()) == 0


@pytest.mark.fixes(PATCH, fails_with=r"every L1 chunk must hold only the cache's reference and no pin")
def test_retrieve_releases_the_pins_of_prefetched_chunks_it_does_not_use(engine_kv):
    """vLLM holds the first chunk itself (the retrieve masks it) and loads
    three of the four chunks (the scheduler capped the load): the first and
    the last chunk were prefetched, pinned and not used."""
    from lmcache.v1.pin_monitor import PinMonitor

    engine, kv, client = engine_kv
    tokens = tokens_of(4, 4)
    kv.fill(4, len(tokens))
    engine.store(tokens)
    cached = l1_chunks(engine, tokens)
    assert [(obj.get_ref_count(), obj.metadata.pin_count) for _, _, obj in cached] == [(1, 0)] * 4

    assert prefetch(client, tokens, "req-masked") == len(tokens)
    # The lookup server pinned every chunk and the prefetch holds a reference.
    assert [(obj.get_ref_count(), obj.metadata.pin_count) for _, _, obj in cached] == [(2, 1)] * 4

    # start_load_kv: vLLM's computed prefix is masked (whole chunks), and
    # the retrieve covers the scheduled tokens only.
    vllm_cached, scheduled = CHUNK_SIZE, 3 * CHUNK_SIZE
    mask = torch.ones(scheduled, dtype=torch.bool)
    mask[:vllm_cached] = False
    kv.kv.zero_()
    ret = engine.retrieve(tokens[:scheduled], mask, req_id="req-masked")
    assert int(ret.sum()) == scheduled - vllm_cached
    engine.lookup_unpin("req-masked")  # wait_for_save

    state = [(start, obj.get_ref_count(), obj.metadata.pin_count) for start, _, obj in cached]
    assert state == [(start, 1, 0) for start, _, _ in cached], (
        "after the request, every L1 chunk must hold only the cache's reference "
        f"and no pin; (start, ref_count, pin_count) = {state}"
    )
    monitored = {id(obj) for obj, _ in PinMonitor.GetOrCreate()._pinned_objects.values()}
    assert not monitored & {id(obj) for _, _, obj in cached}, "the pin monitor still tracks a chunk"
