"""Phase 2b of make test (build/distbuild/host/forward_picks.py): the picks file's rules, held for the
real 0.5.6 picks against docs/pr-map.md and the proofs' own markers, and the judgement of each pick,
fed by real pytest runs of the project's proof hooks as phase 2b runs them."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distbuild.errors import DistBuildError
from distbuild.host import forward_lmcache, forward_picks, testrun
from distbuild.prmap import PR_MAP, pull_requests
from distbuild.series import series_entries

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
PATCH, OTHER = series_entries(REPO / "patches" / "lmcache" / "series")[:2]   # 0001, 0002


def _collected_markers(nodes: list[str], dest: Path) -> dict[str, dict]:
    """The ``fixes`` marker of each node id, as a --collect-only run of the project's tests reads it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(DIST_PROOF_MARKERS=str(dest), DIST_LMCACHE_TREE="patched")
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                             "-p", "tests.support.proof_reasons", *nodes], cwd=REPO, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(dest.read_text())


def test_every_pull_request_has_one_pick_and_it_proves_a_patch_of_that_pull_request(tmp_path):
    prs = pull_requests(REPO / PR_MAP)
    assert sorted(prs) == list(range(1, 8))
    (release,) = forward_picks.releases(REPO)
    assert (release.version, release.series_dir.name) == ("0.5.6", "lmcache-0.5.6")
    series = series_entries(release.series_dir / "series")
    declared = forward_lmcache.not_applicable(release.series_dir, series)
    picks = forward_picks.read_picks(release.series_dir / forward_picks.PICKS, prs, declared)
    assert [pick.pr for pick in picks] == sorted(prs)
    markers = _collected_markers([pick.node for pick in picks], tmp_path / "markers.json")
    for pick in picks:
        assert pick.node in markers, f"PR {pick.pr}: {pick.node} is not a collected proof"
        patch = markers[pick.node]["patch"]
        assert patch in series, f"PR {pick.pr}: {pick.node} proves {patch}, not a patch of {release.series_dir}"
        assert patch[:4] in prs[pick.pr], f"PR {pick.pr}: {pick.node} proves {patch}, of another pull request"


PRS = {1: {"0001"}, 2: {"0002", "0003"}}
GOOD = ("PR 1 proof tests/lmcache/test_a.py::test_x: cheapest\n"
        "PR 2 proof tests/lmcache/test_b.py::test_y[2]: cheapest of 0002\n")


@pytest.mark.parametrize("text, message", [
    ("PR 1 tests/lmcache/test_a.py::test_x: why\n", ":1: not 'PR <n> proof <test node id>: <why>'"),
    (GOOD + "PR 9 proof tests/lmcache/test_c.py::test_z: why\n", ":3: PR 9 is not a pull request of docs/pr-map.md"),
    (GOOD + "PR 2 proof tests/lmcache/test_c.py::test_z: why\n", ":3: PR 2 has a second pick (line 2 has its first)"),
    ("PR 1 proof tests/lmcache/test_a.py::test_x: why\n", "no pick for PR 2 of docs/pr-map.md"),
    ("PR 1 proof test_x: why\n" + GOOD, ":1: PR 1: test_x: not a test node id"),
    ("PR 1 proof tests/engine/test_l2_loss.py::test_x: why\n", "an engine proof; it needs the engine venv"),
    ("PR 1 proof tests/lmcache/test_na.py::test_sync[1]: why\n", "declared not applicable to this release"),
])
def test_a_bad_picks_file_is_refused_naming_its_line(tmp_path, text, message):
    path = tmp_path / forward_picks.PICKS
    path.write_text(text)
    declared = [forward_lmcache.NotApplicable("0001-a.patch", "tests/lmcache/test_na.py::test_sync", "fixed")]
    with pytest.raises(DistBuildError, match=re.escape(str(path)) + ".*" + re.escape(message)):
        forward_picks.read_picks(path, PRS, declared)


