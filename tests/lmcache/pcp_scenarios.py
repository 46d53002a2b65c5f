"""Scenarios that run on every rank of a real PCP group (see
tests/support/pcp_ranks.py). They live in an importable module because the
ranks are spawned processes."""

from __future__ import annotations

import hashlib
from typing import Any

from tests.support.pcp_ranks import CHUNK_SIZE, RankContext


def prompt_tokens(seed: int, num_chunks: int) -> list[int]:
    """A prompt of whole chunks whose chunk hashes differ from every other seed's."""
    return [(seed * 7919 + i * 31) % 50021 for i in range(num_chunks * CHUNK_SIZE)]


def chunk_keys(ctx: RankContext, tokens: list[int]) -> list[tuple[int, Any]]:
    return [(start, key) for start, _end, key in ctx.engine.token_database.process_tokens(tokens=tokens)]


def l1_starts(ctx: RankContext, tokens: list[int]) -> list[int]:
    backend = ctx.engine.storage_manager.storage_backends["LocalCPUBackend"]
    return [start for start, key in chunk_keys(ctx, tokens) if backend.contains(key)]


def drop_chunks(ctx: RankContext, tokens: list[int], starts: list[int]) -> None:
    """Remove chunks from every tier of this rank (an eviction)."""
    for start, key in chunk_keys(ctx, tokens):
        if start in starts:
            ctx.engine.storage_manager.remove(key)


def kv_matches(ctx: RankContext, seed: int, num_tokens: int, prefix: int) -> bool:
    """This rank's KV holds the reference data below ``prefix``, zeros above."""
    import torch

    loaded = ctx.kv.kv[:, :, :num_tokens, :].clone()
    ctx.kv.fill(seed, num_tokens)
    expected = ctx.kv.kv[:, :, :num_tokens, :].clone()
    expected[:, :, prefix:, :] = 0
    return bool(torch.equal(loaded, expected))


