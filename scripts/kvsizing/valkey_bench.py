"""GET bandwidth of one Valkey instance with chunk-sized values, through valkey-py (the ops environment).

It writes ``keys`` values of ``chunk_bytes`` under a unique prefix, opens
``connections`` connections (a rank's 32 by default), and on each one GETs
the values in turn, one GET in flight per connection, for ``seconds`` or
``max_gets`` GETs in all; then it deletes the values. b is the bytes
delivered per second of wall time; the time per GET is reported both as
the instance's (chunk_bytes / b) and as each connection saw it.

valkey-py parses replies in Python, which holds the GIL while it copies a
12 MB value (several times), so the reading of one process is bound to one
core: the connections are spread over one worker process per usable core
(threads within each), and a run whose processes were busy on the cores
they had is flagged client-bound (b is then a lower bound of the instance's).

On a shard under LRU pressure the values evict as much real cache
(32 x 12.2 MB = 391 MB by default).
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from .measure import (
    PRODUCTION_CONNECTIONS,
    ClientMissing,
    Measurement,
    MeasureError,
    Target,
    check_bounds,
    client_bound,
    parse_resp_url,
    percentile,
    usable_cores,
)

READ_BYTES = 1 << 20  # recv size: fewer system calls per 12 MB reply than valkey-py's 64 KiB default
START_TIMEOUT_S = 60.0  # worker processes connecting
KEY_PREFIX = "kv-sizing-bench"


def _import_valkey() -> Any:
    try:
        import valkey
    except ImportError as e:
        raise ClientMissing(f"--measure needs the Python package valkey ({e}); install scripts/requirements.txt"
                            ) from None
    return valkey


def _client(target: Target, timeout_s: float) -> Any:
    valkey = _import_valkey()
    pool = valkey.ConnectionPool(host=target.host, port=target.port, username=target.username or None,
                                 password=target.password or None, socket_timeout=timeout_s,
                                 socket_connect_timeout=timeout_s, socket_read_size=READ_BYTES)
    return valkey.Valkey(connection_pool=pool, single_connection_client=True)


@dataclass(frozen=True)
class WorkerPlan:
    """One worker process's share of the connections and of the GETs."""

    target: Target
    names: Tuple[str, ...]
    chunk_bytes: int
    connections: int
    first_connection: int  # its connections' index among all, so that they start on different keys
    max_gets: int
    seconds: float
    timeout_s: float


@dataclass
class WorkerResult:
    latencies_s: List[float] = field(default_factory=list)
    last_end: float = 0.0  # time.monotonic(), the same clock in every process
    cpu_seconds: float = 0.0
    error: str = ""