def test_a_good_picks_file_reads_one_pick_per_pull_request(tmp_path):
    path = tmp_path / forward_picks.PICKS
    path.write_text(f"# why these\n\n{GOOD}")
    assert forward_picks.read_picks(path, PRS, []) == [
        forward_picks.Pick(1, "tests/lmcache/test_a.py::test_x", "cheapest"),
        forward_picks.Pick(2, "tests/lmcache/test_b.py::test_y[2]", "cheapest of 0002")]
    with pytest.raises(DistBuildError, match=r"make-test-picks: no such file"):
        forward_picks.read_picks(tmp_path / "absent" / forward_picks.PICKS, PRS, [])


def test_a_series_folder_with_picks_must_be_pinned_for_forward(tmp_path):
    (tmp_path / "patches" / "lmcache-9.9").mkdir(parents=True)
    assert forward_picks.releases(tmp_path) == []   # no picks file: not checked in make test
    (tmp_path / "patches" / "lmcache-9.9" / forward_picks.PICKS).write_text(GOOD)
    with pytest.raises(DistBuildError, match=r"lmcache==9\.9: not pinned in .*build/forward\.toml"):
        forward_picks.releases(tmp_path)


# A proof file whose tests behave as the series' fix would: fixed on the series' build only.
PROOFS = """import os
import pytest
PATCH = {patch!r}
OTHER = {other!r}
FIXED = os.environ["DIST_LMCACHE_TREE"] == "patched"

@pytest.mark.fixes(PATCH, fails_with=r"2 pins left")
def test_stated():
    assert FIXED, "2 pins left"

@pytest.mark.fixes(PATCH, fails_with=r"2 pins left")
def test_passes_on_pristine():
    pass

@pytest.mark.fixes(PATCH, fails_with=r"2 pins left")
def test_other_reason():
    if not FIXED:
        import lmcache_module_that_does_not_exist

@pytest.mark.fixes(OTHER, fails_with=r"lost")
def test_of_another_pull_request():
    assert FIXED, "lost"

@pytest.mark.fixes(PATCH, fails_with=r"2 pins left")
def test_broken_on_the_series():
    assert False, "2 pins left"

def test_not_a_proof():
    pass
"""
CONFTEST = "from tests.conftest import pytest_configure, pytest_collection_modifyitems, pytest_runtest_makereport\n"


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tree: str, junit: Path,
         extra: tuple[str, ...] = ()) -> testrun.Outcome:
    """One real pytest run of PROOFS on ``tree`` (pristine or patched), as phase 2b runs its picks."""
    monkeypatch.setenv("DIST_LMCACHE_TREE", tree)
    pytester.runpytest("-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *extra)
    return testrun.parse_junit(junit)


def test_each_pick_is_judged_by_its_reason_on_pristine_its_pull_request_and_the_series(pytester, monkeypatch,
                                                                                       tmp_path):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_proof=PROOFS.format(patch=PATCH, other=OTHER))
    reasons = tmp_path / "reasons.json"
    monkeypatch.setenv("DIST_PROOF_REASONS", str(reasons))
    pristine = _run(pytester, monkeypatch, "pristine", tmp_path / "pristine.xml",
                    ("-p", "tests.support.proof_reasons"))
    monkeypatch.delenv("DIST_PROOF_REASONS")
    series = _run(pytester, monkeypatch, "patched", tmp_path / "series.xml")
    names = ["stated", "passes_on_pristine", "other_reason", "of_another_pull_request", "broken_on_the_series",
             "not_a_proof"]
    picks = [forward_picks.Pick(pr, f"test_proof.py::test_{name}", "why") for pr, name in enumerate(names, start=1)]
    prs = dict.fromkeys(range(1, 7), {PATCH[:4]})
    judged = forward_picks.judge(picks, forward_lmcache.read_reasons(reasons), pristine, series)
    logs = {"pristine": Path("p.log"), "series": Path("s.log")}
    found = {row.pick.pr: forward_picks.pick_problems(row, prs, "9.9", logs) for row in judged}

    assert found[1] == ([], [])
    assert found[2][0] == ["phase 2b: LMCache 9.9: PR 2: test_proof.py::test_passes_on_pristine passed on pristine "
                           "9.9: a proof must fail without its patch (log p.log)"]
    assert found[3][0][0].startswith("phase 2b: LMCache 9.9: PR 3: test_proof.py::test_other_reason failed on "
                                     "pristine 9.9, but not for its stated reason /2 pins left/: ModuleNotFoundError")
    assert found[4][0] == [f"phase 2b: LMCache 9.9: PR 4: test_proof.py::test_of_another_pull_request proves "
                           f"{OTHER}, which docs/pr-map.md puts in no pull request, not PR 4"]
    assert found[5] == ([], ["phase 2b: LMCache 9.9: PR 5: test_proof.py::test_broken_on_the_series failed on the "
                             "9.9 series; it must pass there (log s.log)"])
    assert found[6][0][0].startswith("phase 2b: LMCache 9.9: PR 6: test_proof.py::test_not_a_proof is not a proof")
    assert all(side == [] for pr in (2, 3, 4, 6) for side in found[pr][1:])   # each passed on the series
    assert forward_picks.checks(judged, prs, "9.9") == (7, 5)
    assert forward_picks.verdict_line(judged, "9.9") == (
        "the 9.9 series: 6 PRs, 3 proofs failed on pristine 9.9 for their stated reason, 5 passed on the series")


