"""What every --measure client shares: the shard URLs, the bounds, the errors and the result.

A measurement GETs values of the chunk size (12,211,200 B for GLM-5.3 with
the presets) from one Valkey instance with the production connection count
and reports the bytes per second delivered (the cost model's b) and the time
per GET at that chunk size. The clients: valkey_bench.py (valkey-py, the ops
environment's) and native.py (LMCache's C++ RESP client, the serving image's).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import List, Optional
from urllib.parse import unquote, urlsplit

LIMITS = {"seconds": 60.0, "connections": 256, "keys": 256, "max_gets": 100_000, "chunk_bytes": 512 * 1024 * 1024}
# A prefill rank reads its shard through LMCache's RESP client with resp_num_threads worker connections
# (configs/prefill/lmcache.yaml: 32); every pod's rank r reads shard r, so P pods put P x 32 on a shard.
PRODUCTION_CONNECTIONS = 32
CLIENT_BOUND_SHARE = 0.8  # client CPU at this share of what it can use: the client, not Valkey, is the limit
SCHEMES = ("resp", "redis", "valkey")


class MeasureError(RuntimeError):
    """The measurement could not run or could not finish (exit status 3)."""


class ClientMissing(RuntimeError):
    """The chosen client cannot be imported by this Python (exit status 2: a setup error, not a measurement)."""


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    username: str
    password: str


def parse_resp_url(url: str) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise ValueError(f"{url!r}: expected resp://HOST:PORT")
    if "{" in url:
        raise ValueError(f"{url!r}: a template; give one instance's URL (e.g. rank 0's shard)")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"{url!r}: bad port") from None
    return Target(parts.hostname, port, unquote(parts.username or ""), unquote(parts.password or ""))


def expand_urls(urls: List[str], instances: int) -> List[str]:
    """--measure values: a URL, or a template with {rank} standing for each of ``instances`` shards."""
    expanded = []
    for url in urls:
        if "{rank}" in url:
            expanded += [url.replace("{rank}", str(rank)) for rank in range(instances)]
        else:
            expanded.append(url)
    for url in expanded:
        parse_resp_url(url)
    return expanded


def check_bounds(**values) -> None:
    """Each of chunk_bytes, keys, connections, seconds, max_gets within LIMITS (seconds from 0.05, others 1)."""
    for name, value in values.items():
        low = 0.05 if name == "seconds" else 1
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= LIMITS[name]):
            raise ValueError(f"{name}: expected {low}..{LIMITS[name]}, got {value!r}")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def percentile(ordered: List[float], share: float) -> float:
    """The nearest-rank value at ``share`` (0..1) of an ascending list."""
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


@dataclass
class Measurement:
    url: str
    client: str
    chunk_bytes: int
    keys: int
    connections: int
    gets: int
    bytes: int
    seconds: float  # wall time of the GETs
    bandwidth: float  # bytes/s: b
    ms_per_get: float  # chunk_bytes / bandwidth: the instance's time per GET at this chunk size
    get_p50_ms: Optional[float]  # one GET as its connection saw it, with `connections` GETs in flight
    get_p99_ms: Optional[float]
    round_p50_ms: Optional[float]  # LMCache client: one round = every key GET once, all in flight
    round_p99_ms: Optional[float]
    server_usec_per_get: Optional[float]  # INFO commandstats over the measurement (every GET the shard ran)
    client_cpu_seconds: float  # the client's processes, all their threads, over the GETs
    client_cpu_cores: float  # client_cpu_seconds / seconds
    usable_cores: int
    client_processes: int
    client_bound: bool

    def as_dict(self) -> dict:
        return asdict(self)


def client_bound(cpu_cores: float, cores_it_can_use: float) -> bool:
    """A native client can use every usable core; a Python process about one (its parsing holds the GIL)."""
    return cpu_cores >= CLIENT_BOUND_SHARE * cores_it_can_use