def kv_digest(ctx: RankContext, num_tokens: int) -> str:
    import torch

    data = ctx.kv.kv[:, :, :num_tokens, :].contiguous().view(-1).view(dtype=torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def l1_capacity_bytes(ctx: RankContext) -> int:
    allocator = ctx.engine.storage_manager.storage_backends["LocalCPUBackend"].memory_allocator
    return int(allocator.size)


def store_then_load(
    ctx: RankContext,
    cases: list[dict],
) -> list[dict]:
    """For each case: fill the KV, store, apply this rank's evictions and
    faults, clear the KV, retrieve, and report what happened."""
    results = []
    for case in cases:
        seed = case["seed"]
        num_chunks = case["num_chunks"]
        # a rank that got a different prompt for the same request
        tokens = prompt_tokens(seed + case.get("prompt_shift", {}).get(ctx.rank, 0), num_chunks)
        num_tokens = len(tokens)
        ctx.kv.fill(seed, num_tokens)
        ctx.engine.store(tokens)
        stored = l1_starts(ctx, tokens)
        drop_chunks(ctx, tokens, case.get("drop", {}).get(ctx.rank, []))
        lookup = ctx.engine.lookup(tokens)
        fault = case.get("fault", {}).get(ctx.rank)
        restore = apply_fault(ctx, fault)
        log_start = len(ctx.collectives.log)
        try:
            ctx.kv.kv.zero_()
            mask = ctx.engine.retrieve(tokens, req_id=f"req-{seed}")
        finally:
            restore()
        collectives = ctx.collectives.log[log_start:]
        prefix = int(mask.sum())
        contiguous = bool(mask[:prefix].all()) and not bool(mask[prefix:].any())
        seed += case.get("prompt_shift", {}).get(ctx.rank, 0)
        results.append(
            {
                "stored": stored,
                "lookup": lookup,
                "prefix": prefix,
                "contiguous": contiguous,
                "digest": kv_digest(ctx, num_tokens),
                "kv_ok": kv_matches(ctx, seed, num_tokens, prefix),
                "collectives": collectives,
            }
        )
    return results


def apply_fault(ctx: RankContext, fault: str | None):
    """Force a failure on this rank. These are deliberate fakes: a real run
    cannot make one rank's read raise, or its health monitor flip, on
    demand."""
    engine = ctx.engine
    if fault is None:
        return lambda: None
    if fault == "read_raises":
        original = engine._pcp_shard_read_owned

        def boom(*args, **kwargs):
            raise RuntimeError("injected: storage read failed on this rank")

        engine._pcp_shard_read_owned = boom
        return lambda: setattr(engine, "_pcp_shard_read_owned", original)
    if fault == "unhealthy":
        original_health = engine.is_healthy
        engine.is_healthy = lambda: False
        return lambda: setattr(engine, "is_healthy", original_health)
    if fault == "read_misses_all":
        storage = engine.storage_manager
        original_get = storage.batched_get

        def all_none(keys, location=None, **kwargs):
            objs = original_get(keys, location=location, **kwargs)
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
            return [None] * len(keys)

        storage.batched_get = all_none
        return lambda: setattr(storage, "batched_get", original_get)
    raise ValueError(f"unknown fault {fault!r}")


def report_l1(ctx: RankContext) -> dict:
    return {"l1_bytes": l1_capacity_bytes(ctx)}


def async_prefetch_then_load(ctx: RankContext, cases: list[dict]) -> list[dict]:
    """Async loading as vLLM drives it: every rank's lookup server prefetches,
    the scheduler takes the minimum of the answers, every rank retrieves
    (when the minimum is > 0) and then unpins (wait_for_save)."""
    results = []
    for case in cases:
        seed = case["seed"]
        tokens = prompt_tokens(seed, case["num_chunks"])
        num_tokens = len(tokens)
        ctx.kv.fill(seed, num_tokens)
        ctx.engine.store(tokens)
        drop_chunks(ctx, tokens, case.get("drop", {}).get(ctx.rank, []))
        lookup_id = f"async-{seed}"
        ctx.engine.async_lookup_and_prefetch(lookup_id, tokens)
        answer = ctx.responses.wait(lookup_id)
        # The scheduler's minimum over every rank's lookup server.
        scheduled = min(ctx.collectives.all_gather_object(answer))
        # Evictions between prefetch and retrieve do not matter any more:
        # the prefetched objects are held.
        ctx.kv.kv.zero_()
        prefix = 0
        if scheduled > 0:
            mask = ctx.engine.retrieve(tokens[:scheduled], req_id=lookup_id)
            prefix = int(mask.sum())
        ctx.engine.lookup_unpin(lookup_id)
        # L1 must still serve every chunk it holds after the request is done.
        intact = l1_intact(ctx, tokens, seed)
        results.append(
            {
                "answer": answer,
                "scheduled": scheduled,
                "prefix": prefix,
                "kv_ok": kv_matches(ctx, seed, num_tokens, prefix),
                "digest": kv_digest(ctx, num_tokens),
                "l1_intact": intact,
            }
        )
    return results


def l1_intact(ctx: RankContext, tokens: list[int], seed: int) -> bool:
    """Every chunk this rank holds in L1 is still allocated (ref count >= 1)
    and still holds the KV that was stored."""
    import torch

    backend = ctx.engine.storage_manager.storage_backends["LocalCPUBackend"]
    for start, key in chunk_keys(ctx, tokens):
        if not backend.contains(key):
            continue
        obj = backend.hot_cache[key]
        if obj.get_ref_count() < 1:
            return False
        end = start + CHUNK_SIZE
        if not torch.equal(obj.tensor.reshape(ctx.kv.kv[:, :, start:end, :].shape), reference_kv(ctx, seed, len(tokens), start, end)):
            return False
    return True


def reference_kv(ctx: RankContext, seed: int, num_tokens: int, start: int, end: int):
    saved = ctx.kv.kv.clone()
    ctx.kv.fill(seed, num_tokens)
    ref = ctx.kv.kv[:, :, start:end, :].clone()
    ctx.kv.kv.copy_(saved)
    return ref


def store_to_l2(ctx: RankContext, seed: int, num_chunks: int) -> bool:
    """Store a prompt (L1 and L2) and wait until the L2 writes are done."""
    import time

    tokens = prompt_tokens(seed, num_chunks)
    ctx.kv.fill(seed, len(tokens))
    ctx.engine.store(tokens)
    remote = ctx.engine.storage_manager.storage_backends["RemoteBackend"]
    owned = [key for start, key in chunk_keys(ctx, tokens) if (start // CHUNK_SIZE) % ctx.world_size == ctx.rank]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(remote.contains(key) for key in owned):
            return True
        time.sleep(0.05)
    return False


def load_from_l2(ctx: RankContext, seed: int, num_chunks: int) -> dict:
    """A fresh pod (empty L1) loads the prompt."""
    tokens = prompt_tokens(seed, num_chunks)
    from_l1 = l1_starts(ctx, tokens)
    ctx.kv.kv.zero_()
    mask = ctx.engine.retrieve(tokens, req_id=f"l2-{seed}")
    prefix = int(mask.sum())
    return {
        "from_l1": from_l1,
        "prefix": prefix,
        "contiguous": bool(mask[:prefix].all()) and not bool(mask[prefix:].any()),
        "digest": kv_digest(ctx, len(tokens)),
        "kv_ok": kv_matches(ctx, seed, len(tokens), prefix),
    }
