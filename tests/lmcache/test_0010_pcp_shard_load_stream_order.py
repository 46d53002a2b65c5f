"""0010's load orders its device work on one stream, on real ranks (CPU).

0010 runs the owner's copies into the staging buffer, the broadcast and the
paged-KV write (the connector's batched_to_gpu) on the engine's broadcast
stream, which is the connector's load stream, so the write reads the buffer
after the broadcast that fills it. The ranks here model CUDA's stream
ordering (tests/support/device_streams.py): a broadcast delivers into the
receiving rank's buffer only when the stream that was current at the call is
drained, as late as CUDA allows, and the connector writes on its own load
stream, as LMCache's V2 and V3 paged connectors do.

On the tree without 0010's stream-order part (tests/parts/lmcache/: the
series with 0010 less its ``torch_dev.stream(self.broadcast_stream)``
wrapper) the broadcast delivers on the caller's stream, which the load
stream does not wait for: on every rank the paged KV differs in the chunks
the other rank broadcast, and only there (a rank's own chunks are copied in
before it sends them). The same proof through LMCache's CUDA connectors on a
GPU is test_0010_pcp_shard_gpu_load.py.
"""

from __future__ import annotations

import pytest

from tests.lmcache import pcp_scenarios as S
from tests.lmcache.test_pcp_shard_store import assert_protocol
from tests.support.pcp_ranks import CHUNK_SIZE, run_ranks

pytestmark = pytest.mark.lmcache

SYNC = "0010-pcp-shard-sync-load.patch"
L1_GB = 0.04


@pytest.mark.fixes(SYNC, part="stream-order", fails_with=r"paged KV differs")
def test_the_paged_kv_write_reads_the_staging_buffer_after_the_broadcast_fills_it(tmp_path):
    world_size = 2
    num_chunks = 6
    # A staging buffer of one chunk: one broadcast per chunk, each reusing the buffer.
    results = run_ranks(
        world_size,
        S.load_on_device_streams,
        tmp_path,
        timeout_s=150,
        engine_options={"l1_gb": L1_GB, "extra": {"pcp_shard_load_buffer_mb": 0}, "device_streams": True},
        seed=66,
        num_chunks=num_chunks,
    )
    assert [r["prefix"] for r in results] == [num_chunks * CHUNK_SIZE] * world_size, results
    assert_protocol(results, 0, num_chunks * CHUNK_SIZE, one_piece_per_owner=False)
    for rank, result in enumerate(results):
        assert not result["differs"], (
            f"rank {rank}: paged KV differs from the stored KV in the chunks at {result['differs']} "
            f"(owned by ranks {sorted({start // CHUNK_SIZE % world_size for start in result['differs']})})"
        )
