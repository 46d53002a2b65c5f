"""Pieces of ``make test``'s runner (build/distbuild/host/testrun.py) that decide what counts."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distbuild.host import leftovers, testrun
from distbuild.errors import DistBuildError


def test_a_failure_in_a_test_file_the_series_adds_counts_though_pristine_has_no_baseline():
    peer = testrun.Outcome(failed={
        "tests.v1.lookup_client.test_lookup_timeout_metrics::test_sync",
        "tests.v1.test_new.TestThing::test_method",
        "tests.v1.test_upstream::test_flaky_on_both",
    })
    added = ["tests/v1/lookup_client/test_lookup_timeout_metrics.py", "tests/v1/test_new.py"]
    assert testrun.added_failed(peer, added) == [
        "tests.v1.lookup_client.test_lookup_timeout_metrics::test_sync",
        "tests.v1.test_new.TestThing::test_method",
    ]
    assert testrun.added_failed(None, added) == []


def test_a_module_whose_name_extends_an_added_one_is_not_counted():
    peer = testrun.Outcome(failed={"tests.v1.test_new_other::test_x"})
    assert testrun.added_failed(peer, ["tests/v1/test_new.py"]) == []


@pytest.mark.parametrize("raw", ["0", "-1", "two", ""])
def test_bad_jobs_value_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(testrun.JOBS_ENV, raw)
    with pytest.raises(DistBuildError, match=f"{testrun.JOBS_ENV}="):
        testrun.leave_one_out_jobs()


def test_a_corrupt_proof_map_names_the_file(tmp_path):
    path = tmp_path / "proof-map.json"
    path.write_text("{not json")
    with pytest.raises(DistBuildError, match=str(path)):
        testrun.read_proof_map(path)
    assert testrun.read_proof_map(tmp_path / "absent.json") == {}


def test_a_problem_line_names_the_failed_tests():
    assert testrun._names(set()) == ""
    assert testrun._names({"b::t", "a::t"}) == ": a::t, b::t"
    many = {f"m::t{i:02d}" for i in range(12)}
    assert testrun._names(many).endswith("m::t09 and 2 more")


def test_no_engine_leaves_out_the_engine_scenarios_even_where_a_path_names_them():
    """--no-engine's pytest arguments, given to the real pytest: no test of tests/engine is
    collected, from tests/ or from a path that names an engine file; the others are."""
    import subprocess
    import sys

    from distbuild.host.testrun import ENGINE_TESTS, without_engine

    repo = Path(__file__).resolve().parents[2]
    for given in (["tests/tool", "tests/engine"], [f"{ENGINE_TESTS}/test_harness.py", "tests/tool/test_testrun.py"]):
        paths, args = without_engine(given, ["-q"])
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only",
                               *args, *paths],
                              capture_output=True, text=True, cwd=repo, timeout=120)
        collected = [line for line in done.stdout.splitlines() if "::" in line]
        assert collected and all(line.startswith("tests/tool/") for line in collected), done.stdout[-2000:]
    # from tests/, as make test gives it: the folder walk honours --ignore
    paths, args = without_engine(["tests"], ["-q"])
    assert paths == ["tests"] and args[-1] == f"--ignore={ENGINE_TESTS}"
    with pytest.raises(DistBuildError, match="every path given"):
        without_engine([f"{ENGINE_TESTS}/test_protocol.py::test_x"], [])


def test_the_summary_names_the_slowest_tests_of_every_run(tmp_path):
    """CI's summary lists the ten slowest tests by junit's own times, each with its run."""
    junit = tmp_path / "junit.xml"
    cases = "".join(f'<testcase classname="tests.t" name="test_{i}" time="{i}.5"/>' for i in range(12))
    junit.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    patched = testrun.parse_junit(junit)
    assert patched.seconds["tests.t::test_3"] == 3.5
    proofs = testrun.Outcome(seconds={"tests.p::test_proof": 60.0})
    text = testrun.slowest_tests({"patched": patched, "pristine": proofs})
    lines = text.splitlines()
    assert lines[0] == "  slowest 10 tests:" and len(lines) == 11
    assert lines[1].split() == ["60.0", "s", "pristine:", "tests.p::test_proof"]
    assert lines[2].endswith("patched: tests.t::test_11") and "tests.t::test_2" not in text


def test_phase_4_names_a_regression_and_the_log_that_shows_it(tmp_path, capsys):
    (tmp_path / "test-results").mkdir()
    run = testrun.PeerRun(pristine=testrun.Outcome(passed={"tests.a::t", "tests.b::t"}),
                          patched=testrun.Outcome(passed={"tests.a::t"}, failed={"tests.b::t"}),
                          added=[], seconds=90.0)
    problems = testrun.judge_peer(run, tmp_path)
    assert len(problems) == 1 and "1 upstream test(s)" in problems[0] and "tests.b::t" in problems[0]
    assert str(tmp_path / "logs" / "phase-4-patched.log") in problems[0]
    assert "ran beside phases 1 to 3, 1.5 min" in capsys.readouterr().out
    assert (tmp_path / "test-results" / "peer-pristine-passed.txt").read_text() == "tests.a::t\ntests.b::t\n"


def test_phase_4_a_regression_that_passes_every_rerun_alone_is_named_load_sensitive(tmp_path, capsys):
    (tmp_path / "test-results").mkdir()
    run = testrun.PeerRun(pristine=testrun.Outcome(passed={"tests.a::t", "tests.b::t"}),
                          patched=testrun.Outcome(passed={"tests.a::t"}, failed={"tests.b::t"}),
                          added=[], seconds=90.0, reruns={"tests.b::t": testrun.PEER_RERUNS})
    assert testrun.judge_peer(run, tmp_path) == []
    assert run.load_sensitive() == {"tests.b::t"} and run.regressed() == set()
    assert f"passed {testrun.PEER_RERUNS} of {testrun.PEER_RERUNS} reruns: load-sensitive" in capsys.readouterr().out


def test_phase_4_a_regression_that_fails_one_rerun_counts(tmp_path, capsys):
    (tmp_path / "test-results").mkdir()
    run = testrun.PeerRun(pristine=testrun.Outcome(passed={"tests.b::t"}),
                          patched=testrun.Outcome(failed={"tests.b::t"}),
                          added=[], seconds=90.0, reruns={"tests.b::t": testrun.PEER_RERUNS - 1})
    problems = testrun.judge_peer(run, tmp_path)
    assert len(problems) == 1 and "tests.b::t" in problems[0]
    assert ": a regression" in capsys.readouterr().out


def test_a_junit_node_maps_back_to_the_pytest_node_it_came_from(tmp_path):
    (tmp_path / "tests" / "v1").mkdir(parents=True)
    (tmp_path / "tests" / "v1" / "test_x.py").write_text("")
    assert (testrun.pytest_node("tests.v1.test_x.TestY::test_z[a.b]", tmp_path)
            == "tests/v1/test_x.py::TestY::test_z[a.b]")
    assert testrun.pytest_node("tests.v1.test_x::test_z", tmp_path) == "tests/v1/test_x.py::test_z"
    with pytest.raises(DistBuildError, match="tests.v1.gone::t"):
        testrun.pytest_node("tests.v1.gone::t", tmp_path)


def test_reruns_count_real_pytest_passes_of_each_node_alone(tmp_path):
    """Real pytest runs: a test that passes every time, and one that passes only on its first run
    (a counter file stands in for load that comes and goes)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_r.py").write_text(
        "from pathlib import Path\n"
        "def test_steady():\n    pass\n"
        "def test_once():\n"
        "    seen = Path(__file__).with_name('seen')\n"
        "    first = not seen.exists()\n"
        "    seen.write_text('x')\n"
        "    assert first\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    passes = testrun.rerun_regressed(Path(sys.executable), {"tests.test_r::test_steady", "tests.test_r::test_once"},
                                     tmp_path, tmp_path / "rerun.xml", env, tmp_path / "logs" / "rerun.log")
    assert passes == {"tests.test_r::test_steady": testrun.PEER_RERUNS, "tests.test_r::test_once": 1}


