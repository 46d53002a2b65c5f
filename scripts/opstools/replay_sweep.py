"""A rate sweep's table: one row per rate, from each rate's ``result.json`` and TTFT summary.

Rows carry ``vllm bench serve``'s key names (``request_rate``,
``request_throughput``, ``output_throughput``, ``median_ttft_ms``, ...), so
the sweep's ``sweep.json`` and ``sweep.csv`` read like a series of vLLM
results.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import EXIT_ERROR, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from .stats import Distribution

RESULT_KEYS = (
    "completed", "failed", "not_sent", "request_throughput", "output_throughput", "total_token_throughput",
    "max_concurrent_requests", "verdict", "aborted",
)
TTFT_KEYS = ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms")
ROW_KEYS = RESULT_KEYS[:-2] + TTFT_KEYS + RESULT_KEYS[-2:]


@dataclass
class SweepRow:
    rate: float
    folder: str  # the rate's output folder, inside the sweep's
    code: int  # the rate's exit code
    result: dict[str, Any]  # its result.json; empty when nothing was sent
    ttft: Distribution | None  # seconds; None when nothing was sent

    def as_dict(self) -> dict[str, Any]:
        """The row under vLLM's key names (TTFT in ms whatever --percentile-metrics chose)."""
        values: dict[str, Any] = {key: self.result.get(key) for key in RESULT_KEYS}
        ttft = self.ttft or Distribution(count=0)
        for key, seconds in zip(TTFT_KEYS, (ttft.mean, ttft.p50, ttft.p90, ttft.p99)):
            values[key] = None if seconds is None else seconds * 1000
        if not self.result:
            values["verdict"] = "ERROR"
        return {"request_rate": "inf" if math.isinf(self.rate) else self.rate, "folder": self.folder,
                **{key: values[key] for key in ROW_KEYS}}


def rate_folder(rate: float) -> str:
    return f"rate-{rate:g}"


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def sweep_table(rows: list[SweepRow]) -> list[str]:
    """A Markdown table of the rates run, then the highest rate that passed every gate."""
    header = ("| rate (req/s) | completed | failed | req/s done | output tok/s | TTFT p50 (ms) | TTFT p90 (ms) "
              "| TTFT p99 (ms) | verdict |")
    lines = [header, "|" + " --- |" * 9]
    for row in rows:
        data = row.as_dict()
        lines.append(
            f"| {row.rate:g} | {_cell(data['completed'])} | {_cell(data['failed'])} "
            f"| {_cell(data['request_throughput'], 3)} | {_cell(data['output_throughput'], 1)} "
            f"| {_cell(data['median_ttft_ms'], 1)} | {_cell(data['p90_ttft_ms'], 1)} "
            f"| {_cell(data['p99_ttft_ms'], 1)} | {data['verdict']}"
            + (" (stopped early)" if data["aborted"] else "") + " |")
    passing = [row.rate for row in rows if row.code == EXIT_OK]
    lines.append(f"highest rate passing every gate: {max(passing):g} req/s" if passing
                 else "no rate passed every gate")
    return lines


def write_sweep(out: Path, rows: list[SweepRow], context: dict[str, Any]) -> None:
    data = [row.as_dict() for row in rows]
    rates = [r if not math.isinf(r) else "inf" for r in context.get("rates", [])]
    summary = {**context, "rates": rates, "rows": data}
    (out / "sweep.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    with (out / "sweep.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["request_rate", "folder", *ROW_KEYS])
        writer.writeheader()
        writer.writerows(data)


def sweep_code(rows: list[SweepRow], rates_asked: int) -> int:
    """The worst outcome: interrupted, error, a failed gate, or every rate passing."""
    codes = {row.code for row in rows}
    for code in (EXIT_INTERRUPTED, EXIT_ERROR):
        if code in codes:
            return code
    if len(rows) < rates_asked or EXIT_FAILED in codes:
        return EXIT_FAILED
    return EXIT_OK
