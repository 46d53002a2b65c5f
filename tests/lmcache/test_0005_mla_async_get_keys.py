"""Proof of 0005-remote-backend-worker0-keys-in-async-get.patch.

Under MLA with more than one worker, ``remote_enable_mla_worker_id_as0``
(on by default) makes only worker 0 write to the remote store; every other
rank reads worker 0's copy by renaming its keys to worker 0 before it talks
to the connector. The pristine ``RemoteBackend.batched_get_non_blocking``
(the async-loading GET) skips that rename, so rank 2 finds its chunks through
the async lookup and then asks for keys that were never written.

Both tests use a rank-2 ``RemoteBackend`` (MLA, world size 4):

* with a recording connector: the keys the connector receives are worker 0's,
  and the objects come back in the caller's key order (the storage manager
  pairs them with the rank's own keys by position); a layerwise key keeps its
  layer id through the rename (as upstream PR #5225 does it,
  https://github.com/LMCache/LMCache/pull/5225);
* with a real Valkey server holding only worker 0's chunks, through the real
  native RESP client: the async GET loads them, byte for byte.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

import pytest
import torch

from lmcache.utils import CacheEngineKey, LayerCacheEngineKey

from tests.support.background_loop import loop  # noqa: F401 - pytest fixture
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

pytestmark = pytest.mark.lmcache

PATCH = "0005-remote-backend-worker0-keys-in-async-get.patch"

MODEL = "test-model"
WORLD_SIZE = 4
RANK = 2
# MLA: (num_layers, 1, chunk_size, 1, head_size), small enough for tests.
KV_SHAPE = (2, 1, 256, 1, 32)
KV_DTYPE = torch.float16
HASHES = [0x1111, 0x2222, 0x3333]
# Bounds every wait on the backend; the pristine RESP client blocks on a GET
# of a missing key until blocking_timeout_secs.
BLOCKING_TIMEOUT_S = 5
WAIT_S = 30.0


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float = WAIT_S) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def bounded(fn: Callable[[], Any], timeout: float = WAIT_S) -> None:
    """Run a teardown step in a daemon thread so it can never hang pytest."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(timeout)


def make_config(remote_url: str) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=256,
        local_cpu=True,
        max_local_cpu_size=0.1,
        remote_url=remote_url,
        remote_serde="naive",
        save_unfull_chunk=False,
        blocking_timeout_secs=BLOCKING_TIMEOUT_S,
        extra_config={
            "save_chunk_meta": False,
            "resp_num_threads": 2,
            "remote_enable_mla_worker_id_as0": True,
        },
    )


def make_metadata(worker_id: int) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=WORLD_SIZE,
        local_world_size=WORLD_SIZE,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=KV_DTYPE,
        kv_shape=KV_SHAPE,
        use_mla=True,
    )


def make_key(worker_id: int, chunk_hash: int) -> CacheEngineKey:
    return CacheEngineKey(
        model_name=MODEL,
        world_size=WORLD_SIZE,
        worker_id=worker_id,
        chunk_hash=chunk_hash,
        dtype=KV_DTYPE,
    )


def make_backend(loop, remote_url: str, worker_id: int = RANK):
    config = make_config(remote_url)
    metadata = make_metadata(worker_id)
    local_cpu = LocalCPUBackend(config, metadata, memory_allocator=AdHocMemoryAllocator())
    backend = RemoteBackend(
        config=config, metadata=metadata, loop=loop, local_cpu_backend=local_cpu
    )
    return backend, local_cpu


class RecordingConnector:
    """Records the keys of each non-blocking GET and serves only the chunks
    it holds (worker 0's), each tagged with its chunk hash."""

    def __init__(self, stored: dict[CacheEngineKey, Any]):
        self.stored = stored
        self.get_keys: list[list[CacheEngineKey]] = []

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id, keys, pin=False) -> int:
        hits = 0
        for key in keys:
            if key not in self.stored:
                break
            hits += 1
        return hits

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id, keys):
        self.get_keys.append(list(keys))
        objs = []
        for key in keys:
            if key not in self.stored:
                break
            objs.append(self.stored[key])
        return objs

    async def close(self) -> None:
        pass


