"""Smoke test of benchmarks/resp_get_throughput.py against a real Valkey server.

Runs the benchmark end to end with a tiny workload (2 chunks, 2 rounds of 2
GETs per variant) and checks that it produces its CSV, its PNG and a
patched/pristine ratio line. It asserts nothing about speed: the benchmark's
figures belong in the issue note, not in a pass/fail gate on a shared
2-core machine.

The chunks keep the real size (12.2 MB), read two per connection per call,
rather than 1 MB: the pristine build loses a completion (the hang patch 0001
fixes) when a batch GET finishes within a few ms of its submit, which 1-4 MB
values on loopback do often (measured here: hangs within 1-90 calls in most
tries), so the pristine worker of a 1 MB run hangs in many runs. 25 MB per
call did not hang in 600 calls.
"""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lmcache

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "resp_get_throughput.py"
PRISTINE = REPO / "work" / "lmcache-pristine"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROUNDS = 2


def run_benchmark(out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), "--chunk-bytes", "12211200", "--keys", "2", "--batch", "2",
           "--workers", "1", "--rounds", str(ROUNDS), "--gets", "2", "--round-timeout-s", "20",
           "--python", sys.executable, "--pristine-path", str(PRISTINE), "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    if not (PRISTINE / "lmcache").is_dir():
        pytest.skip(f"no pristine LMCache build at {PRISTINE} (make test installs it)")
    out = tmp_path_factory.mktemp("resp-get")
    result = run_benchmark(out)
    assert result.returncode == 0, f"benchmark failed:\n{result.stdout}\n{result.stderr}"
    return result, out


def test_writes_a_row_per_round_and_variant(bench) -> None:
    _, out = bench
    with (out / "rounds.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((int(r["round"]), r["variant"]) for r in rows) == sorted(
        (n, v) for n in range(1, ROUNDS + 1) for v in ("patched", "pristine", "raw"))
    assert all(r["status"] == "ok" and float(r["gbps"]) > 0 for r in rows)


def test_draws_the_png(bench) -> None:
    _, out = bench
    assert (out / "rounds.png").read_bytes().startswith(PNG_MAGIC)


def test_prints_both_builds_ratios_and_a_verdict(bench) -> None:
    result, out = bench
    text = result.stdout
    assert "lmcache 0.5.5+dist." in text and f"lmcache 0.5.5 from {PRISTINE}" in text
    for pair in ("patched/pristine", "patched/raw", "pristine/raw"):
        assert any(line.startswith(pair) for line in text.splitlines()), f"no {pair} ratio line"
    assert "verdict: patched/pristine = " in text
    assert (out / "summary.txt").read_text().strip().endswith("summary.txt")


def test_refuses_a_pristine_path_that_is_not_a_build(tmp_path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--pristine-path", str(tmp_path), "--out", str(tmp_path / "out")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert "no pristine LMCache build" in result.stderr
