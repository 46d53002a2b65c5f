"""The replay against a local streaming server: open loop, TTFT, tokens, gates, plots, failures.

Timing bounds are generous (a loaded 2-core machine): they compare against
delays of a second or more that the fake engine is told to take.
"""
from __future__ import annotations

import asyncio
import csv
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import pytest
from opstools import replay_cli
from opstools.completions import stream_completion
from opstools.records import RequestRecord

from tests.ops.fake_engine import FakeEngine
from tests.support.ports import free_loopback_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def write_stream(path: Path, requests: list[tuple[str, float, str]], max_tokens: int = 4) -> Path:
    with path.open("w") as handle:
        for request_id, offset, plan in requests:
            prompt = f"@plan {plan}\nsome words of a prompt"
            handle.write(json.dumps({"id": request_id, "offset_s": offset, "prompt": prompt,
                                     "max_tokens": max_tokens}) + "\n")
    return path


def read_rows(out: Path) -> dict[str, dict[str, str]]:
    with (out / "records.csv").open() as handle:
        return {row["id"]: row for row in csv.DictReader(handle)}


def run_replay(tmp_path: Path, engine_url: str, requests: list[tuple[str, float, str]], *extra: str,
               plots: bool = False) -> tuple[int, Path]:
    stream = write_stream(tmp_path / "stream.jsonl", requests)
    out = tmp_path / "out"
    argv = ["run", str(stream), "--url", engine_url, "--out", str(out), "--quiet", *extra]
    code = replay_cli.main(argv if plots else [*argv, "--no-plots"])
    return code, out


def test_open_loop_keeps_send_times_under_a_slow_server(tmp_path, engine):
    offsets = [round(0.2 * i, 2) for i in range(8)]
    requests = [(f"r{i}", offset, "ttft=2.0 chunks=1") for i, offset in enumerate(offsets)]
    code, out = run_replay(tmp_path, engine.url, requests)
    assert code == 0
    rows = read_rows(out)
    # the client sent each request at its offset ...
    for i, offset in enumerate(offsets):
        assert abs(float(rows[f"r{i}"]["sent_s"]) - offset) < 0.5
    # ... and the server saw them arrive at those offsets, though each took 2 s
    arrivals = sorted(a.monotonic_s for a in engine.arrivals)
    for arrival, offset in zip(arrivals, offsets):
        assert abs((arrival - arrivals[0]) - offset) < 0.5
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["peak_in_flight"] == 8  # a closed loop would have had 1
    assert summary["duration_s"] < 6.0  # 8 x 2 s one after another would be 16 s
    for row in rows.values():
        assert float(row["ttft_s"]) >= 1.9


def test_ttft_is_taken_at_the_first_choices_event_even_without_text(tmp_path, engine):
    # two empty-text choices events at 1.2 s (tokens that detokenize to ""), the first text 1.0 s later
    requests = [
        ("empty-first", 0.0, "empty=2 ttft=1.2 chunks=3 gap=1.0"),
        ("fast", 0.0, "ttft=0.05 chunks=1"),
    ]
    code, out = run_replay(tmp_path, engine.url, requests)
    assert code == 0
    rows = read_rows(out)
    ttft, e2e = float(rows["empty-first"]["ttft_s"]), float(rows["empty-first"]["e2e_s"])
    assert 1.1 <= ttft < 2.0  # the first text came at 2.2 s: not where TTFT is taken
    assert e2e - ttft >= 2.9  # gap, then two more 1.0 s gaps after the first event
    assert float(rows["fast"]["ttft_s"]) < ttft - 0.5
    assert (rows["empty-first"]["text_chunks"], rows["empty-first"]["choice_events"]) == ("3", "5")
    assert len(rows["empty-first"]["token_times_s"].split(";")) == 4  # every choices event after the first


