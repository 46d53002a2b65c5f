"""The fleet simulator: its queueing against M/D/1, the write-up's figures, layout and the CLI.

M/D/1 (Poisson arrivals, one server, deterministic service D): the mean wait
in queue is rho * D / (2 * (1 - rho)). The simulator reduces to it with one
rank, one shard and prompts of one chunk that is always in L2: in async mode
the shard is the server (the timeout never fires), in sync mode the frozen pod
is. Tolerance 6% of the closed form: the standard error of a mean over
80,000 customers is about 2% at rho = 0.8 (strongly correlated waits), less
below.

The write-up's figures (test per figure): inputs are the write-up's own
(cellsim_writeup.py); each simulated figure is the median over 20 Poisson
streams. A figure counts as reproduced within 20% of the write-up's value;
figures the model does not reproduce are tested on what it does claim, with
the reason (scripts/README.md has the table).
"""
from __future__ import annotations

import csv
import json
import statistics

import pytest
from opstools import cellsim_cli, replay_cli
from opstools.cellsim_model import Arrival, CellConfig, busy_per_window, poisson_arrivals, simulate
from opstools.cellsim_writeup import RECOMPUTE_S, reproduce

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def md1_mean_wait(loading: str, rho: float, customers: int = 40_000, seeds: int = 2) -> tuple[float, float]:
    """(simulated mean wait, shard utilisation) with D = 1 s."""
    waits: list[float] = []
    util = []
    config = CellConfig(ranks=1, shards=1, loading=loading, get_s=1.0, chunk_tokens=1, async_timeout_s=1e12)
    for seed in range(seeds):
        result = simulate(config, poisson_arrivals(customers, rho, 1, 1.0, 1, seed))
        waits.extend(o.ttft_s - 1.0 for o in result.outcomes)
        util.append(result.shard_utilisation()[0])
    return statistics.fmean(waits), statistics.fmean(util)


@pytest.mark.parametrize("rho", [0.3, 0.6, 0.8])
def test_a_frozen_pod_queues_as_m_d_1(rho):
    wait, util = md1_mean_wait("sync", rho)
    assert wait == pytest.approx(rho / (2 * (1 - rho)), rel=0.06)
    assert util == pytest.approx(rho, rel=0.02)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_a_shard_queues_as_m_d_1(rho):
    wait, util = md1_mean_wait("async", rho)
    assert wait == pytest.approx(rho / (2 * (1 - rho)), rel=0.06)
    assert util == pytest.approx(rho, rel=0.02)


def test_rank_r_of_every_pod_reads_shard_r():
    sharded = CellConfig(ranks=8, shards=8)
    assert sharded.chunks_per_shard(0, 63) == [8, 8, 8, 8, 8, 8, 8, 7]
    assert CellConfig(ranks=8, shards=4).chunks_per_shard(0, 64) == [16] * 4  # ranks r and r+4 share one
    assert CellConfig(ranks=8, shards=8, store="rank0").chunks_per_shard(0, 63) == [63, 0, 0, 0, 0, 0, 0, 0]
    # four pods, each at the write-up's rate, share the same eight shards: four times the load on each
    one = simulate(CellConfig(pods=1, shards=8, get_s=8.9e-3), poisson_arrivals(450, 1.2, 16384, 0.985, 256, 1))
    four = simulate(CellConfig(pods=4, shards=8, get_s=8.9e-3), poisson_arrivals(1800, 4.8, 16384, 0.985, 256, 1))
    assert max(four.shard_utilisation()) == pytest.approx(4 * max(one.shard_utilisation()), rel=0.1)
    assert {o.pod for o in four.outcomes} == {0, 1, 2, 3}


def test_an_async_timeout_recomputes_while_the_prefetch_keeps_the_shard_busy():
    # one 64-chunk prompt at 0.1 s per GET: 6.4 s of prefetch, timeout at 1 s, then 0.31 s of recompute
    config = CellConfig(shards=1, store="rank0", loading="async", get_s=0.1, async_timeout_s=1.0,
                        prefill_tokens_per_s=16384 / 0.31)
    result = simulate(config, [Arrival(0.0, 16384, 16384)])
    outcome = result.outcomes[0]
    assert outcome.timed_out and outcome.ttft_s == pytest.approx(1.31)
    assert result.shard_busy[0] == [(0.0, pytest.approx(6.4))]  # not cancelled
    sync = simulate(CellConfig(shards=1, get_s=0.1), [Arrival(0.0, 16384, 16384), Arrival(0.5, 16384, 16384)])
    assert [o.ttft_s for o in sync.outcomes] == [pytest.approx(6.4), pytest.approx(12.3)]  # the pod was frozen


def test_busy_per_window_splits_intervals_at_window_edges():
    assert busy_per_window([(5.0, 15.0), (18.0, 19.0)], 20.0, 10.0) == [pytest.approx(0.5), pytest.approx(0.6)]


# -- the write-up's figures ----------------------------------------------------


@pytest.fixture(scope="module")
def figures():
    return {(r.figure.scenario, r.figure.name): r for r in reproduce(seeds=20)}


def within(value: float, target: float, rel: float = 0.2) -> bool:
    return (1 - rel) * target <= value <= (1 + rel) * target


def test_sync_last_third_median_within_20pct(figures):
    row = figures[("sync, 1 instance", "median TTFT, last third")]
    assert within(row.median, 52.5), row  # simulated ~48 s