def test_a_pick_that_did_not_run_is_named():
    pick = forward_picks.Pick(1, "tests/lmcache/test_a.py::test_x", "why")
    (row,) = forward_picks.judge([pick], {}, testrun.Outcome(), testrun.Outcome())
    pristine, series = forward_picks.pick_problems(row, {1: {"0001"}}, "9.9", {"pristine": Path("p"),
                                                                               "series": Path("s")})
    assert pristine == ["phase 2b: LMCache 9.9: PR 1: tests/lmcache/test_a.py::test_x did not run on pristine 9.9 "
                        "(no such test, or pytest stopped before it) (log p)"]
    assert series == ["phase 2b: LMCache 9.9: PR 1: tests/lmcache/test_a.py::test_x not run on the 9.9 series; "
                      "it must pass there (log s)"]


def test_the_releases_unmet_requirements_are_named(tmp_path):
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "common.txt").write_text(
        "# the release's\npytest\nno-such-distribution-here==1.0; platform_system == \"Linux\"\n"
        "pytest<1\nonly-elsewhere==2.0; platform_system == \"Windows\"\n")
    unmet = forward_picks.unmet_requirements(Path(sys.executable), tmp_path)
    assert unmet[0] == 'no-such-distribution-here==1.0; platform_system == "Linux"'
    assert re.fullmatch(r"pytest<1 \(the venv has [\d.]+\)", unmet[1]) and len(unmet) == 2


def test_phase_2b_is_in_the_summary_and_its_problems_fail_the_run(tmp_path, capsys):
    phases = testrun._Phases(REPO, tmp_path, Path(sys.executable), tmp_path, {}, {"DIST_X": "1"}, ["tests"], [],
                             {}, {}, [], results={"patched": testrun.Outcome(), "pristine": testrun.Outcome()})
    assert phases.start_forward(None) is None
    assert phases.problems == ["phase 2b: skipped (--no-forward): a partial run"]
    side = testrun.SideRun(["phase 2b: the 9.9 series: 7 PRs, ..."], ["phase 2b: LMCache 9.9: PR 3: t failed"], 90.0,
                           {"phase 2b 9.9 series": testrun.Outcome(seconds={"t::slow": 42.0})}, 13, 1, ["PR 3: t"])
    future = phases.start_forward(lambda extra: side if extra == {"DIST_X": "1"} else None)
    phases.take_forward(future.result())
    phases.print_summary(0.0)
    out = capsys.readouterr().out
    assert "phase 2b 1.5 min beside 3" in out and "\n  phase 2b: the 9.9 series: 7 PRs, ...\n" in out
    assert "phase 2b 9.9 series: t::slow" in out and "FAILED phase 2b: LMCache 9.9: PR 3: t failed" in out
    assert out.rstrip().endswith("test: 13 passed, 1 failed, 0 skipped")
