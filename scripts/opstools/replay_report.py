"""The replay's written results: per-request CSV, summary JSON, the printed report."""
from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import OpsError, utc_iso
from .gates import GateResult
from .records import RequestRecord
from .stats import THIRD_NAMES, Distribution, ReplaySummary, output_rate, percentile_key, tpot_s

FIELD_LIMIT = 1 << 28

CSV_COLUMNS = (
    "id",
    "offset_s",
    "sent_s",
    "sent_at_utc",
    "send_lag_s",
    "client_queue_s",  # wait for a free slot under --max-concurrency; empty without
    "ttft_s",
    "e2e_s",
    "tpot_s",
    "output_tokens_per_s",
    "prompt_tokens",
    "completion_tokens",
    "tokens_source",
    "cached_tokens",
    "text_chunks",
    "choice_events",
    "status",
    "http_status",
    "error",
    "token_times_s",  # every choices event after the first, seconds after the send, ';'-separated
)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6f}"
    return str(value)


def record_row(record: RequestRecord) -> dict[str, str]:
    values: dict[str, Any] = {
        "id": record.id,
        "offset_s": record.offset_s,
        "sent_s": record.sent_s,
        "sent_at_utc": utc_iso(record.sent_epoch_s) if record.sent_epoch_s is not None else None,
        "send_lag_s": record.send_lag_s,
        "client_queue_s": record.client_queue_s,
        "ttft_s": record.ttft_s,
        "e2e_s": record.e2e_s,
        "tpot_s": tpot_s(record),
        "output_tokens_per_s": output_rate(record),
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "tokens_source": record.tokens_source,
        "cached_tokens": record.cached_tokens,
        "text_chunks": record.text_chunks,
        "choice_events": record.choice_events,
        "status": record.status,
        "http_status": record.http_status,
        "error": record.error,
        "token_times_s": ";".join(f"{t - record.sent_s:.4f}" for t in record.token_times_s)
        if record.sent_s is not None else "",
    }
    return {column: _cell(values[column]) for column in CSV_COLUMNS}


def write_records_csv(path: Path, records: Sequence[RequestRecord]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for record in records:
            writer.writerow(record_row(record))


def read_records_csv(path: Path) -> list[RequestRecord]:
    """Records back from a ``records.csv`` (to judge an earlier run again)."""
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise OpsError(f"records {path}: cannot open: {exc.strerror or exc}") from exc
    # token_times_s of a long answer outgrows the csv module's default field limit (128 KiB)
    limit = csv.field_size_limit(max(csv.field_size_limit(), FIELD_LIMIT))
    with handle:
        reader = csv.DictReader(handle)
        try:
            return _records_from_rows(path, reader)
        except UnicodeDecodeError as exc:
            raise OpsError(f"records {path}: not UTF-8 text ({exc.reason}); is it a replay records.csv?") from None
        except csv.Error as exc:
            raise OpsError(f"{path}:{reader.line_num}: not CSV ({exc})") from None
        finally:
            csv.field_size_limit(limit)


def _records_from_rows(path: Path, reader: csv.DictReader) -> list[RequestRecord]:
    columns = reader.fieldnames or []
    missing = [c for c in ("id", "offset_s", "sent_s", "ttft_s", "e2e_s", "status") if c not in columns]
    if missing:
        raise OpsError(f"records {path}: not a replay records.csv (no column {', '.join(missing)})")

    def number(row: dict[str, str], column: str, line: int) -> float | None:
        text = row.get(column) or ""
        if not text:
            return None
        try:
            return float(text)
        except ValueError:
            raise OpsError(f"{path}:{line}: {column} is not a number: {text!r}") from None

    records = []
    for row in reader:
        line = reader.line_num
        sent = number(row, "sent_s", line)
        ttft = number(row, "ttft_s", line)
        e2e = number(row, "e2e_s", line)
        tokens = number(row, "completion_tokens", line)
        prompt = number(row, "prompt_tokens", line)
        cached = number(row, "cached_tokens", line)
        try:
            gaps = [float(t) for t in (row.get("token_times_s") or "").split(";") if t]
        except ValueError:
            raise OpsError(f"{path}:{line}: token_times_s is not a ';'-separated list of numbers") from None
        records.append(RequestRecord(
            id=row["id"],
            offset_s=number(row, "offset_s", line) or 0.0,
            sent_s=sent,
            client_queue_s=number(row, "client_queue_s", line),
            first_token_s=None if sent is None or ttft is None else sent + ttft,
            end_s=None if sent is None or e2e is None else sent + e2e,
            prompt_tokens=None if prompt is None else int(prompt),
            completion_tokens=None if tokens is None else int(tokens),
            cached_tokens=None if cached is None else int(cached),
            status=row["status"],
            error=row.get("error") or "",
            token_times_s=[sent + t for t in gaps] if sent is not None else [],
        ))
    if not records:
        raise OpsError(f"records {path}: no rows")
    return records


def write_summary_json(
    path: Path,
    summary: ReplaySummary,
    gate_results: Sequence[GateResult],
    passed: bool,
    context: dict[str, Any],
) -> None:
    data = {
        **context,
        "summary": summary.to_json(),
        "gates": [
            {"gate": r.gate.description, "metric": r.gate.metric, "limit": r.gate.limit, "value": r.value,
             "passed": r.passed}
            for r in gate_results
        ],
        "verdict": "PASS" if passed else "FAIL",
    }
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _distribution_row(name: str, dist: Distribution) -> str:
    return (
        f"  {name:<13} {dist.count:>6} {_seconds(dist.p50):>8} {_seconds(dist.p90):>8}"
        f" {_seconds(dist.p99):>8} {_seconds(dist.mean):>8}"
    )


METRIC_LABELS = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "itl": "ITL",
    "e2el": "E2EL",
    "client_queue_time": "client queue",
    "e2el_including_client_queue": "E2EL + queue",
    "send_lag": "send lag",
}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def latency_table(summary: ReplaySummary) -> list[str]:
    """The --percentile-metrics at the --metric-percentiles, in milliseconds, and the send lag."""
    keys = [percentile_key(q) for q in summary.percentiles]
    lines = [f"  {'ms':<13} {'n':>6} " + " ".join(f"{key:>8}" for key in keys) + f" {'mean':>8}"]
    for metric, stats in summary.latency_ms.items():
        cells = " ".join(f"{_ms(stats.get(key)):>8}" for key in [*keys, "mean"])
        lines.append(f"  {METRIC_LABELS.get(metric, metric):<13} {int(stats.get('count') or 0):>6} {cells}")
    return lines