@pytest.mark.fixes(PATCH, fails_with=r"async GET asked the remote for worker 2's keys")
def test_rank2_async_get_sends_worker0_keys(loop):
    # blackhole:// gives a connection that is replaced right away.
    backend, local_cpu = make_backend(loop, "blackhole://")
    tagged = {chunk_hash: object() for chunk_hash in HASHES}
    connector = RecordingConnector({make_key(0, h): tagged[h] for h in HASHES})
    backend.connection = connector

    keys = [make_key(RANK, h) for h in HASHES]
    # The async lookup already reads worker 0's keys on both trees.
    assert run(loop, backend.batched_async_contains("req-1", keys)) == len(HASHES)

    try:
        objs = run(loop, backend.batched_get_non_blocking("req-1", keys))
    finally:
        bounded(local_cpu.close)

    asked = sorted({key.worker_id for batch in connector.get_keys for key in batch})
    assert connector.get_keys == [[make_key(0, h) for h in HASHES]], (
        f"async GET asked the remote for worker {', '.join(map(str, asked))}'s keys, not worker 0's")
    # One object per requested key, in the caller's key order.
    assert [id(o) for o in objs] == [id(tagged[h]) for h in HASHES]


@pytest.mark.fixes(PATCH, fails_with=r"async GET asked the remote for worker 2's keys")
def test_rank2_async_get_keeps_layer_ids_of_layerwise_keys(loop):
    backend, local_cpu = make_backend(loop, "blackhole://")
    layer_keys = [
        LayerCacheEngineKey(MODEL, WORLD_SIZE, worker, h, KV_DTYPE, layer_id=layer)
        for worker in (0, RANK)
        for h in HASHES
        for layer in (0, 3)
    ]
    stored = {key: object() for key in layer_keys if key.worker_id == 0}
    connector = RecordingConnector(stored)
    backend.connection = connector
    keys = [key for key in layer_keys if key.worker_id == RANK]
    try:
        objs = run(loop, backend.batched_get_non_blocking("req-3", keys))
    finally:
        bounded(local_cpu.close)

    (asked,) = connector.get_keys
    workers = sorted({key.worker_id for key in asked})
    assert workers == [0], f"async GET asked the remote for worker {', '.join(map(str, workers))}'s keys"
    lost = [key for key in asked if not isinstance(key, LayerCacheEngineKey)]
    assert not lost, f"the worker-0 rename dropped the layer id of {len(lost)} of {len(asked)} keys"
    assert [(k.chunk_hash, k.layer_id) for k in asked] == [(k.chunk_hash, k.layer_id) for k in keys]
    assert len(objs) == len(keys)


def _payload(chunk_hash: int, size: int) -> bytes:
    pattern = chunk_hash.to_bytes(4, "little")
    return (pattern * (size // len(pattern) + 1))[:size]


@pytest.mark.fixes(PATCH, fails_with=r"rank 2 loaded 0 of 3 chunks it had found")
def test_rank2_async_get_loads_worker0_chunks_from_valkey(valkey, loop):
    """A real Valkey holding only worker 0's chunks, the real native RESP
    client: rank 2's async GET must load every chunk it found."""
    backend, local_cpu = make_backend(loop, valkey.url)
    objs = []
    try:
        assert backend.connection is not None, "RemoteBackend did not connect"
        shape = make_metadata(RANK).get_shapes()[0]
        chunk_bytes = shape.numel() * torch.tensor([], dtype=KV_DTYPE).element_size()
        server = valkey.client()
        for h in HASHES:
            server.set(make_key(0, h).to_string(), _payload(h, chunk_bytes))

        keys = [make_key(RANK, h) for h in HASHES]
        assert run(loop, backend.batched_async_contains("req-2", keys)) == len(HASHES)

        objs = run(
            loop,
            backend.batched_get_non_blocking("req-2", keys),
            timeout=BLOCKING_TIMEOUT_S + WAIT_S,
        )
        assert len(objs) == len(HASHES), (
            f"rank {RANK} loaded {len(objs)} of {len(HASHES)} chunks it had found"
        )
        for h, obj in zip(HASHES, objs, strict=True):
            assert bytes(obj.byte_array) == _payload(h, chunk_bytes)
    finally:
        for obj in objs:
            obj.ref_count_down()
        # Stop the server first: on the pristine tree a native worker is still
        # blocked in a GET of a missing key, and only a closed socket frees it.
        valkey.stop()
        # Close the native client on the loop thread. Not RemoteBackend.close():
        # RESPConnector.close() runs on the loop and waits, through the sync
        # AsyncPQExecutor.shutdown(), for work scheduled on that same loop.
        if backend.connection is not None:
            resp = backend.connection.getWrappedConnector()
            bounded(lambda: run(loop, _close_client(resp.client)))
        bounded(local_cpu.close)


async def _close_client(client) -> None:
    client.close()