def test_a_stream_without_any_choices_event_is_a_failure(tmp_path, engine, capsys):
    requests = [("ok", 0.0, "chunks=2"), ("tokenless", 0.1, "chunks=0")]
    code, out = run_replay(tmp_path, engine.url, requests)
    rows = read_rows(out)
    assert rows["tokenless"]["status"] == "no_token" and rows["tokenless"]["ttft_s"] == ""
    assert code == 1  # the success gate
    assert "without any 'choices' event" in rows["tokenless"]["error"]
    printed = capsys.readouterr().out
    assert "TTFT measured: 1 with TTFT / 1 ok" in printed
    assert "failures: no_token 1" in printed


def test_a_stream_with_a_json_content_type_is_read_as_sse_with_one_warning(tmp_path, engine, capsys):
    requests = [(f"r{i}", 0.05 * i, "ctype=json ttft=0.1 chunks=3") for i in range(4)]
    code, out = run_replay(tmp_path, engine.url, requests)
    assert code == 0
    rows = read_rows(out)
    assert {row["status"] for row in rows.values()} == {"ok"}
    assert {row["completion_tokens"] for row in rows.values()} == {"3"}
    err = capsys.readouterr().err
    assert err.count("Content-Type 'application/json', not text/event-stream") == 1


def test_tokens_come_from_usage_else_from_counted_chunks(tmp_path, engine):
    requests = [("usage", 0.0, "chunks=3 tokens=7"), ("no-usage", 0.0, "chunks=4 usage=0")]
    code, out = run_replay(tmp_path, engine.url, requests)
    assert code == 0
    rows = read_rows(out)
    assert (rows["usage"]["completion_tokens"], rows["usage"]["tokens_source"]) == ("7", "usage")
    assert (rows["no-usage"]["completion_tokens"], rows["no-usage"]["tokens_source"]) == ("4", "chunks")


