"""0026: decode context parallelism under MLA stops the engine at init, with or without the
PCP-sharded store.

Under DCP each rank's paged KV cache holds only its share of every block's tokens; LMCache's
MLA path stores rank 0's cache for every rank and loads it into every rank, so a hit would
write rank 0's tokens into the other ranks' blocks without a word. 0012 refused DCP only
together with ``pcp_shard_store``.

The engine and manager are LMCache's real ones, built through the real VllmServiceFactory
from vLLM's own ParallelConfig (tests/support/pcp_ranks.guard_vllm_config); the scheduler
builds the engine because ``enable_scheduler_bypass_lookup`` is set, as a worker would.
"""

from __future__ import annotations

import pytest

from tests.support.pcp_ranks import CHUNK_SIZE, guard_vllm_config

pytestmark = pytest.mark.lmcache

DCP_GUARD = "0026-vllm-refuse-decode-context-parallelism-under-mla.patch"


def build_manager(use_mla: bool, **parallel):
    from lmcache.integration.vllm.vllm_service_factory import VllmServiceFactory
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.manager import LMCacheManager

    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_SIZE, local_cpu=True, max_local_cpu_size=0.01,
                                               enable_scheduler_bypass_lookup=True)
    vllm_config = guard_vllm_config(**parallel)
    vllm_config.model_config.use_mla = use_mla
    return LMCacheManager(config, VllmServiceFactory(config, vllm_config, "scheduler"))


@pytest.fixture
def engines():
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    yield
    LMCacheEngineBuilder.destroy(ENGINE_NAME)


@pytest.mark.fixes(DCP_GUARD, fails_with=r"DID NOT RAISE")
def test_dcp_under_mla_stops_engine_init_without_the_sharded_store(engines):
    with pytest.raises(ValueError, match="under MLA does not support decode_context_parallel_size=2"):
        build_manager(True, tensor_parallel_size=2, decode_context_parallel_size=2)


def test_mla_without_dcp_still_starts(engines):
    manager = build_manager(True, tensor_parallel_size=2, decode_context_parallel_size=1)
    assert manager.lmcache_engine is not None, "MLA without DCP: LMCache degraded"


def test_dcp_without_mla_is_not_refused():
    """Without MLA each rank stores its own cache under its own worker id. (The scheduler
    cannot build a non-MLA engine to show it end to end: upstream allows the bypass lookup only
    with save_only_first_rank, which is MLA's.)"""
    from lmcache.integration.vllm.vllm_service_factory import VllmServiceFactory
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.pcp_shard import validate_mla_context_parallelism

    vllm_config = guard_vllm_config(tensor_parallel_size=2, decode_context_parallel_size=2)
    vllm_config.model_config.use_mla = False
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_SIZE)
    metadata = VllmServiceFactory(config, vllm_config, "scheduler").get_or_create_metadata()
    assert (metadata.use_mla, metadata.dcp_world_size) == (False, 2)
    validate_mla_context_parallelism(metadata)
