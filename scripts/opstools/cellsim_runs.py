"""One cell over several seeds: per-seed runs, their figures, and one table, one CSV and one verdict for all.

Every figure is the median over the seeds with its range beside it; the
verdict passes only when the gates pass in every seed; ``records.csv`` holds
every seed's requests, told apart by its ``seed`` column (ids ``s<seed>-r<n>``),
in the replay's columns otherwise, so ``scripts/replay report`` reads it (it
then judges the seeds' requests pooled).
"""
from __future__ import annotations

import csv
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import gates as gate_rules
from .cellsim_model import Arrival, CellConfig, SimResult, simulate
from .records import OK, RequestRecord
from .replay_report import CSV_COLUMNS, record_row
from .stats import ReplaySummary, summarize


@dataclass
class SeedRun:
    seed: int
    result: SimResult
    records: list[RequestRecord]
    summary: ReplaySummary
    gates: list[gate_rules.GateResult]

    @property
    def passed(self) -> bool:
        return gate_rules.verdict(self.gates)


def records_of(result: SimResult, seed: int) -> list[RequestRecord]:
    records = []
    for index, outcome in enumerate(result.outcomes):
        arrival = outcome.arrival
        records.append(RequestRecord(
            id=f"s{seed}-r{index:05d}", offset_s=arrival.arrival_s, sent_s=arrival.arrival_s,
            first_token_s=outcome.first_token_s, end_s=outcome.first_token_s, prompt_tokens=arrival.prompt_tokens,
            completion_tokens=1, cached_tokens=0 if outcome.timed_out else arrival.hit_tokens, status=OK,
            error="async lookup timeout: recomputed" if outcome.timed_out else "",
        ))
    return records


def run_seeds(config: CellConfig, arrivals_for: Callable[[int], Sequence[Arrival]], seeds: Sequence[int],
              gates: list[gate_rules.Gate]) -> list[SeedRun]:
    runs = []
    for seed in seeds:
        result = simulate(config, arrivals_for(seed))
        records = records_of(result, seed)
        summary = summarize(records)
        runs.append(SeedRun(seed, result, records, summary, gate_rules.evaluate(summary, gates)))
    return runs


# (key, label, unit) of each figure the table and summary.json give
FIGURES = (
    ("ttft_p50", "TTFT p50", "s"),
    ("ttft_p90", "TTFT p90", "s"),
    ("ttft_p99", "TTFT p99", "s"),
    ("ttft_mean", "TTFT mean", "s"),
    ("ttft_p50_first_third", "TTFT p50, first third", "s"),
    ("ttft_p50_second_third", "TTFT p50, second third", "s"),
    ("ttft_p50_last_third", "TTFT p50, last third", "s"),
    ("peak_in_flight", "peak in flight", ""),
    ("tokens_per_minute", "tokens per minute (prompt + output)", ""),
    ("gpu_busy", "GPU busy", "share"),
    ("max_shard_utilisation", "busiest shard's thread", "share"),
    ("timeout_share", "async timeouts", "share"),
)


def figures_of(run: SeedRun) -> dict[str, float | None]:
    summary, result = run.summary, run.result
    thirds = [d.p50 for d in summary.ttft_thirds]
    return {
        "ttft_p50": summary.ttft.p50, "ttft_p90": summary.ttft.p90, "ttft_p99": summary.ttft.p99,
        "ttft_mean": summary.ttft.mean, "ttft_p50_first_third": thirds[0], "ttft_p50_second_third": thirds[1],
        "ttft_p50_last_third": thirds[2], "peak_in_flight": float(summary.peak_in_flight),
        "tokens_per_minute": summary.throughput.tokens_per_minute, "gpu_busy": result.gpu_busy_fraction(),
        "max_shard_utilisation": max(result.shard_utilisation()), "timeout_share": result.timeout_share(),
    }


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(known), "min": min(known), "max": max(known)}


def aggregate(runs: Sequence[SeedRun]) -> dict[str, dict[str, float | None]]:
    per_seed = [figures_of(run) for run in runs]
    return {key: spread([figures[key] for figures in per_seed]) for key, _, _ in FIGURES}


def seeds_label(runs: Sequence[SeedRun]) -> str:
    if len(runs) == 1:
        return f"1 seed ({runs[0].seed})"
    return f"{len(runs)} seeds ({runs[0].seed}..{runs[-1].seed})"


def _shown(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "share":
        return f"{value:.1%}"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:,.0f}"


def format_table(runs: Sequence[SeedRun]) -> str:
    figures = aggregate(runs)
    lines = [f"over {seeds_label(runs)}: median and range over the seeds",
             f"  {'figure':<36} {'median':>12}   range"]
    for key, label, unit in FIGURES:
        row = figures[key]
        lines.append(f"  {label:<36} {_shown(row['median'], unit):>12}   "
                     f"{_shown(row['min'], unit)} .. {_shown(row['max'], unit)}")
    return "\n".join(lines)


def gate_lines(runs: Sequence[SeedRun]) -> list[dict[str, Any]]:
    """Each gate over the seeds: how many pass, and the value's median and range."""
    out = []
    for index, result in enumerate(runs[0].gates):
        results = [run.gates[index] for run in runs]
        out.append({"gate": result.gate.description, "passed_seeds": sum(r.passed for r in results),
                    "seeds": len(runs), **spread([r.value for r in results])})
    return out


def format_gates(runs: Sequence[SeedRun]) -> str:
    lines = [f"gates (each must pass in every one of the {len(runs)} seeds):"]
    for gate in gate_lines(runs):
        mark = "pass" if gate["passed_seeds"] == gate["seeds"] else "FAIL"
        value = "no data" if gate["median"] is None else f"median {gate['median']:.2f}"
        lines.append(f"  {mark}  {gate['gate']:<22} in {gate['passed_seeds']}/{gate['seeds']} seeds, {value}")
    return "\n".join(lines)


def verdict(runs: Sequence[SeedRun]) -> bool:
    return all(run.passed for run in runs)


def write_records(path: Path, runs: Sequence[SeedRun]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=("seed", *CSV_COLUMNS))
        writer.writeheader()
        for run in runs:
            for record in run.records:
                writer.writerow({"seed": str(run.seed), **record_row(record)})


def summary_json(config: CellConfig, runs: Sequence[SeedRun]) -> dict[str, Any]:
    return {
        "config": {key: list(value) if isinstance(value, tuple) else value for key, value in config.__dict__.items()},
        "seeds": [run.seed for run in runs],
        "over": seeds_label(runs),
        "figures": aggregate(runs),
        "gates": gate_lines(runs),
        "per_seed": [{"seed": run.seed, "passed": run.passed, **figures_of(run)} for run in runs],
        "verdict": "PASS" if verdict(runs) else "FAIL",
    }