def test_sync_peak_in_flight_within_20pct(figures):
    row = figures[("sync, 1 instance", "peak in flight")]
    assert within(row.median, 59), row  # simulated ~64


def test_sync_first_and_second_third_rise_but_not_as_measured(figures):
    # Not reproduced (sim ~14 s and ~27 s against 3.5 s and 9.0 s): at a constant per-GET time the queue grows
    # from the first second; the run's slow start then steep rise needs a service time that grows under load.
    # Tested: the runaway itself, medians rising third over third, the last one over three times the first.
    first = figures[("sync, 1 instance", "median TTFT, first third")].median
    second = figures[("sync, 1 instance", "median TTFT, second third")].median
    last = figures[("sync, 1 instance", "median TTFT, last third")].median
    assert first < second < last and last > 3 * first
    assert not within(first, 3.5) and not within(second, 9.0)  # the table says "no": keep it honest


def test_sync_p99_within_20pct_only_over_the_bandwidth_interval(figures):
    # At the midpoint 0.835 GB/s the p99 is ~59 s (0.70 of 83.7); across the measured 0.78-0.89 GB/s it spans
    # ~36-86 s, which holds 83.7 s: reproduced within the input's own uncertainty, not at its midpoint.
    row = figures[("sync, 1 instance", "p99 TTFT")]
    assert not within(row.median, 83.7)
    assert 0.8 * row.band_low <= 83.7 <= 1.2 * row.band_high


def test_sync_gpu_busy_is_a_lower_bound_of_the_measured(figures):
    # Not reproduced (~0.5% against 7%): the model counts only the prefill of the 1.5% not in L2; the measured
    # share also holds GPU work outside that (the load path, collectives), which the model does not have.
    row = figures[("sync, 1 instance", "GPU busy")]
    assert row.median < 0.07 and row.median < 0.1


def test_async_rank0_ttft_capped_at_timeout_plus_recompute_within_20pct(figures):
    assert within(figures[("async rank-0, 1 instance", "median TTFT")].median, 3.2)  # 3 s + 0.31 s
    assert within(figures[("async rank-0, 1 instance", "p99 TTFT")].median, 3.8)


def test_async_rank0_timeout_share_is_not_reproduced(figures):
    # Not reproduced (~98% against 49%): the instance's offered load is 1.2/s x 63 GETs x 14.85 ms = 1.12 > 1 and
    # the prefetches of timed-out requests keep running, so the backlog never drains and nearly every later
    # lookup times out. 49% needs the instance below saturation in that run (the model gives 66% at 1.0 GB/s,
    # 36% at 1.1 GB/s): more bandwidth under async concurrency than the 0.78-0.89 GB/s measured, or prefetches
    # that ended early. Tested: at least the write-up's share times out.
    row = figures[("async rank-0, 1 instance", "timeout share")]
    assert row.median >= 0.49 and not within(row.median, 0.49)


def test_eight_shards_utilisation_within_20pct(figures):
    assert within(figures[("sync, 8 shards", "shard utilisation")].median, 0.09)


def test_eight_shards_async_ttft_at_or_below_recompute(figures):
    # The write-up: TTFT near recompute, ~0.1 s over it at the median, spent in the engine's load path. The model
    # has only the cache tier (74 ms of GETs per rank-shard), so its TTFT is below recompute; tested: no backlog,
    # p99 within the write-up's recompute + 0.1 s.
    row = figures[("async, 8 shards", "median TTFT")]
    assert row.median <= RECOMPUTE_S + 0.1 and row.seed_high <= RECOMPUTE_S + 0.1


# -- the tool ----------------------------------------------------------------


def test_run_writes_records_the_replay_can_rejudge_and_pngs(tmp_path, capsys):
    out = tmp_path / "sim"
    code = cellsim_cli.main(["run", "--shards", "8", "--get-ms", "8.9", "--loading", "async", "--count", "200",
                             "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "shard utilisation: " in printed and "verdict: PASS" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sim"]["timeout_share"] == 0.0 and len(summary["sim"]["shard_utilisation"]) == 8
    for name in ("ttft_over_time.png", "in_flight.png", "cache_tier.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name
    assert replay_cli.main(["report", str(out / "records.csv"), "--gate-p90", "0.01", "--no-plots",
                            "--out", str(tmp_path / "rejudged")]) == 1


def test_run_reads_a_replay_stream(tmp_path, capsys):
    stream = tmp_path / "stream.jsonl"
    stream.write_text("".join(json.dumps({"id": f"r{i}", "offset_s": i * 0.5, "prompt": "x", "max_tokens": 1,
                                          "approx_prompt_tokens": 8192}) + "\n" for i in range(10)))
    out = tmp_path / "sim"
    assert cellsim_cli.main(["run", "--stream", str(stream), "--no-plots", "--out", str(out)]) == 0
    with (out / "records.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["prompt_tokens"] for r in rows] == ["8192"] * 10
    assert cellsim_cli.main(["run", "--stream", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_sweep_names_the_smallest_cell_that_passes(capsys):
    # four pods' worth of the write-up's load (4.8/s) with synchronous loading: how many shards?
    code = cellsim_cli.main(["sweep", "--rate", "4.8", "--count", "400", "--pods", "4", "--shards", "1,2,8",
                             "--gate-p90", "1", "--gate-p50", "off", "--gate-mean", "off", "--seeds", "2"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "smallest cell passing TTFT P90 < 1 s in every stream: 4 pod(s), 8 shard(s)" in printed
