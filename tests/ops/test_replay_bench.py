"""vllm bench serve's vocabulary: request throughput, percentiles, result.json keys, concurrency, rates, sweeps.

The engine is tests/ops/fake_engine.py run as its own process; prompts that
start with ``@plan`` tell it how long to take (see fake_engine.py). Timing
bounds are generous: they compare against delays of 0.3 s and more.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from opstools import replay_cli
from opstools.common import EXIT_ERROR, EXIT_FAILED, EXIT_OK, OpsError
from opstools.replay_sweep import SweepRow, sweep_code
from opstools.stats import metric_statistics, percentile
from opstools.stream import StreamRequest, at_rate

from tests.ops.fake_engine import start_engine_process

# the keys of vLLM 0.31.0's vllm bench serve --save-result (benchmarks/serve.py) this tool writes
VLLM_RESULT_KEYS = (
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times", "errors",
    "max_output_tokens_per_s", "max_concurrent_requests",
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    server = start_engine_process(tmp_path_factory.mktemp("engine"))
    try:
        yield server
    finally:
        server.stop()


def write_stream(path: Path, requests: list[tuple[str, float, str]], max_tokens: int = 4) -> Path:
    with path.open("w") as handle:
        for request_id, offset, plan in requests:
            handle.write(json.dumps({"id": request_id, "offset_s": offset, "prompt": f"@plan {plan}\nwords",
                                     "max_tokens": max_tokens}) + "\n")
    return path


def run(tmp_path: Path, url: str, requests: list[tuple[str, float, str]], *extra: str,
        command: str = "run") -> tuple[int, Path]:
    stream = write_stream(tmp_path / "stream.jsonl", requests)
    out = tmp_path / "out"
    return replay_cli.main([command, str(stream), "--url", url, "--out", str(out), "--quiet", "--no-plots",
                            *extra]), out


def test_result_json_has_vllm_bench_serve_keys_in_their_units(tmp_path, engine, capsys):
    requests = [(f"r{i}", 0.1 * i, "ttft=0.3 chunks=3 gap=0.05") for i in range(4)]
    requests.append(("boom", 0.45, "status=500"))
    code, out = run(tmp_path, engine.url, requests, "--gate-success", "50", "--goodput", "ttft:5000")
    assert code == EXIT_OK
    result = json.loads((out / "result.json").read_text())
    missing = [key for key in VLLM_RESULT_KEYS if key not in result]
    assert not missing
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in result
    assert (result["completed"], result["failed"], result["num_prompts"]) == (4, 1, 5)
    assert result["total_output_tokens"] == 12 and result["output_lens"] == [3, 3, 3, 3, 0]
    assert 250 <= result["mean_ttft_ms"] < 1500 and 250 <= result["p99_ttft_ms"] < 1500  # milliseconds
    assert 40 <= result["median_itl_ms"] < 500 and 40 <= result["mean_tpot_ms"] < 500
    assert all(0.25 <= t < 1.5 for t in result["ttfts"][:4]) and result["ttfts"][4] == 0.0  # seconds
    assert all(len(gaps) == 2 and 0.04 <= min(gaps) for gaps in result["itls"][:4])
    assert result["request_throughput"] == pytest.approx(4 / result["duration"])
    assert result["output_throughput"] == pytest.approx(12 / result["duration"])
    assert result["request_goodput"] == pytest.approx(4 / result["duration"])
    assert result["errors"][4].startswith("HTTP 500") and result["errors"][0] == ""
    assert result["model_id"] == "fake-glm" and result["open_loop"] is True and result["verdict"] == "PASS"
    assert result["mean_ttft_ms"] == pytest.approx(1000 * sum(result["ttfts"][:4]) / 4)
    # request throughput is printed and in summary.json too
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())["summary"]
    requests_per_s = summary["throughput"]["requests_per_s"]
    assert requests_per_s == pytest.approx(4 / summary["throughput"]["span_s"])
    assert f"{requests_per_s:.3f} req/s completed" in printed


def test_metric_percentiles_and_percentile_metrics_choose_the_table_and_keys(tmp_path, engine, capsys):
    requests = [(f"r{i}", 0.05 * i, "ttft=0.3 chunks=2") for i in range(3)]
    code, out = run(tmp_path, engine.url, requests, "--metric-percentiles", "50,99.9",
                    "--percentile-metrics", "ttft,e2el")
    assert code == EXIT_OK
    result = json.loads((out / "result.json").read_text())
    assert {"p50_ttft_ms", "p99.9_ttft_ms", "median_e2el_ms", "p99.9_e2el_ms"} <= result.keys()
    assert not [key for key in result if "tpot" in key or "itl_ms" in key or "p90_" in key]
    printed = capsys.readouterr().out
    assert "p99.9" in printed and "\n  E2EL " in printed and "\n  TPOT " not in printed
    code, out = run(tmp_path, engine.url, requests, "--percentiles", "75")  # the short alias
    assert "p75_ttft_ms" in json.loads((out / "result.json").read_text())


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--metric-percentiles", "50,abc", "expected percentiles like 50,90,99"),
    ("--metric-percentiles", "0", "a percentile must be in (0, 100]"),
    ("--percentile-metrics", "ttft,latency", "expected metrics among ttft, tpot, itl, e2el"),
    ("--max-concurrency", "0", "expected a whole number >= 1"),
    ("--request-rate", "-1", "expected a number > 0"),
    ("--abort-after-errors", "many", "expected a whole number"),
])
def test_bad_values_of_the_new_flags_are_argument_errors(tmp_path, capsys, flag, value, message):
    stream = write_stream(tmp_path / "s.jsonl", [("r", 0.0, "chunks=1")])
    with pytest.raises(SystemExit) as exit_info:
        replay_cli.main(["run", str(stream), "--url", "http://127.0.0.1:9", flag, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_fractional_percentiles_interpolate_like_numpy():
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 99.9) == pytest.approx(9.991)
    assert percentile(values, 12.5) == pytest.approx(2.125)
    stats = metric_statistics([0.1, 0.2, 0.3, 0.4], [99.9])
    assert stats["mean"] == pytest.approx(250.0) and stats["median"] == pytest.approx(250.0)
    assert stats["std"] == pytest.approx(111.803, rel=1e-4)  # population standard deviation, as numpy.std
    assert stats["p99.9"] == pytest.approx(399.7)
    assert metric_statistics([], [50]) == {"mean": None, "median": None, "std": None, "p50": None}


def test_max_concurrency_holds_later_sends_and_says_the_run_is_not_open_loop(tmp_path, engine, capsys):
    requests = [(f"r{i}", 0.02 * i, "ttft=0.4 chunks=1") for i in range(6)]
    before = len(engine.events())
    code, out = run(tmp_path, engine.url, requests, "--max-concurrency", "2")
    assert code == EXIT_OK
    arrivals = sorted(a["t"] for a in engine.events()[before:])
    assert len(arrivals) == 6 and arrivals[1] - arrivals[0] < 0.3
    # the engine never had three: each request came after the one two before it had ended (0.4 s each)
    assert all(later - earlier >= 0.35 for earlier, later in zip(arrivals, arrivals[2:]))
    captured = capsys.readouterr()
    assert "NOT OPEN LOOP: --max-concurrency 2 held later sends" in captured.out
    assert "at most 2 in flight, so NOT open loop" in captured.err
    assert "fell behind" not in captured.err  # the wait for a slot is not send lag
    result = json.loads((out / "result.json").read_text())
    assert result["max_concurrency"] == 2 and result["open_loop"] is False
    queue = result["queue_times"]
    assert max(queue[:2]) < 0.2 and min(queue[4:]) > 0.6
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["peak_in_flight"] == 2 and summary["client_queue"]["count"] == 6
    with (out / "records.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert float(rows[5]["client_queue_s"]) > 0.6 and float(rows[5]["send_lag_s"]) < 0.2


def test_request_rate_scales_the_send_times(tmp_path, engine):
    requests = [(f"r{i}", 1.0 * i, "chunks=1") for i in range(3)]
    before = len(engine.events())
    code, out = run(tmp_path, engine.url, requests, "--request-rate", "4")
    assert code == EXIT_OK
    arrivals = sorted(a["t"] for a in engine.events()[before:])
    assert [t - arrivals[0] for t in arrivals] == pytest.approx([0.0, 0.25, 0.5], abs=0.15)
    assert json.loads((out / "result.json").read_text())["request_rate"] == pytest.approx(4.0)


def test_at_rate_keeps_the_pattern_and_refuses_a_stream_without_a_span():
    requests = [StreamRequest(id=f"r{i}", offset_s=t, max_tokens=1, prompt="p") for i, t in enumerate((2, 3, 6))]
    # 2 gaps over 4 s: 0.5 req/s; at 0.25 req/s every gap doubles, at 1 req/s it halves
    assert [r.offset_s for r in at_rate(requests, 0.25)] == pytest.approx([2.0, 4.0, 10.0])
    assert [r.offset_s for r in at_rate(requests, 1.0)] == pytest.approx([2.0, 2.5, 4.0])
    assert [r.offset_s for r in at_rate(requests, math.inf)] == [2.0, 2.0, 2.0]
    with pytest.raises(OpsError, match="no rate to scale"):
        at_rate([StreamRequest(id="a", offset_s=1.0, max_tokens=1, prompt="p")] * 2, 2.0)


def test_sweep_runs_the_stream_at_each_rate_and_writes_a_table(tmp_path, engine, capsys):
    requests = [(f"r{i}", 0.5 * i, "ttft=0.05 chunks=2") for i in range(3)]
    code, out = run(tmp_path, engine.url, requests, "--rates", "8,inf", command="sweep")
    assert code == EXIT_OK
    for folder in ("rate-8", "rate-inf"):
        result = json.loads((out / folder / "result.json").read_text())
        assert result["completed"] == 3
    assert json.loads((out / "rate-8" / "result.json").read_text())["request_rate"] == pytest.approx(8.0)
    assert json.loads((out / "rate-inf" / "result.json").read_text())["request_rate"] == "inf"
    with (out / "sweep.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["request_rate"], r["completed"], r["verdict"]) for r in rows] == [("8.0", "3", "PASS"),
                                                                               ("inf", "3", "PASS")]
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["rates"] == [8.0, "inf"] and 30 <= sweep["rows"][0]["median_ttft_ms"] < 1000
    printed = capsys.readouterr().out
    assert "| rate (req/s) | completed |" in printed and "| 8 | 3 | 0 |" in printed
    assert "highest rate passing every gate: inf req/s" in printed


def test_sweep_of_a_stream_with_one_send_time_is_an_error_before_anything_runs(tmp_path, engine, capsys):
    requests = [(f"r{i}", 0.0, "chunks=1") for i in range(2)]
    before = len(engine.events())
    code, out = run(tmp_path, engine.url, requests, "--rates", "1,2", command="sweep")
    assert code == EXIT_ERROR
    assert "no rate to scale" in capsys.readouterr().err
    assert not out.exists() and len(engine.events()) == before


def test_sweep_exit_code_is_the_worst_rate():
    def row(code: int) -> SweepRow:
        return SweepRow(1.0, "rate-1", code, {}, None)

    assert sweep_code([row(EXIT_OK), row(EXIT_OK)], 2) == EXIT_OK
    assert sweep_code([row(EXIT_OK), row(EXIT_FAILED)], 2) == EXIT_FAILED
    assert sweep_code([row(EXIT_FAILED), row(EXIT_ERROR)], 3) == EXIT_ERROR
