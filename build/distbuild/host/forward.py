"""Check the series on a newer upstream release, exactly, and FlashInfer's kernel on it (make forward).

``make health`` says whether each patch still applies somewhere near its place; this says
whether the series is good on the release, from nothing but the repository and the download
cache:

1. fetch: the release's sdist as ``build/forward.toml`` pins it (file name, size, sha256),
   verified like every pinned download;
2. apply: the release unpacked as the pristine commit (``refs/dist/pristine``), then each
   patch checked with ``git apply --check -v`` before ``git am``: no fuzz (git never drops
   context), and a hunk that applies only at an offset stops the run as a failing one does,
   naming the patch and the hunk (``--allow-offsets`` lists the offsets and goes on);
3. compile and 4. CPU tests, for FlashInfer: ``tests/flashinfer`` with the test environment's
   Python against that tree (``DIST_FLASHINFER_TREE``) and the pinned nvcc. Its compile check
   builds the activation kernels for sm_103a, sm_100a and sm_90a with the flags it reads from
   the tree's own JIT code, and its ptxas report gives registers and spills per arch; a spill
   in a patched kernel fails the step;
5. the verdict: one screen, printed and written to ``<work>/forward/<upstream>-<version>/``
   with the logs it points to.

For LMCache, steps 3 and 4 are instead its build, proofs, suite and engine steps (forward_lmcache.py):
CPU wheels of the pristine release and of the series, the project's proofs on both, LMCache's own CPU
suite on both, and the real vLLM engine scenarios with the series' build.

The series a release is checked with is ``patches/<upstream>-<version>/`` when that folder exists (the
series forwarded to that release), else ``patches/<upstream>/`` (series_dir).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import forward_lmcache
from ..errors import DistBuildError
from ..gitrepo import PREPARED_REF, PRISTINE_REF, Repo
from ..health import parse_spec
from ..pins import Pin, load, normalize_name
from ..prepare import apply_patch, unpack_sdist
from ..series import Patch

ARCHS = ("sm_103a", "sm_100a", "sm_90a")
KERNEL_FAMILIES = ("activationKernel", "activationDeepSeekKernel", "activationDeepSeekSmallBatchKernel")
# The flags of the compile that the verdict names (the rest are in the ptxas report).
SHOWN_FLAGS = ("-O3", "-use_fast_math", "-std=c++17", "-gencode=arch=compute_103a,code=sm_103a")
# The compile check's pytest temp folder under --basetemp (tmp_path_factory.mktemp numbers it 0).
PTXAS_REPORT = Path("activation_compile0") / "ptxas_report.json"


class ForwardStop(DistBuildError):
    """A step that failed: the verdict says which and why."""


# ---------------------------------------------------------------------------------------------
# Step 1: the pin


def forward_pin(pins_file: Path, spec: str) -> Pin:
    """The pin of ``NAME==VERSION`` in build/forward.toml; NAME is the package or the upstream folder."""
    name, version = parse_spec(spec)
    pins = load(pins_file) if pins_file.is_file() else []
    for pin in pins:
        names = {normalize_name(pin.name), normalize_name(pin.upstream or "")}
        if normalize_name(name) in names and pin.version == version:
            if pin.kind != "sdist" or not pin.upstream:
                raise DistBuildError(f"{pins_file}: {pin.filename} must be an upstream sdist (role upstream)")
            return pin
    known = ", ".join(p.spec for p in pins) or "nothing"
    raise DistBuildError(f"{spec}: not pinned in {pins_file} (it pins {known}); add its sdist there with the "
                         "sha256 the package index lists for it")


def series_dir(patches: Path, upstream: str, version: str) -> Path:
    """The series a release is checked with: ``patches/<upstream>-<version>/`` when that folder exists (the
    series forwarded to that release), else ``patches/<upstream>/`` (the pinned release's)."""
    forwarded = patches / f"{upstream}-{version}"
    return forwarded if forwarded.is_dir() else patches / upstream


# ---------------------------------------------------------------------------------------------
# Step 2: exact apply


@dataclass(frozen=True)
class Hunk:
    path: str
    number: int  # 1-based, within its file
    old_start: int
    header: str

    def name(self) -> str:
        return f"hunk #{self.number} of {self.path} ({self.header})"


@dataclass(frozen=True)
class Offset:
    patch: str
    hunk: Hunk
    lines: int

    def describe(self) -> str:
        return f"{self.patch}: {self.hunk.name()} applies {self.lines:+d} lines off"


HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")


def hunks(text: str) -> list[Hunk]:
    """Every hunk of a patch file, with its file (the new name) and its number in that file."""
    out: list[Hunk] = []
    path, number = "", 0
    for line in text.splitlines():
        diff = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
        if diff:
            path, number = diff.group(2), 0
            continue
        header = HUNK_HEADER.match(line)
        if header and path:
            number += 1
            out.append(Hunk(path, number, int(header.group(1)), header.group(0)))
    return out


def _hunk(all_hunks: list[Hunk], path: str, number: int | None = None, old_start: int | None = None) -> Hunk:
    for hunk in all_hunks:
        if hunk.path == path and (hunk.number == number or hunk.old_start == old_start):
            return hunk
    return Hunk(path, number or 0, old_start or 0, "?")


def offsets_in(verbose: str, patch: Patch) -> list[Offset]:
    """The hunks ``git apply -v`` reports as applied at an offset ("Hunk #2 succeeded at 250 (offset 25 lines).")."""
    all_hunks = hunks(patch.path.read_text(errors="replace"))
    found: list[Offset] = []
    path = ""
    for line in verbose.splitlines():
        checking = re.match(r"^Checking patch (.+)\.\.\.$", line)
        if checking:
            path = checking.group(1)
        moved = re.match(r"^Hunk #(\d+) succeeded at \d+ \(offset (-?\d+) lines?\)", line)
        if moved:
            found.append(Offset(patch.name, _hunk(all_hunks, path, number=int(moved.group(1))), int(moved.group(2))))
    return found


def conflict_message(verbose: str, patch: Patch) -> str:
    """Which hunk of ``patch`` does not apply, from ``git apply -v``'s errors."""
    all_hunks = hunks(patch.path.read_text(errors="replace"))
    failed = [_hunk(all_hunks, path, old_start=int(line)).name()
              for path, line in re.findall(r"error: patch failed: (.+):(\d+)", verbose)]
    missing = [f"{path} ({why})" for path, why in
               re.findall(r"error: (.+): (does not exist in index|No such file or directory|already exists)", verbose)]
    where = "; ".join(failed + missing) or (verbose.strip().splitlines() or ["git gave no reason"])[-1]
    return f"{patch.name} does not apply: {where}"


def check_exact(repo: Repo, patch: Patch) -> list[Offset]:
    """The patch's offset hunks; ForwardStop naming the hunk when one does not apply at all."""
    result = repo.git("apply", "--check", "-v", str(patch.path.resolve()), check=False)
    verbose = result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")
    if result.returncode != 0:
        raise ForwardStop(conflict_message(verbose, patch))
    return offsets_in(verbose, patch)


@dataclass(frozen=True)
class Tree:
    path: Path
    pristine_tree: str
    patched_tree: str
    offsets: list[Offset]


def prepare_tree(sdist: Path, pin: Pin, patches: list[Patch], dest: Path, allow_offsets: bool) -> Tree:
    """A fresh tree at dest: the release as the pristine commit, the series on top, each patch exactly."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    unpack_sdist(sdist, dest)
    repo = Repo(dest)
    repo.init()
    repo.commit_all(f"pristine {pin.filename}\n\nsha256: {pin.sha256}\n")
    repo.set_ref(PRISTINE_REF, repo.head())
    offsets: list[Offset] = []
    for patch in patches:
        moved = check_exact(repo, patch)
        if moved and not allow_offsets:
            raise ForwardStop("\n".join(["applies only at an offset (the series is not exact on this release; "
                                         "OFFSETS=1 goes on):", *(o.describe() for o in moved)]))
        apply_patch(repo, patch)
        offsets.extend(moved)
    repo.set_ref(PREPARED_REF, repo.head())
    return Tree(dest, repo.tree(PRISTINE_REF), repo.tree("HEAD"), offsets)


# ---------------------------------------------------------------------------------------------
# Steps 3 and 4: tests/flashinfer against the tree


def pytest_command(python: Path, out: Path, paths: list[str]) -> list[str]:
    return [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
            f"--basetemp={out / 'pytest'}", f"--junitxml={out / 'junit.xml'}", *paths]


def run_pytest(repo_root: Path, python: Path, tree: Path, cuda: Path, out: Path, paths: list[str]) -> Path:
    """Run tests against ``tree`` with their output in ``out``; return the log. CI=true: a check
    that cannot run (no nvcc, no tree) fails instead of skipping."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = {**os.environ, "DIST_FLASHINFER_TREE": str(tree), "DIST_CUDA_HOME": str(cuda), "CI": "true",
           "PYTHONDONTWRITEBYTECODE": "1"}
    log = out / "pytest.log"
    with log.open("w") as handle:
        subprocess.run(pytest_command(python, out, paths), cwd=repo_root, env=env, stdout=handle,
                       stderr=subprocess.STDOUT)
    return log


