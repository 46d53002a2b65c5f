"""Phase 2b of make test: each forwarded LMCache series proven by one proof per pull request.

``make forward UPSTREAM=lmcache==<version>`` proves a series forwarded to a newer release
(``patches/lmcache-<version>/``) whole, in about half an hour (forward_lmcache.py). make test runs
its slimmest form, beside phase 3, for each such folder with a ``make-test-picks`` file (one
proof per pull request of docs/pr-map.md, with why it was picked) and a pin in build/forward.toml:

1. the release's sdist, fetched and verified as make forward fetches it, unpacked as the pristine
   commit with the series applied exactly on it (forward.prepare_tree), in
   ``work/phase-2b/lmcache-<version>/tree``;
2. its two ``NO_GPU_EXT=1`` wheels, cached by tree hash in the wheel cache make test and make forward
   share (testenv.build_wheel), installed into ``lmcache-pristine/`` and ``lmcache-series/`` beside
   the tree: make test's own venv runs both, each put first on ``PYTHONPATH`` as phase 2 runs the
   pinned release's pristine build;
3. the picked proofs on the pristine release as phase 2 runs them (strict xfail, what each failed
   with recorded by tests/support/proof_reasons.py, the series folder's ``fails-with`` applied) and on
   the series as phase 1 runs them, the two runs side by side;
4. the judgement: each pick failed on the pristine release for its stated reason, passed on the
   series, and its ``fixes`` marker names a patch of its pull request.
"""
from __future__ import annotations

import concurrent.futures
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import forward, forward_lmcache, testenv, testrun
from ..errors import DistBuildError
from ..pins import Pin
from ..prmap import PR_MAP, pull_request_of, pull_requests
from ..series import Patch, load_series

PICKS = "make-test-picks"
PICK_RULE = re.compile(r"^PR\s+(?P<pr>\d+)\s+proof\s+(?P<node>\S+):\s+(?P<why>\S.*)$")
PICK_FORM = "PR <n> proof <test node id>: <why>"
# The engine proofs need an engine venv with the release's build: make forward's engine step runs them.
ENGINE_TESTS = testrun.ENGINE_TESTS + "/"
FOLDER = "phase-2b"   # under work/, work/logs and work/test-results


@dataclass(frozen=True)
class Pick:
    """The proof that stands for one pull request."""
    pr: int
    node: str
    why: str


def _pick_line(path: Path, number: int, text: str, prs: dict[int, set[str]],
               declared: list[forward_lmcache.NotApplicable]) -> Pick:
    """One line of a picks file, checked on its own."""
    match = PICK_RULE.match(text)
    if match is None:
        raise DistBuildError(f"{path}:{number}: not '{PICK_FORM}': {text[:80]}")
    pick = Pick(int(match["pr"]), match["node"], match["why"])
    where = f"{path}:{number}: PR {pick.pr}: {pick.node}"
    if pick.pr not in prs:
        raise DistBuildError(f"{path}:{number}: PR {pick.pr} is not a pull request of {PR_MAP} "
                             f"(it has {', '.join(map(str, sorted(prs)))})")
    if not pick.node.startswith("tests/") or ".py::" not in pick.node:
        raise DistBuildError(f"{where}: not a test node id (tests/<folder>/<file>.py::<test>)")
    if pick.node.startswith(ENGINE_TESTS):
        raise DistBuildError(f"{where}: an engine proof; it needs the engine venv with the release's build, "
                             "which make forward's engine step makes")
    for entry in declared:
        if forward_lmcache.covers(entry.node, pick.node) or forward_lmcache.covers(pick.node, entry.node):
            raise DistBuildError(f"{where}: declared not applicable to this release "
                                 f"({path.parent / forward_lmcache.NOT_APPLICABLE}): it cannot fail there")
    return pick


