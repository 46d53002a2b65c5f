"""0009's sharded load on a GPU, through LMCache's real CUDA connectors.

Two ranks share one GPU and form a PCP group over gloo (gloo broadcasts CUDA
tensors; NCCL would need one device per rank). Each rank runs LMCache's real
engine with a paged connector, VLLMPagedMemGPUConnectorV2 or V3 (the one the
presets use: use_gpu_connector_v3), on a vLLM-MLA-layout paged KV cache (per
layer [blocks, block_size, head_size], bf16) with a shuffled slot mapping,
stores the prompt (every rank its own chunks), zeroes the paged KV and
retrieves. The chunks are large (61 layers x 256 tokens x 576: 18 MB) and the
staging buffer holds three of them, so every rank runs many host-to-device
copies, broadcasts and paged-KV writes back to back. Both connectors write
the paged KV on their own load stream; gloo's broadcast of a CUDA tensor
delivers on a side stream that only the caller's current stream waits for.
A paged-KV write that does not wait for the copy or broadcast that fills its
buffer reads stale bytes. The paged KV must come back byte for byte on both
ranks.

The proof is of 0010's stream-order part (tests/parts/lmcache/): its
leave-one-out tree is the series with 0010 less the wrapper that puts the
load's device work on the broadcast stream, where the load still runs and the
race is what is left. Without the whole of 0010 there is no sharded load to
race. test_0010_pcp_shard_load_stream_order.py proves the same on CPU, with
CUDA's stream ordering modelled.

Needs a GPU and LMCache's CUDA extension; skipped elsewhere.
"""

from __future__ import annotations

import pytest

from tests.support.pcp_ranks import MODEL, mla_metadata, run_processes

pytestmark = [pytest.mark.lmcache, pytest.mark.gpu]

SYNC = "0010-pcp-shard-sync-load.patch"
NUM_LAYERS = 61
HEAD_SIZE = 576
CHUNK_SIZE = 256
BLOCK_SIZE = 16
NUM_CHUNKS = 24
CHUNK_MB = NUM_LAYERS * CHUNK_SIZE * HEAD_SIZE * 2 / 1024**2


def gpu_rank(rank: int, world_size: int, workdir: str, rounds: int, connector_class: str) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=120)
    )
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import gpu_connectors
    from lmcache.v1.pcp_collectives import PCPCollectives

    device = torch.device("cuda", 0)
    ranks = list(range(world_size))
    cpu_group = dist.new_group(ranks, backend="gloo")
    device_group = dist.new_group(ranks, backend="gloo")
    collectives = PCPCollectives.from_process_groups(ranks, cpu_group, device_group, device)
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE,
        local_cpu=True,
        max_local_cpu_size=2 * NUM_CHUNKS * CHUNK_MB / 1024 + 0.1,
        save_unfull_chunk=False,
        extra_config={
            "pcp_shard_store": True,
            "save_chunk_meta": False,
            "pcp_shard_load_buffer_mb": 3 * CHUNK_MB,
        },
    )
    metadata = mla_metadata(
        MODEL, world_size, rank, pcp_world_size=world_size, num_layers=NUM_LAYERS, head_size=HEAD_SIZE,
        chunk_size=CHUNK_SIZE
    )
    num_tokens = NUM_CHUNKS * CHUNK_SIZE
    num_blocks = num_tokens // BLOCK_SIZE + 4
    gen = torch.Generator(device=device).manual_seed(97)  # the same KV on both ranks
    kvcaches = [
        torch.randn(num_blocks, BLOCK_SIZE, HEAD_SIZE, generator=gen, device=device, dtype=torch.bfloat16)
        for _ in range(NUM_LAYERS)
    ]
    connector = getattr(gpu_connectors, connector_class).from_metadata(metadata, use_gpu=False, device=device)
    # V3 builds its layer groups (which size every memory object) when the
    # caches are registered, as LMCache's vLLM adapter does before the engine
    # exists; V2 has no such step.
    register = getattr(connector, "register_kv_caches", None)
    if register is not None:
        register(kvcaches)
    engine = LMCacheEngineBuilder.get_or_create(
        f"gpu-pcp-{rank}", config, metadata, connector, collectives.broadcast, collectives.broadcast_object,
        pcp_collectives=collectives,
    )
    engine.post_init()
    perm = torch.randperm(num_blocks * BLOCK_SIZE, generator=torch.Generator().manual_seed(5))[:num_tokens]
    slot_mapping = perm.to(device=device, dtype=torch.int64)
    reference = [layer.clone() for layer in kvcaches]
    tokens = [(11 + 13 * i) % 50021 for i in range(num_tokens)]
    engine.store(tokens, kvcaches=kvcaches, slot_mapping=slot_mapping)
    torch.cuda.synchronize()
    dist.barrier(group=cpu_group)

    loaded = []
    mismatched: list[tuple[int, int]] = []
    for round_ in range(rounds):
        for layer in kvcaches:
            layer.zero_()
        torch.cuda.synchronize()
        mask = engine.retrieve(tokens, kvcaches=kvcaches, slot_mapping=slot_mapping, req_id=f"gpu-{round_}")
        torch.cuda.synchronize()
        loaded.append(int(mask.sum()))
        for index, (got, want) in enumerate(zip(kvcaches, reference, strict=True)):
            got_slots = got.view(-1, HEAD_SIZE)[slot_mapping].view(torch.int16)
            want_slots = want.view(-1, HEAD_SIZE)[slot_mapping].view(torch.int16)
            if not torch.equal(got_slots, want_slots):
                mismatched.append((round_, index))
    dist.barrier(group=cpu_group)
    LMCacheEngineBuilder.destroy(f"gpu-pcp-{rank}")
    return {"loaded": loaded, "mismatched": mismatched}


@pytest.mark.fixes(SYNC, part="stream-order", fails_with=r"paged KV differs")
@pytest.mark.parametrize("connector_class", ["VLLMPagedMemGPUConnectorV2", "VLLMPagedMemGPUConnectorV3"])
def test_sharded_load_through_the_cuda_connector_is_byte_exact(tmp_path, connector_class):
    rounds = 5
    results = run_processes(2, gpu_rank, tmp_path, timeout_s=540, rounds=rounds, connector_class=connector_class)
    assert [r["loaded"] for r in results] == [[NUM_CHUNKS * CHUNK_SIZE] * rounds] * 2, results
    for rank, result in enumerate(results):
        assert not result["mismatched"], (
            f"rank {rank}: paged KV differs from the stored KV in (round, layer) {result['mismatched'][:10]}"
        )