@dataclass(frozen=True)
class KernelRow:
    arch: str
    tree: str
    family: str
    count: int
    registers: tuple[int, int]
    stack: int
    spill_stores: int
    spill_loads: int


def family_of(short_name: str) -> str:
    return short_name.split("<", 1)[0]


def kernel_rows(report: dict) -> list[KernelRow]:
    """Per arch, tree and kernel: instantiations, register range, largest stack, spill bytes summed."""
    rows = []
    for arch in ARCHS:
        for tree in ("pristine", "patched"):
            kernels = report.get("kernels", {}).get(f"{tree}/{arch}", {})
            for family in KERNEL_FAMILIES:
                stats = [s for name, s in kernels.items() if family_of(name) == family]
                if not stats:
                    continue
                regs = [s.get("registers", 0) for s in stats]
                rows.append(KernelRow(arch, tree, family, len(stats), (min(regs), max(regs)),
                                      max(s.get("stack", 0) for s in stats),
                                      sum(s.get("spill_stores", 0) for s in stats),
                                      sum(s.get("spill_loads", 0) for s in stats)))
    return rows


def spilling(report: dict) -> list[str]:
    """Patched activation kernels with a stack frame or spills, named with their arch."""
    bad = []
    for arch in ARCHS:
        for name, s in sorted(report.get("kernels", {}).get(f"patched/{arch}", {}).items()):
            if s.get("stack", 1) or s.get("spill_stores", 1) or s.get("spill_loads", 1):
                bad.append(f"{name} on {arch}: stack {s.get('stack')} B, spills {s.get('spill_stores')}/"
                           f"{s.get('spill_loads')} B")
    return bad


