"""0009: each rank's L1 under the PCP-sharded store fits this host's memory
together with the other ranks'.

LMCache clamps L1 to the host's available memory less
``reserve_local_cpu_size``. Under the rank-0 store that clamp is right for
rank 0 alone (upstream: "non-first ranks do not allocate memory"); under the
sharded store all W ranks of the pod allocate their L1 from the same host, so
each rank's share of the usable memory is 1/W, as its share of the pod's budget
is.

The metadata is what LMCache's VllmServiceFactory builds from vLLM's own
ParallelConfig (PCP = W, TP = 1) for each rank; each rank's L1 is LMCache's
real LocalCPUBackend and allocator. One stand-in: the host's available memory
(``SystemMemoryDetector.get_available_memory_gb``, psutil's reading) is fixed
at a chosen value, because the free memory of a machine that other test
sessions share cannot be set on demand, and the clamp only binds when it is
smaller than the budget.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.pcp_ranks import CHUNK_SIZE, guard_vllm_config

pytestmark = pytest.mark.lmcache

STORE = "0009-pcp-shard-store-and-lookup.patch"
GB = 1024**3
AVAILABLE_GB = 0.35  # what the host reports as available
RESERVE_GB = 0.15  # reserve_local_cpu_size
USABLE_GB = AVAILABLE_GB - RESERVE_GB
POD_BUDGET_GB = 8.0  # first_rank_max_local_cpu_size: far above what the host can give


def rank_metadata(world_size: int, rank: int):
    """LMCache's metadata of PCP rank ``rank``, built by its vLLM service
    factory from vLLM's ParallelConfig. The factory's worker path probes the
    GPUs of the node (one stub device here, so W > 1 ranks look multi-node);
    the scheduler path reads the same parallel config without probing, and
    the rank's role is then set to worker."""
    from lmcache.integration.vllm.vllm_service_factory import VllmServiceFactory
    from lmcache.v1.config import LMCacheEngineConfig

    vllm_config = guard_vllm_config(prefill_context_parallel_size=world_size)
    vllm_config.parallel_config.rank = rank
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_SIZE)
    metadata = VllmServiceFactory(config, vllm_config, "scheduler").get_or_create_metadata()
    assert (metadata.world_size, metadata.worker_id) == (world_size, rank)
    assert getattr(metadata, "pcp_world_size", world_size) == world_size
    return dataclasses.replace(metadata, role="worker")


def l1_sizes(world_size: int, monkeypatch) -> list[int]:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend import local_cpu_backend
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    monkeypatch.setattr(
        local_cpu_backend.SystemMemoryDetector, "get_available_memory_gb", staticmethod(lambda: AVAILABLE_GB)
    )
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE,
        local_cpu=True,
        max_local_cpu_size=1.0,
        reserve_local_cpu_size=RESERVE_GB,
        extra_config={"pcp_shard_store": True, "first_rank_max_local_cpu_size": POD_BUDGET_GB},
    )
    sizes = []
    for rank in range(world_size):
        backend = LocalCPUBackend(config, metadata=rank_metadata(world_size, rank))
        try:
            sizes.append(int(backend.memory_allocator.size))
        finally:
            backend.close()
    return sizes


@pytest.mark.fixes(STORE, fails_with=r"more than the [\d.]+ GB this host can give")
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_ranks_l1_together_fit_the_hosts_usable_memory(world_size, monkeypatch):
    sizes = l1_sizes(world_size, monkeypatch)
    total = sum(sizes) / GB
    assert total <= USABLE_GB + 1e-9, (
        f"W={world_size}: the ranks' L1 add up to {total:.3f} GB ({[round(s / GB, 3) for s in sizes]}), "
        f"more than the {USABLE_GB:.2f} GB this host can give"
    )
    # each rank gets its share of what the host can give, not less
    assert sizes == [int(USABLE_GB / world_size * GB)] * world_size, sizes
