"""gpu/plot.py: the harness result as a PNG, and a clear error for what is not a result.

The recorded run in gpu/results/ (an H200, sm_90a; earlier runs in results/earlier/) is the
input: the plot must be written
from the very JSON run.py wrote there, and its numbers must be the ones the log beside it
printed (so the record is one run, not an edited file). matplotlib comes with the test
environment (scripts/requirements.txt), so these never skip.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parent / "gpu"
PLOT = GPU / "plot.py"
RESULT = GPU / "results" / "h200-sm90a.json"
LOG = GPU / "results" / "h200-sm90a.log"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

def _plot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PLOT), *args], capture_output=True, text=True, timeout=120)


def test_plot_writes_a_png_from_the_recorded_run(tmp_path):
    out = tmp_path / "sub" / "activation.png"
    proc = _plot(str(RESULT), str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert out.stat().st_size > 10_000
    assert not list(out.parent.glob("*.tmp"))


def test_recorded_json_matches_its_log():
    """The recorded JSON is the run its log printed: every timed shape with its microseconds and
    ratio as printed, every checked case, and a run that finished (stage "done")."""
    data = json.loads(RESULT.read_text())
    log = LOG.read_text()
    table = log.split("%copy\n", 1)[1].split("goal ", 1)[0]
    rows = re.findall(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\d+\s+\d+%$", table, re.M)
    assert len(rows) == len(data["timings"]) == 27
    for (label, local_rows, pristine, patched, ratio), t in zip(rows, data["timings"]):
        assert (label, int(local_rows)) == (t["label"], t["local_rows"])
        assert float(pristine) == pytest.approx(t["pristine_us"], abs=0.05)
        assert float(patched) == pytest.approx(t["patched_us"], abs=0.05)
        assert float(ratio) == pytest.approx(t["ratio"], abs=0.005)
    checked = re.search(r"bit-identical and within the CPU reference's bounds: (\d+) of (\d+) cases", log)
    assert checked and int(checked.group(1)) == int(checked.group(2)) == len(data["checks"]) == 124
    assert data["stage"] == "done" and data["failures"] == []


@pytest.mark.parametrize("content, expect", [
    ("{not json", "not a readable harness result"),
    ('{"gpu": "x"}', "no 'timings'"),
    ('{"timings": [{"tokens": 1}]}', "timings[0] lacks routing"),
])
def test_plot_rejects_what_is_not_a_result(tmp_path, content, expect):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    out = tmp_path / "out.png"
    proc = _plot(str(bad), str(out))
    assert proc.returncode == 2
    assert str(bad) in proc.stderr and expect in proc.stderr
    assert not out.exists()


def test_plot_reads_the_current_result_format(tmp_path):
    """run.py's current JSON (labelled shapes, nvcc, cross-device note), built here from its own
    timing grid with placeholder times: the plot is written (nothing is claimed about the times)."""
    sys.path.insert(0, str(GPU))
    try:
        import run as harness
    finally:
        sys.path.remove(str(GPU))
    timings = [{"label": t.label, "kind": t.kind, "tokens": t.shape.num_tokens, "width": t.shape.width,
                "routing": t.shape.routing, "tile": t.shape.tile or 8, "walk": t.walk, "pdl": t.pdl,
                "pristine_us": 2.0 + i, "patched_us": 1.0 + i, "ratio": (2.0 + i) / (1.0 + i),
                "copy_fraction": 0.5} for i, t in enumerate(harness.timing_grid())]
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"gpu": "placeholder", "arch": "sm_90a", "timings": timings,
                                  "nvcc": "Cuda compilation tools, release 13.0, V13.0.88",
                                  "cross_device_note": "measured on placeholder (sm_90a)"}))
    out = tmp_path / "activation.png"
    proc = _plot(str(result), str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000