def throughput_lines(summary: ReplaySummary) -> list[str]:
    tput = summary.throughput
    lines = [
        f"throughput over {tput.span_s:.1f} s (first send to last end): {tput.requests_per_s:.3f} req/s "
        f"completed, output {tput.output_tokens_per_s:.1f} "
        f"tok/s ({summary.completion_tokens} tokens); {tput.tokens_per_minute / 1e6:.3f}M tokens/min "
        f"(prompt + output)"
        + (f", {tput.tokens_per_minute_per_node / 1e6:.3f}M per node over {tput.nodes} nodes"
           if tput.tokens_per_minute_per_node is not None else ""),
    ]
    per_request = tput.output_tps_per_request
    if per_request.count:
        lines.append(f"output tok/s per request (tokens / e2e): p50 {per_request.p50:.1f}, "
                     f"p90 {per_request.p90:.1f}, min {per_request.min:.1f}, mean {per_request.mean:.1f}")
    lines.extend(latency_table(summary))
    if tput.good_requests is not None:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in tput.goodput_slo_ms.items())
        lines.append(f"goodput ({slo}): {tput.good_requests} of {summary.ok} ok requests, "
                     f"{tput.goodput_per_s:.3f} req/s")
    if summary.send_lag_warning:
        lines.append(f"WARNING: {summary.send_lag_warning}")
    return lines


def concurrency_line(max_concurrency: int, summary: ReplaySummary) -> str:
    queue = summary.client_queue
    waited = (f"client queue p50 {queue.p50:.2f} s, max {queue.max:.2f} s" if queue.count
              else "no request waited")
    return (f"NOT OPEN LOOP: --max-concurrency {max_concurrency} held later sends until a request ended "
            f"({waited}); TTFT excludes that wait")


def format_report(summary: ReplaySummary, gate_results: Sequence[GateResult], passed: bool,
                  max_concurrency: int | None = None) -> str:
    lines = [
        f"requests: {summary.requests} in the stream, {summary.sent} sent, {summary.ok} ok "
        f"({summary.success_pct:.1f}%), {summary.failed} failed; run {summary.duration_s:.1f} s; "
        f"peak in flight {summary.peak_in_flight}",
        f"TTFT measured: {summary.with_ttft} with TTFT / {summary.ok} ok",
    ]
    if max_concurrency is not None:
        lines.append(concurrency_line(max_concurrency, summary))
    if summary.failures_by_status:
        lines.append(
            "failures: "
            + ", ".join(f"{status} {count}" for status, count in sorted(summary.failures_by_status.items()))
        )
    lines.append(f"  {'TTFT (s)':<13} {'n':>6} {'p50':>8} {'p90':>8} {'p99':>8} {'mean':>8}")
    lines.append(_distribution_row("overall", summary.ttft))
    for name, dist in zip(THIRD_NAMES, summary.ttft_thirds):
        lines.append(_distribution_row(name, dist))
    lines.append(_distribution_row("e2e (s)", summary.e2e))
    lines.extend(throughput_lines(summary))
    lines.append("gates:")
    lines.extend("  " + result.line() for result in gate_results)
    lines.append(f"verdict: {'PASS' if passed else 'FAIL'}")
    return "\n".join(lines)
