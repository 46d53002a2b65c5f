"""tests/device_run.sh, the one device call for every GPU check: its parts, what it writes and
what it refuses (no GPU here: the parts are run without their bundles)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def _stale_bundle(folder: Path, upstream: str) -> Path:
    """A bundle whose stamp records another series of ``upstream`` than the tree carries."""
    from distbuild.host import gpubundles

    (folder / "payload").mkdir(parents=True)
    (folder / "payload" / "file").write_text("old\n")
    stale = {"bundle": folder.name, "made_at": "2026-01-01T00:00:00Z", "files": {},
             "series": {upstream: {"version": "0", "series_sha256": "0" * 64, "patched_tree": "0" * 40}},
             "content_sha256": gpubundles.content_sha256(folder)}
    (folder / gpubundles.STAMP).write_text(json.dumps(stale))
    return folder


def test_stale_bundles_are_printed_first_and_refused_by_both_parts_before_any_build(tmp_path):
    """Bundles stamped for other series than the carried patches/: the call prints both stamps
    before the parts start, and each part refuses its bundle (exit 2) without building or
    installing anything; LMCache's JSON says why."""
    activation = _stale_bundle(tmp_path / "activation-bundle", "flashinfer")
    lmcache = _stale_bundle(tmp_path / "lmcache-gpu-bundle", "lmcache")
    done, rows = device_run(tmp_path, ACTIVATION_BUNDLE=str(activation), LMCACHE_BUNDLE=str(lmcache))
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert sorted((name, rc) for name, _, rc in rows) == [("activation", "2"), ("lmcache", "2")]
    stamps = said.index("=== bundles")
    assert stamps < said.index("=== activation:") and stamps < said.index("=== lmcache:")
    assert said.count("REFUSED") >= 4 and "stale bundle" in said  # the stamps first, then each part
    out = tmp_path / "out"
    assert "stale bundle" in (out / "activation.log").read_text()
    verdict = json.loads((out / "lmcache-gpu.json").read_text())["verdict"]
    assert verdict.startswith("unfit:") and "not this tree's" in verdict
    assert not list((tmp_path / "dist-device-run" / "activation").iterdir())  # nothing built
    assert not (tmp_path / "dist-lmcache-gpu").exists()  # nothing installed


def test_limits_that_do_not_fit_stop_it_before_anything_runs(tmp_path):
    done, rows = device_run(tmp_path, TOTAL_S="300", ACTIVATION_S="290")
    assert done.returncode == 2 and rows == []
    assert "ACTIVATION_S=290 does not fit in TOTAL_S=300" in done.stderr


def test_the_harness_on_a_machine_without_a_gpu_writes_its_verdict_and_exits_2(tmp_path):
    """Not 1, which would read as wrong results: the JSON's verdict says there is no CUDA device."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    bundle = tmp_path / "bundle"
    (bundle / "patched").mkdir(parents=True)
    (bundle / "pristine").mkdir()
    (bundle / "pristine" / "OVERLAY_ROOTS").write_text("include\n")
    result = tmp_path / "activation.json"
    done = subprocess.run([sys.executable, str(REPO / "tests/flashinfer/gpu/run.py"), "--bundle", str(bundle),
                           "--out", str(tmp_path / "build"), "--json", str(result)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    record = json.loads(result.read_text())
    assert record["stage"] == "unfit" and record["verdict"].startswith("unfit: no CUDA device")
