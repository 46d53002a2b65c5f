"""``make stress``: the test phases with busy loops beside them, and every test whose result
changed from the last idle run.

A test that passes on an idle host and fails on a loaded one waits on the clock where it
should wait on a condition; CI's host is not always idle. The busy loops are plain Python
processes spinning on one core each, so the load needs nothing installed.
"""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from ..errors import DistBuildError

LOAD_FILE = "load.txt"       # in a results folder: "idle", or "N busy loop(s)"
BASELINE = "test-results-idle"


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """``count`` processes that each keep one core busy until the block ends."""
    if count < 0:
        raise DistBuildError(f"--hog {count}: expected 0 or more busy loops")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
             for _ in range(count)]
    if loops:
        print(f"load: {count} busy loop(s) beside the run (pids {', '.join(str(p.pid) for p in loops)})", flush=True)
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def record_load(results: Path, count: int) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / LOAD_FILE).write_text("idle\n" if count == 0 else f"{count} busy loop(s)\n")


def keep_idle_baseline(work: Path) -> Path | None:
    """Copy the last run's results aside if that run was idle: the baseline a loaded run is read against."""
    results, baseline = work / "test-results", work / BASELINE
    load = results / LOAD_FILE
    if load.is_file() and load.read_text().strip() == "idle":
        shutil.rmtree(baseline, ignore_errors=True)
        shutil.copytree(results, baseline)
    return baseline if (baseline / LOAD_FILE).is_file() else None


def results_by_test(results: Path) -> dict[str, str]:
    """{"<run>: <test>": "passed" | "failed" | "skipped" | "xfailed"} over every junit file in a folder."""
    from .testrun import parse_junit

    found: dict[str, str] = {}
    for path in sorted(results.rglob("*.xml")):
        run = path.relative_to(results).with_suffix("").as_posix()
        outcome = parse_junit(path)
        for state in ("passed", "failed", "skipped", "xfailed"):
            for node in getattr(outcome, state):
                found[f"{run}: {node}"] = state
    return found


def changed_results(baseline: Path, loaded: Path) -> list[str]:
    """One line per test whose result differs between the idle baseline and the loaded run
    (a test that ran in only one of them is not a change: a partial run selects fewer)."""
    before, after = results_by_test(baseline), results_by_test(loaded)
    return [f"{test}: {before[test]} idle, {after[test]} under load"
            for test in sorted(before.keys() & after.keys()) if before[test] != after[test]]


def report(work: Path, baseline: Path | None) -> int:
    """Print the changed results; non-zero if any changed. Without a baseline (a clean clone) the
    run's own failures are all there is: on a suite that passes idle, each is a change."""
    loaded = work / "test-results"
    if baseline is None:
        print(f"\nstress: no idle baseline in {work / BASELINE} (an idle `make test` writes it); the run's own "
              "failures above are what broke under load")
        return 0
    changed = changed_results(baseline, loaded)
    compared = len(results_by_test(baseline).keys() & results_by_test(loaded).keys())
    print(f"\nstress: {len(changed)} of {compared} test results changed under load (baseline {baseline})")
    for line in changed:
        print(f"  {line}")
    return 1 if changed else 0
