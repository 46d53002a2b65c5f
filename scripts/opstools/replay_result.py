"""``result.json``: a run's figures under ``vllm bench serve --save-result``'s key names.

Key names and units follow vLLM 0.31.0's ``vllm/benchmarks/serve.py`` (the
``result`` dict of ``benchmark()``, its ``process_one_metric`` and the setup
keys ``main`` adds), so tools that read vLLM's result files read these:
counts and token totals, ``duration`` (s), ``request_throughput`` (req/s),
``output_throughput`` and ``total_token_throughput`` (tok/s), for every
metric of ``--percentile-metrics`` ``mean_<m>_ms``, ``median_<m>_ms``,
``std_<m>_ms`` and ``p<q>_<m>_ms`` (milliseconds; ``p99.9`` for a fractional
rank), and per request, in stream order, ``ttfts``, ``latencies``,
``start_times`` and ``queue_times`` (seconds), ``itls`` (lists of seconds),
``input_lens``, ``output_lens`` and ``errors``.

As vLLM does: the throughputs are over ``duration`` (run start to the last
answer), a failed request has TTFT and latency 0 and output length 0, the
standard deviation is the population one, and ``max_output_tokens_per_s`` /
``max_concurrent_requests`` are the peaks over one-second buckets. Where this
differs: ``start_times`` are seconds after the run's start (vLLM: the
client's ``perf_counter``), null for a request never sent; a statistic of no
values is null (vLLM: 0); ``input_lens`` are the tokens the server reported
(0 when it did not); ``request_rate`` is the stream's mean arrival rate after
any ``--request-rate``, not a generator's; there are no ``generated_texts``
(the replay does not keep answers). Keys of the replay's own are added:
``not_sent``, ``max_concurrency``, ``open_loop``, ``verdict``, and the
run's context.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .records import RequestRecord
from .stats import ReplaySummary


def _token_times(record: RequestRecord) -> list[float]:
    return [] if record.first_token_s is None else [record.first_token_s, *record.token_times_s]


def per_second_peaks(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """(most token events in one second, most requests active in one second), successful requests."""
    ok = [r for r in records if r.ok and r.sent_s is not None and r.end_s is not None]
    if not ok:
        return 0.0, 0
    first = min(r.sent_s for r in ok)  # type: ignore[type-var]
    seconds = int(math.ceil(max(r.end_s for r in ok) - first)) + 1  # type: ignore[type-var, operator]
    tokens = [0] * seconds
    active = [0] * seconds
    for record in ok:
        for moment in _token_times(record):
            bucket = int(moment - first)
            if 0 <= bucket < seconds:
                tokens[bucket] += 1
        for bucket in range(int(record.sent_s - first), int(record.end_s - first) + 1):  # type: ignore[operator]
            active[bucket] += 1
    return float(max(tokens)), max(active)


def _per_request(records: Sequence[RequestRecord]) -> dict[str, list[Any]]:
    def if_ok(record: RequestRecord, value: Any, failed: Any) -> Any:
        return value if record.ok else failed

    return {
        "input_lens": [r.prompt_tokens or 0 for r in records],
        "output_lens": [if_ok(r, r.completion_tokens or 0, 0) for r in records],
        "ttfts": [if_ok(r, r.ttft_s or 0.0, 0.0) for r in records],
        "itls": [if_ok(r, [b - a for a, b in zip(_token_times(r), _token_times(r)[1:])], []) for r in records],
        "latencies": [if_ok(r, r.e2e_s or 0.0, 0.0) for r in records],
        "start_times": [r.sent_s for r in records],
        "queue_times": [r.client_queue_s or 0.0 for r in records],
        "errors": [r.error for r in records],
    }


def build_result(records: Sequence[RequestRecord], summary: ReplaySummary,
                 setup: dict[str, Any] | None = None) -> dict[str, Any]:
    """The result dict of a run summarized as ``summary``; ``setup`` (model, rate, ...) goes first."""
    duration = summary.duration_s

    def per_s(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    total = summary.prompt_tokens + summary.completion_tokens
    good = summary.throughput.good_requests
    peak_tokens, peak_active = per_second_peaks(records)
    result: dict[str, Any] = dict(setup or {})
    result.update({
        "duration": duration,
        "completed": summary.ok,
        "failed": summary.sent - summary.ok,
        "not_sent": summary.not_sent,
        "total_input_tokens": summary.prompt_tokens,
        "total_output_tokens": summary.completion_tokens,
        "request_throughput": per_s(summary.ok),
        "request_goodput": per_s(good) if good is not None else None,
        "output_throughput": per_s(summary.completion_tokens),
        "total_token_throughput": per_s(total),
        **_per_request(records),
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_active,
    })
    for metric, stats in summary.latency_ms.items():
        if metric == "send_lag":
            continue
        for name, value in stats.items():
            if name != "count":
                result[f"{name}_{metric}_ms"] = value
    return result


def write_result_json(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