def test_verdict_flips_at_the_gate_and_plots_are_written(tmp_path, engine, capsys):
    requests = [(f"r{i}", 0.1 * i, "ttft=0.6 chunks=2") for i in range(3)]
    code, out = run_replay(tmp_path, engine.url, requests, "--gate-p50", "0.3", plots=True)
    assert code == 1
    printed = capsys.readouterr().out
    assert "FAIL  TTFT P50 < 0.3 s" in printed and "verdict: FAIL" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "FAIL"
    for name in ("ttft_over_time.png", "ttft_cdf.png", "in_flight.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name

    code, out = run_replay(tmp_path, engine.url, requests, "--gate-p50", "5")
    assert code == 0
    assert "verdict: PASS" in capsys.readouterr().out


def test_a_failed_request_fails_the_success_gate_but_is_no_error(tmp_path, engine, capsys):
    requests = [("ok1", 0.0, "chunks=1"), ("ok2", 0.1, "chunks=1"), ("boom", 0.2, "status=500")]
    code, out = run_replay(tmp_path, engine.url, requests)
    assert code == 1
    rows = read_rows(out)
    assert rows["boom"]["status"] == "http_error" and rows["boom"]["http_status"] == "500"
    assert "success >= 100%" in capsys.readouterr().out
    code, _ = run_replay(tmp_path, engine.url, requests, "--gate-success", "60")
    assert code == 0


def test_dead_endpoint_is_a_clear_error_with_records_written(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_loopback_port()}"
    code, out = run_replay(tmp_path, url, [("r0", 0.0, "chunks=1"), ("r1", 0.5, "chunks=1")])
    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot connect to {url}" in err
    rows = read_rows(out)
    assert {row["status"] for row in rows.values()} == {"not_sent"}


def test_endpoint_dying_mid_run_stops_the_run_and_keeps_records(tmp_path, capsys):
    engine = FakeEngine().start()
    stopper = threading.Timer(1.0, engine.stop)
    stopper.start()
    try:
        requests = [("early0", 0.0, "chunks=1"), ("early1", 0.1, "chunks=1")]
        requests += [(f"late{i}", 2.5 + 0.1 * i, "chunks=1") for i in range(6)]
        code, out = run_replay(tmp_path, engine.url, requests, "--abort-after-connect-errors", "3", plots=True)
    finally:
        stopper.join()
        engine.stop()
    assert code == 2
    assert "the endpoint stopped answering" in capsys.readouterr().err
    rows = read_rows(out)
    assert rows["early0"]["status"] == rows["early1"]["status"] == "ok"
    late = [rows[f"late{i}"]["status"] for i in range(6)]
    assert late.count("connect_error") >= 3
    assert set(late) <= {"connect_error", "not_sent", "aborted"}
    assert (out / "ttft_over_time.png").read_bytes().startswith(PNG_MAGIC)


def test_malformed_stream_stops_the_run_and_keeps_records(tmp_path, engine, capsys):
    requests = [
        ("good0", 0.0, "chunks=1"),
        ("good1", 0.1, "chunks=1"),
        ("bad", 0.6, "malformed=notjson"),
        ("later", 4.0, "chunks=1"),
    ]
    code, out = run_replay(tmp_path, engine.url, requests)
    assert code == 2
    err = capsys.readouterr().err
    assert "request bad: malformed stream: event is not JSON" in err
    rows = read_rows(out)
    assert rows["good0"]["status"] == rows["good1"]["status"] == "ok"
    assert rows["bad"]["status"] == "malformed_stream"
    assert rows["later"]["status"] == "not_sent"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["aborted"].startswith("request bad")


def _one(engine_url: str, plan: str, timeout_s: float = 20.0) -> RequestRecord:
    async def go() -> RequestRecord:
        record = RequestRecord(id="x", offset_s=0.0)
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": f"@plan {plan}\nwords", "max_tokens": 2, "stream": True,
                    "stream_options": {"include_usage": True}}
            await stream_completion(http, engine_url + "/v1/completions", body, record, 0.0, timeout_s,
                                    keep_text=True)
        return record

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("plan", "status", "message"),
    [
        ("malformed=notjson", "malformed_stream", "event is not JSON"),
        ("malformed=nodone", "malformed_stream", "without 'data: [DONE]'"),
        ("malformed=nochoices", "malformed_stream", "neither 'choices' nor 'error'"),
        ("malformed=json", "malformed_stream", "holds no 'data:' event (Content-Type 'application/json"),
        ("error=1", "stream_error", "planned engine error"),
        ("status=503", "http_error", "HTTP 503"),
        ("close=1 chunks=3", "disconnected", "connection broke"),
    ],
)
def test_each_kind_of_bad_answer_gets_its_status(engine, plan, status, message):
    record = _one(engine.url, plan)
    assert record.status == status
    assert message in record.error


def test_a_request_past_its_timeout_is_a_timeout(engine):
    record = _one(engine.url, "ttft=3 chunks=1", timeout_s=0.5)
    assert record.status == "timeout" and record.ttft_s is None


