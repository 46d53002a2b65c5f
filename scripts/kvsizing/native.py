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
import os
import socket
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from urllib.parse import unquote, urlsplit

LIMITS = {"seconds": 60.0, "connections": 256, "keys": 256, "max_gets": 100_000, "chunk_bytes": 512 * 1024 * 1024}
PRODUCTION_CONNECTIONS = 32  # resp_num_threads in configs/prefill/lmcache.yaml
CLIENT_BOUND_SHARE = 0.8  # client CPU at this share of the usable cores: the client, not Valkey, is the limit


class MeasureError(RuntimeError):
    """The measurement could not run or could not finish."""


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    username: str
    password: str


def parse_resp_url(url: str) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in ("resp", "redis", "valkey") or not parts.hostname:
        raise ValueError(f"{url!r}: expected resp://HOST:PORT")
    if "{" in url:
        raise ValueError(f"{url!r}: a template; give one instance's URL (e.g. rank 0's shard)")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"{url!r}: bad port") from None
    return Target(parts.hostname, port, unquote(parts.username or ""), unquote(parts.password or ""))


@dataclass
class Measurement:
    url: str
    client: str
    chunk_bytes: int
    keys: int
    connections: int
    gets: int
    bytes: int
    seconds: float  # wall time of the loads
    bandwidth: float  # bytes/s
    round_p50_ms: float  # one round = every key GET once, all in flight
    round_p99_ms: float
    client_cpu_seconds: float  # the whole client process (its C++ workers included), over the loads
    client_cpu_cores: float  # client_cpu_seconds / seconds
    usable_cores: int
    client_bound: bool

    def as_dict(self) -> dict:
        return asdict(self)


def _bounded(name: str, value, low) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= LIMITS[name]):
        raise ValueError(f"{name}: expected {low}..{LIMITS[name]}, got {value!r}")


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
        raise MeasureError(f"--measure drives LMCache's native RESP client, which this interpreter cannot import "
                           f"({e}); run kv-sizing with the serving image's python (or one with LMCache 0.5.5)"
                           ) from None
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
    _bounded("chunk_bytes", chunk_bytes, 1)
    _bounded("keys", keys, 1)
    _bounded("connections", connections, 1)
    _bounded("seconds", seconds, 0.05)
    _bounded("max_gets", max_gets, 1)
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
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = cpu / elapsed
    return Measurement(
        url=url, client=f"LMCache native RESP client (lmcache_redis), {connections} workers",
        chunk_bytes=chunk_bytes, keys=keys, connections=connections, gets=gets, bytes=gets * chunk_bytes,
        seconds=elapsed, bandwidth=gets * chunk_bytes / elapsed, round_p50_ms=statistics.median(ordered) * 1e3,
        round_p99_ms=ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3,
        client_cpu_seconds=cpu, client_cpu_cores=cores, usable_cores=usable,
        client_bound=cores >= CLIENT_BOUND_SHARE * usable,
    )

