"""Percentiles, per-third drift view and requests in flight, from replay records.

Percentiles use linear interpolation between the two nearest ranks (the
default of numpy's ``percentile`` and of spreadsheets' ``PERCENTILE.INC``):
for sorted values ``x[0..n-1]`` the q-th percentile sits at rank
``(n - 1) * q / 100``.

Thirds: the span from the first to the last send time is cut into three equal
windows of time; each request belongs to the window its send time falls in
(the last window includes its end). This is the write-up's drift view: a
backlog that keeps growing shows as a median that rises from third to third.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .records import NOT_SENT, RequestRecord

THIRD_NAMES = ("first third", "second third", "last third")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile rank must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    weight = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * weight


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
    failures_by_status: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ttft_thirds"] = {name: asdict(d) for name, d in zip(THIRD_NAMES, self.ttft_thirds)}
        return data


def summarize(records: Sequence[RequestRecord], peak_observed: int | None = None) -> ReplaySummary:
    """Summary over every request of the stream (not-sent ones count as failures).

    TTFT and end-to-end figures use the successful requests only.
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
        prompt_tokens=sum(r.prompt_tokens or 0 for r in ok_records),
        completion_tokens=sum(r.completion_tokens or 0 for r in ok_records),
        failures_by_status=failures,
    )
