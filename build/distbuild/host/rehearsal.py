"""The GPU call rehearsed on a CPU host (``make gpu-rehearsal``): what tests/device_run.sh does
on the GPU host, done here, so that on the day only the GPU is new.

1. bundles: made from the tree under test into the rehearsal's own folder (the step of
   ``make gpu-bundles``), or kept when their stamps still match the tree;
2. host Python: a venv shaped like the GPU host's Python: 3.12 with torch 2.11, numpy,
   matplotlib and the dists closure.py records the host as providing, nothing else; made once,
   kept while its stamp (the requirement list) holds;
3. the call: the files the real call carries (``git ls-files -co --exclude-standard`` and the two
   bundles as work/<bundle>) copied into a scratch tree of at most 64 MiB, and
   tests/device_run.sh run there with OUT set, under the call's outer limit, in a bare
   environment: that Python first on PATH, no pip configuration, ``PIP_NO_INDEX=1``, and
   ``DIST_NO_GPU_EXT=1`` (LMCache's CUDA build skipped: no GPU here);
4. checks: pip in that environment refuses to download; every part wrote its JSON with a
   verdict (no CUDA device here, not a crash); at most 8 files at the top of OUT and nothing
   deeper; the bundles' stamps printed first and matching the carried series; the call's limits
   inside the outer limit; then the activation libraries built from the carried bundle with the
   call's nvcc for the GPU host's arch (``run.py --build-only``, about 30 s on 2 cores).

It prints one line per check and exits 1 naming every check that failed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..errors import DistBuildError
from . import gpubundles

BUNDLES = (gpubundles.ACTIVATION_BUNDLE, gpubundles.LMCACHE_BUNDLE)
CARRY_MAX = 64 << 20          # what the GPU host takes with the command, in all
RETURNED_FILES_MAX = 8        # what it hands back from $OUT, top level only
ARCHIVE_S = 30                # the details archive and the last lines, after the parts
HOST_PYTHON_VERSION = "3.12"
TORCH = "torch==2.11.0"
HOST_PACKAGES = ("numpy", "matplotlib")
STAMP = "dist-host-python"


class RehearsalError(DistBuildError):
    """A step of the rehearsal that could not run (the checks' failures are its verdict)."""


@dataclass
class Report:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

    @property
    def failed(self) -> list[str]:
        return [name for name, ok, _ in self.checks if not ok]


# ---- 1. bundles ---------------------------------------------------------------------------
def bundles_current(rwork: Path, repo: Path) -> bool:
    """True when both bundles under ``rwork`` are stamped for the tree at ``repo``."""
    try:
        for name in BUNDLES:
            gpubundles.check(rwork / name, repo)
    except gpubundles.StaleBundle as exc:
        print(f"bundles: remaking ({exc})", flush=True)
        return False
    return True


# ---- 2. the host's Python -----------------------------------------------------------------
def device_dists(bundle: Path) -> list[str]:
    """``name==version`` of every dist the LMCache bundle's manifest says the GPU host provides."""
    path = bundle / "manifest.json"
    try:
        dists = json.loads(path.read_text())["dists"]
        return sorted(f"{d['name']}=={d['version']}" for d in dists if d["provider"] == "device")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RehearsalError(f"{path}: cannot read the dists the GPU host provides ({exc})") from exc


def ensure_host_python(venv: Path, base: str, packages: list[str], torch_index: str | None) -> Path:
    """``venv``/bin/python: Python 3.12 with torch and ``packages`` only; kept while its stamp holds."""
    python = venv / "bin" / "python"
    wanted = "\n".join([TORCH, f"index {torch_index or 'default'}", *packages]) + "\n"
    stamp = venv / STAMP
    if python.exists() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    found = subprocess.run([base, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
    if found.returncode != 0 or found.stdout.strip() != HOST_PYTHON_VERSION:
        raise RehearsalError(f"--host-python {base}: not a Python {HOST_PYTHON_VERSION} "
                             f"({(found.stdout + found.stderr).strip() or 'does not run'})")
    shutil.rmtree(venv, ignore_errors=True)
    print(f"creating {venv}: Python {HOST_PYTHON_VERSION}, {TORCH}, {' '.join(packages)}", flush=True)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "off", "--disable-pip-version-check"]
    for cmd in ([*pip, *(["--index-url", torch_index] if torch_index else []), TORCH], [*pip, TORCH, *packages]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RehearsalError(f"installing into {venv} failed ({' '.join(cmd[4:])}):\n{done.stderr[-2000:]}")
    stamp.write_text(wanted)
    return python


# ---- 3. the call --------------------------------------------------------------------------
def carried_files(repo: Path) -> list[str]:
    """What the real call carries of the tree: tracked files and untracked ones not ignored."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, text=True, check=True).stdout
    return sorted({rel for rel in listed.split("\0") if rel and (repo / rel).is_file()})


def stage_tree(repo: Path, rwork: Path, dest: Path) -> int:
    """Copy the carried files and both bundles (as work/<bundle>) into ``dest``; return its bytes."""
    shutil.rmtree(dest, ignore_errors=True)
    for rel in carried_files(repo):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target, follow_symlinks=False)
    for name in BUNDLES:
        shutil.copytree(rwork / name, dest / "work" / name, symlinks=True)
    return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file() and not p.is_symlink())


def call_env(python: Path, cuda_bin: Path | None, call: Path) -> dict[str, str]:
    """The GPU host's environment, bare: no pip configuration, no index, no CUDA device."""
    path = [str(python.parent), *([str(cuda_bin)] if cuda_bin else []), os.defpath]
    return {"PATH": os.pathsep.join(path), "HOME": str(call / "home"), "TMPDIR": str(call / "tmp"),
            "OUT": str(call / "out"), "LANG": "C.UTF-8", "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "DIST_NO_GPU_EXT": "1"}


def _pump(stream: IO[str], sink: IO[str], lines: list[str]) -> None:
    for line in stream:
        lines.append(line)
        sink.write(line)
        print(f"  | {line}", end="", flush=True)


def run_call(tree: Path, env: dict[str, str], outer_s: int, log: Path) -> tuple[int | None, str]:
    """tests/device_run.sh in ``tree``, killed at ``outer_s`` like the real call; (rc or None, output)."""
    for name in ("home", "tmp", "out"):
        path = Path(env["TMPDIR"]).parent / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    print(f"=== the call: tests/device_run.sh in {tree}, outer limit {outer_s} s", flush=True)
    lines: list[str] = []
    with log.open("w") as sink:
        proc = subprocess.Popen(["nice", "-n", "10", "tests/device_run.sh"], cwd=tree, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        assert proc.stdout is not None
        reader = threading.Thread(target=_pump, args=(proc.stdout, sink, lines), daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=outer_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        reader.join(timeout=10)
    return rc, "".join(lines)


# ---- 4. checks ----------------------------------------------------------------------------
def check_no_index(python: Path, env: dict[str, str], scratch: Path, report: Report) -> None:
    """In the call's environment pip must refuse to download anything."""
    done = subprocess.run([str(python), "-m", "pip", "download", "--no-deps", "--dest", str(scratch), "six"],
                          env=env, capture_output=True, text=True, timeout=120)
    said = (done.stdout + done.stderr).strip().splitlines()
    report.check("no index", done.returncode != 0 and not any(scratch.glob("*")),
                 f"pip download in the call's environment: exit {done.returncode}, {said[-1] if said else 'silent'}")


def check_activation_build(tree: Path, env: dict[str, str], arch: str, scratch: Path, report: Report) -> None:
    """The one step of the activation part a CPU host can do: both libraries built from the carried
    bundle with the call's nvcc (run.py --build-only), as the GPU host will build them."""
    shutil.rmtree(scratch, ignore_errors=True)
    cmd = ["nice", "-n", "10", "python3", "tests/flashinfer/gpu/run.py", "--bundle", "work/activation-bundle",
           "--build-only", "--arch", arch, "--out", str(scratch), "--jobs", "2"]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        report.check("activation build", False, f"run.py --build-only --arch {arch}: over 600 s")
        return
    libs = sorted(p.name for p in scratch.glob("libactivation_*.so"))
    said = (done.stdout + done.stderr).strip().splitlines()
    report.check("activation build", done.returncode == 0 and len(libs) == 2,
                 f"run.py --build-only --arch {arch} from the bundle: exit {done.returncode} in "
                 f"{time.monotonic() - t0:.0f} s, {' '.join(libs) or 'no library'}"
                 + ("" if done.returncode == 0 else f"; {' | '.join(said[-5:])}"))


def check_out(out: Path, report: Report) -> None:
    entries = sorted(out.iterdir()) if out.is_dir() else []
    deeper = [p.name for p in entries if not p.is_file()]
    files = [p.name for p in entries if p.is_file()]
    report.check("OUT", len(files) <= RETURNED_FILES_MAX and not deeper,
                 f"{len(files)} files (at most {RETURNED_FILES_MAX}): {' '.join(files) or 'none'}"
                 + (f"; not plain files at the top: {' '.join(deeper)}" if deeper else ""))


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def part_statuses(out: Path) -> dict[str, str]:
    path = out / "device-run.tsv"
    rows = [line.split("\t") for line in path.read_text().splitlines()] if path.is_file() else []
    return {row[0]: row[2] for row in rows if len(row) == 3}


def check_parts(out: Path, report: Report) -> None:
    """activation: stage "unfit", no CUDA device, exit 2; lmcache: the rehearsal's steps all passed."""
    status = part_statuses(out)
    act = read_json(out / "activation.json")
    verdict = (act or {}).get("verdict", "")
    report.check("activation part", act is not None and status.get("activation") == "2" and "no CUDA device" in verdict,
                 f"exit {status.get('activation', 'none')}, activation.json "
                 + (f"verdict {verdict!r}" if act is not None else "missing or unreadable"))
    lmc = read_json(out / "lmcache-gpu.json")
    steps = (lmc or {}).get("steps", [])
    failed = [f"{s['step']} (rc {s['rc']})" for s in steps if s.get("rc") != 0]
    verdict = (lmc or {}).get("verdict", "")
    report.check("lmcache part", lmc is not None and status.get("lmcache") == "0" and not failed
                 and "without CUDA" in verdict,
                 f"exit {status.get('lmcache', 'none')}, lmcache-gpu.json "
                 + (f"verdict {verdict!r}; steps {' '.join(s['step'] for s in steps)}"
                    + (f"; failed: {', '.join(failed)}" if failed else "") if lmc is not None
                    else "missing or unreadable"))


def stamp_section(output: str) -> str:
    """The call's lines from "=== bundles" up to its next "===" line."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("=== bundles")), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("===")), len(lines))
    return "\n".join(lines[start:end])


def check_stamps(output: str, tree: Path, rwork: Path, report: Report) -> None:
    """Both bundles' stamps printed before any part started, each the carried series'."""
    section = stamp_section(output)
    first_part = min((output.find(f"=== {p}:") for p in ("activation", "lmcache") if f"=== {p}:" in output),
                     default=len(output))
    before = bool(section) and output.find("=== bundles") < first_part
    for name in BUNDLES:
        record = read_json(rwork / name / gpubundles.STAMP) or {}
        content = str(record.get("content_sha256", ""))[:16]
        series = {u: gpubundles.carried_series(tree, u)[:16] for u in gpubundles.BUNDLE_UPSTREAMS[name]}
        stamped = {u: str(s.get("series_sha256", ""))[:16] for u, s in record.get("series", {}).items()}
        printed = (f"{name}: made" in section and bool(content) and f"content {content}" in section
                   and all(f"series {h}" in section for h in series.values()))
        report.check(f"stamp {name}", before and printed and stamped == series,
                     f"content {content or '?'}, series {stamped} (carried {series}); "
                     + ("printed first" if before and printed else "NOT printed before the parts"))


LIMITS = re.compile(r"=== limits: total (\d+) s; activation (\d+) s \(steps within (\d+)\); "
                    r"lmcache (\d+) s \(steps within (\d+)\); grace (\d+) s")


def check_limits(output: str, outer_s: int, report: Report) -> None:
    """The parts' limits (they run side by side) and the archive after them inside the outer limit."""
    found = LIMITS.search(output)
    if not found:
        report.check("limits", False, "no '=== limits' line in the call's output")
        return
    total, act, act_in, lmc, lmc_in, grace = map(int, found.groups())
    run_py = [int(m) for m in re.findall(r"run\.py: up to (\d+) s", output)]
    worst = max(act, lmc) + grace + ARCHIVE_S
    ok = (act_in < act and lmc_in < lmc and worst < outer_s and lmc <= total
          and all(limit <= act_in for limit in run_py))
    report.check("limits", ok, f"activation {act} s (steps {act_in}, run.py {run_py or '?'}), lmcache {lmc} s "
                 f"(steps {lmc_in}), grace {grace} s, archive {ARCHIVE_S} s: at worst {worst} s of the outer "
                 f"{outer_s} s")


# ---- the whole ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    repo: Path
    rwork: Path
    host_python: str
    torch_index: str | None
    outer_s: int
    cuda_bin: Path | None
    activation_arch: str | None  # build the activation libraries for it after the call; None: skip


def _timed(report: Report, name: str, step: Callable[[], object]) -> object:
    t0 = time.monotonic()
    try:
        return step()
    finally:
        report.timings[name] = time.monotonic() - t0


def commit_of(repo: Path) -> str:
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=normal"],
                           capture_output=True, text=True).stdout.strip()
    return head + (" with uncommitted changes" if dirty else "")


def rehearse(plan: Plan, make_bundles: Callable[[Path], None]) -> int:
    """Run the four steps; 0 when every check passed, else 1 naming the failed ones."""
    report = Report()
    t_start = time.monotonic()
    print(f"rehearsing the GPU call of {plan.repo} at {commit_of(plan.repo)} in {plan.rwork}", flush=True)

    def bundles() -> None:
        if not bundles_current(plan.rwork, plan.repo):
            make_bundles(plan.rwork)

    _timed(report, "bundles", bundles)
    packages = [*HOST_PACKAGES, *device_dists(plan.rwork / gpubundles.LMCACHE_BUNDLE)]
    python = _timed(report, "host python", lambda: ensure_host_python(
        plan.rwork / "host-python", plan.host_python, packages, plan.torch_index))
    assert isinstance(python, Path)
    call = plan.rwork / "call"
    size = _timed(report, "staging", lambda: stage_tree(plan.repo, plan.rwork, call / "tree"))
    assert isinstance(size, int)
    report.check("carried size", size <= CARRY_MAX, f"{size / 2**20:.1f} MiB of at most {CARRY_MAX >> 20} MiB")
    env = call_env(python, plan.cuda_bin, call)
    check_no_index(python, env, call / "no-index", report)
    rc, output = _timed(report, "call", lambda: run_call(call / "tree", env, plan.outer_s, call / "call.log"))
    report.check("call", rc is not None, f"exit {rc} in {report.timings['call']:.0f} s" if rc is not None else
                 f"killed at the outer limit of {plan.outer_s} s")
    out = call / "out"
    check_out(out, report)
    check_parts(out, report)
    check_stamps(output, call / "tree", plan.rwork, report)
    check_limits(output, plan.outer_s, report)
    if plan.activation_arch:
        _timed(report, "activation build", lambda: check_activation_build(
            call / "tree", env, plan.activation_arch, call / "activation-build", report))
    times = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in report.timings.items())
    print(f"rehearsal: {times}; {time.monotonic() - t_start:.0f} s in all; OUT {out}, log {call / 'call.log'}")
    if report.failed:
        print(f"rehearsal: FAILED: {', '.join(report.failed)}", file=sys.stderr)
        return 1
    print("rehearsal: passed: on the GPU host only the GPU is new")
    return 0
