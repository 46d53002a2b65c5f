"""0009's load protocol when one rank fails after (or during) its read, on
real ranks (W processes, gloo, LMCache's real engine, storage manager and L1;
a real Valkey per rank for the L2 read; see tests/support/pcp_ranks.py).

The faults are forced on one rank by hooks in tests/lmcache/pcp_scenarios.py
(apply_load_fault): a real run cannot make a device allocation, a paged-KV
write, metadata parsing or an L2 read fail on demand. Every run is bounded (a
collective that one rank skips raises after pg_timeout_s on the others, and
run_ranks kills ranks that do not finish), and every rank reports an exception
out of retrieve() as its result instead of ending the run.
"""

from __future__ import annotations

import pytest

from tests.lmcache import pcp_scenarios as S
from tests.lmcache.test_pcp_shard_store import assert_protocol
from tests.support.pcp_ranks import CHUNK_SIZE, NUM_LAYERS, HEAD_SIZE, run_ranks
from tests.support.valkey import start_valkey

pytestmark = pytest.mark.lmcache

SYNC = "0010-pcp-shard-sync-load.patch"
L1_GB = 0.04
CHUNK_BYTES = NUM_LAYERS * CHUNK_SIZE * HEAD_SIZE * 2  # one bf16 MLA chunk
# A staging buffer of one chunk: every broadcast carries one chunk.
ONE_CHUNK_BUFFER = {"pcp_shard_load_buffer_mb": 0}


def run_fault(tmp_path, world_size: int, *, extra: dict | None = None, remote_urls=None, **kwargs) -> list[dict]:
    options: dict = {"l1_gb": L1_GB, "extra": extra or {}}
    if remote_urls is not None:
        options["remote_urls"] = remote_urls
    return run_ranks(
        world_size, S.load_with_fault, tmp_path, timeout_s=150, pg_timeout_s=15, engine_options=options, **kwargs
    )


def assert_same_outcome(results: list[dict], prefix: int) -> None:
    errors = [r["error"] for r in results]
    assert errors == [None] * len(results), f"ranks raised out of retrieve(): {errors}"
    prefixes = [r["prefix"] for r in results]
    assert prefixes == [prefix] * len(results), f"ranks ended at different prefixes {prefixes}"
    assert all(r["contiguous"] for r in results)
    assert all(r["kv_below_prefix_ok"] for r in results), "KV below the prefix differs from the stored KV"


@pytest.mark.fixes(SYNC, fails_with=r"OutOfMemoryError: injected|did not finish within|"
                   r"ranks ended at different prefixes")
def test_device_allocation_failure_on_one_rank_loads_nothing_and_never_hangs(tmp_path):
    results = run_fault(tmp_path, 3, seed=60, num_chunks=7, fault=("device_alloc_fails",), fault_rank=1)
    assert_same_outcome(results, 0)
    # rank 1 reported "nothing loaded" in the exchange: no rank broadcast
    assert_protocol(results, 0, 0)
    assert [op for op, _, _ in results[0]["collectives"]] == ["all_gather_object"]


@pytest.mark.fixes(SYNC, fails_with=r"RuntimeError: injected: paged-KV write|ranks ended at different prefixes")
def test_paged_kv_write_failure_on_one_rank_ends_every_rank_at_the_same_prefix(tmp_path):
    # one chunk per broadcast; rank 2 fails to write chunk 4 (owned by rank 1)
    failing = 4 * CHUNK_SIZE
    results = run_fault(
        tmp_path, 3, extra=ONE_CHUNK_BUFFER, seed=61, num_chunks=7, fault=("to_gpu_fails_at", failing), fault_rank=2
    )
    assert_same_outcome(results, failing)
    # rank 2 entered every broadcast after its failure; the last all-gather
    # agreed on the prefix it wrote
    assert_protocol(results, 0, 0, one_piece_per_owner=False)
    assert sum(op == "broadcast" for op, _, _ in results[0]["collectives"]) == 7


@pytest.mark.fixes(SYNC, fails_with=r"ValueError: injected: chunk metadata|did not finish within|"
                   r"ranks ended at different prefixes")
