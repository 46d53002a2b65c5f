"""Ranks of a real vLLM PCP group on CPU (gloo), for the proof of 0006.

Each rank initializes vLLM's own distributed state (init_distributed_environment
+ initialize_model_parallel with PCP = W, TP = 1) and asks LMCache's real
VllmServiceFactory for its engine, as the LMCache connector does on a
worker. Two things stand in: vLLM's paged GPU KV cache and LMCache's GPU
connector (CpuPagedKV, there is no GPU), and vLLM's layout hints for it.
"""

from __future__ import annotations

from types import SimpleNamespace

from tests.support.pcp_ranks import CHUNK_SIZE, make_kv_connector, mla_metadata


def rank_zero_store_then_load(rank: int, world_size: int, workdir: str, num_chunks: int) -> dict:
    import torch

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    parallel_state.init_distributed_environment(
        world_size=world_size,
        rank=rank,
        distributed_init_method=f"file://{workdir}/vllm-rendezvous",
        local_rank=rank,
        backend="gloo",
    )
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, prefill_context_model_parallel_size=world_size
        )

    import lmcache.integration.vllm.utils as lmcache_vllm_utils
    import lmcache.v1.gpu_connector as gpu_connector
    from lmcache.integration.vllm.vllm_service_factory import VllmServiceFactory
    from lmcache.v1.config import LMCacheEngineConfig

    kv = make_kv_connector(num_chunks * CHUNK_SIZE)
    gpu_connector.CreateGPUConnector = lambda *args, **kwargs: kv
    lmcache_vllm_utils.vllm_layout_hints = lambda *args, **kwargs: None

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_SIZE, local_cpu=True, max_local_cpu_size=0.02, save_unfull_chunk=False
    )
    parallel_config = SimpleNamespace(
        prefill_context_parallel_size=world_size,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        world_size=world_size,
        rank=rank,
    )
    factory = VllmServiceFactory(config, SimpleNamespace(parallel_config=parallel_config), "worker")
    # The metadata vLLM's model config would give: MLA, rank = PCP rank.
    factory.metadata = mla_metadata("vllm-pcp-test", world_size, rank)
    engine = factory.get_or_create_lmcache_engine()
    engine.post_init()

    tokens = [(17 + 3 * i) % 40009 for i in range(num_chunks * CHUNK_SIZE)]
    kv.fill(5, len(tokens))
    engine.store(tokens)  # rank 0 stores (save_only_first_rank under MLA)
    torch.distributed.barrier()
    kv.kv.zero_()
    mask = engine.retrieve(tokens, req_id="pcp-req")
    loaded = int(mask.sum())
    got = kv.kv.clone()
    kv.fill(5, len(tokens))
    return {"loaded": loaded, "kv_ok": bool(torch.equal(got, kv.kv))}
