"""Proof of 0006-remote-url-rank-template.patch.

``{rank}`` in ``remote_url`` selects a per-rank remote instance
(``resp://valkey-lmcache-{rank}.svc:6379``): the worker's rank
(``metadata.worker_id``) is substituted before the URL is parsed, for every
remote connector, and the health check (its name and its reconnects) uses the
resolved URL. Any other ``{field}`` is a configuration error that names the
field and the URL.

The tests build a real ``RemoteBackend``; what the RESP connector is asked
to connect to is observed by replacing the native ``RESPClient`` with a
recorder, and, in the last test, by a real Valkey server on 127.0.0.1
reached through ``resp://127.0.0.{rank}:PORT`` from rank 1.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable
from unittest import mock

import pytest
import torch

from lmcache.utils import CacheEngineKey

from tests.support.background_loop import loop  # noqa: F401 - pytest fixture
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.health_monitor.checks.remote_backend_check import RemoteBackendHealthCheck
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

pytestmark = pytest.mark.lmcache

PATCH = "0006-remote-url-rank-template.patch"

WORLD_SIZE = 4
KV_SHAPE = (2, 2, 256, 1, 16)
KV_DTYPE = torch.float16
WAIT_S = 30.0


class RecordingRESPClient:
    """Stands in for the native RESP client: records where it was asked to
    connect and does nothing else."""

    created: list["RecordingRESPClient"] = []

    # The native client's signature, io_timeout_ms (0024) included: an argument
    # it does not take makes the connector fail to connect.
    def __init__(self, host, port, num_workers, loop=None, username="", password="", io_timeout_ms=0):
        self.host = host
        self.port = port
        RecordingRESPClient.created.append(self)

    def close(self) -> None:
        pass


@pytest.fixture
def recorder():
    RecordingRESPClient.created = []
    with mock.patch(
        "lmcache.v1.storage_backend.connector.redis_connector.RESPClient",
        RecordingRESPClient,
    ):
        yield RecordingRESPClient.created


def make_config(remote_url: str, **extra: Any) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=256,
        local_cpu=True,
        max_local_cpu_size=0.1,
        remote_url=remote_url,
        remote_serde="naive",
        save_unfull_chunk=False,
        blocking_timeout_secs=5,
        extra_config={"save_chunk_meta": False, "resp_num_threads": 2, **extra},
    )


def make_metadata(rank: int) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="test-model",
        world_size=WORLD_SIZE,
        local_world_size=WORLD_SIZE,
        worker_id=rank,
        local_worker_id=rank,
        kv_dtype=KV_DTYPE,
        kv_shape=KV_SHAPE,
    )


def make_backend(loop, remote_url: str, rank: int, **extra: Any) -> RemoteBackend:
    config = make_config(remote_url, **extra)
    metadata = make_metadata(rank)
    local_cpu = LocalCPUBackend(config, metadata, memory_allocator=AdHocMemoryAllocator())
    return RemoteBackend(config=config, metadata=metadata, loop=loop, local_cpu_backend=local_cpu)


@pytest.mark.fixes(PATCH, fails_with=r"no connector was created for the template URL")
def test_rank_template_resolves_before_parsing(loop, recorder):
    backend = make_backend(loop, "resp://h-{rank}:700{rank}", rank=3)

    assert backend.connection is not None, "no connector was created for the template URL"
    assert [(c.host, c.port) for c in recorder] == [("h-3", 7003)]
    assert backend.remote_url == "resp://h-3:7003"


def test_url_without_rank_is_unchanged(loop, recorder):
    backend = make_backend(loop, "resp://cache.example.svc:6379", rank=3)

    assert [(c.host, c.port) for c in recorder] == [("cache.example.svc", 6379)]
    assert backend.remote_url == "resp://cache.example.svc:6379"


@pytest.mark.fixes(PATCH, fails_with=r"DID NOT RAISE <class 'ValueError'>")
def test_unknown_template_field_is_a_config_error(loop, recorder):
    url = "resp://{host}-{rank}:6379"
    with pytest.raises(ValueError) as excinfo:
        make_backend(loop, url, rank=3)

    message = str(excinfo.value)
    assert "{host}" in message, message
    assert url in message, message
    assert recorder == [], "a connector was created for an invalid template"


@pytest.mark.fixes(PATCH, fails_with=r"RemoteBackendHealthCheck\(resp://h-\{rank\}")
def test_health_check_uses_resolved_url(loop, recorder):
    backend = make_backend(loop, "resp://h-{rank}:700{rank}", rank=3)
    check = RemoteBackendHealthCheck(backend)

    assert check.name() == "RemoteBackendHealthCheck(resp://h-3:7003)"

    # The connection is lost; the health check re-establishes it.
    backend.connection = None
    backend.failure_time = -1e9
    check.check()

    assert backend.connection is not None, "the health check did not reconnect"
    assert [(c.host, c.port) for c in recorder][-1] == ("h-3", 7003)


def _wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _bounded(fn: Callable[[], Any], timeout: float = WAIT_S) -> None:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(timeout)


async def _close_client(client) -> None:
    client.close()


@pytest.mark.fixes(PATCH, fails_with=r"resp://127\.0\.0\.\{rank\}:\d+")
def test_rank_template_reaches_the_rank_instance(valkey, loop):
    """Rank 1 of resp://127.0.0.{rank}:PORT stores into the real server at
    127.0.0.1:PORT, and the health check's put+get recovery probe passes
    against it."""
    url = f"resp://127.0.0.{{rank}}:{valkey.port}"
    backend = make_backend(loop, url, rank=1, ping_timeout=5.0, waiting_time_for_recovery=0.0)
    assert backend.local_cpu_backend is not None
    try:
        assert backend.remote_url == valkey.url

        key = CacheEngineKey(
            model_name="test-model",
            world_size=WORLD_SIZE,
            worker_id=1,
            chunk_hash=0xABCD,
            dtype=KV_DTYPE,
        )
        metadata = make_metadata(1)
        obj = backend.local_cpu_backend.allocate(metadata.get_shapes(), metadata.get_dtypes())
        assert obj is not None
        backend.batched_submit_put_task([key], [obj])
        server = valkey.client()
        assert _wait_until(lambda: server.exists(key.to_string()) == 1), (
            f"{key.to_string()} never reached the Valkey server behind {url}"
        )
        obj.ref_count_down()

        # After a failure window the health check probes with a put and a get
        # through the backend's connection.
        check = RemoteBackendHealthCheck(backend)
        check.failure_time = time.time() - 1.0
        assert check.check() is True
        assert check.failure_time is None
    finally:
        valkey.stop()
        if backend.connection is not None:
            resp = backend.connection.getWrappedConnector()
            _bounded(
                lambda: asyncio.run_coroutine_threadsafe(_close_client(resp.client), loop).result(
                    WAIT_S
                )
            )
