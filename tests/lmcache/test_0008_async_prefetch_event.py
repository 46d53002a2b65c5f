"""Proof of 0007-async-loading-take-prefetch-event-once.patch.

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
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.pcp_ranks import CHUNK_SIZE, HEAD_SIZE, NUM_LAYERS, ResponseRecorder, make_kv_connector, mla_metadata

pytestmark = pytest.mark.lmcache

PATCH = "0007-async-loading-take-prefetch-event-once.patch"
_ids = itertools.count()


@pytest.fixture
def engine_kv():
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE,
        local_cpu=True,
        max_local_cpu_size=0.02,
        save_unfull_chunk=False,
        enable_async_loading=True,
    )
    metadata = mla_metadata("async-event-test", 1, 0)
    kv = make_kv_connector(4096)
    instance_id = f"async-event-{next(_ids)}"
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id,
        config,
        metadata,
        kv,
        lambda tensor, src: tensor,  # one rank: a broadcast is the identity
        lambda obj, src: obj,
    )
    responses = ResponseRecorder()
    engine.post_init(async_lookup_server=responses)
    try:
        yield engine, kv, responses
    finally:
        LMCacheEngineBuilder.destroy(instance_id)


def tokens_of(seed: int, num_chunks: int) -> list[int]:
    return [(seed * 1009 + 7 * i) % 30011 for i in range(num_chunks * CHUNK_SIZE)]


def l1_chunks(engine, tokens):
    backend = engine.storage_manager.storage_backends["LocalCPUBackend"]
    out = []
    for start, end, key in engine.token_database.process_tokens(tokens=tokens):
        out.append((start, end, backend.hot_cache[key]))
    return out


@pytest.mark.fixes(PATCH)
def test_retrieve_then_unpin_releases_each_prefetched_chunk_once(engine_kv):
    engine, kv, responses = engine_kv
    tokens = tokens_of(1, 4)
    kv.fill(1, len(tokens))
    engine.store(tokens)
    cached = l1_chunks(engine, tokens)
    refs_before = [obj.get_ref_count() for _, _, obj in cached]

    engine.async_lookup_and_prefetch("req-1", tokens)
    assert responses.wait("req-1") == len(tokens)
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


@pytest.mark.fixes(PATCH)
def test_retrieve_after_a_prefetch_that_found_nothing_loads_nothing(engine_kv):
    engine, kv, responses = engine_kv
    tokens = tokens_of(3, 3)
    engine.async_lookup_and_prefetch("req-miss", tokens)
    assert responses.wait("req-miss") == 0
    mask = engine.retrieve(tokens, req_id="req-miss")
    assert int(mask.sum()) == 0
