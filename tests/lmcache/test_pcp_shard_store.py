"""The PCP-sharded MLA store (patches 0008-0011) on real ranks.

W processes form a real PCP group over gloo; each runs LMCache's real engine,
storage manager and L1 (and, in one test, a real Valkey per rank through the
native RESP client). The GPU's paged KV cache is a CPU tensor per rank (see
tests/support/pcp_ranks.py). Every test is bounded by a timeout, so a rank
that hangs in a collective fails it.
"""

from __future__ import annotations

import pytest

from tests.lmcache import pcp_scenarios as S
from tests.support.pcp_ranks import CHUNK_SIZE, run_ranks
from tests.support.valkey import start_valkey

pytestmark = pytest.mark.lmcache

STORE = "0009-pcp-shard-store-and-lookup.patch"
SYNC = "0010-pcp-shard-sync-load.patch"
ASYNC = "0011-pcp-shard-async-load.patch"

L1_GB = 0.04


def assert_consistent(results: list[list[dict]], case: int, expected_prefix: int) -> None:
    """Every rank loaded the same prefix, contiguously, with the right KV."""
    per_rank = [rank_results[case] for rank_results in results]
    prefixes = [r["prefix"] for r in per_rank]
    assert prefixes == [expected_prefix] * len(per_rank), f"case {case}: prefixes {prefixes}"
    assert all(r["kv_ok"] for r in per_rank), f"case {case}: KV differs from the stored KV"
    assert len({r["digest"] for r in per_rank}) == 1, f"case {case}: ranks hold different KV"
    assert all(r.get("contiguous", True) for r in per_rank)
    if "collectives" in per_rank[0]:
        assert_protocol(per_rank, case, expected_prefix)


