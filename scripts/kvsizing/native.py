"""A short, bounded GET-bandwidth measurement of one Valkey instance through LMCache's native client.

Production reads Valkey through LMCache's C++ RESP client
(``lmcache.lmcache_redis.LMCacheRedisClient``, ``resp_num_threads`` = 32
worker connections per worker process, configs/prefill/lmcache.yaml). This
drives the same client the way ``lmcache bench l2`` does (LMCache's L2
adapter over it, the bench's own key and buffer helpers), with three
differences that matter on a production shard: the keys carry a unique
model name, they are deleted afterwards, and the client's CPU time is taken
over the loads only, so a client-bound result is recognisable.

It writes chunk_bytes x keys into the instance (32 x 12.2 MB = 391 MB by
default); on a shard under LRU pressure that evicts as much real cache.
It needs LMCache (with its C++ extension) and torch in this interpreter.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
import uuid

from .measure import (
    PRODUCTION_CONNECTIONS,
    ClientMissing,
    Measurement,
    MeasureError,
    check_bounds,
    client_bound,
    parse_resp_url,
    percentile,
    usable_cores,
)

NEEDS = ("LMCache 0.5.5 with its C++ RESP client (lmcache.lmcache_redis, the distribution's build) and torch, "
         "importable by this Python: the serving image's")


def _import_lmcache():
    try:
        import torch  # noqa: F401
        from lmcache.cli.commands.bench.l2_adapter_bench.data import (
            create_l1_memory_desc,
            make_aligned_tensor,
            make_memory_objects,
            make_object_keys,
            wait_eventfd,
        )
        from lmcache.lmcache_redis import LMCacheRedisClient  # noqa: F401  the native client itself
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
    except ImportError as e:
        raise ClientMissing(f"--measure-client lmcache needs {NEEDS}; this one cannot import it ({e}): run "
                            "kv-sizing with the serving image's python, or use --measure-client valkey-py") from None
    return (create_l1_memory_desc, make_aligned_tensor, make_memory_objects, make_object_keys, wait_eventfd,
            create_l2_adapter, parse_args_to_l2_adapters_config)


def _wait(adapter, task_id: int, fd: int, query, wait_eventfd, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        result = query(task_id)
        if result is not None:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            raise MeasureError(f"{what} did not finish within {timeout:g} s")
        wait_eventfd(fd, timeout=min(left, 1.0))


def measure(url: str, chunk_bytes: int, keys: int = PRODUCTION_CONNECTIONS,
            connections: int = PRODUCTION_CONNECTIONS, seconds: float = 2.0, max_gets: int = 400,
            timeout: float = 30.0) -> Measurement:
    """GET bandwidth of one instance with values of chunk_bytes; bounded in time and count."""
    target = parse_resp_url(url)
    check_bounds(chunk_bytes=chunk_bytes, keys=keys, connections=connections, seconds=seconds, max_gets=max_gets)
    chunk_bytes, keys, connections, max_gets = int(chunk_bytes), int(keys), int(connections), int(max_gets)
    (l1_desc, aligned, memory_objects, object_keys, wait_eventfd, create_adapter,
     parse_config) = _import_lmcache()

    # The native client does not fail on a refused connection, its requests wait: probe first.
    try:
        socket.create_connection((target.host, target.port), timeout=timeout).close()
    except OSError as e:
        raise MeasureError(f"cannot connect to {target.host}:{target.port}: {e}") from None
    spec = {"type": "resp", "host": target.host, "port": target.port, "num_workers": connections,
            "username": target.username, "password": target.password}
    config = parse_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    buffer = aligned(2 * keys * chunk_bytes)
    try:
        adapter = create_adapter(config, l1_memory_desc=l1_desc(buffer))
    except Exception as e:  # the native client's connection errors
        raise MeasureError(f"cannot connect to {target.host}:{target.port}: {e}") from None
    names = object_keys(keys, model_name=f"kv-sizing-bench-{uuid.uuid4().hex}")
    stored = False
    try:
        sources = memory_objects(buffer, keys, chunk_bytes, 0)
        sinks = memory_objects(buffer, keys, chunk_bytes, keys * chunk_bytes, fill_offset=1)
        task = adapter.submit_store_task(names, sources)
        stored = True

        def store_result(task_id):
            done = adapter.pop_completed_store_tasks()
            return done.get(task_id) if done else None

        result = _wait(adapter, task, adapter.get_store_event_fd(), store_result, wait_eventfd, timeout,
                       f"storing {keys} values of {chunk_bytes} bytes")
        if int(result) < 0:  # an L2StoreResult: -1 is a failed store
            raise MeasureError(f"{target.host}:{target.port} refused the benchmark's SETs")

        rounds: list[float] = []
        gets = 0
        cpu0, start = time.process_time(), time.perf_counter()
        deadline = start + seconds
        while time.perf_counter() < deadline and gets + keys <= max(max_gets, keys):
            t0 = time.perf_counter()
            task = adapter.submit_load_task(names, sinks)
            bitmap = _wait(adapter, task, adapter.get_load_event_fd(), adapter.query_load_result, wait_eventfd,
                           timeout, f"a round of {keys} GETs")
            rounds.append(time.perf_counter() - t0)
            loaded = bitmap.popcount()
            if loaded != keys:
                raise MeasureError(f"{keys - loaded} of {keys} benchmark keys vanished during the measurement "
                                   f"(evicted? maxmemory too small for {keys} x {chunk_bytes} bytes)")
            gets += keys
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu0
    finally:
        try:
            if stored:
                adapter.delete(names)
        finally:
            adapter.close()
    ordered = sorted(rounds)
    cores = usable_cores()
    bandwidth = gets * chunk_bytes / elapsed
    return Measurement(
        url=url, client=f"LMCache native RESP client (lmcache_redis), {connections} workers",
        chunk_bytes=chunk_bytes, keys=keys, connections=connections, gets=gets, bytes=gets * chunk_bytes,
        seconds=elapsed, bandwidth=bandwidth, ms_per_get=chunk_bytes / bandwidth * 1e3,
        get_p50_ms=None, get_p99_ms=None,
        round_p50_ms=statistics.median(ordered) * 1e3, round_p99_ms=percentile(ordered, 0.99) * 1e3,
        server_usec_per_get=None, client_cpu_seconds=cpu, client_cpu_cores=cpu / elapsed, usable_cores=cores,
        client_processes=1, client_bound=client_bound(cpu / elapsed, cores),
    )
