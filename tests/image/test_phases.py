"""The entrypoint's cold-start phases (image/imagectl/phases.py).

``RECORDED`` is a decode start (two data-parallel engines) in vLLM 0.31.0's log format
(``(<process> pid=N) LEVEL MM-DD HH:MM:SS [file:line] message``) and FlashInfer 0.7.0.post1's
(``YYYY-MM-DD HH:MM:SS,ms - LEVEL - file:line - flashinfer.jit: message``), every marker in
the words those versions' sources print (the file:line of each names where). It is written
from the sources, not captured: no GPU start of these presets has been logged yet, so the
first one checks the markers. It is replayed at the times it carries, and played by a
stand-in ``vllm`` behind the real entrypoint script.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from imagectl import phases

from .conftest import REPO

START = datetime(2026, 5, 6, 12, 0, 0, tzinfo=timezone.utc)
RECORDED = """\
(APIServer pid=7) INFO 05-06 12:00:02 [utils.py:253] non-default args: {'model': '/models/GLM-5.3-FP8'}
(EngineCore_DP0 pid=210) INFO 05-06 12:00:20 [gpu_model_runner.py:5256] Starting to load model /models/GLM-5.3-FP8...
(EngineCore_DP1 pid=211) INFO 05-06 12:00:21 [gpu_model_runner.py:5256] Starting to load model /models/GLM-5.3-FP8...
(EngineCore_DP0 pid=210) INFO 05-06 12:07:10 [default_loader.py:485] Loading weights took 405.12 seconds
(EngineCore_DP1 pid=211) INFO 05-06 12:07:14 [default_loader.py:485] Loading weights took 409.80 seconds
(EngineCore_DP0 pid=210) INFO 05-06 12:07:15 [gpu_model_runner.py:5355] Model loading took 93.5 GiB memory \
and 414.903 seconds
(EngineCore_DP0 pid=210) INFO 05-06 12:07:40 [backends.py:1152] Dynamo bytecode transform time: 21.40 s
(EngineCore_DP0 pid=210) INFO 05-06 12:08:30 [backends.py:392] Compiling a graph for compile range (1, 8192) \
takes 48.10 s
2026-05-06 12:08:41,102 - INFO - core.py:564 - flashinfer.jit: Building JIT module fused_moe_trtllm_sm100; \
this can take several minutes on first use.
2026-05-06 12:08:41,300 - INFO - cubin_loader.py:231 - flashinfer.jit: Fetching include/flashinferMetaInfo.h from https://store.invalid/artifactory/1d145b82/
(EngineCore_DP0 pid=210) INFO 05-06 12:10:02 [monitor.py:53] torch.compile took 161.90 s in total
(EngineCore_DP1 pid=211) INFO 05-06 12:10:06 [monitor.py:53] torch.compile took 165.00 s in total
(EngineCore_DP0 pid=210) INFO 05-06 12:10:30 [gpu_model_runner.py:6808] Rank 0: Torch profiler disabled \
for CUDA graph capture
Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):   0%|          | 0/67 [00:00<?, ?it/s]\r\
Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 67/67 [00:30<00:00,  2.2it/s]
(EngineCore_DP0 pid=210) INFO 05-06 12:11:08 [gpu_model_runner.py:6855] Graph capturing finished in 38 secs, \
took 1.10 GiB
(EngineCore_DP0 pid=210) INFO 05-06 12:11:10 [core.py:381] init engine (profile, create kv cache, warmup model) \
took 242.10 s
(APIServer pid=7) INFO 05-06 12:11:20 [entry.py:136] Starting vLLM server on http://0.0.0.0:8200
(APIServer pid=7) INFO:     Application startup complete.
"""
SUMMARY = ("cold start: weights 415.0 s (from +20.0 s); compile 167.4 s (from +438.6 s); flashinfer jit: "
           "1 module(s) built, 1 file(s) fetched (from +521.1 s); graph capture 38.0 s (from +630.0 s); "
           "ready at +680.0 s")
STAMP = re.compile(r"(?:(?P<year>\d{4})-)?(?P<md>\d\d-\d\d) (?P<hms>\d\d:\d\d:\d\d)(?:,(?P<ms>\d{3}))?")


def line_time(text: str, before: float) -> float:
    """Seconds since START at which a recorded line was printed (a line without a time: the last one's)."""
    found = STAMP.search(text)
    if not found:
        return before
    stamp = datetime.strptime(f"2026-{found['md']} {found['hms']}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    return (stamp - START).total_seconds() + int(found["ms"] or 0) / 1000


def replay(text: str) -> tuple[phases.Tracker, list[str]]:
    said: list[str] = []
    tracker = phases.Tracker(0.0, START.timestamp(), said.append)
    lines, now = phases.Lines(), 0.0
    for line in lines.feed(text.encode()) + lines.flush():
        now = line_time(line, now)
        tracker.line(line, now)
    return tracker, said


def test_phases_of_a_recorded_start() -> None:
    tracker, said = replay(RECORDED)
    assert said == [
        "phase weights started at +20.0 s (2026-05-06T12:00:20Z)",
        "phase compile started at +438.6 s (2026-05-06T12:07:18Z)",   # dated back by Dynamo's own 21.40 s
        "phase flashinfer jit started at +521.1 s (2026-05-06T12:08:41Z)",
        "phase graph capture started at +630.0 s (2026-05-06T12:10:30Z)",
        SUMMARY,
    ]
    assert tracker.phases["flashinfer jit"].modules == {"fused_moe_trtllm_sm100"}
    assert tracker.phases["flashinfer jit"].files == {"include/flashinferMetaInfo.h"}


def test_a_start_that_dies_is_summarised_with_what_it_reached() -> None:
    cut = RECORDED.split("(EngineCore_DP0 pid=210) INFO 05-06 12:07:40")[0]
    tracker, said = replay(cut)
    assert said == ["phase weights started at +20.0 s (2026-05-06T12:00:20Z)"] and not tracker.summarized
    assert tracker.summary(1) == ("cold start (vLLM exited 1 before it was ready): weights 415.0 s (from +20.0 s); "
                                  "compile not seen; flashinfer jit not seen; graph capture not seen")
    only_start, _ = replay(RECORDED.splitlines()[1] + "\n")
    assert "weights unfinished (from +20.0 s)" in only_start.summary(137)


def test_a_missed_start_line_is_dated_back_by_vllms_own_figure() -> None:
    tracker, said = replay("\n".join(line for line in RECORDED.splitlines() if "Starting to load" not in line))
    assert said[0] == "phase weights started at +24.9 s (2026-05-06T12:00:24Z)"   # 12:07:10 less 405.12 s
    # ... and "Model loading took ... 414.903 seconds" at 12:07:15 dates it further back, to 12:00:20.1.
    assert round(tracker.phases["weights"].start, 3) == 20.097 and tracker.phases["weights"].end == 435.0


def stand_in_vllm(folder: Path, code: int = 0, wait_for_signal: bool = False) -> Path:
    """A ``vllm`` on PATH that plays RECORDED (stderr; one line on stdout) and exits ``code``,
    or waits for SIGTERM and exits 7 on it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "log.txt").write_text(RECORDED)
    script = folder / "vllm"
    script.write_text(f"""#!{sys.executable}
import os, signal, sys, time
here = os.path.dirname(os.path.abspath(__file__))
print("argv", *sys.argv[1:], flush=True)
if {wait_for_signal!r}:
    signal.signal(signal.SIGTERM, lambda *_: (print("stand-in vllm: SIGTERM", file=sys.stderr, flush=True), \
sys.exit(7)))
    print("(EngineCore_DP0 pid=1) INFO 05-06 12:00:20 [gpu_model_runner.py:5256] Starting to load model m...",
          file=sys.stderr, flush=True)
    time.sleep(60)
    sys.exit(99)
text = open(os.path.join(here, "log.txt")).read()
if {code!r}:
    text = text.split("(EngineCore_DP0 pid=210) INFO 05-06 12:07:40")[0]
parts = text.split("\\r")
for number, part in enumerate(parts, 1):
    sys.stderr.write(part + ("\\r" if number < len(parts) else ""))
    sys.stderr.flush()
sys.exit({code!r})
""")
    script.chmod(0o755)
    return folder


def entrypoint(args: list[str], bin_dir: Path, **env: str) -> subprocess.Popen:
    environ = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GLM53_CONFIGS": str(REPO / "configs"),
               "PYTHONPATH": str(REPO / "image"), "GLM53_SKIP_PREFLIGHT": "1", **env}
    return subprocess.Popen([sys.executable, str(REPO / "image" / "entrypoint"), *args], env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_entrypoint_passes_the_output_through_and_prints_the_phases(tmp_path: Path) -> None:
    proc = entrypoint(["decode", "/m", "--port", "8200"], stand_in_vllm(tmp_path / "bin"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == f"argv serve /m --config {REPO / 'configs' / 'decode' / 'vllm.yaml'} --port 8200\n"
    assert f"entrypoint: run vllm serve /m --config {REPO / 'configs' / 'decode' / 'vllm.yaml'} --port 8200" in err
    for line in RECORDED.splitlines():      # the engine's own lines, unchanged
        assert line.split("\r")[0] in err
    summary = next(line for line in err.splitlines() if line.startswith("entrypoint: cold start: "))
    assert "; graph capture " in summary and "; ready at +" in summary   # played at once: seconds near 0
    assert err.count("entrypoint: phase ") == 4
    assert "entrypoint: HF_HUB_OFFLINE=1 (preset)" in err and "entrypoint: exec" not in err


def test_the_engines_exit_status_and_signals_reach_through(tmp_path: Path) -> None:
    died = entrypoint(["prefill", "/m"], stand_in_vllm(tmp_path / "dies", code=3))
    _, err = died.communicate(timeout=60)
    assert died.returncode == 3
    assert "entrypoint: cold start (vLLM exited 3 before it was ready): weights " in err
    waiting = entrypoint(["aggregated", "/m"], stand_in_vllm(tmp_path / "waits", wait_for_signal=True))
    assert waiting.stderr is not None
    for line in waiting.stderr:            # the engine is up and its handler set
        if "phase weights started" in line:
            break
    waiting.send_signal(signal.SIGTERM)   # as tini passes `docker stop` on
    started = time.monotonic()
    _, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 7 and "stand-in vllm: SIGTERM" in err and time.monotonic() - started < 10


def test_phase_log_off_execs_and_on_follows_any_command(tmp_path: Path) -> None:
    bin_dir = stand_in_vllm(tmp_path / "bin")
    plain = entrypoint(["decode", "/m"], bin_dir, GLM53_PHASE_LOG="0")
    out, err = plain.communicate(timeout=60)
    assert plain.returncode == 0 and "entrypoint: exec vllm serve /m" in err and "entrypoint: phase" not in err
    wrapped = entrypoint(["sh", "-c", 'exec "$@"', "engine", "vllm", "serve", "/m"], bin_dir, GLM53_PHASE_LOG="1")
    _, err = wrapped.communicate(timeout=60)
    assert wrapped.returncode == 0 and "entrypoint: cold start: weights " in err
