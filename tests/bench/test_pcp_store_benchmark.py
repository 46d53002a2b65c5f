"""Smoke test of benchmarks/pcp_store_critical_path.py on real ranks.

Runs the benchmark end to end with a tiny workload (W = 2 and 3, 6 chunks of
one layer, 2 repetitions) and checks its table, PNG and JSON: both modes per W,
the rank-0 store's bytes concentrated on one rank (max/mean = W) and the
sharded store's spread to within one chunk. It asserts nothing about speed
(a timed test on a shared 2-core machine would be noise); the figures go in
the issue note.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lmcache

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "pcp_store_critical_path.py"


def test_benchmark_reports_both_modes_and_the_byte_split(tmp_path):
    out = tmp_path / "pcp.json"
    cmd = [sys.executable, str(SCRIPT), "--world-sizes", "2,3", "--chunks", "6", "--repetitions", "2",
           "--layers", "1", "--json", str(out), "--png", str(tmp_path / "pcp.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank-0/sharded" in proc.stdout
    assert (tmp_path / "pcp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(out.read_text())
    assert [(r["W"], r["mode"]) for r in rows] == [
        (2, "rank-0 store"), (2, "sharded"), (3, "rank-0 store"), (3, "sharded")]
    for row in rows:
        if row["mode"] == "rank-0 store":
            assert row["bytes_max_over_mean"] == pytest.approx(row["W"])
        else:
            assert row["bytes_max_over_mean"] <= row["bytes_goal"] + 1e-9
            assert row["speedup"] > 0