def format_rows(rows: list[KernelRow]) -> list[str]:
    table = [("arch", "tree", "kernel", "n", "registers", "stack", "spill st/ld")]
    for r in rows:
        regs = str(r.registers[0]) if r.registers[0] == r.registers[1] else f"{r.registers[0]}-{r.registers[1]}"
        table.append((r.arch, r.tree, r.family, str(r.count), regs, str(r.stack), f"{r.spill_stores}/{r.spill_loads}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]


def compile_lines(report_path: Path, tree: Path, log: Path) -> list[str]:
    """The compile step's lines from the compile check's ptxas report; ForwardStop on a spill or no report."""
    if not report_path.is_file():
        raise ForwardStop(f"the compile check wrote no ptxas report ({report_path}); see {log}")
    try:
        report = json.loads(report_path.read_text())
    except ValueError as exc:
        raise ForwardStop(f"{report_path}: not JSON ({exc})") from None
    if Path(report.get("tree", "")) != tree:
        raise ForwardStop(f"{report_path}: compiled from {report.get('tree')!r}, not {tree}; "
                          "the compile check did not read DIST_FLASHINFER_TREE")
    missing = [arch for arch in ARCHS if f"patched/{arch}" not in report.get("kernels", {})]
    if missing:
        raise ForwardStop(f"{report_path}: no patched kernels for {', '.join(missing)}")
    flags = report.get("flags", {}).get("sm_103a", [])
    lines = [f"nvcc flags read from the tree's flashinfer/jit: {len(flags)} for sm_103a "
             f"({', '.join(f for f in flags if f in SHOWN_FLAGS)}; all in {report_path.name})",
             *format_rows(kernel_rows(report))]
    bad = spilling(report)
    if bad:
        raise ForwardStop("patched activation kernels spill or use a stack frame:\n" + "\n".join(lines + bad))
    return lines


@dataclass(frozen=True)
class Results:
    passed: int
    failed: list[str]
    skipped: list[tuple[str, str]]  # (test, reason)


def junit_results(junit: Path) -> Results:
    """Passed, failed (and errors) and skipped tests from pytest's JUnit XML."""
    if not junit.is_file():
        raise ForwardStop(f"pytest wrote no {junit}; see {junit.with_name('pytest.log')}")
    try:
        root = ET.parse(junit).getroot()
    except ET.ParseError as exc:
        raise ForwardStop(f"{junit}: not JUnit XML ({exc})") from None
    passed, failed, skipped = 0, [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            failed.append(name)
        elif "skipped" in outcome:
            reason = next(c.get("message", "") for c in case if c.tag == "skipped")
            skipped.append((name, reason))
        else:
            passed += 1
    return Results(passed, failed, skipped)


def result_lines(counts: Results, log: Path) -> list[str]:
    lines = [f"{counts.passed} passed, {len(counts.failed)} failed, {len(counts.skipped)} skipped (log {log})"]
    reasons = sorted({reason for _, reason in counts.skipped})
    lines += [f"skipped: {reason}" for reason in reasons]
    if counts.failed or not counts.passed:
        raise ForwardStop("\n".join(lines + [f"failed: {name}" for name in counts.failed]))
    return lines


# ---------------------------------------------------------------------------------------------
# Step 5: the verdict


@dataclass
class Step:
    name: str
    status: str  # ok | offsets (apply, allowed) | FAILED | skipped (by a flag) | not run
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Verdict:
    spec: str
    steps: list[Step] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def good(self) -> bool:
        return all(s.status == "ok" for s in self.steps)


def headline(verdict: Verdict) -> str:
    failed = [s.name for s in verdict.steps if s.status == "FAILED"]
    if failed:
        return f"NOT GOOD: {', '.join(failed)} failed"
    if any(s.status == "offsets" for s in verdict.steps):
        return "NOT EXACT: the series applies only at offsets; every step after it passed"
    skipped = [s for s in verdict.steps if s.status == "skipped"]
    if skipped:
        return ("PARTIAL: every step that ran passed; skipped: "
                + ", ".join(f"{s.name} ({' '.join(s.lines)})" for s in skipped))
    return "GOOD" if verdict.good else "NOT GOOD"


def _timing(seconds: float) -> str:
    """A step's time: seconds, and minutes too once it is long."""
    return f", {seconds:.0f} s" + (f" ({seconds / 60:.1f} min)" if seconds >= 120 else "")


def format_verdict(verdict: Verdict) -> str:
    head = headline(verdict)
    lines = [f"make forward {verdict.spec}: {head}, {verdict.wall_s:.0f} s"
             + (f" ({verdict.wall_s / 60:.1f} min)" if verdict.wall_s >= 120 else "")]
    for step in verdict.steps:
        timing = _timing(step.seconds) if step.status not in ("not run", "skipped") else ""
        lines.append(f"  {step.name:8} {step.status}{timing}")
        lines += [f"           {line}" for text in step.lines for line in text.splitlines()]
    return "\n".join(lines)


def run_step(verdict: Verdict, name: str, action: Callable[[], list[str]]) -> bool:
    """Run one step into the verdict; False (and the step FAILED) when it stops."""
    started = time.monotonic()
    try:
        lines = action()
    except DistBuildError as exc:
        verdict.steps.append(Step(name, "FAILED", str(exc).splitlines(), time.monotonic() - started))
        return False
    verdict.steps.append(Step(name, "ok", lines, time.monotonic() - started))
    return True


def write_verdict(verdict: Verdict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "verdict.txt"
    path.write_text(format_verdict(verdict) + "\n")
    return path


def not_run(verdict: Verdict, steps: tuple[str, ...]) -> None:
    done = {s.name for s in verdict.steps}
    verdict.steps += [Step(name, "not run") for name in steps if name not in done]


# ---------------------------------------------------------------------------------------------
# The run


COMPILE_CHECK = "tests/flashinfer/test_activation_compile.py"
KERNEL_TESTS = "tests/flashinfer"
# Upstreams whose kernel checks run after the apply step.
CHECKED = {"flashinfer": ("compile", "tests")}


@dataclass(frozen=True)
class Context:
    repo: Path  # the repository: patches/, tests/
    pins_file: Path  # build/forward.toml
    work: Path  # outputs go to work/forward/<upstream>-<version>/
    fetch: Callable[[Pin], Path]  # a pinned file, verified, from the download cache or the index
    series: Callable[[Path], list[Patch]]  # the series in a folder (series.load_series)
    toolchain: Callable[[], Path]  # the pinned nvcc's CUDA home
    python: Path  # the test environment's Python (pytest, numpy)
    allow_offsets: bool = False
    bundle: Callable[[Path, str, Path], list[str]] | None = None  # (tree, version, dest) -> lines
    lmcache: forward_lmcache.Setup | None = None  # LMCache's steps 3-6; None: the run ends after apply


class ForwardRun:
    def __init__(self, ctx: Context, pin: Pin) -> None:
        self.ctx, self.pin = ctx, pin
        self.out = ctx.work / "forward" / f"{pin.upstream}-{pin.version}"
        self.series_dir = series_dir(ctx.repo / "patches", pin.upstream or "", pin.version)
        self.sdist: Path | None = None
        self.tree: Tree | None = None
        self.cuda: Path | None = None
        self.lmcache = (forward_lmcache.LMCacheForward(ctx.repo, ctx.lmcache, self.out, pin.version)
                        if pin.upstream == "lmcache" and ctx.lmcache is not None else None)

    def fetch(self) -> list[str]:
        self.sdist = self.ctx.fetch(self.pin)
        return [f"{self.pin.filename}: {self.pin.size} bytes, sha256 {self.pin.sha256} "
                f"({self.ctx.pins_file.relative_to(self.ctx.repo)}), verified"]

    def apply(self) -> list[str]:
        patches = self.ctx.series(self.series_dir)
        self.tree = prepare_tree(self.sdist, self.pin, patches, self.out / "tree", self.ctx.allow_offsets)
        if self.lmcache is not None:
            self.lmcache.prepared(self.tree.path, self.series_dir, patches)
        exact = "no fuzz, no offsets" if not self.tree.offsets else "no fuzz; at offsets (allowed):"
        series_file = (self.series_dir / "series").relative_to(self.ctx.repo)
        return [f"{len(patches)} patch(es) applied with git am, {exact} ({series_file})",
                *(o.describe() for o in self.tree.offsets),
                f"tree {self.tree.path}: pristine {self.tree.pristine_tree[:12]}, "
                f"patched {self.tree.patched_tree[:12]}"]

    def compile(self) -> list[str]:
        self.cuda = self.ctx.toolchain()
        out = self.out / "compile"
        log = run_pytest(self.ctx.repo, self.ctx.python, self.tree.path, self.cuda, out, [COMPILE_CHECK])
        lines = compile_lines(out / "pytest" / PTXAS_REPORT, self.tree.path, log)
        try:
            counts = result_lines(junit_results(out / "junit.xml"), log)
        except ForwardStop as exc:
            raise ForwardStop("\n".join([*lines, f"compile check: {exc}"])) from None
        return [*lines, f"compile check: {counts[0]}"]

    def tests(self) -> list[str]:
        out = self.out / "tests"
        log = run_pytest(self.ctx.repo, self.ctx.python, self.tree.path, self.cuda, out,
                         [KERNEL_TESTS, f"--ignore={COMPILE_CHECK}"])
        return result_lines(junit_results(out / "junit.xml"), log)

    def bundle(self) -> list[str]:
        return self.ctx.bundle(self.tree.path, self.pin.version, self.out / "activation-bundle")

    def steps(self) -> list[tuple[str, Callable[[], list[str]] | None]]:
        """Every step in order; None for a step a flag turned off."""
        steps: list[tuple[str, Callable[[], list[str]] | None]] = [("fetch", self.fetch), ("apply", self.apply)]
        if self.pin.upstream in CHECKED:
            steps += [("compile", self.compile), ("tests", self.tests)]
            if self.ctx.bundle is not None:
                steps.append(("bundle", self.bundle))
        if self.lmcache is not None:
            steps += self.lmcache.steps()
        return steps

    def skip_reason(self, name: str) -> str:
        return self.ctx.lmcache.skipped().get(name, "off") if self.ctx.lmcache is not None else "off"


def start_afresh(out: Path, kept: tuple[str, ...]) -> None:
    """Remove an earlier run's outputs from ``out`` (tree, logs, bundle: the verdict speaks of this run only),
    but the folders in ``kept`` (venvs, rebuilt only when what they are made from changed)."""
    if not out.exists():
        return
    for entry in out.iterdir():
        if entry.name in kept and entry.is_dir():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def run(ctx: Context, spec: str) -> tuple[Verdict, Path]:
    """Every step in order, stopping at the first that fails (but for the independent checks, which all
    run); the verdict and where it was written."""
    started = time.monotonic()
    pin = forward_pin(ctx.pins_file, spec)
    if pin.upstream in CHECKED and not ctx.python.is_file():
        raise DistBuildError(f"{ctx.python}: no such Python; the kernel checks need the test environment "
                             "(run make test once, or name a Python with pytest and numpy: TEST_PYTHON=...)")
    forward = ForwardRun(ctx, pin)
    start_afresh(forward.out, forward_lmcache.KEPT if forward.lmcache is not None else ())
    verdict = Verdict(f"{pin.name}=={pin.version}")
    for name, action in forward.steps():
        if action is None:
            verdict.steps.append(Step(name, "skipped", [forward.skip_reason(name)]))
            continue
        print(f"\n=== make forward {verdict.spec}: {name}", flush=True)
        if not run_step(verdict, name, action) and name not in forward_lmcache.INDEPENDENT:
            break
        if name == "apply" and forward.tree is not None and forward.tree.offsets:
            verdict.steps[-1].status = "offsets"
    not_run(verdict, tuple(name for name, _ in forward.steps()))
    verdict.wall_s = time.monotonic() - started
    return verdict, write_verdict(verdict, forward.out)


__all__ = ["Context", "ForwardStop", "Hunk", "Offset", "Results", "Step", "Tree", "Verdict", "check_exact",
           "compile_lines", "format_verdict", "forward_pin", "hunks", "junit_results", "kernel_rows", "prepare_tree",
           "result_lines", "run", "spilling", "write_verdict"]
