"""tests/device_run.sh, the one device call for every GPU check: its parts, what it writes and
what it refuses (no GPU here: the parts are run without their bundles)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "device_run.sh"
# The GPU host hands back at most 8 result files, no deeper than two folders.
RETURNED_FILES_MAX = 8
DECLARED = {"device-run.tsv", "activation.log", "activation.json", "activation.png", "lmcache-gpu.log",
            "lmcache-gpu.json", "details.tar.gz"}


def device_run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    out = tmp_path / "out"
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(out), "TMPDIR": str(tmp_path),
                               "ACTIVATION_BUNDLE": str(tmp_path / "no-activation"),
                               "LMCACHE_BUNDLE": str(tmp_path / "no-lmcache"), **env})
    rows = [line.split("\t") for line in (out / "device-run.tsv").read_text().splitlines()]
    return done, rows


def test_each_part_runs_and_names_what_it_lacks(tmp_path):
    done, rows = device_run(tmp_path)
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert sorted((name, rc) for name, _, rc in rows) == [("activation", "2"), ("lmcache", "2")]
    assert f"no bundle at {tmp_path / 'no-activation'}" in said
    assert f"no bundle at {tmp_path / 'no-lmcache'}" in said


def test_what_it_writes_fits_what_comes_back(tmp_path):
    """Every file is one the header declares, at the top of $OUT, and the details archive is
    written even when both parts fail."""
    device_run(tmp_path)
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert len(written) <= RETURNED_FILES_MAX
    assert {p.name for p in written} <= DECLARED and all(p.parent == tmp_path / "out" for p in written)
    assert (tmp_path / "out" / "details.tar.gz").is_file()
    assert len(DECLARED) <= RETURNED_FILES_MAX


def test_without_out_it_stops_at_once_naming_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path)
    assert done.returncode != 0 and "set OUT to the directory for the results" in done.stderr
