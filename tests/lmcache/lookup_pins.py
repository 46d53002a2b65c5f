"""Two requests that share a prompt's chunks, each pinning them with its own
lookup, as vLLM runs them with synchronous loading: through LMCache's real
vLLM adapter (GLM-5's KV caches, see glm5_lmcache_run.py) and on the ranks of
the PCP-sharded store (tests/support/pcp_ranks.py). The scenarios live in an
importable module because they run in spawned processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.lmcache.glm5_lmcache_run import (
    _scheduler_lookup_client,
    fill_kv,
    l1_counts,
    slots_of,
    start_worker,
    token_bytes,
)
from tests.lmcache.pcp_scenarios import kv_matches, owned_l1_counts, prompt_tokens
from tests.support.pcp_ranks import RankContext

REQUESTS = ("req-A", "req-B")


def shared_chunk_pins(
    rank: int,
    world_size: int,
    workdir: str,
    variant: str,
    num_tokens: int,
    store_blocks: list[int],
    load_blocks_a: list[int],
    load_blocks_b: list[int],
) -> dict[str, Any]:
    """vLLM's worker with LMCache's adapter (``use_gpu_connector_v3``): the
    scheduler's ``LMCacheLookupClient`` looks the prompt up for both requests
    over ZMQ (the worker's ``LMCacheLookupServer`` pins each L1 chunk once per
    lookup); request A runs its step (``start_load_kv``, ``wait_for_save``);
    L1 is asked for chunk after chunk of memory until it has nothing left to
    evict; then request B runs its step.

    Reports the (ref count, pin count) of the prompt's L1 chunks after each
    load and each step, which chunks of the prompt and of another stored
    prompt L1 still holds after the pressure, per layer the tokens of B's load
    that differ from the stored ones, and LMCache's "Double unpin" warnings."""
    import logging
    from types import SimpleNamespace

    import torch

    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorMetadata, LoadSpec, ReqMeta
    from lmcache.v1.memory_management import MemoryFormat

    kv, connector = start_worker(Path(workdir), variant, {"LMCACHE_USE_GPU_CONNECTOR_V3": "True"})
    adapter = connector._lmcache_engine
    engine = adapter.lmcache_engine
    connector.register_kv_caches(kv.kv_caches)
    client = _scheduler_lookup_client(kv)
    double_unpins: list[str] = []

    class DoubleUnpins(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "Double unpin" in record.getMessage():
                double_unpins.append(record.getMessage())

    logging.getLogger("lmcache.v1.memory_management").addHandler(DoubleUnpins(logging.WARNING))

    kvcaches = list(adapter.kv_caches.values())
    store_slots = slots_of(store_blocks, num_tokens)
    tokens, other = torch.arange(num_tokens) + 7000, torch.arange(num_tokens) + 9000
    fill_kv(kv, seed=31)
    original = {name: t.clone() for name, t in kv.kv_caches.items()}
    engine.store(tokens, kvcaches=kvcaches, slot_mapping=store_slots)
    engine.store(other, kvcaches=kvcaches, slot_mapping=store_slots)
    result: dict[str, Any] = {"answers": [client.lookup(tokens, lookup_id=req) for req in REQUESTS]}
    result["looked_up"] = l1_counts(engine, tokens)

    def run_step(req_id: str, load_slots: Any) -> None:
        """One step of a request whose whole prompt LMCache holds, as the
        model runner drives the connector around the forward pass."""
        metadata = LMCacheConnectorMetadata()
        metadata.add_request(ReqMeta(req_id=req_id, token_ids=tokens.tolist(), slot_mapping=load_slots,
                                     load_spec=LoadSpec(0, num_tokens, True)))
        connector.bind_connector_metadata(metadata)
        connector.start_load_kv(SimpleNamespace(attn_metadata={}))
        result[f"{req_id}_loaded"] = l1_counts(engine, tokens)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        result[f"{req_id}_ended"] = l1_counts(engine, tokens)

    run_step("req-A", slots_of(load_blocks_a, num_tokens))
    local = engine.storage_manager.local_cpu_backend
    shapes, dtypes = engine.metadata.get_shapes(), engine.metadata.get_dtypes()
    held = []
    while (obj := local.allocate(shapes, dtypes, MemoryFormat.KV_MLA_FMT, busy_loop=False)) is not None:
        held.append(obj)
    result["pressure"] = {"allocated": len(held), "prompt_in_l1": sorted(l1_counts(engine, tokens)),
                          "other_in_l1": sorted(l1_counts(engine, other))}
    for obj in held:
        obj.ref_count_down()

    for tensor in kv.kv_caches.values():
        tensor.fill_(0xA5)
    load_slots = slots_of(load_blocks_b, num_tokens)
    run_step("req-B", load_slots)
    result["mismatched_tokens"] = {
        name: int((token_bytes(t, kv.role(name), load_slots)
                   != token_bytes(original[name], kv.role(name), store_slots)).any(dim=1).sum())
        for name, t in kv.kv_caches.items()
    }
    result["double_unpins"] = double_unpins
    return result


def sharded_shared_chunk_pins(ctx: RankContext, seed: int, num_chunks: int) -> dict[str, Any]:
    """The same two requests on a rank of the PCP-sharded store with
    synchronous loading: each rank's lookup pins the chunks it owns, once per
    request (vLLM's lookup client asks every rank's lookup server, which calls
    ``lookup(pin=True)``); then each request loads (the sharded load) and
    ends (``lookup_unpin``) in turn. Reports each lookup's answer and, after
    the lookups and after each request, the (ref count, pin count) of the
    chunks this rank holds, and whether each load wrote the stored KV."""
    tokens = prompt_tokens(seed, num_chunks)
    ctx.kv.fill(seed, len(tokens))
    ctx.engine.store(tokens)
    result: dict[str, Any] = {"answers": [ctx.engine.lookup(tokens, lookup_id=req, pin=True) for req in REQUESTS]}
    result["looked_up"] = owned_l1_counts(ctx, tokens)
    for req_id in REQUESTS:
        ctx.kv.kv.zero_()
        loaded = int(ctx.engine.retrieve(tokens, req_id=req_id).sum())
        ctx.engine.lookup_unpin(req_id)
        result[f"{req_id}_kv_ok"] = loaded == len(tokens) and kv_matches(ctx, seed, len(tokens), loaded)
        result[f"{req_id}_ended"] = owned_l1_counts(ctx, tokens)
    return result
