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


def streamed(rid: str, sent: float, ttft: float, gaps: list[float], tokens: int, prompt: int = 1000,
             status: str = "ok") -> RequestRecord:
    r = RequestRecord(id=rid, offset_s=sent, sent_s=sent, status=status, prompt_tokens=prompt,
                      completion_tokens=tokens)
    r.first_token_s = sent + ttft
    t = r.first_token_s
    for gap in gaps:
        t += gap
        r.token_times_s.append(t)
    r.end_s = t
    return r


def test_throughput_metrics_on_known_data():
    # a: TTFT 1 s then 4 tokens 0.1 s apart (5 tokens); b: TTFT 2 s, 3 tokens 0.5 s apart; c: failed
    records = [streamed("a", 0.0, 1.0, [0.1] * 4, 5), streamed("b", 1.0, 2.0, [0.5, 0.5], 3),
               streamed("c", 2.0, 9.0, [0.1], 2, status="http_error")]
    summary = summarize(records, nodes=2, goodput_slo_ms={"ttft": 1500, "tpot": 200})
    tput = summary.throughput
    assert tput.span_s == pytest.approx(4.0)  # first send 0, last end of an ok request 1 + 2 + 1
    assert tput.output_tokens_per_s == pytest.approx(8 / 4.0)
    assert tput.tokens_per_minute == pytest.approx((2000 + 8) / 4.0 * 60)
    assert tput.tokens_per_minute_per_node == pytest.approx(tput.tokens_per_minute / 2)
    assert tput.tpot.count == 2 and tput.tpot.min == pytest.approx(0.1) and tput.tpot.max == pytest.approx(0.5)
    assert tput.itl.count == 6 and tput.itl.p50 == pytest.approx(0.1)
    assert tput.output_tps_per_request.max == pytest.approx(5 / 1.4)
    assert tput.good_requests == 1 and tput.goodput_per_s == pytest.approx(1 / 4.0)  # b misses TTFT 1.5 s


def test_a_one_token_request_has_no_tpot_but_counts_as_good():
    records = [streamed("one", 0.0, 0.5, [], 1)]
    summary = summarize(records, goodput_slo_ms={"tpot": 1})
    assert summary.throughput.tpot.count == 0 and summary.throughput.itl.count == 0
    assert summary.throughput.good_requests == 1  # vllm bench serve: TPOT 0 for one token


def test_send_lag_warns_when_the_client_fell_behind():
    on_time = [streamed(f"r{i}", float(i), 0.1, [], 1) for i in range(10)]
    assert summarize(on_time).send_lag_warning is None
    late = [streamed(f"r{i}", float(i), 0.1, [], 1) for i in range(10)]
    for i, record in enumerate(late):
        record.offset_s = record.sent_s - 0.05 * i  # 0 .. 0.45 s late
    summary = summarize(late)
    assert summary.send_lag.max == pytest.approx(0.45)
    assert summary.send_lag_warning is not None and "the client fell behind" in summary.send_lag_warning
    assert summarize(late, send_lag_warn_s=1.0).send_lag_warning is None


def test_output_throughput_gate_is_a_floor():
    records = [streamed("a", 0.0, 1.0, [0.1] * 4, 5)]  # 5 tokens over 1.4 s
    summary = summarize(records)
    rate = summary.throughput.output_tokens_per_s
    assert rate == pytest.approx(5 / 1.4)
    assert verdict(summary, output_tps=rate - 0.01)[0] is True
    assert verdict(summary, output_tps=rate)[0] is True  # at its limit: passes
    ok, results = verdict(summary, output_tps=rate + 0.01)
    assert ok is False and results[0].line().startswith("FAIL  output >= ")
    nothing = summarize([streamed("x", 0.0, 1.0, [], 1, status="http_error")])
    assert verdict(nothing, output_tps=0.001)[0] is False  # no successful request: no data, fails
