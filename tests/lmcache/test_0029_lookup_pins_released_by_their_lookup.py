"""Proof of 0029: a lookup's pins are released only by that lookup.

With synchronous loading vLLM's scheduler looks each request up through
LMCache's lookup client; the worker's lookup server pins each L1 chunk of the
hit once (``lookup(pin=True)``) and records its keys under the request's id,
and the connector releases them (``lookup_unpin``). In LMCache 0.5.5 the load
(``retrieve``, and the PCP-sharded load's release of what it read) also
unpinned every pinned chunk it moved, so a request's pin was released twice;
a chunk two requests share (pinned once by each) lost both pins when the
first request was done, while the second still relied on its own to keep the
chunk in L1 until it loads it.

Real parts: vLLM 0.31.0 builds GLM-5.3's KV caches and specs (8 latent and 3
DSA indexer layers, tests/lmcache/glm5_vllm_kv.py); LMCache's adapter inside
vLLM's LMCacheConnectorV1 registers them with the V3 connector; the
scheduler-side connector's LMCacheLookupClient asks the worker's
LMCacheLookupServer over ZMQ; each request's step is the connector's own
``start_load_kv`` and ``wait_for_save`` (see glm5_lmcache_run.py for what
stands in for CUDA). The sharded case runs LMCache's engine on two real PCP
ranks over gloo (tests/support/pcp_ranks.py). Scenarios: lookup_pins.py.
"""

from __future__ import annotations

import pytest

from tests.lmcache import glm5_lmcache_run, lookup_pins
from tests.support.pcp_ranks import CHUNK_SIZE, run_processes, run_ranks

pytestmark = pytest.mark.lmcache

PATCH = "0029-lookup-pins-released-only-by-their-lookup.patch"
RELEASED_BY_A = r"request B's pins were released by request A"

CHUNK = glm5_lmcache_run.CHUNK_SIZE
NUM_TOKENS = 2 * CHUNK
STARTS = [0, CHUNK]


@pytest.mark.fixes(PATCH, fails_with=RELEASED_BY_A)
def test_a_request_releases_only_its_own_pins_on_chunks_it_shares(tmp_path):
    (result,) = run_processes(
        1,
        lookup_pins.shared_chunk_pins,
        tmp_path,
        timeout_s=300,
        variant="flashinfer_fp8",
        num_tokens=NUM_TOKENS,
        store_blocks=[5, 2, 9, 11, 0, 17, 3, 21],
        load_blocks_a=[7, 13, 1, 20, 4, 22, 6, 15],
        load_blocks_b=[8, 10, 12, 14, 16, 18, 19, 23],
    )
    assert result["answers"] == [NUM_TOKENS, NUM_TOKENS], result["answers"]
    # Each lookup pinned each chunk once; L1 holds its own reference.
    assert result["looked_up"] == {start: [1, 2] for start in STARTS}, result["looked_up"]
    # A's load is done and A's pins with it; B's hold the chunks in L1.
    assert result["req-A_loaded"] == {start: [1, 1] for start in STARTS}, result["req-A_loaded"]
    assert result["req-A_ended"] == {start: [1, 1] for start in STARTS}, (
        f"{RELEASED_BY_A}: (ref_count, pin_count) by chunk start after A's step = {result['req-A_ended']}")
    # L1 made room by evicting the other prompt's chunks, and kept B's.
    pressure = result["pressure"]
    assert pressure["allocated"] > 0 and pressure["other_in_l1"] == [], pressure
    assert pressure["prompt_in_l1"] == STARTS, f"L1 evicted request B's pinned chunks: {pressure}"
    # B loads every byte of both kinds of layer; its pins go with its load.
    assert result["mismatched_tokens"] == {name: 0 for name in result["mismatched_tokens"]}, (
        result["mismatched_tokens"])
    assert result["req-B_loaded"] == result["req-B_ended"] == {start: [1, 0] for start in STARTS}, (
        result["req-B_loaded"], result["req-B_ended"])
    assert result["double_unpins"] == [], result["double_unpins"]


@pytest.mark.fixes(PATCH, fails_with=RELEASED_BY_A)
def test_the_sharded_load_releases_only_its_own_pins_on_chunks_it_shares(tmp_path):
    world_size, num_chunks = 2, 4
    results = run_ranks(world_size, lookup_pins.sharded_shared_chunk_pins, tmp_path, timeout_s=240,
                        seed=29, num_chunks=num_chunks)
    for rank, result in enumerate(results):
        owned = [c * CHUNK_SIZE for c in range(num_chunks) if c % world_size == rank]
        assert result["answers"] == [num_chunks * CHUNK_SIZE] * 2, (rank, result["answers"])
        assert result["looked_up"] == {start: (1, 2) for start in owned}, (rank, result["looked_up"])
        assert result["req-A_kv_ok"] and result["req-B_kv_ok"], (rank, result)
        assert result["req-A_ended"] == {start: (1, 1) for start in owned}, (
            f"{RELEASED_BY_A}: rank {rank}, (ref_count, pin_count) by chunk start = {result['req-A_ended']}")
        assert result["req-B_ended"] == {start: (1, 0) for start in owned}, (rank, result["req-B_ended"])
