"""The fleet simulator: its queueing against M/D/1, each mechanism on its own, the trace input and the CLI.

M/D/1 (Poisson arrivals, one server, deterministic service D): the mean wait
in queue is rho * D / (2 * (1 - rho)). The simulator reduces to it with one
rank, one shard, prompts of one chunk that is always in L2, no engine or GPU
time per step, no contention and one request per step: in async mode the
shard is the server (the timeout never fires), in sync mode the frozen pod
is. Tolerance 6% of the closed form: the standard error of a mean over
60,000 customers is about 2.3% at rho = 0.8 (strongly correlated waits), less
below.

The write-up's figures are tests/ops/test_cellsim_writeup.py.
"""
from __future__ import annotations

import csv
import json
import statistics

import pytest
from opstools import cellsim_cli, replay_cli
from opstools.cellsim_arrivals import read_trace
from opstools.cellsim_model import Arrival, CellConfig, busy_per_window, poisson_arrivals, simulate
from opstools.common import OpsError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BARE = dict(get_contention=0.0, engine_load_s_per_chunk=0.0, gpu_step_s=0.0, gpu_load_s_per_chunk=0.0)  # the tier alone
PROMPT = 16_384


def md1_mean_wait(loading: str, rho: float, customers: int = 30_000, seeds: int = 2) -> tuple[float, float]:
    """(simulated mean wait, shard utilisation) with D = 1 s."""
    waits: list[float] = []
    util = []
    config = CellConfig(ranks=1, shards=1, loading=loading, get_s=1.0, chunk_tokens=1, async_timeout_s=1e12,
                        step_requests=1, **BARE)
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


# -- the mechanisms, one at a time ------------------------------------------------


def test_the_main_thread_is_shared_by_clients_and_slows_with_each_one():
    # two ranks each GET 4 chunks from one instance at 1 s per GET, +50% per further client in flight:
    # both finish together at 8 GETs x 1.5 s; alone, one rank's 4 GETs take 4 s
    config = CellConfig(ranks=2, shards=1, get_s=1.0, chunk_tokens=1, engine_load_s_per_chunk=0.0, gpu_step_s=0.0,
                        get_contention=0.5, store_new_chunks=False)
    both = simulate(config, [Arrival(0.0, 9, 8)])
    assert both.outcomes[0].load_s == pytest.approx(12.0)
    alone = simulate(CellConfig(ranks=2, shards=2, get_s=1.0, chunk_tokens=1, engine_load_s_per_chunk=0.0,
                                gpu_step_s=0.0, get_contention=0.5, store_new_chunks=False), [Arrival(0.0, 9, 8)])
    assert alone.outcomes[0].load_s == pytest.approx(4.0)
    # one client's loads queue behind each other (its connector works through one queue): the rank-0 store
    rank0 = CellConfig(shards=1, store="rank0", loading="async", get_s=1.0, chunk_tokens=1, async_timeout_s=1e9,
                       store_new_chunks=False, **BARE)
    served = simulate(rank0, [Arrival(0.0, 4, 3), Arrival(0.0, 4, 3)])
    assert sorted(o.load_s for o in served.outcomes) == [pytest.approx(3.0), pytest.approx(6.0)]


def test_rank_r_of_every_pod_reads_shard_r():
    sharded = CellConfig(ranks=8, shards=8)
    assert sharded.chunks_per_shard(0, 63) == [8, 8, 8, 8, 8, 8, 8, 7]
    assert CellConfig(ranks=8, shards=4).chunks_per_shard(0, 64) == [16] * 4  # ranks r and r+4 share one
    assert CellConfig(ranks=8, shards=8, store="rank0").chunks_per_shard(0, 63) == [63, 0, 0, 0, 0, 0, 0, 0]
    # four pods, each at the write-up's rate, share the same eight shards: four times the load on each
    one = simulate(CellConfig(pods=1, shards=8), poisson_arrivals(450, 1.2, PROMPT, 0.985, 256, 1))
    four = simulate(CellConfig(pods=4, shards=8), poisson_arrivals(1800, 4.8, PROMPT, 0.985, 256, 1))
    assert max(four.shard_utilisation()) == pytest.approx(4 * max(one.shard_utilisation()), rel=0.1)
    assert {o.pod for o in four.outcomes} == {0, 1, 2, 3}


