"""Percentiles, thirds, requests in flight and the SLA gates, on known data."""
from __future__ import annotations

import random

import pytest
from opstools import gates
from opstools.records import RequestRecord
from opstools.stats import Distribution, in_flight_steps, peak_in_flight, percentile, split_by_send_time, summarize


def test_percentiles_on_known_data():
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 100
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 3.0], 50) == 2.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # order of input does not matter
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentiles_match_numpy_linear():
    numpy = pytest.importorskip("numpy")
    rng = random.Random(0)
    for size in (2, 7, 100, 683):
        values = [rng.expovariate(0.1) for _ in range(size)]
        for q in (50, 90, 99):
            assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))


def record(
    rid: str, sent: float | None, ttft: float | None = 1.0, e2e: float = 2.0, status: str = "ok"
) -> RequestRecord:
    r = RequestRecord(id=rid, offset_s=sent or 0.0, sent_s=sent, status=status)
    if sent is not None:
        r.first_token_s = None if ttft is None else sent + ttft
        r.end_s = sent + e2e
    return r


def test_thirds_split_the_send_time_span_equally():
    records = [record(f"r{i}", float(i), ttft=float(i)) for i in range(10)]  # sent 0..9
    groups = split_by_send_time(records)
    # windows [0, 3), [3, 6), [6, 9]
    assert [[r.id for r in g] for g in groups] == [["r0", "r1", "r2"], ["r3", "r4", "r5"],
                                                   ["r6", "r7", "r8", "r9"]]
    summary = summarize(records)
    assert [d.p50 for d in summary.ttft_thirds] == [1.0, 4.0, 7.5]


def test_in_flight_counts_overlaps_and_ends_before_starts():
    records = [record("a", 0.0, e2e=2.0), record("b", 1.0, e2e=2.0), record("c", 2.0, e2e=2.0),
               record("d", 2.5, e2e=0.1)]
    steps = in_flight_steps(records)
    assert steps[0] == (0.0, 1)
    assert (1.0, 2) in steps
    assert (2.0, 2) in steps  # a ended as c started
    assert peak_in_flight(records) == 3  # b, c, d at 2.5
    assert steps[-1][1] == 0


def test_summary_counts_not_sent_as_failures_and_ttft_uses_successes_only():
    records = [record("ok1", 0.0, ttft=1.0), record("ok2", 1.0, ttft=3.0),
               record("bad", 2.0, ttft=50.0, status="http_error"), record("never", None, status="not_sent")]
    summary = summarize(records)
    assert (summary.requests, summary.sent, summary.ok, summary.failed, summary.not_sent) == (4, 3, 2, 2, 1)
    assert summary.success_pct == 50.0
    assert summary.ttft.p50 == 2.0 and summary.ttft.max == 3.0
    assert summary.failures_by_status == {"http_error": 1, "not_sent": 1}


def summary_with(ttfts: list[float], failures: int = 0):
    records = [record(f"r{i}", float(i), ttft=t) for i, t in enumerate(ttfts)]
    records += [record(f"f{i}", 0.5, status="http_error") for i in range(failures)]
    return summarize(records)


def verdict(summary, **limits) -> tuple[bool, list[gates.GateResult]]:
    """Only the gates named in ``limits`` (default: all four defaults)."""
    if limits:
        limits = {"p50_s": None, "p90_s": None, "mean_s": None, "success_pct": None, **limits}
    results = gates.evaluate(summary, gates.build_gates(**limits))
    return gates.verdict(results), results


def test_default_gates_are_the_write_ups():
    described = [g.description for g in gates.build_gates()]
    assert described == ["TTFT P90 < 70 s", "TTFT P50 < 30 s", "TTFT mean < 30 s", "success >= 100%"]


def test_p90_gate_flips_at_its_limit():
    summary = summary_with([10.0 * i for i in range(11)])  # 0, 10, ..., 100: p90 is exactly 90
    assert summary.ttft.p90 == 90.0
    assert verdict(summary, p90_s=90.001)[0] is True
    assert verdict(summary, p90_s=90.0)[0] is False  # strict: equal fails
    assert verdict(summary, p90_s=89.999)[0] is False


def test_p50_and_mean_gates_flip_at_their_limits():
    summary = summary_with([10.0, 20.0, 30.0, 40.0])  # p50 25, mean 25
    assert verdict(summary, p50_s=25.001, mean_s=None)[0] is True
    assert verdict(summary, p50_s=25.0, mean_s=None)[0] is False
    assert verdict(summary, p50_s=None, mean_s=25.001)[0] is True
    assert verdict(summary, p50_s=None, mean_s=25.0)[0] is False


def test_success_gate_needs_every_request_by_default():
    assert verdict(summary_with([1.0] * 99))[0] is True
    ok, results = verdict(summary_with([1.0] * 99, failures=1))
    assert ok is False
    assert [r.passed for r in results] == [True, True, True, False]
    assert verdict(summary_with([1.0] * 99, failures=1), success_pct=99.0)[0] is True


def test_a_latency_gate_without_data_fails_and_gates_can_be_off():
    empty = summary_with([], failures=2)
    ok, results = verdict(empty, p50_s=30.0, p90_s=70.0, mean_s=30.0)
    assert ok is False and len(results) == 3 and all(r.value is None for r in results)
    assert "no data" in results[0].line()
    assert verdict(empty, p50_s=None, p90_s=None, mean_s=None, success_pct=None) == (True, [])


def test_distribution_of_nothing_is_empty():
    assert Distribution.of([]) == Distribution(count=0)
