"""Samples Valkey's server-side statistics from every shard, per interval.

Each sample is one ``INFO commandstats cpu stats memory clients latencystats
errorstats`` call per shard (one round trip, so the counters, CPU times and
memory are from the same instant),
taken from all shards at once. Between two samples of a shard the sampler
reports, for each of GET, SET, EXISTS and MGET (the commands LMCache's RESP
client sends: loads, stores, lookups):

``<cmd>_calls_per_s``
    commands executed per second (``cmdstat_<cmd>.calls`` delta / elapsed).
``<cmd>_usec_per_call``
    server time per command in that interval (``usec`` delta / calls delta),
    not the lifetime average Valkey prints as ``usec_per_call``.
``<cmd>_busy_pct``
    share of wall-clock time the main thread spent executing that command
    (``usec`` delta / elapsed): the write-up's "73-91% on GETs".

and for the shard:

``total_busy_pct``
    share of wall-clock time spent executing any command (every
    ``cmdstat_*`` usec, the sampler's INFO included).
``main_cpu_pct``
    CPU time of the main thread per wall-clock time, in % of one core:
    ``used_cpu_user_main_thread + used_cpu_sys_main_thread`` where the server
    reports them (Valkey 8, Redis 7), else ``used_cpu_user + used_cpu_sys`` of
    the whole process (``cpu_source`` says which).
``other_calls_per_s``
    every other command except INFO (the sampler's own) per second.
``evicted_keys``, ``keyspace_hits``, ``keyspace_misses``
    deltas of INFO stats over the interval: evictions under maxmemory, and
    the key lookups that found / did not find their key (a GET of an
    evicted chunk after its EXISTS said it was there is a miss).
``used_memory_bytes``, ``maxmemory_bytes``
    INFO memory at the end of the interval (gauges, not deltas).
``net_input_bytes``, ``net_output_bytes`` (and per second)
    deltas of INFO stats ``total_net_input_bytes`` / ``total_net_output_bytes``:
    every byte the shard read from and wrote to its clients (replication
    traffic is counted apart by Valkey and not included). Deltas over the
    interval, not ``instantaneous_*``, which Valkey averages over its own
    last 1.6 s whatever the interval. Output bytes per second is the
    bandwidth b the shard served, the cost model's b (kv-sizing).
``<cmd>_rejected_calls``, ``rejected_calls``, ``failed_calls``
    deltas of ``cmdstat_*`` ``rejected_calls`` (refused before running: wrong
    arity, OOM under ``noeviction``, ...) and ``failed_calls`` (ran and
    replied an error), per command of the four and summed over every command.
``error_replies``, ``errors``
    deltas of INFO errorstats: error replies of any kind, and per error
    prefix (``ERR``, ``OOM``, ``WRONGTYPE``...).
``connected_clients``, ``rejected_connections``
    INFO clients at the end of the interval (a gauge), and connections
    refused at ``maxclients`` (a delta).
``<cmd>_p50_usec``, ``<cmd>_p99_usec``, ``<cmd>_p99_9_usec``
    INFO latencystats ``latency_percentiles_usec_<cmd>`` at the end of the
    interval. Valkey keeps one latency histogram per command since its
    start (or ``CONFIG RESETSTAT``): these are lifetime percentiles, read as
    gauges, not percentiles of the interval. None where latency tracking is
    off or the command was never called.

A counter that goes down (restart, ``CONFIG RESETSTAT``) starts a new
baseline: that interval is reported with ``error = "counters reset"``.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from .common import OpsError

SCHEMES = {"resp": False, "redis": False, "valkey": False, "tcp": False, "rediss": True, "valkeys": True}
DEFAULT_PORT = 6379
COMMANDS = ("get", "set", "exists", "mget")
INFO_SECTIONS = ("commandstats", "cpu", "stats", "memory", "clients", "latencystats", "errorstats")
_COUNTERS = ("evicted_keys", "keyspace_hits", "keyspace_misses", "net_input_bytes", "net_output_bytes",
             "rejected_calls", "failed_calls", "error_replies", "rejected_connections")
PERCENTILES = ("p50", "p99", "p99.9")  # Valkey's default latency-tracking-info-percentiles


@dataclass(frozen=True)
class ShardTarget:
    rank: int
    url: str
    host: str
    port: int
    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: bool = False


def parse_shard_url(url: str, rank: int) -> ShardTarget:
    """``resp://``, ``redis://``, ``valkey://`` (``rediss://``/``valkeys://`` for TLS) or ``host:port``."""
    text = url.strip()
    if "://" not in text:
        text = "resp://" + text
    parts = urlsplit(text)
    if parts.scheme not in SCHEMES:
        raise OpsError(f"shard URL {url!r}: unknown scheme {parts.scheme!r}; use resp://, redis:// or valkey://")
    if not parts.hostname:
        raise OpsError(f"shard URL {url!r}: no host")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise OpsError(f"shard URL {url!r}: bad port") from None
    db = 0
    path = parts.path.strip("/")
    if path:
        if not path.isdigit():
            raise OpsError(f"shard URL {url!r}: database must be a number, got {path!r}")
        db = int(path)
    return ShardTarget(
        rank=rank,
        url=url,
        host=parts.hostname,
        port=port,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        db=db,
        tls=SCHEMES[parts.scheme],
    )


