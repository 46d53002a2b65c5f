"""Scenarios that run on every rank of a real PCP group (see
tests/support/pcp_ranks.py). They live in an importable module because the
ranks are spawned processes."""

from __future__ import annotations

import hashlib
from typing import Any

from tests.support.pcp_ranks import CHUNK_SIZE, RankContext



def storage_of(engine):
    """The rank's storage manager. Upstream's MLA store (save_only_first_rank) gives
    ranks other than 0 none, which is what a tree without the sharded store shows."""
    manager = engine.storage_manager
    assert manager is not None, (
        f"rank {engine.metadata.worker_id} has no storage manager: MLA stores on rank 0 only")
    return manager

def prompt_tokens(seed: int, num_chunks: int) -> list[int]:
    """A prompt of whole chunks whose chunk hashes differ from every other seed's."""
    return [(seed * 7919 + i * 31) % 50021 for i in range(num_chunks * CHUNK_SIZE)]


def chunk_keys(ctx: RankContext, tokens: list[int]) -> list[tuple[int, Any]]:
    return [(start, key) for start, _end, key in ctx.engine.token_database.process_tokens(tokens=tokens)]


def l1_starts(ctx: RankContext, tokens: list[int]) -> list[int]:
    backend = storage_of(ctx.engine).storage_backends["LocalCPUBackend"]
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
    allocator = storage_of(ctx.engine).storage_backends["LocalCPUBackend"].memory_allocator
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
        # at the storage manager's read, which every tree has (a tree without
        # the sharded load then shows what upstream does with the exception)
        storage = storage_of(engine)
        original = storage.batched_get

        def boom(*args, **kwargs):
            raise RuntimeError("injected: storage read failed on this rank")

        storage.batched_get = boom
        return lambda: setattr(storage, "batched_get", original)
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