def _read_values(plan: WorkerPlan, clients: List[Any]) -> WorkerResult:
    result = WorkerResult()
    lock = threading.Lock()
    left = [plan.max_gets]
    failed = threading.Event()
    deadline = time.monotonic() + plan.seconds

    def take_turn() -> bool:
        with lock:
            if left[0] <= 0 or failed.is_set() or time.monotonic() >= deadline:
                return False
            left[0] -= 1
            return True

    def connection(index: int, client: Any) -> None:
        key = index
        while take_turn():
            name = plan.names[key % len(plan.names)]
            key += 1
            started = time.monotonic()
            try:
                value = client.get(name)
            except Exception as e:  # the client's connection and protocol errors
                message = f"GET {name}: {type(e).__name__}: {e}"
            else:
                ended = time.monotonic()
                if value is not None and len(value) == plan.chunk_bytes:
                    with lock:
                        result.latencies_s.append(ended - started)
                        result.last_end = max(result.last_end, ended)
                    continue
                message = (f"benchmark key {name} vanished during the measurement (evicted? maxmemory too small "
                           f"for {len(plan.names)} x {plan.chunk_bytes} bytes)" if value is None
                           else f"GET {name} returned {len(value)} bytes, not {plan.chunk_bytes}")
            with lock:
                result.error = result.error or message
            failed.set()

    cpu = time.process_time()
    threads = [threading.Thread(target=connection, args=(plan.first_connection + i, c), daemon=True)
               for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.cpu_seconds = time.process_time() - cpu
    return result


def _worker_process(plan: WorkerPlan, start: Any, abort: Any, results: Any) -> None:
    """In a worker process: connect, say ready, wait for the start (or the abort), GET, report."""
    clients: List[Any] = []
    try:
        for _ in range(plan.connections):
            clients.append(_client(plan.target, plan.timeout_s))
            clients[-1].ping()
    except Exception as e:
        results.put(("error", f"{type(e).__name__}: {e}"))
        return
    results.put(("ready", None))
    if not start.wait(START_TIMEOUT_S) or abort.is_set():
        return
    try:
        results.put(("done", _read_values(plan, clients)))
    finally:
        for client in clients:
            client.close()


def _split(total: int, parts: int) -> List[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _plans(target: Target, names: Tuple[str, ...], chunk_bytes: int, connections: int, max_gets: int,
           seconds: float, timeout_s: float, processes: int) -> List[WorkerPlan]:
    plans, first = [], 0
    for share, gets in zip(_split(connections, processes), _split(max_gets, processes)):
        plans.append(WorkerPlan(target, names, chunk_bytes, share, first, gets, seconds, timeout_s))
        first += share
    return plans


def _next(results: Any, timeout_s: float, what: str) -> Tuple[str, Any]:
    try:
        return results.get(timeout=timeout_s)
    except queue.Empty:
        raise MeasureError(f"{what} did not finish within {timeout_s:g} s") from None


def _run_workers(plans: List[WorkerPlan], seconds: float, timeout_s: float) -> Tuple[List[WorkerResult], float]:
    """Start the worker processes, start their GETs together; (their results, the start time)."""
    # fork, not spawn: a spawned child re-runs the parent's __main__, and scripts/kv-sizing is one
    context = multiprocessing.get_context("fork")
    start, abort = context.Event(), context.Event()
    results = context.Queue()
    workers = [context.Process(target=_worker_process, args=(plan, start, abort, results), daemon=True)
               for plan in plans]
    for worker in workers:
        worker.start()
    finished = False
    try:
        for _ in workers:
            kind, payload = _next(results, START_TIMEOUT_S, "connecting the benchmark's connections")
            if kind == "error":
                raise MeasureError(f"cannot open the benchmark's connections: {payload}")
        began = time.monotonic()
        start.set()
        done: List[WorkerResult] = []
        for _ in workers:
            kind, payload = _next(results, seconds + 2 * timeout_s, "the GETs")
            if kind == "error":
                raise MeasureError(payload)
            done.append(payload)
        finished = True
        return done, began
    finally:
        if not finished:
            abort.set()
        start.set()
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.terminate()
                worker.join()


def _get_stats(admin: Any) -> Optional[Tuple[int, int]]:
    """(calls, usec) of GET on the instance, or None where INFO is not allowed."""
    try:
        stats = admin.info("commandstats").get("cmdstat_get", {})
    except Exception:
        return None
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def _store(admin: Any, names: Tuple[str, ...], chunk_bytes: int, where: str) -> None:
    value = os.urandom(chunk_bytes)
    for name in names:
        try:
            admin.set(name, value)
        except Exception as e:
            raise MeasureError(f"{where} refused the benchmark's SET of {chunk_bytes} bytes: {e}") from None


def _delete(admin: Any, names: Tuple[str, ...]) -> None:
    try:
        admin.unlink(*names)
    except Exception:
        pass  # the instance went away: the error that ended the measurement says so
    finally:
        admin.close()


def measure(url: str, chunk_bytes: int, keys: int = PRODUCTION_CONNECTIONS,
            connections: int = PRODUCTION_CONNECTIONS, seconds: float = 2.0, max_gets: int = 400,
            timeout: float = 30.0) -> Measurement:
    """GET bandwidth of one instance with values of chunk_bytes over ``connections`` connections."""
    target = parse_resp_url(url)
    check_bounds(chunk_bytes=chunk_bytes, keys=keys, connections=connections, seconds=seconds, max_gets=max_gets)
    chunk_bytes, keys, connections, max_gets = int(chunk_bytes), int(keys), int(connections), int(max_gets)
    where = f"{target.host}:{target.port}"
    try:
        admin = _client(target, timeout)  # a single-connection client connects here
        admin.ping()
    except ClientMissing:
        raise
    except Exception as e:
        raise MeasureError(f"cannot connect to {where}: {e}") from None
    names = tuple(f"{KEY_PREFIX}-{uuid.uuid4().hex}:{i}" for i in range(keys))
    cores = usable_cores()
    processes = max(1, min(connections, cores))
    try:
        _store(admin, names, chunk_bytes, where)
        before = _get_stats(admin)
        plans = _plans(target, names, chunk_bytes, connections, max_gets, seconds, timeout, processes)
        results, began = _run_workers(plans, seconds, timeout)
        after = _get_stats(admin)
    finally:
        _delete(admin, names)
    errors = [r.error for r in results if r.error]
    if errors:
        raise MeasureError(errors[0])
    latencies = sorted(t for r in results for t in r.latencies_s)
    gets = len(latencies)
    if not gets:
        raise MeasureError(f"no GET of {chunk_bytes} bytes finished within {seconds:g} s")
    elapsed = max(r.last_end for r in results) - began
    cpu = sum(r.cpu_seconds for r in results)
    server = None
    if before is not None and after is not None and after[0] > before[0]:
        server = (after[1] - before[1]) / (after[0] - before[0])
    bandwidth = gets * chunk_bytes / elapsed
    return Measurement(
        url=url, client=f"valkey-py {_import_valkey().__version__}, {connections} connection(s) in {processes} "
                        f"process(es)",
        chunk_bytes=chunk_bytes, keys=keys, connections=connections, gets=gets, bytes=gets * chunk_bytes,
        seconds=elapsed, bandwidth=bandwidth, ms_per_get=chunk_bytes / bandwidth * 1e3,
        get_p50_ms=percentile(latencies, 0.5) * 1e3, get_p99_ms=percentile(latencies, 0.99) * 1e3,
        round_p50_ms=None, round_p99_ms=None, server_usec_per_get=server,
        client_cpu_seconds=cpu, client_cpu_cores=cpu / elapsed, usable_cores=cores, client_processes=processes,
        client_bound=client_bound(cpu / elapsed, processes),
    )
