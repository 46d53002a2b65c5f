"""Run LMCache's RESP client (the installed build) against one Valkey, as a prefill rank does:
RemoteBackend on resp://HOST:PORT, credentials only from LMCACHE_RESP_PASSWORD (the chart sets it
from the Valkey Secret). Writes one chunk with the connector, then asks whether it exists, and
prints one JSON line: {"connector", "put", "exists", "key"} or the error each step raised.

    python resp_auth_probe.py PORT
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading

CHUNK_TOKENS = 16
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 8)  # 2048 bytes of bf16


def main(port: int) -> dict:
    import torch

    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="backend-loop", daemon=True).start()
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=0.1,
        remote_url=f"resp://127.0.0.1:{port}", remote_serde="naive", save_unfull_chunk=False,
        extra_config={"save_chunk_meta": False, "resp_num_threads": 1},
    )
    metadata = LMCacheMetadata(
        model_name="deploy-auth", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, use_mla=False, chunk_size=CHUNK_TOKENS,
    )
    local = LocalCPUBackend(config, metadata, memory_allocator=PinMemoryAllocator(16 * 2048))
    backend = RemoteBackend(config, metadata, loop, local)
    connector = backend.connection
    while hasattr(connector, "getWrappedConnector"):
        connector = connector.getWrappedConnector()
    key = CacheEngineKey("deploy-auth", 1, 0, 4242, torch.bfloat16)
    out: dict = {"connector": type(connector).__name__, "key": key.to_string()}
    obj = local.allocate(torch.Size(KV_SHAPE), torch.bfloat16)
    obj.tensor.fill_(1.0)
    try:
        asyncio.run_coroutine_threadsafe(connector.put(key, obj), loop).result(20)
        out["put"] = "ok"
    except Exception as e:  # noqa: BLE001 - the outcome is the answer
        out["put"] = f"{type(e).__name__}: {e}"
    try:
        out["exists"] = connector.exists_sync(key)
    except Exception as e:  # noqa: BLE001
        out["exists"] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))), flush=True)
    sys.stdout.flush()
    # The connector's worker threads would hold the interpreter; the answer is out.
    import os

    os._exit(0)