def apply_load_fault(ctx: RankContext, fault: tuple | None):
    """Faults of the load after the exchange (0009), each a deliberate fake:
    a real run cannot make one rank's device allocation, paged-KV write,
    metadata parsing or L2 read fail on demand.

    ``("device_alloc_fails",)``: the load's uint8 device buffers cannot be
    allocated (torch.empty raises OutOfMemoryError for calls from the cache
    engine). ``("to_gpu_fails_at", start)``: the connector raises when asked
    to write the chunk at ``start``. ``("metadata_parse_fails",)``:
    MemoryObjMetadata.from_dict raises. ``("metadata_serialize_fails",)``:
    MemoryObjMetadata.to_dict raises, as the rank describes the chunks it
    read for the exchange. ``("remote_get_raises",)``: a
    storage read from the remote backend raises (after the L1 read of the
    same retrieve returned its objects)."""
    import sys

    import torch

    if fault is None:
        return lambda: None
    name = fault[0]
    if name == "device_alloc_fails":
        real_empty = torch.empty

        def failing_empty(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if kwargs.get("dtype") is torch.uint8 and caller.endswith("lmcache/v1/cache_engine.py"):
                raise torch.OutOfMemoryError("injected: device allocation failed on this rank")
            return real_empty(*args, **kwargs)

        torch.empty = failing_empty
        return lambda: setattr(torch, "empty", real_empty)
    if name == "to_gpu_fails_at":
        kv = ctx.kv
        real_to_gpu = kv.batched_to_gpu

        def failing_to_gpu(memory_objs, starts, ends, **kwargs):
            if fault[1] in list(starts):
                raise RuntimeError(f"injected: paged-KV write of chunk {fault[1]} failed on this rank")
            return real_to_gpu(memory_objs, starts, ends, **kwargs)

        kv.batched_to_gpu = failing_to_gpu
        return lambda: setattr(kv, "batched_to_gpu", real_to_gpu)
    if name == "metadata_parse_fails":
        from lmcache.v1.memory_management import MemoryObjMetadata

        real_from_dict = MemoryObjMetadata.__dict__["from_dict"]

        def failing_from_dict(d):
            raise ValueError("injected: chunk metadata could not be parsed on this rank")

        MemoryObjMetadata.from_dict = staticmethod(failing_from_dict)
        return lambda: setattr(MemoryObjMetadata, "from_dict", real_from_dict)
    if name == "metadata_serialize_fails":
        from lmcache.v1.memory_management import MemoryObjMetadata

        real_to_dict = MemoryObjMetadata.to_dict

        def failing_to_dict(self):
            raise ValueError("injected: chunk metadata could not be serialised on this rank")

        MemoryObjMetadata.to_dict = failing_to_dict
        return lambda: setattr(MemoryObjMetadata, "to_dict", real_to_dict)
    if name == "remote_get_raises":
        storage = ctx.engine.storage_manager
        real_get = storage.batched_get

        def failing_get(keys, location=None, **kwargs):
            if location == "RemoteBackend":
                raise RuntimeError("injected: L2 read failed on this rank")
            return real_get(keys, location=location, **kwargs)

        storage.batched_get = failing_get
        return lambda: setattr(storage, "batched_get", real_get)
    raise ValueError(f"unknown load fault {fault!r}")


def owned_l1_counts(ctx: RankContext, tokens: list[int]) -> dict[int, tuple[int, int]]:
    """(ref count, pin count) of each chunk this rank holds in L1."""
    backend = storage_of(ctx.engine).storage_backends["LocalCPUBackend"]
    counts = {}
    for start, key in chunk_keys(ctx, tokens):
        if backend.contains(key):
            obj = backend.hot_cache[key]
            counts[start] = (obj.get_ref_count(), obj.meta.pin_count)
    return counts


def load_with_fault(
    ctx: RankContext,
    seed: int,
    num_chunks: int,
    fault: tuple | None = None,
    fault_rank: int = 0,
    drop_l1: dict | None = None,
    wait_l2: bool = False,
) -> dict:
    """Store a prompt, force ``fault`` on ``fault_rank`` during the retrieve
    and report every rank's outcome. An exception out of retrieve() is
    reported as the rank's result, so a rank that fails alone shows up as
    such instead of ending the run."""
    import time

    import torch

    tokens = prompt_tokens(seed, num_chunks)
    num_tokens = len(tokens)
    ctx.kv.fill(seed, num_tokens)
    ctx.engine.store(tokens)
    if wait_l2:
        remote = storage_of(ctx.engine).storage_backends["RemoteBackend"]
        owned = [key for start, key in chunk_keys(ctx, tokens) if (start // CHUNK_SIZE) % ctx.world_size == ctx.rank]
        deadline = time.monotonic() + 30
        while not all(remote.contains(key) for key in owned):
            if time.monotonic() > deadline:
                raise TimeoutError("L2 writes did not finish")
            time.sleep(0.05)
    for start, key in chunk_keys(ctx, tokens):
        if start in (drop_l1 or {}).get(ctx.rank, []):
            ctx.engine.storage_manager.remove(key, ["LocalCPUBackend"])
    reference = ctx.kv.kv[:, :, :num_tokens, :].clone()
    ctx.kv.kv.zero_()
    log_start = len(ctx.collectives.log)
    restore = apply_load_fault(ctx, fault if ctx.rank == fault_rank else None)
    error = None
    prefix = None
    contiguous = None
    try:
        mask = ctx.engine.retrieve(tokens, req_id=f"fault-{seed}")
        prefix = int(mask.sum())
        contiguous = bool(mask[:prefix].all()) and not bool(mask[prefix:].any())
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    finally:
        restore()
    loaded = ctx.kv.kv[:, :, :num_tokens, :]
    return {
        "error": error,
        "prefix": prefix,
        "contiguous": contiguous,
        "kv_below_prefix_ok": prefix is not None and bool(torch.equal(loaded[:, :, :prefix], reference[:, :, :prefix])),
        "l1_counts": owned_l1_counts(ctx, tokens),
        "collectives": ctx.collectives.log[log_start:],
    }


def load_on_device_streams(ctx: RankContext, seed: int, num_chunks: int) -> dict:
    """Store a prompt (every rank its own chunks), clear the paged KV,
    retrieve, synchronize the device as a caller does before it reads the KV,
    and report the chunks whose paged KV differs from what was stored. Needs
    a run with ``device_streams`` (tests/support/device_streams.py)."""
    import torch

    assert ctx.streams is not None, "run with engine_options={'device_streams': True}"
    tokens = prompt_tokens(seed, num_chunks)
    num_tokens = len(tokens)
    ctx.kv.fill(seed, num_tokens)
    reference = ctx.kv.kv[:, :, :num_tokens, :].clone()
    ctx.engine.store(tokens)
    ctx.kv.kv.zero_()
    log_start = len(ctx.collectives.log)
    mask = ctx.engine.retrieve(tokens, req_id=f"streams-{seed}")
    ctx.streams.synchronize()
    differs = [
        start
        for start in range(0, num_tokens, CHUNK_SIZE)
        if not torch.equal(ctx.kv.kv[:, :, start : start + CHUNK_SIZE], reference[:, :, start : start + CHUNK_SIZE])
    ]
    return {"prefix": int(mask.sum()), "differs": differs, "collectives": ctx.collectives.log[log_start:]}


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

    backend = storage_of(ctx.engine).storage_backends["LocalCPUBackend"]
    for start, key in chunk_keys(ctx, tokens):
        if not backend.contains(key):
            continue
        obj = backend.hot_cache[key]
        if obj.get_ref_count() < 1:
            return False
        end = start + CHUNK_SIZE
        if not torch.equal(
            obj.tensor.reshape(ctx.kv.kv[:, :, start:end, :].shape), reference_kv(ctx, seed, len(tokens), start, end)
        ):
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
    remote = storage_of(ctx.engine).storage_backends["RemoteBackend"]
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


def async_lookup_server_rank(rank: int, world_size: int, workdir: str, engine_id: str, cases: list[dict]) -> list[dict]:
    """A rank of a sharded, async-loading PCP group wired as vLLM wires it:
    its engine answers prefetches through LMCache's real
    LMCacheAsyncLookupServer (pin=True), and rank 0 also runs the scheduler's
    real LMCacheAsyncLookupClient, which asks every rank's server over ZMQ
    and takes the minimum. Per case: store, prefetch, then load what the
    scheduler would schedule (``vllm_cached`` tokens masked as vLLM's own
    prefix, ``scheduled`` tokens in all) and unpin (wait_for_save); report
    the ref and pin counts of this rank's L1 chunks after the prefetch and
    after the request."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.lookup_client.factory import LookupClientFactory
    from lmcache.v1.lookup_client.lmcache_async_lookup_client import LMCacheAsyncLookupServer
    from lmcache.v1.pcp_collectives import PCPCollectives
    from tests.support.pcp_ranks import MODEL, make_kv_connector, mla_metadata

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=60)
    )
    ranks = list(range(world_size))
    cpu_group = dist.new_group(ranks, backend="gloo")
    device_group = dist.new_group(ranks, backend="gloo")
    collectives = PCPCollectives.from_process_groups(ranks, cpu_group, device_group, torch.device("cpu"))
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE,
        local_cpu=True,
        max_local_cpu_size=0.04,
        save_unfull_chunk=False,
        enable_async_loading=True,
        extra_config={"pcp_shard_store": True, "save_chunk_meta": False},
    )
    metadata = mla_metadata(MODEL, world_size, rank, pcp_world_size=world_size)
    metadata.engine_id = engine_id  # names the ZMQ sockets
    kv = make_kv_connector(4096)
    engine = LMCacheEngineBuilder.get_or_create(
        f"pcp-async-server-{rank}",
        config,
        metadata,
        kv,
        collectives.broadcast,
        collectives.broadcast_object,
        pcp_collectives=collectives,
    )
    server = LookupClientFactory.create_lookup_server(engine, metadata)
    assert isinstance(server, LMCacheAsyncLookupServer)
    engine.post_init(async_lookup_server=server)
    client = None
    if rank == 0:
        scheduler_metadata = mla_metadata(MODEL, world_size, 0, pcp_world_size=world_size)
        scheduler_metadata.engine_id = engine_id
        client = LookupClientFactory.create_lookup_client(config, scheduler_metadata)
    dist.barrier(group=cpu_group)

    backend = storage_of(engine).storage_backends["LocalCPUBackend"]

    def l1_state(tokens: list[int]) -> list[tuple[int, int, int]]:
        return [
            (start, backend.hot_cache[key].get_ref_count(), backend.hot_cache[key].metadata.pin_count)
            for start, key in chunk_keys_of(engine, tokens)
            if key in backend.hot_cache
        ]

    results = []
    for case in cases:
        seed = case["seed"]
        tokens = prompt_tokens(seed, case["num_chunks"])
        lookup_id = f"async-server-{seed}"
        kv.fill(seed, len(tokens))
        engine.store(tokens)
        stored = l1_state(tokens)
        dist.barrier(group=cpu_group)
        answer = None
        if client is not None:
            assert client.lookup_cache(lookup_id) == -1
            assert client.lookup(tokens, lookup_id=lookup_id) is None
            deadline = time.monotonic() + 30
            while (answer := client.lookup_cache(lookup_id)) is None:
                assert time.monotonic() < deadline, f"no prefetch answer for {lookup_id}"
        # The scheduler's decision reaches every worker in the connector metadata.
        answer = collectives.broadcast_object(answer, 0)
        # Every server has answered, so every prefetch has finished.
        prefetched = l1_state(tokens)
        vllm_cached, scheduled = case["vllm_cached"], min(answer, case["scheduled"])
        mask = torch.ones(scheduled, dtype=torch.bool)
        mask[:vllm_cached] = False
        kv.kv.zero_()
        ret = engine.retrieve(tokens[:scheduled], mask, req_id=lookup_id)
        engine.lookup_unpin(lookup_id)  # wait_for_save
        loaded = kv.kv[:, :, : len(tokens), :].clone()
        kv.fill(seed, len(tokens))
        expected = kv.kv[:, :, : len(tokens), :].clone()
        expected[:, :, :vllm_cached, :] = 0
        expected[:, :, scheduled:, :] = 0
        results.append(
            {
                "stored": stored,
                "answer": answer,
                "loaded": int(ret.sum()),
                "kv_ok": bool(torch.equal(loaded, expected)),
                "prefetched": prefetched,
                "after": l1_state(tokens),
            }
        )
    dist.barrier(group=cpu_group)
    return results


def chunk_keys_of(engine: Any, tokens: list[int]) -> list[tuple[int, Any]]:
    return [(start, key) for start, _end, key in engine.token_database.process_tokens(tokens=tokens)]
