"""``make stress``'s comparison (build/distbuild/host/stress.py): which results changed under load."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from distbuild.host import stress
from distbuild.errors import DistBuildError


def _junit(path: Path, cases: dict[str, str]) -> None:
    """A junit file as pytest writes it (xunit2): one testcase per name, in the given state."""
    body = {"passed": "", "failed": "<failure message='boom'/>", "skipped": "<skipped type='pytest.skip'/>",
            "xfailed": "<skipped type='pytest.xfail'/>"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("<testsuites><testsuite>" + "".join(
        f"<testcase classname='tests.m' name='{name}' time='1.0'>{body[state]}</testcase>"
        for name, state in cases.items()) + "</testsuite></testsuites>")


def test_a_result_that_changed_under_load_is_listed_with_its_run(tmp_path):
    idle, loaded = tmp_path / "idle", tmp_path / "loaded"
    _junit(idle / "patched.xml", {"t_ok": "passed", "t_clock": "passed", "t_only_idle": "passed"})
    _junit(idle / "leave-one-out" / "0003.xml", {"t_proof": "xfailed"})
    _junit(loaded / "patched.xml", {"t_ok": "passed", "t_clock": "failed"})
    _junit(loaded / "leave-one-out" / "0003.xml", {"t_proof": "failed"})
    assert stress.changed_results(idle, loaded) == [
        "leave-one-out/0003: tests.m::t_proof: xfailed idle, failed under load",
        "patched: tests.m::t_clock: passed idle, failed under load",
    ]


def test_only_an_idle_run_becomes_the_baseline(tmp_path):
    results = tmp_path / "test-results"
    _junit(results / "patched.xml", {"t": "passed"})
    stress.record_load(results, 1)
    assert stress.keep_idle_baseline(tmp_path) is None, "a loaded run was taken as the baseline"
    stress.record_load(results, 0)
    baseline = stress.keep_idle_baseline(tmp_path)
    assert baseline == tmp_path / stress.BASELINE
    assert stress.results_by_test(baseline) == {"patched: tests.m::t": "passed"}


def test_without_a_baseline_the_report_says_what_writes_one(tmp_path, capsys):
    assert stress.report(tmp_path, None) == 0
    assert "an idle `make test` writes it" in capsys.readouterr().out


def _busy_loops_of_this_process() -> list[Path]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:  # a process may exit between the listing and the read
            if ((proc / "cmdline").read_bytes().endswith(b"while True: pass\0")
                    and int((proc / "stat").read_text().split()[3]) == os.getpid()):
                found.append(proc)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def _cpu_ticks(proc: Path) -> int:
    return int((proc / "stat").read_text().split()[13])


def _wait_for(condition, what: str, bound_s: float = 60.0):
    """Poll ``condition`` until it is truthy. The bound is on a hang, not on speed: on a loaded
    host the child can take seconds to exec and to be scheduled."""
    deadline = time.monotonic() + bound_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what} within {bound_s:.0f} s"
        time.sleep(0.05)
    return result


def test_the_busy_loops_run_for_the_block_and_are_gone_after_it():
    with stress.busy_loops(1):
        # Until the child execs, /proc shows it with this process's command line.
        [loop] = _wait_for(_busy_loops_of_this_process, "the busy loop started")
        pid = int(loop.name)
        _wait_for(lambda: _cpu_ticks(loop) > 0, "the busy loop used CPU time")
    assert not Path(f"/proc/{pid}").exists() or (Path(f"/proc/{pid}") / "stat").read_text().split()[2] == "Z"


def test_a_negative_count_is_refused():
    with pytest.raises(DistBuildError, match="--hog -1"):
        with stress.busy_loops(-1):
            pass


def test_a_changed_result_fails_the_report(tmp_path, capsys):
    _junit(tmp_path / stress.BASELINE / "patched.xml", {"t": "passed"})
    _junit(tmp_path / "test-results" / "patched.xml", {"t": "failed"})
    assert stress.report(tmp_path, tmp_path / stress.BASELINE) == 1
    assert "1 of 1 test results changed under load" in capsys.readouterr().out
