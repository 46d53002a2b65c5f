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
from tests.support.valkey import free_loopback_port

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


def test_ttft_is_taken_at_the_first_chunk_with_text(tmp_path, engine):
    requests = [
        ("slow-first", 0.0, "empty=3 ttft=1.2 chunks=3 gap=0.5"),
        ("fast", 0.0, "ttft=0.05 chunks=1"),
    ]
    code, out = run_replay(tmp_path, engine.url, requests)
    assert code == 0
    rows = read_rows(out)
    slow_ttft, slow_e2e = float(rows["slow-first"]["ttft_s"]), float(rows["slow-first"]["e2e_s"])
    assert 1.1 <= slow_ttft < 3.0  # not the empty chunks sent at once
    assert slow_e2e - slow_ttft >= 0.9  # two more chunks 0.5 s apart came after it
    assert float(rows["fast"]["ttft_s"]) < slow_ttft - 0.5
    assert rows["slow-first"]["text_chunks"] == "3"


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
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "prompt": f"@plan {plan}\nwords", "max_tokens": 2, "stream": True,
                    "stream_options": {"include_usage": True}}
            await stream_completion(session, engine_url + "/v1/completions", body, record, 0.0, timeout_s,
                                    keep_text=True)
        return record

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("plan", "status", "message"),
    [
        ("malformed=notjson", "malformed_stream", "event is not JSON"),
        ("malformed=nodone", "malformed_stream", "without 'data: [DONE]'"),
        ("malformed=nochoices", "malformed_stream", "neither 'choices' nor 'error'"),
        ("malformed=json", "malformed_stream", "expected Content-Type text/event-stream"),
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