def expand_targets(template: str | None, shards: int | None, urls: list[str]) -> list[ShardTarget]:
    """Shards from a ``{rank}`` template and a count, or from a list of URLs (comma-separated allowed)."""
    if template is not None:
        if urls:
            raise OpsError("give either --url-template with --shards, or --url, not both")
        if "{rank}" not in template:
            raise OpsError(f"--url-template {template!r}: has no '{{rank}}' to substitute")
        if shards is None or shards < 1:
            raise OpsError("--url-template needs --shards N (N >= 1)")
        return [parse_shard_url(template.replace("{rank}", str(rank)), rank) for rank in range(shards)]
    flat = [u for item in urls for u in item.split(",") if u.strip()]
    if not flat:
        raise OpsError("no shard to sample: give --url (repeatable) or --url-template with --shards")
    return [parse_shard_url(u, rank) for rank, u in enumerate(flat)]


@dataclass(frozen=True)
class ServerSample:
    at_s: float  # seconds after the sampler's start (monotonic, mid-call)
    epoch_s: float
    calls: Mapping[str, int]  # per command of COMMANDS
    usec: Mapping[str, int]
    total_usec: int  # every command, INFO included
    other_calls: int  # every command but COMMANDS and INFO
    cpu_s: float
    cpu_source: str  # "main_thread" or "process"
    evicted_keys: int = 0
    keyspace_hits: int = 0
    keyspace_misses: int = 0
    used_memory: int = 0
    maxmemory: int = 0
    net_input_bytes: int = 0
    net_output_bytes: int = 0
    rejected: Mapping[str, int] = field(default_factory=dict)  # per command of COMMANDS
    rejected_calls: int = 0  # every command
    failed_calls: int = 0  # every command
    errors: Mapping[str, int] = field(default_factory=dict)  # error replies per prefix (errorstats)
    error_replies: int = 0
    rejected_connections: int = 0
    connected_clients: int | None = None
    latency_usec: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # per command: PERCENTILES


def _int(info: Mapping[str, Any], key: str) -> int:
    try:
        return int(info.get(key, 0))
    except (TypeError, ValueError):
        return 0


def _errors(info: Mapping[str, Any]) -> dict[str, int]:
    """``errorstat_<PREFIX>:count=N`` lines: error replies per prefix."""
    return {key[len("errorstat_"):]: int(value.get("count", 0)) for key, value in info.items()
            if key.startswith("errorstat_") and isinstance(value, Mapping)}