def test_a_hit_pays_the_gets_the_engine_path_and_the_step():
    # eight shards: 8 GETs per shard, then 63 chunks of engine time, then the step (GPU work + 256 tokens)
    config = CellConfig(shards=8, get_s=0.01, get_contention=0.0, engine_load_s_per_chunk=0.004, gpu_step_s=0.05,
                        gpu_load_s_per_chunk=0.001, prefill_tokens_per_s=PROMPT / 0.31)
    ttft = simulate(config, [Arrival(0.0, PROMPT, PROMPT - 256)]).outcomes[0].ttft_s
    assert ttft == pytest.approx(8 * 0.01 + 63 * 0.004 + 0.05 + 63 * 0.001 + 0.31 / 64)


def test_the_gpu_works_per_loaded_chunk_of_every_request_in_a_step():
    # the first request freezes the pod; three more share the next step, and each brings its 63 chunks' broadcasts
    config = CellConfig(shards=1, store="rank0", get_s=0.1, store_new_chunks=False, prefill_tokens_per_s=PROMPT / 0.31,
                        **{**BARE, "gpu_load_s_per_chunk": 0.001})
    result = simulate(config, [Arrival(t, PROMPT, PROMPT - 256) for t in (0.0, 1.0, 2.0, 3.0)])
    assert [o.batch for o in result.outcomes] == [1, 3, 3, 3]
    steps = [b - a for a, b in result.gpu_busy[0]]
    assert steps == [pytest.approx(63 * 0.001 + 0.31 / 64), pytest.approx(3 * (63 * 0.001 + 0.31 / 64))]


def test_async_loading_spends_the_engine_path_in_the_step_or_in_the_prefetch():
    # a hit prefetched in 8 x 0.01 s, then 63 x 4 ms of engine path (none of it a copy only the step can do): held in
    # the step, the second request (sent when the first is ready) waits for it; spent in the prefetch, the pod is free
    # and both take the same time
    arrivals = [Arrival(0.0, PROMPT, PROMPT - 256), Arrival(0.08, PROMPT, PROMPT - 256)]
    common = dict(shards=8, loading="async", get_s=0.01, prefill_tokens_per_s=PROMPT / 0.31, store_new_chunks=False,
                  **{**BARE, "engine_load_s_per_chunk": 0.004, "step_copy_s_per_chunk": 0.0})
    held = simulate(CellConfig(async_load_path="step", **common), arrivals).outcomes
    free = simulate(CellConfig(async_load_path="prefetch", **common), arrivals).outcomes
    alone = 0.08 + 63 * 0.004 + 0.31 / 64
    assert [o.ttft_s for o in free] == [pytest.approx(alone), pytest.approx(alone)]
    assert held[0].ttft_s == pytest.approx(alone) and held[1].ttft_s > alone + 0.1
    assert [o.gets_s for o in free] == [pytest.approx(0.08), pytest.approx(0.08)]
    with pytest.raises(ValueError, match="async_load_path 'gpu'"):
        CellConfig(async_load_path="gpu").validate()


def test_the_pods_loader_runs_the_prefetches_engine_path_in_turn_outside_the_step():
    # two hits sent together: their GETs queue per rank (0.08 s, 0.16 s), then the pod's one loader spends 63 x 4 ms
    # on each in turn; the steps (256 tokens each) do not wait for it
    common = dict(shards=8, loading="async", get_s=0.01, prefill_tokens_per_s=PROMPT / 0.31, store_new_chunks=False,
                  **{**BARE, "engine_load_s_per_chunk": 0.004, "step_copy_s_per_chunk": 0.0})
    outcomes = simulate(CellConfig(async_load_path="loader", **common),
                        [Arrival(0.0, PROMPT, PROMPT - 256), Arrival(0.0, PROMPT, PROMPT - 256)]).outcomes
    assert [o.ttft_s for o in outcomes] == [pytest.approx(0.08 + 63 * 0.004 + 0.31 / 64),
                                            pytest.approx(0.08 + 2 * 63 * 0.004 + 0.31 / 64)]
    assert [o.gets_s for o in outcomes] == [pytest.approx(0.08), pytest.approx(0.16)]


