"""Proof of 0018-resp-connector-close-without-waiting-on-its-own-loop.patch
for the local disk backend's executor (AsyncPQThreadPoolExecutor).

``LocalDiskBackend.close()`` shuts its disk worker's executor down with
``shutdown(wait=True)``. Before the patch that executor had its own copy of
the worker loop and shutdown that 0018 fixed in AsyncPQExecutor: a worker
setting the result of a job whose caller had stopped waiting (a cancelled
prefetch) raised and died, so its shutdown sentinel was never taken and
``queue.join()`` never returned: close() hangs, and so does the engine's
shutdown with a disk tier.

Real parts: LocalDiskBackend over a LocalCPUBackend, a chunk written to a
real disk directory, its real prefetch (``batched_get_non_blocking``) on an
event loop thread as the storage manager runs it. The one stand-in forces
the interleaving: a job that holds the only disk worker (a slow disk write)
while the prefetch is queued behind it and its caller is cancelled (as
``asyncio.wait_for`` cancels it). close() runs in a daemon thread with a
bound, so a hang fails the test instead of the run.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.lmcache.test_0018_resp_close import CLOSE_BOUND_S, HANG, PATCH, unblock

pytestmark = pytest.mark.lmcache

CHUNK_TOKENS = 16
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 8)
CHUNK_BYTES = 2048


class DiskEnv:
    """A LocalDiskBackend with one disk worker, on its own event loop thread."""

    def __init__(self, disk_dir):
        import torch

        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.pin_monitor import PinMonitor
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="backend-loop", daemon=True)
        self.thread.start()
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS,
            local_cpu=False,
            max_local_cpu_size=0.1,
            local_disk=str(disk_dir),
            max_local_disk_size=0.01,
            extra_config={"disk_io_threads": 1},
        )
        metadata = LMCacheMetadata(
            model_name="dist-test",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=KV_SHAPE,
            use_mla=False,
            chunk_size=CHUNK_TOKENS,
        )
        PinMonitor.GetOrCreate(config)  # the cache engine creates it; prefetches pin
        self.allocator = PinMemoryAllocator(64 * CHUNK_BYTES)
        self.local = LocalCPUBackend(config, metadata, memory_allocator=self.allocator)
        self.backend = LocalDiskBackend(config, self.loop, self.local, dst_device="cpu", metadata=metadata)
        assert self.backend.disk_worker.executor.max_workers == 1

    def key(self, i: int):
        import torch

        from lmcache.utils import CacheEngineKey

        return CacheEngineKey("dist-test", 1, 0, 2000 + i, torch.bfloat16)

    def write_chunk(self, i: int) -> None:
        import torch

        obj = self.local.allocate(torch.Size(KV_SHAPE), torch.bfloat16)
        assert obj is not None
        obj.tensor.fill_(i)
        self.backend.submit_put_task(self.key(i), obj)
        obj.ref_count_down()
        deadline = time.monotonic() + 10.0
        while not self.backend.contains(self.key(i)) or self.backend.exists_in_put_tasks(self.key(i)):
            assert time.monotonic() < deadline, "the chunk never reached the disk"
            time.sleep(0.02)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_BOUND_S)


@pytest.fixture
def disk_env(tmp_path):
    env = DiskEnv(tmp_path / "disk")
    yield env
    env.stop()


def close_bounded(close, loop_thread: threading.Thread) -> None:
    outcome: dict = {}

    def target():
        try:
            close()
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    closer = threading.Thread(target=target, name="closer", daemon=True)
    closer.start()
    closer.join(CLOSE_BOUND_S)
    if closer.is_alive():
        unblock(loop_thread)
        pytest.fail(f"LocalDiskBackend close() did not return within {CLOSE_BOUND_S} s "
                    "(after a prefetch whose caller was cancelled)")
    if "error" in outcome:
        raise outcome["error"]


@pytest.mark.fixes(PATCH, fails_with=HANG)
def test_disk_backend_close_returns_after_a_cancelled_prefetch(disk_env):
    env = disk_env
    env.write_chunk(0)
    assert env.backend.contains(env.key(0), pin=True)

    # the only disk worker is busy (a slow write) ...
    hold, held = threading.Event(), threading.Event()

    def slow_disk_job():
        held.set()
        hold.wait(CLOSE_BOUND_S * 4)

    busy = env.submit(env.backend.disk_worker.submit_task("put", slow_disk_job))
    assert held.wait(5.0), "the disk worker never started the first job"

    # ... while the real prefetch is queued behind it, and its caller stops waiting
    prefetch = env.submit(env.backend.batched_get_non_blocking("lookup-0", [env.key(0)]))
    deadline = time.monotonic() + 5.0
    while env.backend.disk_worker.executor._queue.qsize() < 1:
        assert not prefetch.done(), f"the prefetch ended before it was queued: {prefetch.exception()!r}"
        assert time.monotonic() < deadline, "the prefetch was never queued"
        time.sleep(0.01)
    prefetch.cancel()
    hold.set()
    busy.result(5.0)
    time.sleep(0.3)  # the worker runs the abandoned prefetch

    close_bounded(env.backend.close, env.thread)