def _latency(info: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``latency_percentiles_usec_<cmd>:p50=..,p99=..,p99.9=..`` of the four commands."""
    found = {}
    for name in COMMANDS:
        value = info.get(f"latency_percentiles_usec_{name}")
        if isinstance(value, Mapping):
            found[name] = {p: float(value[p]) for p in PERCENTILES if p in value}
    return found


def sample_from_info(info: Mapping[str, Any], at_s: float, epoch_s: float) -> ServerSample:
    """Turn a parsed ``INFO commandstats cpu stats memory`` answer into a sample."""
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    rejected: dict[str, int] = {}
    total_usec = other = total_rejected = total_failed = 0
    for key, value in info.items():
        if not key.startswith("cmdstat_") or not isinstance(value, Mapping):
            continue
        name = key[len("cmdstat_"):]
        total_usec += int(value.get("usec", 0))
        total_rejected += int(value.get("rejected_calls", 0))
        total_failed += int(value.get("failed_calls", 0))
        if name in COMMANDS:
            calls[name] = int(value.get("calls", 0))
            usec[name] = int(value.get("usec", 0))
            rejected[name] = int(value.get("rejected_calls", 0))
        elif name != "info":
            other += int(value.get("calls", 0))
    for name in COMMANDS:  # a command never sent has no cmdstat line
        calls.setdefault(name, 0)
        usec.setdefault(name, 0)
        rejected.setdefault(name, 0)
    errors = _errors(info)
    if "used_cpu_user_main_thread" in info and "used_cpu_sys_main_thread" in info:
        cpu = float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])
        source = "main_thread"
    elif "used_cpu_user" in info and "used_cpu_sys" in info:
        cpu = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        source = "process"
    else:
        raise OpsError("INFO cpu has neither used_cpu_*_main_thread nor used_cpu_user/sys")
    return ServerSample(at_s, epoch_s, calls, usec, total_usec, other, cpu, source,
                        evicted_keys=_int(info, "evicted_keys"), keyspace_hits=_int(info, "keyspace_hits"),
                        keyspace_misses=_int(info, "keyspace_misses"), used_memory=_int(info, "used_memory"),
                        maxmemory=_int(info, "maxmemory"),
                        net_input_bytes=_int(info, "total_net_input_bytes"),
                        net_output_bytes=_int(info, "total_net_output_bytes"),
                        rejected=rejected, rejected_calls=total_rejected, failed_calls=total_failed,
                        errors=errors,
                        error_replies=(_int(info, "total_error_replies") if "total_error_replies" in info
                                       else sum(errors.values())),
                        rejected_connections=_int(info, "rejected_connections"),
                        connected_clients=_int(info, "connected_clients") if "connected_clients" in info else None,
                        latency_usec=_latency(info))


@dataclass(frozen=True)
class CommandInterval:
    calls: int = 0
    calls_per_s: float = 0.0
    usec_per_call: float | None = None
    busy_pct: float = 0.0
    rejected_calls: int = 0
    latency_usec: Mapping[str, float] = field(default_factory=dict)  # lifetime PERCENTILES at the interval's end


_IDLE = CommandInterval()


@dataclass(frozen=True)
class IntervalStats:
    shard: int
    url: str
    start_s: float
    end_s: float
    end_epoch_s: float
    commands: Mapping[str, CommandInterval] = field(default_factory=dict)
    total_busy_pct: float = 0.0
    main_cpu_pct: float = 0.0
    other_calls_per_s: float = 0.0
    cpu_source: str = ""
    evicted_keys: int = 0
    keyspace_hits: int = 0
    keyspace_misses: int = 0
    used_memory_bytes: int | None = None
    maxmemory_bytes: int | None = None
    net_input_bytes: int = 0
    net_output_bytes: int = 0
    rejected_calls: int = 0
    failed_calls: int = 0
    error_replies: int = 0
    errors: Mapping[str, int] = field(default_factory=dict)  # error replies per prefix, those that occurred
    rejected_connections: int = 0
    connected_clients: int | None = None
    error: str = ""

    @property
    def interval_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def net_in_bytes_per_s(self) -> float:
        return self.per_s(self.net_input_bytes)

    @property
    def net_out_bytes_per_s(self) -> float:
        """The bandwidth this shard served in the interval: the cost model's b, as loaded."""
        return self.per_s(self.net_output_bytes)

    def command(self, name: str) -> CommandInterval:
        return self.commands.get(name, _IDLE)

    # The GET figures under their old names (the write-up's metric; the CLI's line and summary).
    @property
    def get_calls(self) -> int:
        return self.command("get").calls

    @property
    def get_calls_per_s(self) -> float:
        return self.command("get").calls_per_s

    @property
    def get_usec_per_call(self) -> float | None:
        return self.command("get").usec_per_call

    @property
    def get_busy_pct(self) -> float:
        return self.command("get").busy_pct

    def per_s(self, count: int) -> float:
        return count / self.interval_s if self.interval_s > 0 else 0.0


def interval_between(target: ShardTarget, before: ServerSample, after: ServerSample) -> IntervalStats:
    elapsed = after.at_s - before.at_s
    deltas = {name: (after.calls[name] - before.calls[name], after.usec[name] - before.usec[name])
              for name in COMMANDS}
    total_usec = after.total_usec - before.total_usec
    cpu = after.cpu_s - before.cpu_s
    other = after.other_calls - before.other_calls
    counters = {name: getattr(after, name) - getattr(before, name) for name in _COUNTERS}
    rejected = {name: after.rejected.get(name, 0) - before.rejected.get(name, 0) for name in COMMANDS}
    errors = {prefix: count - before.errors.get(prefix, 0) for prefix, count in after.errors.items()}
    if (elapsed <= 0 or cpu < 0 or other < 0 or total_usec < 0 or any(v < 0 for v in counters.values())
            or any(c < 0 or u < 0 for c, u in deltas.values()) or any(v < 0 for v in rejected.values())
            or any(v < 0 for v in errors.values()) or not set(before.errors) <= set(after.errors)):
        return IntervalStats(target.rank, target.url, before.at_s, after.at_s, after.epoch_s,
                             cpu_source=after.cpu_source, error="counters reset")
    commands = {
        name: CommandInterval(calls=c, calls_per_s=c / elapsed, usec_per_call=u / c if c else None,
                              busy_pct=100.0 * u / 1e6 / elapsed, rejected_calls=rejected[name],
                              latency_usec=after.latency_usec.get(name, {}))
        for name, (c, u) in deltas.items()
    }
    return IntervalStats(
        shard=target.rank,
        url=target.url,
        start_s=before.at_s,
        end_s=after.at_s,
        end_epoch_s=after.epoch_s,
        commands=commands,
        total_busy_pct=100.0 * total_usec / 1e6 / elapsed,
        main_cpu_pct=100.0 * cpu / elapsed,
        other_calls_per_s=other / elapsed,
        cpu_source=after.cpu_source,
        used_memory_bytes=after.used_memory,
        maxmemory_bytes=after.maxmemory,
        errors={prefix: n for prefix, n in errors.items() if n},
        connected_clients=after.connected_clients,
        **counters,
    )


class ShardClient:
    """One connection to one shard (the ``valkey`` client package)."""

    def __init__(self, target: ShardTarget, timeout_s: float) -> None:
        import valkey

        self.target = target
        self._client = valkey.Valkey(
            host=target.host, port=target.port, username=target.username, password=target.password,
            db=target.db, ssl=target.tls, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        )

    def info(self) -> Mapping[str, Any]:
        return self._client.info(*INFO_SECTIONS)

    def close(self) -> None:
        self._client.close()


class Sampler:
    """Samples all shards together every ``interval_s`` seconds until stopped."""

    def __init__(self, targets: list[ShardTarget], timeout_s: float = 3.0,
                 client_factory: Callable[[ShardTarget, float], Any] = ShardClient) -> None:
        self.targets = targets
        self.clients = [client_factory(t, timeout_s) for t in targets]
        self._start = time.monotonic()
        self._previous: list[ServerSample | None] = [None] * len(targets)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(targets)), thread_name_prefix="valkey-sample")
        self.intervals: list[IntervalStats] = []
        self.failed_samples = 0

    def _sample_one(self, index: int) -> ServerSample | str:
        client = self.clients[index]
        try:
            before = time.monotonic()
            info = client.info()
            after = time.monotonic()
            return sample_from_info(info, (before + after) / 2 - self._start, time.time())
        except OpsError as exc:
            return str(exc)
        except Exception as exc:  # the client's connection and protocol errors
            return f"{type(exc).__name__}: {exc}"

    def check_all(self) -> None:
        """Take the baseline sample of every shard; raise naming each shard that does not answer."""
        results = list(self._pool.map(self._sample_one, range(len(self.targets))))
        errors = [f"{t.url}: {r}" for t, r in zip(self.targets, results) if isinstance(r, str)]
        if errors:
            raise OpsError("cannot sample " + "; ".join(errors))
        self._previous = [r for r in results if not isinstance(r, str)]  # type: ignore[misc]

    def sample(self) -> list[IntervalStats]:
        """One sample of every shard; returns the intervals since each shard's previous sample."""
        results = list(self._pool.map(self._sample_one, range(len(self.targets))))
        now = time.monotonic() - self._start
        new: list[IntervalStats] = []
        for index, (target, result) in enumerate(zip(self.targets, results)):
            previous = self._previous[index]
            if isinstance(result, str):
                self.failed_samples += 1
                start = previous.at_s if previous is not None else now
                new.append(IntervalStats(target.rank, target.url, start, now, time.time(), error=result))
                self._previous[index] = None
                continue
            if previous is not None:
                new.append(interval_between(target, previous, result))
            self._previous[index] = result
        self.intervals.extend(new)
        return new

    def run(self, interval_s: float, duration_s: float | None, stop: threading.Event,
            on_intervals: Callable[[list[IntervalStats]], None] | None = None) -> list[IntervalStats]:
        """Sample on a fixed schedule (no drift) until ``stop`` is set or ``duration_s`` has passed."""
        if all(p is None for p in self._previous):
            self.check_all()
        begin = time.monotonic()
        tick = 1
        while not stop.is_set():
            due = begin + tick * interval_s
            if duration_s is not None:
                due = min(due, begin + duration_s)
            if stop.wait(max(0.0, due - time.monotonic())):
                break
            new = self.sample()
            if on_intervals is not None:
                on_intervals(new)
            if duration_s is not None and time.monotonic() - begin >= duration_s - 1e-6:
                break
            tick += 1
        return self.intervals

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self.clients:
            try:
                client.close()
            except Exception:
                pass