def test_the_step_copies_the_prefetched_chunks_into_gpu_memory_however_the_rest_is_spent():
    # 63 x 4 ms of engine path, 1 ms of it each chunk's copy into GPU memory: the step holds the pod for the copies
    # (63 ms), the prefetch spends the other 63 x 3 ms on its own; alone, a hit takes as long as with it all in one
    # place. Two hits sent together: the second's copies wait for the first's step, its prefetch does not
    common = dict(shards=8, loading="async", get_s=0.01, prefill_tokens_per_s=PROMPT / 0.31, store_new_chunks=False,
                  **{**BARE, "engine_load_s_per_chunk": 0.004, "step_copy_s_per_chunk": 0.001})
    config = CellConfig(async_load_path="prefetch", **common)
    assert config.in_step_s_per_chunk() == 0.001 and config.off_step_s_per_chunk() == pytest.approx(0.003)
    assert CellConfig(async_load_path="step", **common).in_step_s_per_chunk() == 0.004
    assert CellConfig(**{**common, "step_copy_s_per_chunk": 0.01}).in_step_s_per_chunk() == 0.004  # at most all
    one = simulate(config, [Arrival(0.0, PROMPT, PROMPT - 256)])
    assert one.outcomes[0].ttft_s == pytest.approx(0.08 + 63 * 0.004 + 0.31 / 64)
    assert [b - a for a, b in one.gpu_busy[0]] == [pytest.approx(0.31 / 64)]  # a copy is not GPU work
    two = simulate(config, [Arrival(0.0, PROMPT, PROMPT - 256), Arrival(0.0, PROMPT, PROMPT - 256)]).outcomes
    # GETs per rank in turn (0.08 s, 0.16 s), 0.189 s of prefetch each; the first step ends at 0.337 s
    first = 0.08 + 63 * 0.003 + 63 * 0.001 + 0.31 / 64
    assert [o.ttft_s for o in two] == [pytest.approx(first), pytest.approx(0.16 + 63 * 0.003 + 63 * 0.001 + 0.31 / 64)]
    # a 32-chunk hit sent at 0.15 s is ready at 0.15 + 0.04 + 32 x 3 ms = 0.286 s, inside the first's step
    # (0.269-0.337 s): its own step, 32 copies and 256 tokens, waits for that one to end
    held = simulate(config, [Arrival(0.0, PROMPT, PROMPT - 256), Arrival(0.15, 33 * 256, 32 * 256)]).outcomes
    assert held[1].load_s == pytest.approx(0.04 + 32 * 0.003)
    assert held[1].first_token_s == pytest.approx(first + 32 * 0.001 + 0.31 / 64)


def test_a_step_batches_the_waiting_requests_within_its_budgets():
    # the first request freezes the pod for 63 x 0.1 s; three more arrive meanwhile and share the next step
    config = CellConfig(shards=1, store="rank0", get_s=0.1, chunk_tokens=256, store_new_chunks=False, **BARE)
    arrivals = [Arrival(t, PROMPT, PROMPT - 256) for t in (0.0, 1.0, 2.0, 3.0)]
    batched = simulate(config, arrivals)
    assert [o.batch for o in batched.outcomes] == [1, 3, 3, 3]
    assert len({o.first_token_s for o in batched.outcomes[1:]}) == 1  # one first token for the whole step
    one_each = simulate(CellConfig(shards=1, store="rank0", get_s=0.1, step_requests=1, store_new_chunks=False,
                                   **BARE), arrivals)
    assert [o.batch for o in one_each.outcomes] == [1, 1, 1, 1]
    # a token budget of 300 fits one 256-token remainder per step
    tight = simulate(CellConfig(shards=1, store="rank0", get_s=0.1, step_tokens=300, store_new_chunks=False,
                                **BARE), arrivals)
    assert [o.batch for o in tight.outcomes] == [1, 1, 1, 1]