def test_metadata_parse_failure_on_one_rank_loads_nothing_and_never_hangs(tmp_path):
    results = run_fault(tmp_path, 2, seed=62, num_chunks=5, fault=("metadata_parse_fails",), fault_rank=1)
    assert_same_outcome(results, 0)
    assert_protocol(results, 0, 0)


@pytest.mark.fixes(SYNC, part="guarded-exchange",
                   fails_with=r"did not finish within \d+ s \(hang\)|"
                   r"ranks raised out of retrieve\(\).*injected: chunk metadata could not be serialised")
def test_a_rank_that_cannot_describe_its_chunks_still_enters_the_exchange(tmp_path):
    # Rank 1 read its chunks, then fails to serialise their metadata for the
    # exchange. Were that outside the guarded region, rank 1 would raise out
    # of retrieve() while rank 0 waits in the all-gather.
    results = run_fault(tmp_path, 2, seed=63, num_chunks=5, fault=("metadata_serialize_fails",), fault_rank=1)
    assert_same_outcome(results, 0)
    assert_protocol(results, 0, 0)
    assert [op for op, _, _ in results[0]["collectives"]] == ["all_gather_object"]


@pytest.mark.fixes(SYNC, fails_with=r"L1 objects of rank 1 still held|ranks ended at different prefixes")
def test_a_read_that_fails_part_way_releases_what_it_read(tmp_path):
    """Rank 1 owns chunks 1, 3, 5; chunk 5 is only in its L2, so its read
    takes chunks 1 and 3 from L1, then the L2 read raises. The L1 objects it
    took must be released (ref count back to L1's own, nothing pinned)."""
    world_size = 2
    servers = []
    for rank in range(world_size):
        (tmp_path / f"valkey-{rank}").mkdir()
        servers.append(start_valkey(tmp_path / f"valkey-{rank}"))
    try:
        results = run_fault(
            tmp_path / "ranks",
            world_size,
            remote_urls=[server.url for server in servers],
            seed=63,
            num_chunks=6,
            fault=("remote_get_raises",),
            fault_rank=1,
            drop_l1={1: [5 * CHUNK_SIZE]},
            wait_l2=True,
        )
    finally:
        for server in servers:
            server.stop()
    assert_same_outcome(results, 0)
    assert results[1]["l1_counts"].keys() == {CHUNK_SIZE, 3 * CHUNK_SIZE}
    for rank, result in enumerate(results):
        held = {start: counts for start, counts in result["l1_counts"].items() if counts != (1, 0)}
        assert not held, f"L1 objects of rank {rank} still held after the retrieve (start: (ref, pin)): {held}"


@pytest.mark.fixes(SYNC, fails_with=r"broadcasts of more than one chunk|0 broadcasts for the \d+ chunks")
def test_the_load_streams_through_a_bounded_staging_buffer(tmp_path):
    """With a one-chunk staging buffer, no broadcast (and so no device
    buffer of the load) is larger than one chunk, and the load is still
    complete and byte-exact on every rank."""
    world_size = 2
    num_chunks = 9
    results = run_ranks(
        world_size,
        S.store_then_load,
        tmp_path,
        timeout_s=150,
        engine_options={"l1_gb": L1_GB, "extra": ONE_CHUNK_BUFFER},
        cases=[{"seed": 64, "num_chunks": num_chunks}],
    )
    per_rank = [rr[0] for rr in results]
    sizes = [size for op, _, size in per_rank[0]["collectives"] if op == "broadcast"]
    assert all(size == CHUNK_BYTES for size in sizes), f"broadcasts of more than one chunk ({CHUNK_BYTES} B): {sizes}"
    assert len(sizes) == num_chunks, f"{len(sizes)} broadcasts for the {num_chunks} chunks"
    assert [r["prefix"] for r in per_rank] == [num_chunks * CHUNK_SIZE] * world_size
    assert all(r["kv_ok"] for r in per_rank)
    assert_protocol(per_rank, 0, num_chunks * CHUNK_SIZE, one_piece_per_owner=False)
