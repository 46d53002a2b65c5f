"""Property test of the PCP-sharded store (patches 0008-0010): for random
chunk-presence patterns and random W, the scheduler's minimum over the ranks'
async-prefetch answers equals the prefix the synchronous protocol loads, the
minimum of the synchronous lookups, and the true cached prefix (the start of
the first chunk missing from its owner).

All W ranks of a pattern run in this process as separate real engines with
real storage managers and L1 (the collectives are not exercised here: the
per-rank answers are what the property is about, and test_pcp_shard_store.py
runs the exchange on real process groups). The stand-in collectives raise if
anything calls them.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.pcp_ranks import CHUNK_SIZE, ResponseRecorder, make_kv_connector, mla_metadata

pytestmark = pytest.mark.lmcache

PATCH = "0011-pcp-shard-async-load.patch"
WORLD_SIZES = (2, 3, 5, 8)
PATTERNS = 3000


def _no_collectives(*args, **kwargs):
    raise AssertionError("the property test must not reach a collective")


def make_rank(world_size: int, rank: int):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.pcp_collectives import PCPCollectives

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE,
        local_cpu=True,
        max_local_cpu_size=0.004 * world_size,
        save_unfull_chunk=False,
        enable_async_loading=True,
        extra_config={"pcp_shard_store": True},
    )
    metadata = mla_metadata("pcp-property", world_size, rank, pcp_world_size=world_size)
    collectives = PCPCollectives(
        rank=rank,
        world_size=world_size,
        broadcast=_no_collectives,
        broadcast_object=_no_collectives,
        all_gather_object=_no_collectives,
        device=torch.device("cpu"),
    )
    kv = make_kv_connector(16 * CHUNK_SIZE)
    instance_id = f"pcp-property-{world_size}-{rank}"
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id, config, metadata, kv, _no_collectives, _no_collectives, pcp_collectives=collectives
    )
    responses = ResponseRecorder()
    engine.post_init(async_lookup_server=responses)
    return instance_id, engine, kv, responses


@pytest.fixture(scope="module")
def pods():
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    made = {w: [make_rank(w, r) for r in range(w)] for w in WORLD_SIZES}
    try:
        yield made
    finally:
        for ranks in made.values():
            for instance_id, *_ in ranks:
                LMCacheEngineBuilder.destroy(instance_id)


def sync_read_bound(engine, tokens) -> int:
    """This rank's bound from the synchronous protocol's storage read."""
    infos = [(key, start, end) for start, end, key in engine.token_database.process_tokens(tokens=tokens)]
    layout = engine.pcp_shard_layout
    owned = [info for info in infos if layout.owns(info[1])]
    # These engines run with async loading on; read as a synchronous-loading
    # engine would (the same storage, the non-async read path).
    engine.async_loading = False
    try:
        loaded, bound = engine._pcp_shard_read_owned(owned, infos[-1][2])
    finally:
        engine.async_loading = True
    engine._pcp_shard_release(loaded.values())
    return bound


@pytest.mark.fixes(PATCH, fails_with=r"pattern \d+: W=\d+ .*: async \[")
def test_async_minimum_equals_sync_prefix_for_random_presence_patterns(pods):
    rng = random.Random(20261130)
    edge_cases = [
        # (W, chunks, missing): the write-up's case, rank 1's first chunk gone
        (2, 4, {1}),
        (8, 8, {1}),
        (3, 5, {0}),
        (5, 3, set()),
        (8, 1, set()),
        (2, 6, {0, 1, 2, 3, 4, 5}),
    ]
    checked = 0
    for index in range(PATTERNS):
        if index < len(edge_cases):
            world_size, num_chunks, missing = edge_cases[index]
        else:
            world_size = rng.choice(WORLD_SIZES)
            num_chunks = rng.randint(1, 12)
            p_missing = rng.choice((0.05, 0.2, 0.5))
            missing = {c for c in range(num_chunks) if rng.random() < p_missing}
        ranks = pods[world_size]
        tokens = [(index * 104729 + 13 * i) % 65521 for i in range(num_chunks * CHUNK_SIZE)]
        truth = next((c for c in range(num_chunks) if c in missing), num_chunks) * CHUNK_SIZE

        async_answers, sync_lookups, sync_bounds = [], [], []
        for _, engine, kv, responses in ranks:
            kv.fill(index, len(tokens))
            engine.store(tokens)
            for start, _end, key in engine.token_database.process_tokens(tokens=tokens):
                if start // CHUNK_SIZE in missing:
                    engine.storage_manager.remove(key)
            lookup_id = f"p{index}"
            engine.async_lookup_and_prefetch(lookup_id, tokens)
            async_answers.append(responses.wait(lookup_id))
            engine.lookup_unpin(lookup_id)  # never retrieved: frees the prefetch
            sync_lookups.append(engine.lookup(tokens))
            sync_bounds.append(sync_read_bound(engine, tokens))
            engine.clear(tokens)
        assert min(async_answers) == min(sync_bounds) == min(sync_lookups) == truth, (
            f"pattern {index}: W={world_size} chunks={num_chunks} missing={sorted(missing)}: "
            f"async {async_answers} sync-read {sync_bounds} lookup {sync_lookups} truth {truth}"
        )
        if index == 0:
            # the write-up's edge case: rank 1's first chunk (chunk 1) is
            # missing, chunk 0 is present: rank 1 answers one chunk, not 0
            assert async_answers[1] == CHUNK_SIZE
        checked += 1
    assert checked == PATTERNS