def test_a_timed_out_prefetch_keeps_the_shard_busy_and_the_recompute_is_stored_again():
    # one 64-chunk prompt at 0.1 s per GET: 6.3 s of prefetch, timeout at 1 s, then 0.31 s of recompute;
    # LMCache stores past what the lookup reported (0), so 64 SETs follow the orphaned prefetch
    config = CellConfig(shards=1, store="rank0", loading="async", get_s=0.1, async_timeout_s=1.0,
                        prefill_tokens_per_s=PROMPT / 0.31, **BARE)
    result = simulate(config, [Arrival(0.0, PROMPT, PROMPT - 256)])
    outcome = result.outcomes[0]
    assert outcome.timed_out and outcome.ttft_s == pytest.approx(1.31)
    assert result.shard_busy[0] == [(0.0, pytest.approx(6.3 + 6.4))]
    capped = simulate(CellConfig(shards=1, store="rank0", loading="async", get_s=0.1, async_timeout_s=1.0,
                                 orphan_cap=0, **BARE), [Arrival(0.0, PROMPT, PROMPT - 256)])
    assert capped.shard_busy[0] == [(0.0, pytest.approx(1.0)), (pytest.approx(1.31), pytest.approx(1.31 + 6.4))]


def test_a_lost_shard_ends_every_hit_at_its_first_chunk_there():
    config = CellConfig(shards=8, lost_shards=(3,), **BARE)
    assert config.found_chunks(63) == 3
    result = simulate(config, [Arrival(0.0, PROMPT, PROMPT - 256)])
    assert result.outcomes[0].load_s > 0 and not result.shard_busy[3]  # nothing reaches the lost instance
    assert result.gpu_busy[0][0][1] - result.gpu_busy[0][0][0] == pytest.approx((PROMPT - 3 * 256) / (PROMPT / 0.31))
    with pytest.raises(ValueError, match="lost shard 8"):
        CellConfig(shards=8, lost_shards=(8,)).validate()


def test_busy_per_window_splits_intervals_at_window_edges():
    assert busy_per_window([(5.0, 15.0), (18.0, 19.0)], 20.0, 10.0) == [pytest.approx(0.5), pytest.approx(0.6)]


# -- the trace input --------------------------------------------------------------


def test_a_trace_keeps_its_send_times_lengths_and_hits(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"id": "r00000", "offset_s": 0.5, "prompt": "x", "max_tokens": 1, "approx_prompt_tokens": 8200},  # generate
        {"offset_s": 0.0, "prompt_tokens": 1000, "hit_tokens": 700},
        {"offset_s": 2.0, "prompt_token_ids": [1] * 300},
        {"offset_s": 3.0, "prompt": "text without a count", "max_tokens": 1},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
    arrivals = read_trace(trace, default_tokens=4096, hit_fraction=0.5, chunk_tokens=256)
    assert arrivals == [Arrival(0.0, 1000, 512), Arrival(0.5, 8200, 4096), Arrival(2.0, 300, 0),
                        Arrival(3.0, 4096, 2048)]