def assert_protocol(per_rank: list[dict], case: int, expected_prefix: int, *, one_piece_per_owner: bool = True) -> None:
    """The load protocol: every rank issued the same collectives in the same
    order: one all-gather; the broadcasts in owner order (one per owning rank
    when every owner's chunks fit the staging buffer); after them, one
    all-gather that agrees on the prefix."""
    logs = [r["collectives"] for r in per_rank]
    assert all(log == logs[0] for log in logs), f"case {case}: ranks issued different collectives {logs}"
    ops = [op for op, _, _ in logs[0]]
    sources = [src for op, src, _ in logs[0] if op == "broadcast"]
    expected_ops = ["all_gather_object"] + ["broadcast"] * len(sources) + (["all_gather_object"] if sources else [])
    assert ops == expected_ops, f"case {case}: {ops}"
    assert sources == sorted(sources), sources
    if one_piece_per_owner:
        assert sources == sorted(set(sources)) and len(sources) <= len(per_rank), sources
    if expected_prefix > 0:
        owners = {(start // CHUNK_SIZE) % len(per_rank) for start in range(0, expected_prefix, CHUNK_SIZE)}
        assert sorted(set(sources)) == sorted(owners), (sources, owners)


@pytest.mark.fixes(SYNC, fails_with=r"AssertionError: case 0: prefixes \[16(, 0)+\]")
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_store_spreads_chunks_and_load_gives_every_rank_the_prefix(world_size, tmp_path):
    full = 2 * world_size + 1  # chunks: every rank owns two, rank 0 three
    short = max(1, world_size - 1)  # fewer chunks than ranks: some own none
    cases = [
        {"seed": 10, "num_chunks": full},
        {"seed": 11, "num_chunks": short},
        # chunk 3 evicted from its owner between lookup and load
        {"seed": 12, "num_chunks": full, "drop": {3 % world_size: [3 * CHUNK_SIZE]}},
    ]
    results = run_ranks(
        world_size,
        S.store_then_load,
        tmp_path,
        timeout_s=120 + 40 * world_size,
        engine_options={"l1_gb": L1_GB},
        cases=cases,
    )
    for case, spec in enumerate(cases):
        n = spec["num_chunks"]
        stored = [(start, rank) for rank, rr in enumerate(results) for start in rr[case]["stored"]]
        starts = sorted(start for start, _ in stored)
        # the union of the ranks' L1 holds every chunk exactly once, at its owner
        assert starts == [c * CHUNK_SIZE for c in range(n)], f"case {case}: stored {stored}"
        assert all((start // CHUNK_SIZE) % world_size == rank for start, rank in stored)
    # the lookup minimum over the ranks is the cached prefix
    assert min(rr[0]["lookup"] for rr in results) == full * CHUNK_SIZE
    assert min(rr[2]["lookup"] for rr in results) == 3 * CHUNK_SIZE
    assert_consistent(results, 0, full * CHUNK_SIZE)
    assert_consistent(results, 1, short * CHUNK_SIZE)
    assert_consistent(results, 2, 3 * CHUNK_SIZE)


@pytest.mark.fixes(STORE, fails_with=r"has no storage manager: MLA stores on rank 0 only")
def test_l1_per_rank_is_the_pod_budget_over_w(tmp_path):
    world_size = 4
    results = run_ranks(
        world_size,
        S.report_l1,
        tmp_path,
        engine_options={"l1_gb": 1.0, "first_rank_l1_gb": 0.4},
    )
    # the pod budget is what rank 0 holds under the rank-0 store
    assert [r["l1_bytes"] for r in results] == [int(0.4 / world_size * 1024**3)] * world_size


@pytest.mark.fixes(SYNC, fails_with=r"AssertionError: case 0: prefixes \[16(, 0)+\]")
def test_faults_on_one_rank_never_hang_and_every_rank_agrees(tmp_path):
    world_size = 4
    n = 9
    cases = [
        {"seed": 20, "num_chunks": n, "fault": {2: "read_raises"}},
        {"seed": 21, "num_chunks": n, "fault": {1: "unhealthy"}},
        {"seed": 22, "num_chunks": n, "fault": {3: "read_misses_all"}},
        {"seed": 23, "num_chunks": n, "drop": {1: [5 * CHUNK_SIZE]}},
        {"seed": 24, "num_chunks": n},
    ]
    results = run_ranks(
        world_size, S.store_then_load, tmp_path, timeout_s=200, cases=cases, engine_options={"l1_gb": L1_GB}
    )
    # an exception or an unhealthy engine on one rank: that rank loads
    # nothing, so no rank loads anything (and nobody hangs)
    assert_consistent(results, 0, 0)
    assert_consistent(results, 1, 0)
    # rank 3 reads none of its chunks: the prefix ends at its first (chunk 3)
    assert_consistent(results, 2, 3 * CHUNK_SIZE)
    # rank 1 misses chunk 5: the prefix ends at chunk 5's start
    assert_consistent(results, 3, 5 * CHUNK_SIZE)
    # and the group is healthy afterwards
    assert_consistent(results, 4, n * CHUNK_SIZE)


@pytest.mark.fixes(SYNC, fails_with=r"ranks that disagree loaded prefixes \[16, 0\]")
def test_ranks_that_disagree_on_the_chunks_load_nothing(tmp_path):
    """Ranks that name a request's chunks differently (another prompt on one
    rank; in production, e.g. workers without a common PYTHONHASHSEED): the
    fingerprints differ, nothing loads, nobody hangs."""
    results = run_ranks(
        2,
        S.store_then_load,
        tmp_path,
        cases=[{"seed": 30, "num_chunks": 5, "prompt_shift": {1: 1000}}],
        engine_options={"l1_gb": L1_GB},
    )
    prefixes = [r[0]["prefix"] for r in results]
    assert prefixes == [0, 0], f"ranks that disagree loaded prefixes {prefixes}"
    assert all(r[0]["kv_ok"] for r in results)


@pytest.mark.fixes(ASYNC, fails_with=r"case 0: scheduled \[0, 0, 0, 0\]")
def test_async_loading_minimum_equals_the_sync_prefix(tmp_path):
    world_size = 4
    n = 9
    cases = [
        {"seed": 40, "num_chunks": n},
        # the write-up's edge case: rank 1's first chunk (chunk 1) is
        # missing and chunk 0 is present: rank 1 answers one chunk, not 0
        {"seed": 41, "num_chunks": n, "drop": {1: [1 * CHUNK_SIZE]}},
        {"seed": 42, "num_chunks": n, "drop": {0: [0]}},
        {"seed": 43, "num_chunks": n, "drop": {2: [6 * CHUNK_SIZE]}},
        {"seed": 44, "num_chunks": 2},
    ]
    results = run_ranks(
        world_size,
        S.async_prefetch_then_load,
        tmp_path,
        timeout_s=200,
        engine_options={"async_loading": True, "l1_gb": L1_GB},
        cases=cases,
    )
    expected = [n * CHUNK_SIZE, 1 * CHUNK_SIZE, 0, 6 * CHUNK_SIZE, 2 * CHUNK_SIZE]
    for case, prefix in enumerate(expected):
        scheduled = [rr[case]["scheduled"] for rr in results]
        assert scheduled == [prefix] * world_size, (
            f"case {case}: scheduled {scheduled}, expected {prefix} on every rank"
        )
        assert_consistent(results, case, prefix)
        # nothing this request touched was released twice: L1 still serves
        assert all(rr[case]["l1_intact"] for rr in results), f"case {case}: L1 damaged"
    assert results[1][1]["answer"] == CHUNK_SIZE


@pytest.mark.fixes(STORE, fails_with=r"has no storage manager: MLA stores on rank 0 only")
def test_a_prompt_stored_by_one_pod_is_found_by_another_through_valkey_per_rank(tmp_path):
    world_size = 3
    servers = []
    for rank in range(world_size):
        (tmp_path / f"valkey-{rank}").mkdir()
        servers.append(start_valkey(tmp_path / f"valkey-{rank}"))
    try:
        urls = [server.url for server in servers]
        n = 7
        stored = run_ranks(
            world_size, S.store_to_l2, tmp_path / "pod-a", engine_options={"remote_urls": urls, "l1_gb": L1_GB},
            seed=50, num_chunks=n
        )
        assert all(stored)
        # each instance holds exactly its rank's chunks
        for rank, server in enumerate(servers):
            with server.client() as client:
                assert client.dbsize() == len(range(rank, n, world_size)), f"valkey {rank}"
        loaded = run_ranks(
            world_size, S.load_from_l2, tmp_path / "pod-b", engine_options={"remote_urls": urls, "l1_gb": L1_GB},
            seed=50, num_chunks=n
        )
        assert [r["from_l1"] for r in loaded] == [[]] * world_size
        assert_consistent([[r] for r in loaded], 0, n * CHUNK_SIZE)
    finally:
        for server in servers:
            server.stop()
