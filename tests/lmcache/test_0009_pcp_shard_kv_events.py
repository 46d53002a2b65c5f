"""0009: the KV events of the PCP-sharded store, on real ranks.

vLLM publishes the BlockStored events of an LMCache engine through its own
aggregation: each worker's events are wrapped by
``LMCacheConnectorV1.get_kv_connector_kv_cache_events``, combined by
``KVOutputAggregator`` and kept by ``LMCacheConnectorV1.take_events`` only when
every worker that reported events reported them (``get_common_events``). The
rank-0 store passes because rank 0 alone reports. Under the sharded store every
rank stores a different share of the prompt, so it must still report the
pod's events, chained by the hash of the chunk before each one in the prompt,
as one rank-0 store (W=1) does; a rank that reports only its own chunks names
the wrong parent and vLLM drops every event.

W processes over gloo run LMCache's real engine, token database and L1 (see
tests/support/pcp_ranks.py; the paged GPU KV is a CPU tensor); vLLM's own
classes aggregate what they report.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.lmcache import pcp_scenarios as S
from tests.support.pcp_ranks import CHUNK_SIZE, run_processes

pytestmark = pytest.mark.lmcache

STORE = "0009-pcp-shard-store-and-lookup.patch"
NUM_CHUNKS = 9
# the second prompt shares the first one's first two chunks, which vLLM's
# store mask leaves out (they are already cached)
CASES = [{"seed": 70, "masked_chunks": 0}, {"seed": 70, "masked_chunks": 2, "suffix_seed": 71}]


def prompt(case: dict) -> list[int]:
    tokens = S.prompt_tokens(case["seed"], NUM_CHUNKS)
    if "suffix_seed" in case:
        cut = case["masked_chunks"] * CHUNK_SIZE
        tokens = tokens[:cut] + S.prompt_tokens(case["suffix_seed"], NUM_CHUNKS)[cut:]
    return tokens


def kv_events_rank(rank: int, world_size: int, workdir: str) -> list[list[tuple]]:
    """Store each case's prompt on this rank with KV events on; return the
    events it reports (as plain tuples), per case."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.pcp_collectives import PCPCollectives
    from tests.support.pcp_ranks import MODEL, make_kv_connector, mla_metadata

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=60)
    )
    ranks = list(range(world_size))
    group = dist.new_group(ranks, backend="gloo")
    collectives = PCPCollectives.from_process_groups(ranks, group, group, torch.device("cpu"))
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE,
        local_cpu=True,
        max_local_cpu_size=0.02,
        save_unfull_chunk=False,
        enable_kv_events=True,
        extra_config={"pcp_shard_store": True, "save_chunk_meta": False},
    )
    metadata = mla_metadata(MODEL, world_size, rank, pcp_world_size=world_size)
    kv = make_kv_connector(NUM_CHUNKS * CHUNK_SIZE)
    engine = LMCacheEngineBuilder.get_or_create(
        f"kv-events-{rank}", config, metadata, kv, collectives.broadcast, collectives.broadcast_object,
        pcp_collectives=collectives,
    )
    engine.post_init()
    S.storage_of(engine)
    per_case = []
    for case in CASES:
        tokens = prompt(case)
        kv.fill(case["seed"], len(tokens))
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[: case["masked_chunks"] * CHUNK_SIZE] = False
        engine.store(tokens, mask=mask)
        per_case.append(
            [
                (tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.block_size, e.medium)
                for e in engine.get_kv_events()
            ]
        )
    dist.barrier(group=group)
    return per_case


_runs: dict[int, list] = {}


def reported(world_size: int, tmp_path) -> list[list[list[tuple]]]:
    """What each rank of a PCP group of W ranks reports, per case (W=1: one
    rank-0 store, no sharding). Run once per W in this module, inside the
    first test that needs it, so a failing run fails that test's call."""
    if world_size not in _runs:
        try:
            _runs[world_size] = ["ok", run_processes(world_size, kv_events_rank, tmp_path / f"w{world_size}",
                                                     timeout_s=120 + 30 * world_size)]
        except AssertionError as e:
            _runs[world_size] = ["error", e]
    status, value = _runs[world_size]
    if status == "error":
        raise value
    return value


def published_by_vllm(per_rank: list[list[tuple]]) -> list[tuple]:
    """The events vLLM's scheduler publishes for one step in which every
    rank reported ``per_rank[r]``: vLLM's own wrapping, aggregation and
    common-event filter."""
    from lmcache.utils import CacheStoreEvent
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    outputs = []
    for events in per_rank:
        lmcache_events = [
            CacheStoreEvent(list(hashes), parent, list(token_ids), size, None, medium, None)
            for hashes, parent, token_ids, size, medium in events
        ]
        # the worker side of vLLM's connector, around this rank's engine
        worker = SimpleNamespace(_lmcache_engine=SimpleNamespace(get_kv_events=lambda e=lmcache_events: e))
        wrapped = LMCacheConnectorV1.get_kv_connector_kv_cache_events(worker)
        outputs.append(
            ModelRunnerOutput(
                req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(kv_cache_events=wrapped)
            )
        )
    combined = KVOutputAggregator(expected_finished_count=len(per_rank)).aggregate(outputs)
    scheduler = SimpleNamespace(_kv_cache_events=None)
    LMCacheConnectorV1.update_connector_output(scheduler, combined.kv_connector_output)
    published = list(LMCacheConnectorV1.take_events(scheduler))
    return sorted(
        (tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.block_size, e.medium) for e in published
    )


@pytest.mark.fixes(STORE, fails_with=r"has no storage manager: MLA stores on rank 0 only|name parents")
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_chains_its_events_to_the_prompts_previous_chunk(world_size, tmp_path):
    w1_events = reported(1, tmp_path)[0]
    results = reported(world_size, tmp_path)
    for case, expected in enumerate(w1_events):
        assert len(expected) == NUM_CHUNKS - CASES[case]["masked_chunks"]
        parent_of = {hashes: parent for hashes, parent, *_ in expected}
        for rank, rank_results in enumerate(results):
            got = {hashes: parent for hashes, parent, *_ in rank_results[case]}
            assert got, f"case {case}: rank {rank} reported no KV events"
            wrong = {h[0]: p for h, p in got.items() if parent_of.get(h) != p}
            assert not wrong, (
                f"case {case}: rank {rank}'s KV events name parents {wrong} (chunk hash: parent), "
                f"not the previous chunk of the prompt as W=1 does"
            )
            assert rank_results[case] == expected, f"case {case}: rank {rank} reported other events than W=1"


@pytest.mark.fixes(STORE, fails_with=r"has no storage manager: MLA stores on rank 0 only|vLLM publishes 0 of")
@pytest.mark.parametrize("world_size", [2, 4])
def test_vllm_publishes_the_events_w1_publishes(world_size, tmp_path):
    w1_events = reported(1, tmp_path)[0]
    results = reported(world_size, tmp_path)
    for case, expected in enumerate(w1_events):
        published = published_by_vllm([rank_results[case] for rank_results in results])
        assert published == sorted(expected), (
            f"case {case}: vLLM publishes {len(published)} of the {len(expected)} events W=1 publishes"
        )