@pytest.mark.parametrize("raw", ["-1", "4", "one"])
def test_bad_beside_phase_1_value_names_the_variable_and_the_range(monkeypatch, raw):
    monkeypatch.setenv(testrun.BESIDE_PHASE_1_ENV, raw)
    expected = rf"{testrun.BESIDE_PHASE_1_ENV}='{raw}': .*from 0 to {testrun.JOBS_ENV} \(3\)"
    with pytest.raises(DistBuildError, match=expected):
        testrun.jobs_beside_phase_1(3)


def test_runs_beside_phase_1_wait_for_a_slot_and_all_go_once_the_slots_widen():
    """One slot while phase 1 runs: a second run waits until the slots widen (phase 1's end), then both
    run at once. Events, not sleeps, say what ran."""
    import concurrent.futures
    import threading

    slots = testrun.Slots(1)
    started = [threading.Event(), threading.Event()]
    release = threading.Event()

    def run(number: int) -> int:
        started[number].set()
        assert release.wait(30), "the test's own release never came"
        return number

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        slotted = testrun.SlottedPool(pool, slots)
        first, second = slotted.submit(run, 0), slotted.submit(run, 1)
        assert started[0].wait(30)
        assert not started[1].wait(0.5), "a second run started while only one slot was open"
        slots.widen(3)
        assert started[1].wait(30), "the second run did not start once the slots widened"
        release.set()
        assert (first.result(30), second.result(30)) == (0, 1)


