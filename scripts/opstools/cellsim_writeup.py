"""The write-up's measured figures, its predictions, and the simulator's runs of them.

Inputs (all the write-up's; ``cellsim_defaults`` has the parameters derived
from its measurements): 450 hit-heavy requests of 16k tokens over 374 s
(Poisson, lambda = 1.20/s), 98.5% of prompt tokens in L2 (63 of 64 chunks of
256 tokens, 12.4 MB each, the chunk its times were measured with), one B300
prefill node (one pod, PCP over 8 ranks), 0.31 s to recompute a 16k prompt,
8.9 ms of server time per GET, the 3 s async lookup timeout, the 1.55 s the
other ranks waited while rank 0 copied 19.1 GB of KV inside the steps.

Every scenario runs with the same parameter set, the documented defaults;
nothing is tuned per figure. A figure is the median over ``seeds`` Poisson
streams (near rho = 1 one stream differs a lot from the next), with the
range over the streams and, for the one-instance runs, the medians at the
ends of the measured 0.83-0.89 s load beside it.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvsizing.geometry import WRITEUP_CHUNK_BYTES

from . import cellsim_defaults as defaults
from .cellsim_model import Arrival, CellConfig, SimResult, poisson_arrivals, simulate
from .records import RequestRecord
from .stats import percentile, split_by_send_time

REQUESTS = 450
SPAN_S = 374.0
PROMPT_TOKENS = 16_384
HIT_FRACTION = 0.985
SEEDS = 20

SYNC_ONE = "sync, 1 instance"
ASYNC_RANK0 = "async rank-0, 1 instance"
ASYNC_EIGHT = "async, 8 shards"
SYNC_EIGHT = "sync, 8 shards"


def writeup_config(loading: str, store: str, shards: int, load_s: float = defaults.INSTANCE_LOAD_S[1]) -> CellConfig:
    return CellConfig(pods=1, ranks=defaults.RANKS, shards=shards, store=store, loading=loading,
                      get_s=defaults.get_s_for_chunk(defaults.GET_MS, WRITEUP_CHUNK_BYTES, WRITEUP_CHUNK_BYTES),
                      get_contention=defaults.writeup_contention(load_s))


SCENARIOS: dict[str, tuple[str, str, int]] = {
    SYNC_ONE: ("sync", "sharded", 1),  # the deployed setting of the runaway
    ASYNC_RANK0: ("async", "rank0", 1),  # LMCache's default async path, the rank-0 store
    ASYNC_EIGHT: ("async", "sharded", 8),  # the fix: rank r reads shard r, async loading (H4-H5b)
    SYNC_EIGHT: ("sync", "sharded", 8),  # the same shards, synchronous (H3): the prediction rho ~ 0.09
}

# A figure the model does not reproduce says which mechanism (or input) it lacks.
NO_SEND_TIMES = ("the run's original send times (a --trace of them): with Poisson arrivals at the mean 1.2/s and the "
                 "measured 0.83-0.89 s load, rho is 1.0-1.1 from the first second and the backlog grows from the start")
STEEP_END = ("a service time that grows with the backlog: at a constant service time (0.92 s per request, its "
             "chunks' GETs, load path and broadcasts) the backlog that ends in the 83.7 s p99 is about 90 requests, "
             "where the run had 59 in flight (1.44 s per request ahead). A frozen pod loads one request at a time, "
             "so its GETs never compete more (Valkey's thread 65% busy in the busiest minute, where the write-up's "
             "one-instance runs had 89-91%); loading a step's requests at once, each rank's GETs of each request "
             "competing ('concurrent loads compete for the same server'), runs away instead: 280 in flight, p99 "
             "1,060 s")


@dataclass(frozen=True)
class Figure:
    scenario: str
    name: str  # the key in figures_of()
    low: float  # the write-up's value, or the low end of its range
    high: float
    claim: str  # the write-up's words
    unit: str = "s"
    calibrates: str = ""  # the default this measurement sets, where it sets one (then not independent)
    missing: str = ""  # why the model does not reproduce it ("" where it does)

    def within(self, value: float, rel: float = 0.2) -> bool:
        return (1 - rel) * self.low <= value <= (1 + rel) * self.high


MEASURED = (
    Figure(SYNC_ONE, "median TTFT, first third", 3.5, 3.5, "median latency of 3.5 s in the first third",
           missing=NO_SEND_TIMES),
    Figure(SYNC_ONE, "median TTFT, second third", 9.0, 9.0, "9.0 s in the second", missing=NO_SEND_TIMES),
    Figure(SYNC_ONE, "median TTFT, last third", 52.5, 52.5, "52.5 s in the last"),
    Figure(SYNC_ONE, "p99 TTFT", 83.7, 83.7, "p99 of 83.7 s",
           calibrates="gpu_load_s_per_chunk (the run's length in its 7% arithmetic: 374 s + this p99)"),
    Figure(SYNC_ONE, "peak in flight", 59, 59, "up to 59 requests in flight", unit="", missing=STEEP_END),
    Figure(SYNC_ONE, "GPU busy", 0.07, 0.07, "GPUs only 7% busy", unit="share", calibrates="gpu_load_s_per_chunk"),
    Figure(ASYNC_RANK0, "p99 TTFT", 3.2, 3.8, "capped latency at 3.2-3.8 s"),
    Figure(ASYNC_RANK0, "timeout share", 0.49, 0.49, "49% of requests hit the 3 s async-lookup timeout",
           unit="share"),
    Figure(ASYNC_EIGHT, "median TTFT", 0.40, 0.40, "p50 0.40 s", calibrates="engine_load_s_per_chunk"),
    Figure(ASYNC_EIGHT, "p99 TTFT", 0.67, 0.67, "p99 0.67 s"),
)


@dataclass(frozen=True)
class Prediction:
    scenario: str
    name: str
    value: float
    claim: str
    unit: str = ""


PREDICTIONS = (
    Prediction(SYNC_ONE, "offered rho", 1.07, "rho = lambda x T_service ~ 1.2/s x 0.9 s ~ 1.07 > 1"),
    Prediction(SYNC_EIGHT, "shard utilisation", 0.09, "eight instances: rho ~ 0.09", "share"),
    Prediction(ASYNC_EIGHT, "hit GETs", 0.074, "the whole 16k prompt arrives in about 74 ms", "s"),
)


def figures_of(result: SimResult) -> dict[str, float]:
    """Every figure the tables compare, from one run."""
    outcomes = result.outcomes
    records = [RequestRecord(id=str(i), offset_s=o.arrival.arrival_s, sent_s=o.arrival.arrival_s,
                             first_token_s=o.first_token_s, end_s=o.first_token_s, status="ok")
               for i, o in enumerate(outcomes)]
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    thirds = [[r.ttft_s for r in group] for group in split_by_send_time(records)]
    events = sorted([(o.arrival.arrival_s, 1) for o in outcomes]
                    + [(o.first_token_s, -1) for o in outcomes if o.first_token_s is not None])
    level = peak = 0
    for _, change in events:
        level += change
        peak = max(peak, level)
    prefetches = [o.gets_s for o in outcomes if o.gets_s and not o.timed_out]
    return {
        "median TTFT": percentile(ttfts, 50),
        "p99 TTFT": percentile(ttfts, 99),
        "median TTFT, first third": percentile(thirds[0], 50),
        "median TTFT, second third": percentile(thirds[1], 50),
        "median TTFT, last third": percentile(thirds[2], 50),
        "peak in flight": float(peak),
        "GPU busy": result.gpu_busy_fraction(),
        "timeout share": result.timeout_share(),
        "shard utilisation": max(result.shard_utilisation()),
        "offered rho": REQUESTS / SPAN_S * alone_s(result.config),
        "hit GETs": statistics.median(prefetches) if prefetches else 0.0,  # async: the prefetch's GETs
    }


def alone_s(config: CellConfig) -> float:
    """A write-up request's time to first token with nothing else in flight: the pod's service time."""
    hit = int(PROMPT_TOKENS * HIT_FRACTION) // config.chunk_tokens * config.chunk_tokens
    return simulate(config, [Arrival(0.0, PROMPT_TOKENS, hit)]).outcomes[0].ttft_s or 0.0


def run_scenario(name: str, seeds: int = SEEDS, first_seed: int = 0,
                 load_s: float = defaults.INSTANCE_LOAD_S[1]) -> list[dict[str, float]]:
    """The figures of every stream of one scenario."""
    config = writeup_config(*SCENARIOS[name], load_s=load_s)
    return [figures_of(simulate(config, poisson_arrivals(REQUESTS, REQUESTS / SPAN_S, PROMPT_TOKENS, HIT_FRACTION,
                                                         config.chunk_tokens, seed)))
            for seed in range(first_seed, first_seed + seeds)]


@dataclass(frozen=True)
class Row:
    scenario: str
    name: str
    median: float  # over the seeds, at the midpoint load
    seed_low: float
    seed_high: float
    band: tuple[float, float] | None  # medians at the ends of the measured one-instance load (None: not run)


def summarise(name: str, runs: dict[float, list[dict[str, float]]], figure: str) -> Row:
    scenario_runs = runs[defaults.INSTANCE_LOAD_S[1]]
    values = [run[figure] for run in scenario_runs]
    ends = [statistics.median(run[figure] for run in runs[s]) for s in (defaults.INSTANCE_LOAD_S[0],
                                                                        defaults.INSTANCE_LOAD_S[2]) if s in runs]
    band = (min(ends), max(ends)) if len(ends) == 2 else None
    return Row(name, figure, statistics.median(values), min(values), max(values), band)


def reproduce(seeds: int = SEEDS, first_seed: int = 0, band: bool = True) -> tuple[list[Row], list[Row]]:
    """(measured rows, prediction rows): every figure over ``seeds`` streams; with ``band`` the one-instance
    scenarios also run at the ends of the measured load time."""
    runs: dict[str, dict[float, list[dict[str, float]]]] = {}
    for name, (_, _, shards) in SCENARIOS.items():
        loads = defaults.INSTANCE_LOAD_S if band and shards == 1 else (defaults.INSTANCE_LOAD_S[1],)
        runs[name] = {load: run_scenario(name, seeds, first_seed, load) for load in loads}
    measured = [summarise(f.scenario, runs[f.scenario], f.name) for f in MEASURED]
    predicted = [summarise(p.scenario, runs[p.scenario], p.name) for p in PREDICTIONS]
    return measured, predicted


def _value(value: float, unit: str) -> str:
    if unit == "share":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def _written(low: float, high: float, unit: str) -> str:
    return _value(low, unit) if low == high else f"{_value(low, unit)}-{_value(high, unit)}"


def format_tables(measured: list[Row], predicted: list[Row], seeds: int) -> str:
    low, mid, high = defaults.INSTANCE_LOAD_S
    lines = [
        f"write-up inputs: {REQUESTS} requests of {PROMPT_TOKENS} tokens over {SPAN_S:g} s (Poisson), "
        f"{HIT_FRACTION:.1%} in L2, recompute {defaults.RECOMPUTE_S} s, {defaults.GET_MS} ms per 12.4 MB GET, "
        f"one instance loading a 16k prompt in {low}-{high} s; median of {seeds} Poisson streams",
        "",
        f"| scenario | figure | write-up | simulated (median) | range over streams | at {low}...{high} s per load "
        "| within 20% | sets a default | missing mechanism |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for figure, row in zip(MEASURED, measured, strict=True):
        unit = figure.unit
        band = "-" if row.band is None else f"{_value(row.band[0], unit)}-{_value(row.band[1], unit)}"
        lines.append(
            f"| {figure.scenario} | {figure.name} | {_written(figure.low, figure.high, unit)} | "
            f"{_value(row.median, unit)} | {_value(row.seed_low, unit)}-{_value(row.seed_high, unit)} | {band} | "
            f"{'yes' if figure.within(row.median) else 'no'} | {figure.calibrates or '-'} | "
            f"{figure.missing or '-'} |")
    lines += ["", "predictions (the write-up's arithmetic, not measurements):", "",
              "| scenario | prediction | write-up | simulated (median) |", "| --- | --- | --- | --- |"]
    for prediction, row in zip(PREDICTIONS, predicted, strict=True):
        lines.append(f"| {prediction.scenario} | {prediction.claim} | {_value(prediction.value, prediction.unit)} "
                     f"| {_value(row.median, prediction.unit)} |")
    return "\n".join(lines)


def scenario_config(name: str) -> CellConfig:
    return writeup_config(*SCENARIOS[name])