def test_token_id_prompts_are_sent_as_a_list(tmp_path, engine):
    stream = tmp_path / "ids.jsonl"
    stream.write_text(json.dumps({"id": "ids", "offset_s": 0, "prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    code = replay_cli.main(["run", str(stream), "--url", engine.url, "--out", str(tmp_path / "o"), "--quiet",
                            "--no-plots"])
    assert code == 0
    assert engine.arrivals[0].body["prompt"] == [1, 2, 3]
    assert engine.arrivals[0].body["stream"] is True
    assert engine.arrivals[0].body["model"] == "fake-glm"  # from /v1/models


def test_bad_stream_file_names_the_line(tmp_path, engine, capsys):
    stream = tmp_path / "bad.jsonl"
    stream.write_text('{"offset_s": 0, "prompt": "a", "max_tokens": 1}\n'
                      '{"offset_s": -1, "prompt": "b", "max_tokens": 1}\n')
    code = replay_cli.main(["run", str(stream), "--url", engine.url, "--out", str(tmp_path / "o")])
    assert code == 2
    assert f"{stream}:2: 'offset_s' must be a number >= 0" in capsys.readouterr().err
    assert not engine.arrivals


def test_report_rejudges_an_earlier_run_with_other_gates(tmp_path, engine, capsys):
    requests = [(f"r{i}", 0.05 * i, "ttft=0.4 chunks=1") for i in range(4)]
    code, out = run_replay(tmp_path, engine.url, requests)
    assert code == 0
    capsys.readouterr()
    rejudged = tmp_path / "rejudged"
    code = replay_cli.main(["report", str(out / "records.csv"), "--gate-p90", "0.2", "--no-plots",
                            "--out", str(rejudged)])
    assert code == 1
    assert "FAIL  TTFT P90 < 0.2 s" in capsys.readouterr().out
    before = json.loads((out / "summary.json").read_text())["summary"]["ttft"]
    after = json.loads((rejudged / "summary.json").read_text())["summary"]["ttft"]
    assert after["p50"] == pytest.approx(before["p50"], abs=1e-5)
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert replay_cli.main(["report", str(bad), "--out", str(rejudged)]) == 2
    assert "not a replay records.csv" in capsys.readouterr().err


def test_ctrl_c_stops_the_replay_and_keeps_the_records(tmp_path, engine):
    stream = write_stream(tmp_path / "stream.jsonl",
                          [("quick", 0.0, "chunks=1"), ("slow", 0.1, "ttft=30 chunks=1"), ("later", 30.0, "chunks=1")])
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "replay"), "run", str(stream), "--url", engine.url, "--out", str(out),
         "--progress-interval", "0.2", "--no-plots"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        while "done 1" not in (line := process.stderr.readline()):  # progress: the quick one is done
            assert line, "replay ended early"
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    assert "stopped by SIGINT" in err
    rows = read_rows(out)
    assert [rows[i]["status"] for i in ("quick", "slow", "later")] == ["ok", "aborted", "not_sent"]


def test_throughput_tpot_itl_and_goodput_are_reported_and_survive_a_rejudge(tmp_path, engine, capsys):
    requests = [(f"r{i}", 0.1 * i, "ttft=0.2 chunks=5 gap=0.1") for i in range(4)]
    code, out = run_replay(tmp_path, engine.url, requests, "--nodes", "4", "--goodput", "ttft:5000,tpot:1000",
                           "--gate-output-tps", "1", plots=True)
    assert code == 0
    printed = capsys.readouterr().out
    assert "M tokens/min (prompt + output)" in printed and "per node over 4 nodes" in printed
    assert "goodput (ttft <= 5000 ms, tpot <= 1000 ms): 4 of 4 ok requests" in printed
    assert "pass  output >= 1 tok/s" in printed
    summary = json.loads((out / "summary.json").read_text())["summary"]
    itl = summary["throughput"]["itl"]
    assert itl["count"] == 16 and 0.08 <= itl["p50"] < 0.5  # 4 gaps of 0.1 s per request
    assert 0.08 <= summary["throughput"]["tpot"]["p50"] < 0.5
    assert (out / "throughput.png").read_bytes().startswith(PNG_MAGIC)
    rejudged = tmp_path / "rejudged"
    assert replay_cli.main(["report", str(out / "records.csv"), "--no-plots", "--gate-output-tps", "1000",
                            "--out", str(rejudged)]) == 1
    again = json.loads((rejudged / "summary.json").read_text())["summary"]["throughput"]
    assert again["itl"]["count"] == 16 and again["itl"]["p50"] == pytest.approx(itl["p50"], abs=1e-3)
    assert again["tokens_per_minute"] == pytest.approx(summary["throughput"]["tokens_per_minute"], rel=1e-3)
    assert "FAIL  output >= 1000 tok/s" in capsys.readouterr().out


def test_bad_goodput_slo_is_an_argument_error(tmp_path, engine, capsys):
    with pytest.raises(SystemExit):
        run_replay(tmp_path, engine.url, [("r", 0.0, "chunks=1")], "--goodput", "ttfb:10")
    assert "KEY one of ttft, tpot, e2el" in capsys.readouterr().err
