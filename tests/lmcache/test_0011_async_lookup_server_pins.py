"""Proof of 0011-pcp-shard-async-load.patch: the sharded async load releases
exactly what the lookup server's prefetch took.

W=2 real ranks over gloo, each with LMCache's real engine, L1 and
LMCacheAsyncLookupServer; rank 0 also runs the scheduler's real
LMCacheAsyncLookupClient (see pcp_scenarios.async_lookup_server_rank). The
servers prefetch with pin=True, as in vLLM. The request has six chunks
(rank 0 owns 0, 2, 4; rank 1 owns 1, 3, 5); vLLM holds chunk 0 itself (the
retrieve masks it) and the scheduler capped the load at five chunks, so rank
0's chunk 0 and rank 1's chunk 5 are prefetched but not loaded.

* Without the fix: those two chunks are released with ref_count_down() only
  and stay pinned (ref_count 1, pin_count 1) after the request, until the pin
  monitor's timeout; L1 cannot evict them.
"""

from __future__ import annotations

import os

import pytest

from tests.lmcache import pcp_scenarios as S
from tests.support.pcp_ranks import CHUNK_SIZE, run_processes

pytestmark = pytest.mark.lmcache

PATCH = "0011-pcp-shard-async-load.patch"


@pytest.mark.fixes(PATCH, fails_with=r"the lookup answered 0 tokens of 96")
def test_sharded_async_load_releases_every_pin_the_lookup_server_took(tmp_path):
    world_size, num_chunks = 2, 6
    cases = [{"seed": 41, "num_chunks": num_chunks, "vllm_cached": CHUNK_SIZE, "scheduled": 5 * CHUNK_SIZE}]
    results = run_processes(
        world_size,
        S.async_lookup_server_rank,
        tmp_path,
        timeout_s=240,
        engine_id=f"pcp-async-pins-{os.getpid()}",
        cases=cases,
    )
    after, expected_after = {}, {}
    for rank, (result,) in enumerate(results):
        owned = [c * CHUNK_SIZE for c in range(num_chunks) if c % world_size == rank]
        assert result["stored"] == [(start, 1, 0) for start in owned], f"rank {rank}: {result['stored']}"
        assert result["answer"] == num_chunks * CHUNK_SIZE, (
            f"rank {rank}: the lookup answered {result['answer']} tokens of {num_chunks * CHUNK_SIZE}")
        # the server pinned every owned chunk and the prefetch holds a reference
        assert result["prefetched"] == [(start, 2, 1) for start in owned], f"rank {rank}: {result['prefetched']}"
        assert result["loaded"] == 4 * CHUNK_SIZE, f"rank {rank}: loaded {result['loaded']}"
        assert result["kv_ok"], f"rank {rank}: KV differs from the stored KV"
        after[rank] = result["after"]
        expected_after[rank] = [(start, 1, 0) for start in owned]
    assert after == expected_after, (
        "after the request every L1 chunk must hold only the cache's reference and no pin; "
        f"per rank (start, ref_count, pin_count) = {after}"
    )
