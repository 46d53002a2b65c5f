"""The scheduler's and worker 0's halves of LMCache's async lookup, real and
wired as vLLM wires them with async loading (the prefill preset): an
LMCacheEngine with its RESP remote backend on a real Valkey, the
LMCacheAsyncLookupServer on that engine, the LMCacheAsyncLookupClient of the
scheduler, over ZMQ."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.support.pcp_ranks import CHUNK_SIZE, make_kv_connector, mla_metadata


@dataclass
class AsyncLookup:
    engine: object
    server: object
    client: object
    scheduler_metadata: object
    tokens: list[int]
    keys: list

    def fresh_pod(self) -> None:
        """Nothing of the prompt in L1: the next lookup reaches Valkey."""
        l1 = self.engine.storage_manager.storage_backends["LocalCPUBackend"]
        for key in self.keys:
            l1.remove(key)


def stop_receiving(listener, wake) -> None:
    """Stop an async lookup client's or server's receive thread before its
    close(): closing a socket another thread blocks in recv() on can leave the
    context's term() waiting forever, so the thread is woken and joined."""
    listener.running = False
    wake()
    listener.thread.join(timeout=5)
    assert not listener.thread.is_alive(), f"{type(listener).__name__}'s receive thread did not stop"


@contextmanager
def async_lookup(valkey, config, name: str) -> Iterator[AsyncLookup]:
    """Server and client on ``config`` (async loading), with a two-chunk prompt
    stored in Valkey."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.lookup_client.factory import LookupClientFactory
    from lmcache.v1.lookup_client.lmcache_async_lookup_client import (
        LMCacheAsyncLookupClient,
        LMCacheAsyncLookupServer,
    )
    from tests.lmcache.test_0003_resp_per_key_results import close_remote_connection

    config.enable_async_loading = True
    engine_id = f"{name}-{os.getpid()}-{id(valkey)}"
    metadata = mla_metadata(name, 1, 0)
    metadata.engine_id = engine_id  # names the ZMQ sockets
    scheduler_metadata = mla_metadata(name, 1, 0)
    scheduler_metadata.engine_id = engine_id
    scheduler_metadata.role = "scheduler"

    instance_id = f"{name}-{id(valkey)}"
    kv = make_kv_connector(256)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id, config, metadata, kv, lambda t, src: t, lambda o, src: o
    )
    server = client = None
    try:
        server = LookupClientFactory.create_lookup_server(engine, metadata)
        assert isinstance(server, LMCacheAsyncLookupServer)
        engine.post_init(async_lookup_server=server)
        client = LookupClientFactory.create_lookup_client(config, scheduler_metadata)
        assert isinstance(client, LMCacheAsyncLookupClient)

        remote = engine.storage_manager.storage_backends["RemoteBackend"]
        tokens = [(17 * i + 5) % 30011 for i in range(2 * CHUNK_SIZE)]
        kv.fill(7, len(tokens))
        engine.store(tokens)
        keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
        deadline = time.monotonic() + 10.0
        while not all(remote.contains(key) for key in keys):
            assert time.monotonic() < deadline, "the chunks never reached Valkey"
            time.sleep(0.05)
        yield AsyncLookup(engine, server, client, scheduler_metadata, tokens, keys)
    finally:
        _close(engine, server, client, engine_id)
        close_remote_connection(engine.storage_manager.storage_backends.get("RemoteBackend")
                                if engine.storage_manager is not None else None)
        LMCacheEngineBuilder.destroy(instance_id)


def _close(engine, server, client, engine_id: str) -> None:
    import msgspec
    import zmq

    from lmcache.v1.lookup_client.async_lookup_message import LookupResponseMsg
    from lmcache.v1.rpc_utils import get_zmq_context, get_zmq_rpc_path_lmcache, get_zmq_socket

    if server is not None and client is not None:
        stop_receiving(server, lambda: client._send_cleanup_message("close"))
        server.close()
    if client is not None:
        # the client's context is pyzmq's shared instance: term() in its
        # close() waits for this socket too, so it is closed first
        wake = get_zmq_socket(get_zmq_context(use_asyncio=False),
                              get_zmq_rpc_path_lmcache(engine_id, "lookup_scheduler", 0, 0),
                              "ipc", zmq.PUSH, "connect")
        try:
            stop_receiving(client, lambda: wake.send(msgspec.msgpack.encode(
                LookupResponseMsg(lookup_id="close", num_hit_tokens=0))))
        finally:
            wake.close(linger=0)
        client.close()
