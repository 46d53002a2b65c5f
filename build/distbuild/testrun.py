"""``make test``: run the project's tests against both LMCache trees and the
peer suite (LMCache's own CPU tests) against the patched one.

Phases:
1. ``patched``: every project test with the patched build (must pass).
2. ``pristine``: only ``@pytest.mark.fixes`` tests, with the pristine build,
   as strict xfail: each proof must fail there (the proof that a patch fixes
   something runs in CI).
3. ``peer``: LMCache's own CPU tests listed in ``tests/peer/suite.txt`` with
   the patched build; every test recorded as passing on pristine
   (``tests/peer/pristine-passed.txt``) must pass.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DistBuildError

PHASE_TIMEOUT_S = 40 * 60


@dataclass
class Outcome:
    passed: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)
    xfailed: set[str] = field(default_factory=set)
    returncode: int = 0


def run_pytest(python: Path, args: list[str], cwd: Path, junit: Path, env: dict[str, str], label: str) -> Outcome:
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEsxX",
           f"--junitxml={junit}", "-o", "junit_family=xunit2", *args]
    print(f"\n=== {label}: {' '.join(cmd)}", flush=True)
    try:
        result = subprocess.run(cmd, cwd=cwd, env=env, timeout=PHASE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DistBuildError(f"{label}: pytest ran past {PHASE_TIMEOUT_S} s and was stopped") from None
    outcome = parse_junit(junit) if junit.exists() else Outcome()
    outcome.returncode = result.returncode
    return outcome


def parse_junit(path: Path) -> Outcome:
    outcome = Outcome()
    for case in ET.parse(path).getroot().iter("testcase"):
        node = f"{case.get('classname', '')}::{case.get('name', '')}"
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            outcome.failed.add(node)
        elif skipped is not None:
            (outcome.xfailed if skipped.get("type") == "pytest.xfail" else outcome.skipped).add(node)
        else:
            outcome.passed.add(node)
    return outcome


def peer_tests_dir(tree: Path, work: Path, name: str) -> Path:
    """A copy of LMCache's tests/ outside the source tree (else the sources shadow the install)."""
    dest = work / "peer" / name
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(tree / "tests", dest / "tests")
    for ini in ("pytest.ini", "pyproject.toml"):
        if (tree / ini).is_file() and ini == "pytest.ini":
            shutil.copy(tree / ini, dest / ini)
    return dest


def read_list(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _env(tree: str, work: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DIST_LMCACHE"))}
    env.update(extra or {})
    env.update(DIST_LMCACHE_TREE=tree, PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1",
               TMPDIR=str(work / "tmp"))
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def run_all(repo: Path, work: Path, python: Path, envs: dict[str, dict[str, str]], tree: Path,
            pytest_args: list[str], extra_env: dict[str, str] | None = None,
            paths: list[str] | None = None, peer: bool = True) -> int:
    """The three phases; prints one closing 'N passed, N failed' line."""
    junit = work / "test-results"
    results: dict[str, Outcome] = {}
    problems: list[str] = []

    patched_env = _env("patched", work, {**(extra_env or {}), **envs["patched"]})
    pristine_env = _env("pristine", work, {**(extra_env or {}), **envs["pristine"]})
    paths = paths or ["tests"]
    pytest_args = [a for a in pytest_args if a != "--"]
    results["patched"] = run_pytest(python, [*paths, *pytest_args], repo, junit / "patched.xml", patched_env, "phase 1/3: project tests, patched LMCache")
    if results["patched"].returncode != 0:
        problems.append(f"phase 1: {len(results['patched'].failed)} project test(s) failed on the patched tree")

    proofs = run_pytest(python, [*paths, "-m", "fixes", *pytest_args], repo, junit / "pristine.xml", pristine_env, "phase 2/3: patch proofs, pristine LMCache")
    results["pristine"] = proofs
    if proofs.returncode not in (0, 5):
        problems.append(f"phase 2: {len(proofs.failed)} proof(s) did not fail on the pristine tree (strict xfail)")

    suite = read_list(repo / "tests" / "peer" / "suite.txt")
    recorded = set(read_list(repo / "tests" / "peer" / "pristine-passed.txt"))
    if not peer:
        problems.append("phase 3: skipped (--no-peer): a partial run")
    elif suite:
        peer_dir = peer_tests_dir(tree, work, "patched")
        peer = run_pytest(python, [*suite, *pytest_args], peer_dir, junit / "peer.xml", patched_env, "phase 3/3: LMCache's own CPU tests, patched LMCache")
        results["peer"] = peer
        regressed = sorted(recorded - peer.passed)
        if regressed:
            problems.append(f"phase 3: {len(regressed)} upstream test(s) that pass on pristine do not pass on patched: "
                            + ", ".join(regressed[:10]))
        print(f"\npeer suite: {len(peer.passed)} passed on patched; {len(recorded)} recorded on pristine; "
              f"{len(recorded & peer.passed)} of those pass on patched")
    else:
        problems.append("phase 3: tests/peer/suite.txt is empty; the peer suite did not run")

    passed = sum(len(o.passed) for o in results.values()) + len(proofs.xfailed)
    failed = sum(len(o.failed) for o in results.values())
    skipped = sum(len(o.skipped) for o in results.values())
    print("\nsummary:")
    print(f"  phase 1 project tests (patched): {len(results['patched'].passed)} passed, "
          f"{len(results['patched'].failed)} failed, {len(results['patched'].skipped)} skipped")
    print(f"  phase 2 patch proofs (pristine): {len(proofs.xfailed)} failed as they must, "
          f"{len(proofs.failed)} passed on pristine (must not)")
    if "peer" in results:
        p = results["peer"]
        print(f"  phase 3 LMCache CPU suite (patched): {len(p.passed)} passed, {len(p.failed)} failed, {len(p.skipped)} skipped")
    for problem in problems:
        print(f"FAILED {problem}")
    print(f"test: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if problems else 0


def record_peer(repo: Path, work: Path, python: Path, pristine_env: dict[str, str], pristine_src: Path) -> int:
    """Run the peer suite on the pristine build and write tests/peer/pristine-passed.txt."""
    suite = read_list(repo / "tests" / "peer" / "suite.txt")
    if not suite:
        raise DistBuildError(f"{repo / 'tests' / 'peer' / 'suite.txt'}: empty; list the upstream tests to run")
    peer_dir = peer_tests_dir(pristine_src, work, "pristine")
    outcome = run_pytest(python, suite, peer_dir, work / "test-results" / "peer-pristine.xml",
                         _env("pristine", work, pristine_env), "LMCache's own CPU tests, pristine LMCache")
    out = repo / "tests" / "peer" / "pristine-passed.txt"
    header = ("# Upstream LMCache tests that pass on the pristine build (written by `make peer-record`).\n"
              "# `make test` requires each of them to pass on the patched build too.\n")
    out.write_text(header + "".join(f"{node}\n" for node in sorted(outcome.passed)))
    print(f"peer-record: {len(outcome.passed)} passed, {len(outcome.failed)} failed, "
          f"{len(outcome.skipped)} skipped on pristine; wrote {out}")
    return 0