@dataclass(frozen=True)
class CommandSummary:
    calls: int
    mean_calls_per_s: float
    usec_per_call: float | None
    mean_busy_pct: float
    max_busy_pct: float
    rejected_calls: int = 0
    latency_usec: dict[str, float] = field(default_factory=dict)  # lifetime PERCENTILES at the last sample


@dataclass(frozen=True)
class ShardSummary:
    shard: int
    url: str
    intervals: int
    commands: dict[str, CommandSummary]
    mean_total_busy_pct: float
    max_total_busy_pct: float
    mean_main_cpu_pct: float
    max_main_cpu_pct: float
    evicted_keys: int
    keyspace_hits: int
    keyspace_misses: int
    last_used_memory_bytes: int | None
    max_used_memory_bytes: int | None
    maxmemory_bytes: int | None
    failed_intervals: int
    net_input_bytes: int = 0
    net_output_bytes: int = 0
    mean_net_in_bytes_per_s: float = 0.0
    mean_net_out_bytes_per_s: float = 0.0  # b as served over the whole run
    max_net_out_bytes_per_s: float = 0.0  # b in the busiest interval
    rejected_calls: int = 0
    failed_calls: int = 0
    error_replies: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    rejected_connections: int = 0
    last_connected_clients: int | None = None
    max_connected_clients: int | None = None

    @property
    def get_calls(self) -> int:
        return self.commands["get"].calls


