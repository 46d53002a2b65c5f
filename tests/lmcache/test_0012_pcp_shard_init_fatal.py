"""0011: unsupported PCP settings stop the engine at init.

* decode context parallelism with pcp_shard_store is rejected, naming both
  settings, and LMCache reads DCP from vLLM's own ParallelConfig;
* PCP with TP > 1 under MLA is rejected instead of warned about;
* the guard's error reaches the caller of LMCacheManager (what the vLLM
  connector constructs on every worker and on the scheduler) instead of
  leaving LMCache in degraded mode, where a rank that degrades alone would
  hang the others at the first cache hit.

The engine and manager are LMCache's real ones, built through the real
VllmServiceFactory; the vLLM config is vLLM's ParallelConfig (the model and
cache configs, which need a model download, are small stand-ins with the
attributes the factory reads).
"""

from __future__ import annotations

import pytest

from tests.support.pcp_ranks import CHUNK_SIZE, guard_vllm_config as vllm_config, mla_metadata

pytestmark = pytest.mark.lmcache

GUARDS = "0012-pcp-shard-guards.patch"


def lmcache_config(**overrides):
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE,
        local_cpu=True,
        max_local_cpu_size=0.01,
        extra_config={"pcp_shard_store": True},
        **overrides,
    )


# A unit test of the validator 0012 adds, not a proof: without 0012 LMCache has no
# notion of DCP at all, which test_lmcache_reads_dcp_from_vllms_parallel_config proves.
def test_dcp_with_the_sharded_store_is_rejected_naming_both_settings():
    from lmcache.v1.pcp_shard import validate_pcp_shard_store

    metadata = mla_metadata("guards", 4, 1, pcp_world_size=4)
    metadata.dcp_world_size = 4  # DCP spanning the PCP axis, as vLLM allows
    with pytest.raises(ValueError, match="decode_context_parallel_size=4") as info:
        validate_pcp_shard_store(lmcache_config(), metadata)
    assert "pcp_shard_store" in str(info.value)


@pytest.mark.fixes(GUARDS, fails_with=r"dcp_world_size")
def test_lmcache_reads_dcp_from_vllms_parallel_config():
    from lmcache.integration.vllm.vllm_service_factory import VllmServiceFactory

    config = vllm_config(prefill_context_parallel_size=2, decode_context_parallel_size=2)
    metadata = VllmServiceFactory(lmcache_config(), config, "scheduler").get_or_create_metadata()
    assert (metadata.pcp_world_size, getattr(metadata, "dcp_world_size", None)) == (2, 2), "dcp_world_size"


@pytest.mark.fixes(GUARDS, fails_with=r"DID NOT RAISE")
def test_pcp_with_tp_under_mla_is_rejected():
    from lmcache.integration.vllm.vllm_service_factory import create_pcp_collectives

    config = vllm_config(prefill_context_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="prefill_context_parallel_size=2 with tensor_parallel_size=2"):
        create_pcp_collectives(config)


@pytest.mark.fixes(GUARDS, fails_with=r"DID NOT RAISE")
def test_a_guard_failure_stops_lmcache_manager_init_instead_of_degrading():
    """The scheduler builds an engine when enable_scheduler_bypass_lookup is
    set; the sharded store rejects that setting in the engine's init. The
    error must come out of LMCacheManager, not be logged as degraded mode."""
    from lmcache.integration.vllm.vllm_service_factory import VllmServiceFactory
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.manager import LMCacheManager

    config = lmcache_config(enable_scheduler_bypass_lookup=True)
    factory = VllmServiceFactory(config, vllm_config(prefill_context_parallel_size=4), "scheduler")
    factory.metadata = mla_metadata("guards", 4, 0, pcp_world_size=4)
    factory.metadata.role = "scheduler"
    try:
        with pytest.raises(
            ValueError, match="pcp_shard_store: unsupported configuration.*enable_scheduler_bypass_lookup"
        ):
            LMCacheManager(config, factory)
    finally:
        from lmcache.integration.vllm.utils import ENGINE_NAME

        LMCacheEngineBuilder.destroy(ENGINE_NAME)