def read_picks(path: Path, prs: dict[int, set[str]], declared: list[forward_lmcache.NotApplicable]) -> list[Pick]:
    """The picks file's lines, ``PR <n> proof <test node id>: <why>``: exactly one per pull request of
    ``prs``, none of them an engine proof or a proof ``declared`` not applicable."""
    if not path.is_file():
        raise DistBuildError(f"{path}: no such file (one proof per pull request, '{PICK_FORM}')")
    picks: dict[int, tuple[int, Pick]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        pick = _pick_line(path, number, text, prs, declared)
        if pick.pr in picks:
            raise DistBuildError(f"{path}:{number}: PR {pick.pr} has a second pick (line {picks[pick.pr][0]} "
                                 "has its first): one proof per pull request")
        picks[pick.pr] = (number, pick)
    missing = sorted(set(prs) - set(picks))
    if missing:
        raise DistBuildError(f"{path}: no pick for PR {', '.join(map(str, missing))} of {PR_MAP}: "
                             "one proof per pull request")
    return [pick for _, (_, pick) in sorted(picks.items())]


# ---------------------------------------------------------------------------------------------
# The judgement


@dataclass(frozen=True)
class Judged:
    """What one pick did: on the pristine release (forward_lmcache.pristine_state, ``not a proof`` or
    ``not run``) and on the series (passed | failed | skipped | xfailed | not run), with the patch and the
    reason its marker names."""
    pick: Pick
    patch: str | None
    fails_with: str | None
    pristine: str
    series: str

    @property
    def proven(self) -> bool:
        return self.pristine == "stated"


def _records_of(pick: Pick, reasons: dict[str, dict]) -> list[dict]:
    return [record for node, record in sorted(reasons.items()) if forward_lmcache.covers(pick.node, node)]


def _state(pick: Pick, outcome: testrun.Outcome) -> str:
    """What the pick's test(s) did in one run, by pytest's JUnit XML: the worst of its cases."""
    junit = forward_lmcache.junit_name(pick.node)
    states = [state for state, names in (("failed", outcome.failed), ("skipped", outcome.skipped),
                                         ("xfailed", outcome.xfailed), ("passed", outcome.passed))
              if any(forward_lmcache.covers(junit, name) for name in names)]
    return states[0] if states else "not run"


def _pristine(pick: Pick, reasons: dict[str, dict], pristine: testrun.Outcome) -> str:
    """The pick's state on the pristine release: from proof_reasons.py's records (the worst case of a
    parametrized pick), ``not a proof`` for a test that ran there without a record, else ``not run``."""
    states = [forward_lmcache.pristine_state(record) for record in _records_of(pick, reasons)]
    if states:
        return next((state for state in states if state != "stated"), "stated")
    return "not a proof" if _state(pick, pristine) != "not run" else "not run"


def judge(picks: list[Pick], reasons: dict[str, dict], pristine: testrun.Outcome,
          series: testrun.Outcome) -> list[Judged]:
    """Each pick's outcome on both builds."""
    judged = []
    for pick in picks:
        records = _records_of(pick, reasons)
        first = records[0] if records else {}
        judged.append(Judged(pick, first.get("patch"), first.get("fails_with"), _pristine(pick, reasons, pristine),
                             _state(pick, series)))
    return judged


def _pristine_problem(row: Judged, version: str) -> str | None:
    state = row.pristine
    if state == "stated":
        return None
    if state == "passed":
        return f"passed on pristine {version}: a proof must fail without its patch"
    if state.startswith("other: "):
        return (f"failed on pristine {version}, but not for its stated reason /{row.fails_with}/: "
                f"{state.removeprefix('other: ')[:300]}")
    if state.startswith("setup failed: "):
        return (f"its setup failed on pristine {version} before its test ran: "
                f"{state.removeprefix('setup failed: ')[:300]}")
    if state == "failed, no fails_with stated":
        return f"failed on pristine {version}, but states no reason (fails_with) to hold it to"
    if state == "not a proof":
        return "is not a proof (no @pytest.mark.fixes marker): only a proof can stand for a pull request"
    if state == "not run":
        return f"did not run on pristine {version} (no such test, or pytest stopped before it)"
    return f"was {state} on pristine {version}: a pick must run there and fail for its stated reason"


def pick_problems(row: Judged, prs: dict[int, set[str]], version: str,
                  logs: dict[str, Path]) -> tuple[list[str], list[str]]:
    """The ways one pick fell short on the pristine release (its reason, its pull request) and on the
    series, each naming its pull request, its proof and why (and the log)."""
    head = f"phase 2b: LMCache {version}: PR {row.pick.pr}: {row.pick.node}"
    pristine, series = [], []
    why = _pristine_problem(row, version)
    if why is not None:
        pristine.append(f"{head} {why} (log {logs['pristine']})")
    if row.patch is not None and row.patch[:4] not in prs[row.pick.pr]:
        owner = pull_request_of(row.patch, prs)
        pristine.append(f"{head} proves {row.patch}, which {PR_MAP} puts in "
                        + (f"PR {owner}" if owner else "no pull request") + f", not PR {row.pick.pr}")
    if row.series != "passed":
        series.append(f"{head} {row.series} on the {version} series; it must pass there (log {logs['series']})")
    return pristine, series


def problems(judged: list[Judged], prs: dict[int, set[str]], version: str, logs: dict[str, Path]) -> list[str]:
    """Every pick's problems (pick_problems), in the picks' order."""
    return [line for row in judged for side in pick_problems(row, prs, version, logs) for line in side]


def checks(judged: list[Judged], prs: dict[int, set[str]], version: str) -> tuple[int, int]:
    """Checks passed and failed: two per pick, one on each build."""
    failed = sum(bool(side) for row in judged for side in pick_problems(row, prs, version, {"pristine": Path(),
                                                                                            "series": Path()}))
    return 2 * len(judged) - failed, failed


def verdict_line(judged: list[Judged], version: str) -> str:
    proven = sum(row.proven for row in judged)
    passed = sum(row.series == "passed" for row in judged)
    return (f"the {version} series: {len(judged)} PRs, {proven} proofs failed on pristine {version} for their "
            f"stated reason, {passed} passed on the series")


def pick_lines(judged: list[Judged]) -> list[str]:
    """One line per pull request: its proof, the patch it proves, what it did on both builds."""
    return [f"PR {row.pick.pr}: {row.pick.node.split('::', 1)[-1]} ({(row.patch or '?')[:4]}): pristine "
            f"{'failed for its stated reason' if row.proven else row.pristine[:60]}, series {row.series}"
            for row in judged]


# ---------------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True)
class Release:
    """A forwarded series make test checks: its release, its folder, its pin."""
    version: str
    series_dir: Path
    pin: Pin


def releases(repo: Path) -> list[Release]:
    """Each ``patches/lmcache-<version>/`` with a picks file, pinned in build/forward.toml (else refused)."""
    found = []
    for folder in sorted((repo / "patches").glob("lmcache-*")):
        if (folder / PICKS).is_file():
            version = folder.name.removeprefix("lmcache-")
            found.append(Release(version, folder, forward.forward_pin(repo / "build" / "forward.toml",
                                                                      f"lmcache=={version}")))
    return found


@dataclass(frozen=True)
class Setup:
    """What phase 2b takes from make test."""
    repo: Path
    work: Path
    python: Path                      # make test's venv (work/venv)
    wheels: Path                      # the wheel cache, by tree hash
    fetch: Callable[[Pin], Path]      # a pinned sdist, verified, from the download cache or the index


# The release's runtime requirements that make test's venv (made from the pinned release's) does not meet.
UNMET = """
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
for line in open(sys.argv[1]):
    text = line.split("#", 1)[0].strip()
    if not text or text.startswith("-"):
        continue
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        found = version(req.name)
    except PackageNotFoundError:
        print(text)
        continue
    if req.specifier and not req.specifier.contains(found, prereleases=True):
        print(f"{text} (the venv has {found})")
"""


def unmet_requirements(python: Path, tree: Path) -> list[str]:
    """The lines of the release's requirements/common.txt that ``python``'s environment does not meet."""
    common = tree / "requirements" / "common.txt"
    result = subprocess.run([str(python), "-c", UNMET, str(common)], capture_output=True, text=True)
    if result.returncode != 0:
        raise DistBuildError(f"could not check {common} against {python}: {result.stderr.strip()[-300:]}")
    return result.stdout.splitlines()


@dataclass
class ReleaseRun:
    """Phase 2b on one release: its folders, its builds, its two pytest runs."""
    setup: Setup
    release: Release
    extra_env: dict[str, str]
    patches: list[Patch] = field(default_factory=list)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def version(self) -> str:
        return self.release.version

    @property
    def out(self) -> Path:
        return self.setup.work / FOLDER / f"lmcache-{self.version}"

    @property
    def logs(self) -> Path:
        return self.setup.work / "logs" / FOLDER

    @property
    def results(self) -> Path:
        return self.setup.work / "test-results" / FOLDER

    def run_log(self, build: str) -> Path:
        return self.logs / f"lmcache-{self.version}-{build}.log"

    def picks(self) -> tuple[list[Pick], dict[int, set[str]]]:
        prs = pull_requests(self.setup.repo / PR_MAP)
        self.patches = load_series(self.release.series_dir)
        declared = forward_lmcache.not_applicable(self.release.series_dir, [p.name for p in self.patches])
        return read_picks(self.release.series_dir / PICKS, prs, declared), prs

    def build(self) -> list[str]:
        """The tree, both builds installed, and their environments; lines that say what was built."""
        sdist = self.setup.fetch(self.release.pin)
        tree = forward.prepare_tree(sdist, self.release.pin, self.patches, self.out / "tree", allow_offsets=False)
        variants = forward_lmcache.release_variants(tree.path, self.version, self.patches,
                                                    self.setup.python.parent.parent, self.out / "lmcache-series",
                                                    self.out / "lmcache-pristine")
        restated = self.results / f"lmcache-{self.version}-restated.json"
        forward_lmcache.write_restated(self.release.series_dir, [p.name for p in self.patches], restated)
        extra = {**self.extra_env, "DIST_LMCACHE_SRC": str(tree.path), forward_lmcache.RESTATED_ENV: str(restated)}
        for variant in variants:
            env = testenv.install(variant, self.setup.python, self.setup.wheels, self.logs)
            self.envs[variant.name] = testrun.run_env(variant.name, self.setup.work, {**extra, **env})
        unmet = unmet_requirements(self.setup.python, tree.path)
        return [f"{len(self.patches)} patches applied exactly on {self.release.pin.filename}; builds in {self.out}",
                *([f"of LMCache {self.version}'s requirements, make test's venv lacks: {', '.join(unmet)}"]
                  if unmet else [])]

    def _pytest(self, build: str, args: list[str], env: dict[str, str]) -> testrun.Outcome:
        name = f"lmcache-{self.version}-{build}"
        tmp = testrun.job_tmp(self.setup.work, f"2b-{self.version}-{build[0]}")  # short: Unix socket paths
        return testrun.run_pytest(self.setup.python, args, self.setup.repo, self.results / f"{name}.xml",
                                  {**env, "TMPDIR": tmp}, f"phase 2b: {name}", self.run_log(build))

    def run(self, picks: list[Pick]) -> tuple[dict[str, dict], testrun.Outcome, testrun.Outcome]:
        """The picks on the pristine release and on the series, side by side: the pristine run's records and
        both outcomes."""
        nodes = [pick.node for pick in picks]
        reasons = self.results / f"lmcache-{self.version}-pristine-reasons.json"
        reasons.unlink(missing_ok=True)
        pristine_env = {**self.envs["pristine"], forward_lmcache.REASONS_ENV: str(reasons)}
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            pristine = pool.submit(self._pytest, "pristine", ["-p", forward_lmcache.PROOF_PLUGIN, *nodes],
                                   pristine_env)
            series = pool.submit(self._pytest, "series", nodes, self.envs["patched"])
            pristine_outcome, series_outcome = pristine.result(), series.result()
        records = forward_lmcache.read_reasons(reasons) if reasons.is_file() else {}
        return records, pristine_outcome, series_outcome


def check_release(setup: Setup, release: Release, extra_env: dict[str, str]) -> testrun.SideRun:
    """Phase 2b on one release: build, run, judge."""
    started = time.monotonic()
    run = ReleaseRun(setup, release, extra_env)
    label = f"phase 2b: LMCache {release.version}"
    try:
        picks, prs = run.picks()
        built = run.build()
        records, pristine, series = run.run(picks)
    except DistBuildError as exc:
        return testrun.SideRun([f"phase 2b: the {release.version} series: did not run"], [f"{label}: {exc}"],
                               time.monotonic() - started)
    judged = judge(picks, records, pristine, series)
    found = problems(judged, prs, release.version, {"pristine": run.run_log("pristine"),
                                                    "series": run.run_log("series")})
    passed, failed = checks(judged, prs, release.version)
    seconds = time.monotonic() - started
    return testrun.SideRun([f"phase 2b: {verdict_line(judged, release.version)} ({seconds / 60:.1f} min)"],
                           found, seconds,
                           {f"phase 2b {release.version} pristine": pristine,
                            f"phase 2b {release.version} series": series},
                           passed, failed, [*built, *pick_lines(judged)])


def run_phase(setup: Setup, extra_env: dict[str, str]) -> testrun.SideRun:
    """Phase 2b over every forwarded series with picks; one SideRun for them all."""
    total = testrun.SideRun([], [], 0.0)
    try:
        found = releases(setup.repo)
    except DistBuildError as exc:
        return testrun.SideRun(["phase 2b: did not run"], [f"phase 2b: {exc}"], 0.0)
    print(f"\n=== phase 2b: {len(found)} forwarded LMCache series, one proof per pull request "
          f"(logs: {setup.work / 'logs' / FOLDER})", flush=True)
    for release in found:
        total = total.add(check_release(setup, release, extra_env))
    return total


__all__ = ["Judged", "PICKS", "Pick", "Release", "Setup", "check_release", "checks", "judge", "pick_problems",
           "problems", "read_picks", "releases", "run_phase", "unmet_requirements", "verdict_line"]