def _weighted(rows: list[IntervalStats], value: Callable[[IntervalStats], float], elapsed: float) -> float:
    return sum(value(i) * i.interval_s for i in rows) / elapsed if elapsed else 0.0


def summarize_shards(targets: list[ShardTarget], intervals: list[IntervalStats]) -> list[ShardSummary]:
    summaries = []
    for target in targets:
        rows = [i for i in intervals if i.shard == target.rank]
        good = [i for i in rows if not i.error]
        elapsed = sum(i.interval_s for i in good)
        commands = {}
        for name in COMMANDS:
            calls = sum(i.command(name).calls for i in good)
            usec = sum((i.command(name).usec_per_call or 0.0) * i.command(name).calls for i in good)
            commands[name] = CommandSummary(
                calls=calls,
                mean_calls_per_s=calls / elapsed if elapsed else 0.0,
                usec_per_call=usec / calls if calls else None,
                mean_busy_pct=_weighted(good, lambda i, n=name: i.command(n).busy_pct, elapsed),
                max_busy_pct=max((i.command(name).busy_pct for i in good), default=0.0),
                rejected_calls=sum(i.command(name).rejected_calls for i in good),
                latency_usec=dict(good[-1].command(name).latency_usec) if good else {},
            )
        memory = [i.used_memory_bytes for i in good if i.used_memory_bytes is not None]
        clients = [i.connected_clients for i in good if i.connected_clients is not None]
        errors: dict[str, int] = {}
        for row in good:
            for prefix, count in row.errors.items():
                errors[prefix] = errors.get(prefix, 0) + count
        net_in = sum(i.net_input_bytes for i in good)
        net_out = sum(i.net_output_bytes for i in good)
        summaries.append(ShardSummary(
            shard=target.rank,
            url=target.url,
            intervals=len(good),
            commands=commands,
            mean_total_busy_pct=_weighted(good, lambda i: i.total_busy_pct, elapsed),
            max_total_busy_pct=max((i.total_busy_pct for i in good), default=0.0),
            mean_main_cpu_pct=_weighted(good, lambda i: i.main_cpu_pct, elapsed),
            max_main_cpu_pct=max((i.main_cpu_pct for i in good), default=0.0),
            evicted_keys=sum(i.evicted_keys for i in good),
            keyspace_hits=sum(i.keyspace_hits for i in good),
            keyspace_misses=sum(i.keyspace_misses for i in good),
            last_used_memory_bytes=memory[-1] if memory else None,
            max_used_memory_bytes=max(memory) if memory else None,
            maxmemory_bytes=next((i.maxmemory_bytes for i in reversed(good) if i.maxmemory_bytes is not None), None),
            failed_intervals=len(rows) - len(good),
            net_input_bytes=net_in,
            net_output_bytes=net_out,
            mean_net_in_bytes_per_s=net_in / elapsed if elapsed else 0.0,
            mean_net_out_bytes_per_s=net_out / elapsed if elapsed else 0.0,
            max_net_out_bytes_per_s=max((i.net_out_bytes_per_s for i in good), default=0.0),
            rejected_calls=sum(i.rejected_calls for i in good),
            failed_calls=sum(i.failed_calls for i in good),
            error_replies=sum(i.error_replies for i in good),
            errors=errors,
            rejected_connections=sum(i.rejected_connections for i in good),
            last_connected_clients=clients[-1] if clients else None,
            max_connected_clients=max(clients) if clients else None,
        ))
    return summaries
