"""A replay against the cell's Valkey shards through LMCache's RESP client (the installed build),
with one shard killed and restarted during it; one JSON line of per-request records out.

Each of SHARDS ranks has its own RemoteBackend on resp://127.0.0.1:<port of shard r> (rank r
reads shard r, as remote_url's {rank} does in the cell) with the Secret's password from
LMCACHE_RESP_PASSWORD. Chunk c of a prompt lives on shard c mod SHARDS (pcp_shard_store). A
request looks its chunks up in order and stops at the first miss (a prefix hit), then writes
the chunks it had to recompute. Its TTFT is the lookups' measured wall time plus a modelled
recompute time per missing chunk (RECOMPUTE_S_PER_CHUNK; no GPU here).

At request `kill_at` the runner SIGKILLs the shard's process (a node loss, an OOM kill); at
`restart_at` it starts the shard again with the rendered command (empty, as a restarted pod
without persistence is), as the StatefulSet controller would.

    python chaos_replay.py SPEC.json      (tests/deploy/test_chaos.py writes SPEC)
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

CHUNK_TOKENS = 16
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 8)  # 2048 bytes of bf16 per chunk
# A 256-token chunk at 20,000 prompt tokens/s of one prefill pod: 12.8 ms (a model, stated in the note).
RECOMPUTE_S_PER_CHUNK = 0.0128


def backends(ports: list[int]):
    import torch

    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    out = []
    for rank, port in enumerate(ports):
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name=f"rank{rank}-loop", daemon=True).start()
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=0.1,
            remote_url=f"resp://127.0.0.1:{port}", remote_serde="naive", save_unfull_chunk=False,
            extra_config={"save_chunk_meta": False, "resp_num_threads": 1},
        )
        metadata = LMCacheMetadata(
            model_name="chaos", world_size=len(ports), local_world_size=len(ports), worker_id=0,
            local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, use_mla=False, chunk_size=CHUNK_TOKENS,
        )
        local = LocalCPUBackend(config, metadata, memory_allocator=PinMemoryAllocator(64 * 2048))
        out.append((RemoteBackend(config, metadata, loop, local), local, loop))
    return out


def main(spec: dict) -> dict:
    import torch

    from lmcache.utils import CacheEngineKey

    ranks = backends([s["port"] for s in spec["shards"]])
    shards = len(ranks)
    prompts, chunks = spec["prompts"], spec["chunks"]

    def key(prompt: int, chunk: int) -> CacheEngineKey:
        return CacheEngineKey("chaos", 1, 0, prompt * 1000 + chunk, torch.bfloat16)

    records, restarted = [], None
    start = time.monotonic()
    restart_t = None
    i = -1
    # Fixed request counts up to the restart; after it, replay for after_restart_s (the client's
    # reconnect backoff is time, not requests), one request every pace_s.
    while restart_t is None or time.monotonic() - restart_t < spec["after_restart_s"]:
        i += 1
        if i == spec["kill_at"]:
            os.kill(spec["shards"][spec["victim"]]["pid"], signal.SIGKILL)
        if i == spec["restart_at"]:
            r = spec["restart"]
            restarted = subprocess.Popen(r["argv"], env=r["env"], cwd=r["cwd"], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while subprocess.run(r["probe"], env=r["env"], capture_output=True).returncode != 0:
                assert time.monotonic() < deadline, "restarted shard never became ready"
                time.sleep(0.05)
            restart_t = time.monotonic()
        if restart_t is not None:
            time.sleep(spec["pace_s"])
        prompt = i % prompts
        t0 = time.monotonic()
        hit = 0
        while hit < chunks and ranks[hit % shards][0].contains(key(prompt, hit)):
            hit += 1
        lookup_s = time.monotonic() - t0
        put_failures = 0
        for c in range(hit, chunks):
            backend, local, loop = ranks[c % shards]
            obj = local.allocate(torch.Size(KV_SHAPE), torch.bfloat16)
            try:
                asyncio.run_coroutine_threadsafe(backend.connection.put(key(prompt, c), obj), loop).result(10)
            except Exception:  # noqa: BLE001 - a write to the dead shard fails; the replay goes on
                put_failures += 1
            finally:
                obj.ref_count_down()
        records.append({"i": i, "t": t0 - start, "hit": hit, "lookup_s": lookup_s,
                        "ttft_s": lookup_s + (chunks - hit) * RECOMPUTE_S_PER_CHUNK, "put_failures": put_failures})
    return {"records": records, "restarted_pid": restarted.pid if restarted else None}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = main(json.load(f))
    print(json.dumps(result), flush=True)
    os._exit(0)  # the backends' loop and worker threads would hold the interpreter
