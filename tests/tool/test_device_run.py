"""tests/device_run.sh, the one device call for every GPU check: its parts, their budgets
and their results (no GPU here: the parts are run without their bundles, or stopped)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "device_run.sh"


def device_run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    out = tmp_path / "out"
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(out), "ACTIVATION_BUNDLE": str(tmp_path / "no-activation"),
                               "LMCACHE_BUNDLE": str(tmp_path / "no-lmcache"), **env})
    rows = [line.split("\t") for line in (out / "device-run.tsv").read_text().splitlines()]
    return done, rows


def test_each_part_runs_and_names_what_it_lacks(tmp_path):
    done, rows = device_run(tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert [(name, rc) for name, _, rc in rows] == [("activation", "2"), ("lmcache", "2")]
    assert f"no bundle at {tmp_path / 'no-activation'}" in done.stderr
    assert f"no bundle at {tmp_path / 'no-lmcache'}" in done.stderr
    assert (tmp_path / "out" / "activation").is_dir() and (tmp_path / "out" / "lmcache").is_dir()


def test_the_lmcache_part_is_not_started_without_a_minute_left(tmp_path):
    done, rows = device_run(tmp_path, TOTAL_S="30")
    assert done.returncode == 2
    assert rows[1] == ["lmcache", "0", "not started"]
    assert "lmcache: not started" in done.stdout


def test_without_out_it_stops_at_once_naming_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path)
    assert done.returncode != 0 and "set OUT to the directory for the results" in done.stderr