@pytest.mark.parametrize("line, message", [
    ({"prompt_tokens": 10}, "'offset_s' must be a number >= 0"),
    ({"offset_s": -1, "prompt_tokens": 10}, "'offset_s' must be a number >= 0"),
    ({"offset_s": 0}, "no prompt length"),
    ({"offset_s": 0, "prompt_tokens": 0}, "'prompt_tokens' must give a prompt length"),
    ({"offset_s": 0, "prompt_tokens": 10, "hit_tokens": 11}, "'hit_tokens' must be a whole number from 0"),
    ([1, 2], "expected a JSON object"),
])
def test_a_bad_trace_line_is_named(tmp_path, line, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(json.dumps({"offset_s": 0, "prompt_tokens": 10}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(OpsError, match=f"bad.jsonl:2: {message}"):
        read_trace(trace, 16384, 0.985, 256)


# -- the tool ----------------------------------------------------------------


def test_run_writes_records_the_replay_can_rejudge_and_pngs(tmp_path, capsys):
    out = tmp_path / "sim"
    code = cellsim_cli.main(["run", "--shards", "8", "--loading", "async", "--count", "200", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "busiest shard's thread" in printed and "verdict over 1 seed (0): PASS" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["figures"]["timeout_share"]["median"] == 0.0 and summary["verdict"] == "PASS"
    assert summary["config"]["lost_shards"] == []
    for name in ("ttft_over_time.png", "in_flight.png", "cache_tier.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name
    assert replay_cli.main(["report", str(out / "records.csv"), "--gate-p90", "0.01", "--no-plots",
                            "--out", str(tmp_path / "rejudged")]) == 1


def test_run_over_seeds_judges_every_seed_and_the_summary_agrees_with_the_exit_code(tmp_path, capsys):
    # the write-up's runaway over five streams: TTFT p90 spans about 14-50 s, so a 30 s gate passes in some
    args = ["run", "--chunk-mb", "12.4", "--get-ms", "8.9", "--seeds", "5", "--gate-p50", "off", "--gate-mean",
            "off", "--no-plots"]
    failing = cellsim_cli.main([*args, "--gate-p90", "30", "--out", str(tmp_path / "fail")])
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "fail" / "summary.json").read_text())
    passed = [seed["passed"] for seed in summary["per_seed"]]
    assert any(passed) and not all(passed), passed  # the seeds disagree: the verdict must be all of them
    assert failing == 1 and summary["verdict"] == "FAIL" and "verdict over 5 seeds (0..4): FAIL" in printed
    assert "over 5 seeds (0..4)" in printed and summary["gates"][0]["passed_seeds"] == sum(passed)
    with (tmp_path / "fail" / "records.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [sum(r["seed"] == str(s) for r in rows) for s in range(5)] == [450] * 5
    passing = cellsim_cli.main([*args, "--gate-p90", "200", "--out", str(tmp_path / "pass")])
    assert passing == 0 and json.loads((tmp_path / "pass" / "summary.json").read_text())["verdict"] == "PASS"


def test_run_reads_a_trace_and_refuses_a_bad_one_before_writing(tmp_path, capsys):
    trace = tmp_path / "stream.jsonl"
    trace.write_text("".join(json.dumps({"id": f"r{i}", "offset_s": i * 0.5, "prompt": "x", "max_tokens": 1,
                                         "approx_prompt_tokens": 8192}) + "\n" for i in range(10)))
    out = tmp_path / "sim"
    assert cellsim_cli.main(["run", "--trace", str(trace), "--no-plots", "--out", str(out)]) == 0
    with (out / "records.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["prompt_tokens"] for r in rows] == ["8192"] * 10
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"offset_s": "soon", "prompt_tokens": 10}\n')
    for argv, named in ((["--trace", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
                        (["--trace", str(bad)], "bad.jsonl:1: 'offset_s'"),
                        (["--shards", "8", "--lost-shards", "8"], "lost shard 8"),
                        (["--orphan-cap", "-1"], "orphan_cap must be >= 0")):
        fresh = tmp_path / "never"
        assert cellsim_cli.main(["run", *argv, "--no-plots", "--out", str(fresh)]) == 2, argv
        error = capsys.readouterr().err
        assert named in error and len(error.strip().splitlines()) == 1 and not fresh.exists(), (argv, error)


def test_sweep_names_the_smallest_cell_that_passes(capsys):
    # four pods' worth of the write-up's load (4.8/s) with synchronous loading: how many shards?
    code = cellsim_cli.main(["sweep", "--rate", "4.8", "--count", "400", "--pods", "4", "--shards", "1,2,8",
                             "--gate-p90", "2", "--gate-p50", "off", "--gate-mean", "off", "--seeds", "2"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "smallest cell passing TTFT P90 < 2 s in every seed: 4 pod(s), 8 shard(s)" in printed
