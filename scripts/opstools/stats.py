"""Percentiles, per-third drift view, throughput and requests in flight, from replay records.

Percentiles come from :func:`statistics.quantiles` with ``method="inclusive"``:
linear interpolation between the two nearest ranks (numpy's ``percentile``
default, spreadsheets' ``PERCENTILE.INC``).

Thirds: the span from the first to the last send time is cut into three equal
windows of time; each request belongs to the window its send time falls in
(the last window includes its end). This is the write-up's drift view: a
backlog that keeps growing shows as a median that rises from third to third.

Throughput follows ``vllm bench serve``: TPOT of a request is
``(e2e - TTFT) / (output tokens - 1)`` (requests with one token have none),
ITL the gaps between consecutive ``choices`` events, output tokens/s the
output tokens of the successful requests over the run's span (first send to
last end). Tokens per minute counts prompt and output tokens of the successful
requests over the same span (the write-up's headline figure), per node when
the node count is given. Goodput counts the successful requests within every
SLO given (``ttft``, ``tpot``, ``e2el``, milliseconds, as ``vllm bench serve
--goodput``). Send lag is how late the client sent each request against its
offset: a p99 above a fraction of a second means the client, not the server,
shaped the load. Under ``--max-concurrency`` the wait for a free slot is the
client queue time (``vllm bench serve``'s ``client_queue_time``), kept apart
from the send lag. Request throughput is the successful requests over the
same span as the output tokens/s.

:data:`PERCENTILE_METRICS` are the names ``vllm bench serve
--percentile-metrics`` takes; :func:`metric_values` gives each one's values
(seconds, successful requests only, as vLLM computes them).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .records import NOT_SENT, RequestRecord

SEND_LAG_WARN_S = 0.25
GOODPUT_KEYS = ("ttft", "tpot", "e2el")

THIRD_NAMES = ("first third", "second third", "last third")

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100, fractions allowed) of ``values``, linear interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
        raise ValueError(f"percentile rank must be a number in [0, 100], got {q!r}")
    if len(values) == 1:
        return values[0]
    if q == 0:
        return min(values)
    if q == 100:
        return max(values)
    if q == int(q):
        return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]
    data = sorted(values)
    rank = (len(data) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """p50/p90/p99/mean/min/max of a set of seconds; all ``None`` when empty."""

    count: int
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        data = list(values)
        if not data:
            return cls(count=0)
        return cls(
            count=len(data),
            p50=percentile(data, 50),
            p90=percentile(data, 90),
            p99=percentile(data, 99),
            mean=sum(data) / len(data),
            min=min(data),
            max=max(data),
        )


def split_by_send_time(records: Sequence[RequestRecord], parts: int = 3) -> list[list[RequestRecord]]:
    """Sent records in ``parts`` equal windows of send time (see module doc)."""
    sent = [r for r in records if r.sent_s is not None]
    groups: list[list[RequestRecord]] = [[] for _ in range(parts)]
    if not sent:
        return groups
    first = min(r.sent_s for r in sent)  # type: ignore[type-var]
    last = max(r.sent_s for r in sent)  # type: ignore[type-var]
    span = last - first
    for record in sent:
        assert record.sent_s is not None
        index = 0 if span <= 0 else min(parts - 1, int((record.sent_s - first) / span * parts))
        groups[index].append(record)
    return groups


def third_boundaries(records: Sequence[RequestRecord]) -> list[float]:
    """The two send times that separate the thirds (for plots)."""
    sent = [r.sent_s for r in records if r.sent_s is not None]
    if not sent:
        return []
    first, last = min(sent), max(sent)
    return [first + (last - first) / 3, first + 2 * (last - first) / 3]


def in_flight_steps(records: Sequence[RequestRecord]) -> list[tuple[float, int]]:
    """``(time, requests in flight from then on)`` at every send and every end."""
    events: list[tuple[float, int]] = []
    for record in records:
        if record.sent_s is None:
            continue
        events.append((record.sent_s, +1))
        end = record.end_s if record.end_s is not None else record.sent_s
        events.append((end, -1))
    # at equal times, ends before sends: a request that ends as another starts
    # does not count as overlapping it
    events.sort(key=lambda e: (e[0], e[1]))
    steps: list[tuple[float, int]] = []
    level = 0
    for time_s, change in events:
        level += change
        if steps and steps[-1][0] == time_s:
            steps[-1] = (time_s, level)
        else:
            steps.append((time_s, level))
    return steps


def peak_in_flight(records: Sequence[RequestRecord]) -> int:
    return max((level for _, level in in_flight_steps(records)), default=0)


def _span(records: Sequence[RequestRecord]) -> float:
    """First send to last end of the sent requests (0 when nothing was sent)."""
    sent = [r.sent_s for r in records if r.sent_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    if not sent or not ends:
        return 0.0
    return max(0.0, max(ends) - min(sent))


def tpot_s(record: RequestRecord) -> float | None:
    """``(e2e - TTFT) / (tokens - 1)``; None for one token or less, or without TTFT."""
    if record.ttft_s is None or record.e2e_s is None or not record.completion_tokens:
        return None
    if record.completion_tokens <= 1:
        return None
    return (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)


def inter_token_latencies(record: RequestRecord) -> list[float]:
    if record.first_token_s is None:
        return []
    times = [record.first_token_s, *record.token_times_s]
    return [b - a for a, b in zip(times, times[1:])]


def output_rate(record: RequestRecord) -> float | None:
    """Output tokens per second of one request: its tokens over its end-to-end time."""
    if record.e2e_s is None or record.e2e_s <= 0 or record.completion_tokens is None:
        return None
    return record.completion_tokens / record.e2e_s


def is_good(record: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """Within every SLO (``vllm bench serve --goodput``: a one-token request has TPOT 0)."""
    values = {"ttft": record.ttft_s, "tpot": tpot_s(record) or 0.0, "e2el": record.e2e_s}
    for key, limit_ms in slo_ms.items():
        value = values[key]
        if value is None or value > limit_ms / 1000.0:
            return False
    return True


def metric_values(records: Sequence[RequestRecord], metric: str) -> list[float]:
    """Seconds of one of :data:`PERCENTILE_METRICS` over the successful requests."""
    ok = [r for r in records if r.ok]
    if metric == "ttft":
        return [r.ttft_s for r in ok if r.ttft_s is not None]
    if metric == "tpot":
        return [v for r in ok if (v := tpot_s(r)) is not None]
    if metric == "itl":
        return [gap for r in ok for gap in inter_token_latencies(r)]
    if metric == "e2el":
        return [r.e2e_s for r in ok if r.e2e_s is not None]
    if metric == "client_queue_time":
        return [r.client_queue_s or 0.0 for r in ok]
    if metric == "e2el_including_client_queue":
        return [r.e2e_s + (r.client_queue_s or 0.0) for r in ok if r.e2e_s is not None]
    raise ValueError(f"unknown metric {metric!r}; known: {', '.join(PERCENTILE_METRICS)}")


def percentile_key(q: float) -> str:
    """``99`` -> ``p99``, ``99.9`` -> ``p99.9`` (``vllm bench serve``'s spelling)."""
    return f"p{int(q)}" if q == int(q) else f"p{q}"


def metric_statistics(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std (population) and the percentiles of seconds, in milliseconds; None for no values."""
    names = ["mean", "median", "std", *(percentile_key(q) for q in percentiles)]
    if not values:
        return dict.fromkeys(names)
    mean = sum(values) / len(values)
    stats: dict[str, float | None] = {
        "mean": mean * 1000,
        "median": percentile(values, 50) * 1000,
        "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) * 1000,
    }
    for q in percentiles:
        stats[percentile_key(q)] = percentile(values, q) * 1000
    return stats


@dataclass
class Throughput:
    span_s: float
    output_tokens_per_s: float
    tokens_per_minute: float
    nodes: int | None
    tokens_per_minute_per_node: float | None
    output_tps_per_request: Distribution
    tpot: Distribution
    itl: Distribution
    goodput_slo_ms: dict[str, float]
    good_requests: int | None
    goodput_per_s: float | None
    requests_per_s: float = 0.0  # successful requests over the span


@dataclass
class ReplaySummary:
    requests: int
    sent: int
    ok: int
    failed: int
    not_sent: int
    success_pct: float
    duration_s: float
    peak_in_flight: int
    ttft: Distribution
    ttft_thirds: list[Distribution]
    e2e: Distribution
    prompt_tokens: int
    completion_tokens: int
    throughput: Throughput
    send_lag: Distribution
    send_lag_warning: str | None = None
    failures_by_status: dict[str, int] = field(default_factory=dict)
    client_queue: Distribution = field(default_factory=lambda: Distribution(count=0))
    percentiles: list[float] = field(default_factory=lambda: list(DEFAULT_PERCENTILES))
    # per metric of --percentile-metrics, and "send_lag": count and metric_statistics, in ms
    latency_ms: dict[str, dict[str, float | None]] = field(default_factory=dict)

    @property
    def with_ttft(self) -> int:
        return self.ttft.count

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ttft_thirds"] = {name: asdict(d) for name, d in zip(THIRD_NAMES, self.ttft_thirds)}
        data["with_ttft"] = self.with_ttft
        return data


def summarize(
    records: Sequence[RequestRecord],
    peak_observed: int | None = None,
    nodes: int | None = None,
    goodput_slo_ms: dict[str, float] | None = None,
    send_lag_warn_s: float = SEND_LAG_WARN_S,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
) -> ReplaySummary:
    """Summary over every request of the stream (not-sent ones count as failures).

    TTFT, end-to-end and throughput figures use the successful requests only.
    """
    ok_records = [r for r in records if r.ok]
    sent = [r for r in records if r.status != NOT_SENT]
    failures: dict[str, int] = {}
    for record in records:
        if not record.ok:
            failures[record.status] = failures.get(record.status, 0) + 1
    ends = [r.end_s for r in sent if r.end_s is not None]
    duration = max(ends) if ends else 0.0
    thirds = [
        Distribution.of(r.ttft_s for r in group if r.ok and r.ttft_s is not None)
        for group in split_by_send_time(records)
    ]
    peak = peak_in_flight(records)
    if peak_observed is not None:
        peak = max(peak, peak_observed)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok_records)
    completion_tokens = sum(r.completion_tokens or 0 for r in ok_records)
    span = _span(ok_records)
    slo = dict(goodput_slo_ms or {})
    good = sum(is_good(r, slo) for r in ok_records) if slo else None
    tokens_per_minute = (prompt_tokens + completion_tokens) / span * 60.0 if span > 0 else 0.0
    throughput = Throughput(
        span_s=span,
        output_tokens_per_s=completion_tokens / span if span > 0 else 0.0,
        tokens_per_minute=tokens_per_minute,
        nodes=nodes,
        tokens_per_minute_per_node=tokens_per_minute / nodes if nodes else None,
        output_tps_per_request=Distribution.of(v for r in ok_records if (v := output_rate(r)) is not None),
        tpot=Distribution.of(v for r in ok_records if (v := tpot_s(r)) is not None),
        itl=Distribution.of(gap for r in ok_records for gap in inter_token_latencies(r)),
        goodput_slo_ms=slo,
        good_requests=good,
        goodput_per_s=(good / span if span > 0 else 0.0) if good is not None else None,
        requests_per_s=len(ok_records) / span if span > 0 else 0.0,
    )
    lags = [v for r in sent if (v := r.send_lag_s) is not None]
    lag = Distribution.of(lags)
    latency_ms: dict[str, dict[str, float | None]] = {}
    for metric in percentile_metrics:
        values = metric_values(records, metric)
        latency_ms[metric] = {"count": len(values), **metric_statistics(values, percentiles)}
    latency_ms["send_lag"] = {"count": len(lags), **metric_statistics(lags, percentiles)}
    warning = None
    if lag.p99 is not None and lag.p99 > send_lag_warn_s:
        warning = (f"the client fell behind: send lag p99 {lag.p99:.3f} s (max {lag.max:.3f} s) > "
                   f"{send_lag_warn_s:g} s; the load was shaped by this client, not only by the stream "
                   "(run the replay on a less busy machine, or split the stream)")
    return ReplaySummary(
        requests=len(records),
        sent=len(sent),
        ok=len(ok_records),
        failed=len(records) - len(ok_records),
        not_sent=len(records) - len(sent),
        success_pct=100.0 * len(ok_records) / len(records) if records else 0.0,
        duration_s=duration,
        peak_in_flight=peak,
        ttft=Distribution.of(r.ttft_s for r in ok_records if r.ttft_s is not None),
        ttft_thirds=thirds,
        e2e=Distribution.of(r.e2e_s for r in ok_records if r.e2e_s is not None),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        throughput=throughput,
        send_lag=lag,
        send_lag_warning=warning,
        failures_by_status=failures,
        client_queue=Distribution.of(r.client_queue_s for r in sent if r.client_queue_s is not None),
        percentiles=list(percentiles),
        latency_ms=latency_ms,
    )
