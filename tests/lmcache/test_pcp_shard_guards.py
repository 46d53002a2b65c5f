"""pcp_shard_store: unsupported combinations fail at engine init with a
message naming the setting (0011), the switch without MLA or without PCP
does nothing, and without the switch the engine behaves as upstream."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.pcp_ranks import CHUNK_SIZE, mla_metadata

pytestmark = pytest.mark.lmcache

GUARDS = "0012-pcp-shard-guards.patch"
STORE = "0009-pcp-shard-store-and-lookup.patch"
_ids = itertools.count()


def build(world_size=4, pcp=4, use_mla=True, collectives=True, collectives_rank=1, **config_overrides):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.pcp_collectives import PCPCollectives

    extra = {"pcp_shard_store": True}
    extra.update(config_overrides.pop("extra_config", {}))
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE, local_cpu=True, max_local_cpu_size=0.01, extra_config=extra, **config_overrides
    )
    metadata = mla_metadata("guards", world_size, 1, pcp_world_size=pcp, use_mla=use_mla)
    pcp_collectives = None
    if collectives:
        pcp_collectives = PCPCollectives(collectives_rank, pcp, None, None, None, torch.device("cpu"))
    instance_id = f"guards-{next(_ids)}"
    try:
        return LMCacheEngineBuilder.get_or_create(
            instance_id, config, metadata, None, None, None, pcp_collectives=pcp_collectives
        )
    finally:
        LMCacheEngineBuilder.destroy(instance_id)


@pytest.mark.fixes(GUARDS, fails_with=r"DID NOT RAISE <class 'ValueError'>")
@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"use_layerwise": True}, "use_layerwise"),
        ({"enable_scheduler_bypass_lookup": True}, "enable_scheduler_bypass_lookup"),
        ({"lookup_server_worker_ids": [0]}, "lookup_server_worker_ids"),
        ({"world_size": 8}, "TP=1, PP=1"),  # PCP 4 inside a world of 8: TP or PP > 1
    ],
)
def test_unsupported_combination_fails_at_init_naming_it(overrides, named):
    kwargs = dict(overrides)
    world_size = kwargs.pop("world_size", 4)
    with pytest.raises(ValueError, match="pcp_shard_store") as info:
        build(world_size=world_size, **kwargs)
    assert named in str(info.value)


@pytest.mark.parametrize("setting", ["enable_blending", "enable_p2p", "enable_pd"])
def test_settings_that_need_other_services_are_rejected_by_the_validator(setting):
    """Blending, P2P and PD need a tokenizer download or peers to build an
    engine at all; the engine calls this validator first thing. A unit test
    of the validator 0012 adds, not a proof: without 0012 it does not exist
    (the init-path proofs above are 0012's)."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.pcp_shard import validate_pcp_shard_store

    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_SIZE, extra_config={"pcp_shard_store": True})
    setattr(config, setting, True)
    metadata = mla_metadata("guards", 4, 1, pcp_world_size=4)
    with pytest.raises(ValueError, match=setting):
        validate_pcp_shard_store(config, metadata)


@pytest.mark.fixes(STORE, fails_with=r"DID NOT RAISE <class 'ValueError'>")
def test_worker_without_pcp_collectives_fails_at_init():
    with pytest.raises(ValueError, match="collectives"):
        build(collectives=False)


@pytest.mark.fixes(STORE, fails_with=r"DID NOT RAISE <class 'ValueError'>")
def test_collectives_of_another_rank_fail_at_init_naming_both():
    with pytest.raises(ValueError, match="collectives say rank 2 of 4, metadata says rank 1 of 4"):
        build(collectives_rank=2)


def test_switch_without_mla_or_pcp_changes_nothing():
    assert build(use_mla=False).pcp_shard_layout is None
    engine = build(world_size=1, pcp=1)
    assert engine.pcp_shard_layout is None
    assert engine.save_only_first_rank  # MLA's upstream default still applies


@pytest.mark.fixes(STORE, fails_with=r"not the rank-0 store's \(1, 0\)")
def test_sharded_keys_are_the_rank0_store_keys():
    """Every rank names a chunk like the rank-0 store does (world size 1,
    worker 0), so pods and rank-0 deployments share one cache."""
    engine = build()
    key = next(iter(engine.token_database.process_tokens(tokens=list(range(CHUNK_SIZE)))))[2]
    named = (key.world_size, key.worker_id)
    assert named == (1, 0), f"rank 1 names its chunks {named}, not the rank-0 store's (1, 0)"
    assert engine.pcp_shard_layout.owner(5 * CHUNK_SIZE) == 1
