"""Failing endpoints and bad files: the run stops with a clear line and keeps what it measured.

The engine is tests/ops/fake_engine.py run as its own process; ``@plan
status=N`` prompts make it answer HTTP N.
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from opstools import replay_cli
from opstools.common import EXIT_ERROR, EXIT_FAILED

from tests.ops.fake_engine import start_engine_process

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    server = start_engine_process(tmp_path_factory.mktemp("engine"))
    try:
        yield server
    finally:
        server.stop()


def run(tmp_path: Path, url: str, plans: list[str], *extra: str, gap_s: float = 0.01) -> tuple[int, Path]:
    stream = tmp_path / "stream.jsonl"
    with stream.open("w") as handle:
        for i, plan in enumerate(plans):
            handle.write(json.dumps({"id": f"r{i:02d}", "offset_s": gap_s * i, "prompt": f"@plan {plan}\nw",
                                     "max_tokens": 2}) + "\n")
    out = tmp_path / "out"
    return replay_cli.main(["run", str(stream), "--url", url, "--out", str(out), "--quiet", "--no-plots",
                            *extra]), out


def statuses(out: Path) -> list[str]:
    with (out / "records.csv").open() as handle:
        return [row["status"] for row in csv.DictReader(handle)]


def test_twenty_404s_in_a_row_stop_the_run_with_a_hint(tmp_path, engine, capsys):
    code, out = run(tmp_path, engine.url, ["status=404"] * 50, "--model", "fake-glm", gap_s=0.02)
    assert code == EXIT_ERROR
    err = capsys.readouterr().err
    assert "run stopped early: 20 requests in a row failed with HTTP 404" in err
    assert f"nothing answers POST {engine.url}/v1/completions: --url must be the server's base URL" in err
    found = statuses(out)
    assert found.count("http_error") >= 20 and found[-1] == "not_sent"  # stopped well before the end
    result = json.loads((out / "result.json").read_text())
    assert result["failed"] >= 20 and result["not_sent"] >= 1 and "20 requests in a row" in result["aborted"]


def test_the_limit_counts_one_kind_of_failure_and_can_be_turned_off(tmp_path, engine, capsys):
    code, _ = run(tmp_path, engine.url, ["status=500", "status=503"] * 4, "--abort-after-errors", "3")
    assert code == EXIT_FAILED  # failures alternate, never 3 of one kind in a row: measured, success gate fails
    code, out = run(tmp_path, engine.url, ["status=503"] * 6, "--abort-after-errors", "off")
    assert code == EXIT_FAILED and statuses(out) == ["http_error"] * 6
    code, out = run(tmp_path, engine.url, ["status=503"] * 8, "--abort-after-errors", "3")
    assert code == EXIT_ERROR
    assert "3 requests in a row failed with HTTP 503" in capsys.readouterr().err


def test_a_url_ending_in_v1_is_refused_naming_the_base_url(tmp_path, engine, capsys):
    before = len(engine.events())
    for url in (engine.url + "/v1", engine.url + "/v1/"):
        code, out = run(tmp_path, url, ["chunks=1"], "--model", "fake-glm")
        assert code == EXIT_ERROR
        err = capsys.readouterr().err
        assert f"--url {url} ends in /v1: give the server's base URL ({engine.url})" in err
        assert "pass --model" not in err
        assert not out.exists()
    assert len(engine.events()) == before


def test_a_url_with_another_path_gets_a_base_url_hint_on_404(tmp_path, engine, capsys):
    code, _ = run(tmp_path, engine.url + "/api", ["chunks=1"])
    assert code == EXIT_ERROR
    assert "else check that --url is the server's base URL" in capsys.readouterr().err


def test_report_on_a_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    binary = tmp_path / "records.csv"
    binary.write_bytes(b"id,offset_s,sent_s\n\xff\xfe\x00\x81 not text\n")
    out = tmp_path / "rejudged"
    process = subprocess.run([sys.executable, str(SCRIPTS / "replay"), "report", str(binary), "--out", str(out)],
                             capture_output=True, text=True, timeout=60)
    assert process.returncode == 2
    assert process.stderr.strip() == (f"replay: error: records {binary}: not UTF-8 text (invalid start byte); "
                                      "is it a replay records.csv?")
    assert not out.exists()


def test_report_reads_a_token_times_field_longer_than_the_csv_default_limit(tmp_path, capsys):
    records = tmp_path / "records.csv"
    gaps = ";".join(f"{0.5 + 0.001 * i:.4f}" for i in range(30_000))  # about 200 kB in one field
    records.write_text("id,offset_s,sent_s,ttft_s,e2e_s,status,completion_tokens,token_times_s\n"
                       f"r1,0,0,0.4,31,ok,30001,{gaps}\n")
    assert replay_cli.main(["report", str(records), "--no-plots", "--out", str(tmp_path / "o")]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())["summary"]
    assert summary["throughput"]["itl"]["count"] == 30_000
