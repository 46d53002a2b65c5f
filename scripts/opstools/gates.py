"""SLA gates on a replay summary, and the verdict.

Defaults are the write-up's benchmark limits: TTFT P90 < 70 s, P50 < 30 s,
mean < 30 s, and 100% of the stream's requests successful. Latency gates are
strict (a value equal to the limit fails); the success gate passes at or
above its limit. A latency gate with no successful request to measure fails.

The output-throughput gate (off by default: a prefill-only replay with
``max_tokens: 1`` has almost no output) is a floor on the aggregate output
tokens/s, as the write-up's benchmark has one (30 tokens/s); it passes at or
above its limit.
"""
from __future__ import annotations

from dataclasses import dataclass

from .stats import ReplaySummary

DEFAULT_P90_S = 70.0
DEFAULT_P50_S = 30.0
DEFAULT_MEAN_S = 30.0
DEFAULT_SUCCESS_PCT = 100.0

TTFT_METRICS = ("p50", "p90", "p99", "mean")


@dataclass(frozen=True)
class Gate:
    metric: str  # one of TTFT_METRICS, "success_pct" or "output_tps"
    limit: float

    @property
    def description(self) -> str:
        if self.metric == "success_pct":
            return f"success >= {self.limit:g}%"
        if self.metric == "output_tps":
            return f"output >= {self.limit:g} tok/s"
        return f"TTFT {self.metric.upper() if self.metric != 'mean' else 'mean'} < {self.limit:g} s"


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    value: float | None
    passed: bool

    def line(self) -> str:
        if self.value is None:
            shown = "no data"
        elif self.gate.metric == "success_pct":
            shown = f"{self.value:.1f}%"
        elif self.gate.metric == "output_tps":
            shown = f"{self.value:.1f} tok/s"
        else:
            shown = f"{self.value:.2f} s"
        return f"{'pass' if self.passed else 'FAIL'}  {self.gate.description:<22} measured {shown}"


def build_gates(
    p50_s: float | None = DEFAULT_P50_S,
    p90_s: float | None = DEFAULT_P90_S,
    mean_s: float | None = DEFAULT_MEAN_S,
    success_pct: float | None = DEFAULT_SUCCESS_PCT,
    p99_s: float | None = None,
    output_tps: float | None = None,
) -> list[Gate]:
    """The gates to apply; ``None`` leaves a gate out."""
    gates = []
    for metric, limit in (("p90", p90_s), ("p50", p50_s), ("mean", mean_s), ("p99", p99_s)):
        if limit is not None:
            gates.append(Gate(metric, limit))
    if success_pct is not None:
        gates.append(Gate("success_pct", success_pct))
    if output_tps is not None:
        gates.append(Gate("output_tps", output_tps))
    return gates


def evaluate(summary: ReplaySummary, gates: list[Gate]) -> list[GateResult]:
    results = []
    for gate in gates:
        if gate.metric == "success_pct":
            value: float | None = summary.success_pct
            passed = summary.requests > 0 and summary.success_pct >= gate.limit
        elif gate.metric == "output_tps":
            value = summary.throughput.output_tokens_per_s if summary.ok else None
            passed = value is not None and value >= gate.limit
        elif gate.metric in TTFT_METRICS:
            value = getattr(summary.ttft, gate.metric)
            passed = value is not None and value < gate.limit
        else:
            raise ValueError(f"unknown gate metric {gate.metric!r}")
        results.append(GateResult(gate, value, passed))
    return results


def verdict(results: list[GateResult]) -> bool:
    return all(result.passed for result in results)