def test_slots_go_to_the_runs_in_the_order_they_asked():
    """Five runs wait for one slot; each, once started, records itself and frees the slot. They
    must start in the order submitted (a Condition wakes waiters in no set order)."""
    import concurrent.futures
    import threading

    slots = testrun.Slots(1)
    hold = threading.Event()
    order: list[int] = []

    def run(number: int) -> None:
        order.append(number)
        if number == 0:
            assert hold.wait(30), "the test's own release never came"

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        slotted = testrun.SlottedPool(pool, slots)
        futures = [slotted.submit(run, 0)]
        for number in range(1, 6):
            futures.append(slotted.submit(run, number))
            while len(slots._waiting) < number:  # queued before the next one is submitted
                threading.Event().wait(0.01)
        hold.set()
        for future in futures:
            future.result(30)
    assert order == [0, 1, 2, 3, 4, 5]


def test_variants_with_engine_proofs_and_more_proof_files_are_submitted_first(tmp_path):
    from build.distbuild.host import leaveout

    def variant(patch: str) -> leaveout.LeftOut:
        return leaveout.LeftOut(patch=patch, tree_hash="0" * 40, dependents=(), changed=())

    variants = [variant(p) for p in ("0001-a.patch", "0002-b.patch", "0003-c.patch", "0004-d.patch")]
    proof_files = {"0001-a.patch": ["tests/lmcache/test_a.py"],
                   "0002-b.patch": ["tests/lmcache/test_b.py", "tests/engine/test_b.py"],
                   "0003-c.patch": ["tests/lmcache/test_c.py", "tests/lmcache/test_c2.py"],
                   "0004-d.patch": ["tests/lmcache/test_d.py"]}
    phase = testrun.LeaveOneOut(tmp_path, tmp_path, tmp_path / "python", ["tests"], [], {}, proof_files,
                                variants, [])
    assert [(number, v.patch) for number, v in phase.heaviest_first()] == [
        (2, "0002-b.patch"), (3, "0003-c.patch"), (1, "0001-a.patch"), (4, "0004-d.patch")]


def test_lines_beside_phase_1_are_held_until_it_ends_then_printed_in_order(capsys):
    lines = testrun.HeldLines()
    lines.say("variant 1: failed for its stated reason")
    lines.say("variant 2: failed for its stated reason")
    assert capsys.readouterr().out == ""
    lines.release()
    lines.say("variant 3: failed for its stated reason")
    assert capsys.readouterr().out.splitlines() == [f"variant {n}: failed for its stated reason" for n in (1, 2, 3)]


def test_phase_3_waits_for_the_proof_map_phase_2_writes_or_for_phase_2_to_end(tmp_path):
    import concurrent.futures
    import json

    path = tmp_path / "proof-map.json"
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        def collect() -> None:
            path.write_text(json.dumps({"0001-x.patch": ["tests/lmcache/test_x.py"]}))
        writer = pool.submit(collect)
        assert testrun.wait_for_proof_map(path, writer) == {"0001-x.patch": ["tests/lmcache/test_x.py"]}
        path.unlink()
        ended = pool.submit(lambda: None)
        ended.result()
        assert testrun.wait_for_proof_map(path, ended) == {}


LEAVES_A_SERVER = (
    "import subprocess, sys, time\n"
    "def test_starts_a_server_and_leaves_it():\n"
    "    # a session of its own, as the engine harness starts vLLM and Valkey\n"
    "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # left-behind'],\n"
    "                     start_new_session=True)\n"
    "    time.sleep({hold})\n")


def _left_behind() -> list[str]:
    return [line for line in os.popen("ps -eo pid,args").read().splitlines() if "left-behind" in line
            and "ps -eo" not in line]


@pytest.mark.parametrize("hold, stopped", [(0, False), (120, True)], ids=["run ends", "run stopped at its bound"])
def test_what_a_pytest_run_leaves_running_is_killed_and_named(tmp_path, monkeypatch, hold, stopped):
    """Real pytest runs whose test starts a server in its own session: whether the run ends or is
    stopped at its bound (its fixtures' teardown then never runs), the server is killed and named."""
    monkeypatch.setattr(testrun, "PHASE_TIMEOUT_S", 20)
    (tmp_path / "test_leaves.py").write_text(LEAVES_A_SERVER.replace("{hold}", str(hold)))
    log = tmp_path / "run.log"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if stopped:
        with pytest.raises(DistBuildError, match="ran past 20 s"):
            testrun.run_pytest(Path(sys.executable), ["test_leaves.py"], tmp_path, tmp_path / "r.xml", env, "run", log)
    else:
        assert testrun.run_pytest(Path(sys.executable), ["test_leaves.py"], tmp_path, tmp_path / "r.xml", env, "run",
                                  log).returncode == 0
    assert not _left_behind()
    assert "run: killed 1 process(es) the run left running:" in log.read_text()
    assert "left-behind" in log.read_text()


def test_processes_of_other_runs_are_left_alone(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # left-behind"],
                             env={**os.environ, leftovers.TOKEN_ENV: "another-run"})
    try:
        assert leftovers.kill_leftovers(leftovers.new_token()) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
