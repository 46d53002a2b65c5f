"""Hash-locked requirement files for the image: the full dependency closure, by sha256.

``build/pins.toml`` pins the artifacts we name (vLLM, torch, nixl-cu13, the
sdists). The image also installs everything those depend on; pip's
``--require-hashes`` needs a hash for each. ``python -m distbuild lock``
(``make lock``) resolves the closure once with pip itself (``pip install
--dry-run --report``, Python 3.11, manylinux x86_64, wheels only) against the
primary index pip is configured with, isolated from local find-links and
constraint files (they hold CPU builds of torch), on CPython 3.11 x86_64
Linux (the image's platform), and writes:

- ``build/lock/image.txt``: what the runtime stage installs, the operator
  tools' ``scripts/requirements.txt`` included. LMCache and FlashInfer are
  resolved for their dependencies and then left out: the image installs our
  patched builds of them.
- ``build/lock/builder.txt``: torch and the build requirements of the two
  patched wheels (plus FlashInfer's import-time dependencies, for the
  ahead-of-time compile).
- ``build/lock/router.txt``: the P/D router's own image, vllm-router and its
  closure, resolved with the image closure as constraints: every line is
  image.txt's (version, file and sha256), so the router's image runs the
  router the serving image carries. ``--router-only`` (``make lock
  ROUTER_ONLY=1``) rewrites it alone from the committed image.txt.

Every wheel that ``pins.toml`` also pins must resolve to the pinned file and
hash, or the lock is refused: the two lists never disagree.

One CUDA compiler: vLLM 0.31.0 requires ``humming-kernels[cu13]``, whose extra
asks for ``nvidia-cuda-nvcc`` and ``nvidia-cuda-cccl`` with no version, so pip
alone takes the newest (13.5 nvcc, which pulls 13.5 crt and nvvm, and cccl
13.3) beside the 13.0 toolchain every build used. The image closure therefore
requires the toolchain's own compiler wheels (``JIT_TOOLCHAIN``, role
``toolchain`` in pins.toml) at their pinned file and hash: the runtime's JIT
(FlashInfer, DeepGEMM) compiles with the same nvcc as the build stages.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import markers
from ..errors import DistBuildError
from ..pins import Pin, normalize_name

PYTHON_VERSION = "3.11"
IMAGE_PYTHON = "3.11.2"   # the base image's python3 (Debian bookworm); the Dockerfile's PYTHON_VERSION is 3.11
MAX_MARKER_ROUNDS = 4
PLATFORM = "manylinux_2_28_x86_64"

IMAGE_EXTRA = ("lmcache", "flashinfer-python")   # resolved for their deps, installed from our builds
# Resolved but never installed, with the reason (rendered into image.txt; the
# self-test's pip check accepts exactly these unmet requirements):
IMAGE_NOT_INSTALLED = {
    "nixl-cu12": "nixl (the package vLLM imports as nixl._api) requires nixl-cu12 and nixl-cu13 "
                 "unconditionally; the image is CUDA 13 and nixl loads nixl_cu13 (torch.version.cuda)",
}
# The toolchain pins the runtime's JIT needs: nvcc and ptxas, its front end (crt,
# nvvm), CCCL's headers and cuobjdump (DeepGEMM reads SASS with it). Not the
# toolchain's cudart: torch's cuda-toolkit pins the runtime's (13.0 as well).
JIT_TOOLCHAIN = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl", "nvidia-cuda-cuobjdump")
BUILDER_REQUIREMENTS = (
    "ninja", "packaging>=24.2", "setuptools>=77.0.3,<81.0.0", "setuptools_scm>=8", "wheel",
    "grpcio==1.78.0", "grpcio-tools==1.78.0",      # LMCache's build-system requires
    "apache-tvm-ffi>=0.1.11,<0.2",                   # FlashInfer's build-system requires
)


@dataclass(frozen=True)
class Locked:
    name: str
    version: str
    filename: str
    sha256: str

    def line(self) -> str:
        return f"{self.name}=={self.version} \\\n    --hash=sha256:{self.sha256}  # {self.filename}"


LOCK_ENTRY = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)==(?P<version>\S+) \\\n\s+--hash=sha256:(?P<sha256>[0-9a-f]{64})"
                        r"\s+# (?P<filename>\S+)$", re.MULTILINE)
ROUTER = "vllm-router"


def read_lock(path: Path) -> list[Locked]:
    """The entries of a lock file this module wrote."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise DistBuildError(f"{path}: cannot read the lock: {exc}") from exc
    entries = [Locked(m["name"], m["version"], m["filename"], m["sha256"]) for m in LOCK_ENTRY.finditer(text)]
    if not entries:
        raise DistBuildError(f"{path}: no locked requirement (name==version, --hash=sha256:..., # file)")
    return entries


def router_specs(pins: list[Pin]) -> list[str]:
    found = [p.spec for p in pins if p.role == "image" and normalize_name(p.name) == ROUTER]
    if not found:
        raise DistBuildError(f"build/pins.toml: no image pin of {ROUTER}; the router's image installs it")
    return found


def check_within(part: list[Locked], whole: list[Locked], part_name: str, whole_name: str) -> None:
    """Every entry of ``part`` is ``whole``'s, file and sha256 alike."""
    by_name = {x.name: x for x in whole}
    differ = [f"{x.name} {x.filename} ({whole_name}: {by_name[x.name].filename if x.name in by_name else 'absent'})"
              for x in part if by_name.get(x.name) != x]
    if differ:
        raise DistBuildError(f"{part_name} is not within {whole_name}: " + "; ".join(differ))


def _upstream_spec(pins: list[Pin], upstream: str) -> str:
    pin = next(p for p in pins if p.upstream == upstream)
    return pin.spec


def requirement_lines(path: Path) -> list[str]:
    """The requirements of a pip requirements file (comments and blank lines dropped)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise DistBuildError(f"{path}: cannot read the requirements: {exc}") from exc
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


def jit_toolchain_pins(pins: list[Pin]) -> list[Pin]:
    """The toolchain wheels the runtime image installs too (``JIT_TOOLCHAIN``); each must be pinned."""
    found = {normalize_name(p.name): p for p in pins if p.role == "toolchain" and p.kind == "wheel"}
    missing = [n for n in JIT_TOOLCHAIN if n not in found]
    if missing:
        raise DistBuildError(f"build/pins.toml: no toolchain pin for {', '.join(missing)}; the image's JIT "
                             "toolchain must be the build stages' (role = toolchain)")
    return [found[n] for n in JIT_TOOLCHAIN]


def image_specs(pins: list[Pin], tools: list[str] = ()) -> list[str]:
    wheels = [p.spec for p in pins if p.role == "image"]
    compiler = [p.spec for p in jit_toolchain_pins(pins)]
    return [*wheels, *compiler, _upstream_spec(pins, "lmcache"), _upstream_spec(pins, "flashinfer"), *tools]


def builder_specs(pins: list[Pin]) -> list[str]:
    torch = next(p.spec for p in pins if p.role == "image" and normalize_name(p.name) == "torch")
    return [torch, *BUILDER_REQUIREMENTS, _upstream_spec(pins, "flashinfer")]


def check_host() -> None:
    """pip resolves for the interpreter it runs in (``--platform`` does not widen manylinux
    tags), so the lock is made on the image's platform: CPython 3.11, x86_64 Linux."""
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    if have != PYTHON_VERSION or platform.machine() != "x86_64" or sys.platform != "linux":
        raise DistBuildError(f"make lock resolves for the image (CPython {PYTHON_VERSION}, x86_64 Linux) and must run "
                             f"on one; this is Python {have} on {sys.platform}/{platform.machine()}")


def _pip_report(cmd_base: list[str], specs: list[str], env: dict[str, str], tmp: Path) -> dict:
    report = tmp / "report.json"
    report.unlink(missing_ok=True)
    result = subprocess.run([*cmd_base, "--report", str(report), *specs], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise DistBuildError(f"pip could not resolve {' '.join(specs)}:\n{result.stderr[-3000:]}")
    return json.loads(report.read_text())


def resolve(specs: list[str], index_url: str, python: str = sys.executable,
            constraints: list[Locked] | None = None, image_python: str = IMAGE_PYTHON) -> list[Locked]:
    """pip's own resolution of ``specs`` for the image's platform, with each file's sha256,
    completed with what the markers of ``image_python`` add."""
    check_host()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        extra = []
        if constraints:
            (tmp / "constraints.txt").write_text("".join(f"{c.name}=={c.version}\n" for c in constraints))
            extra = ["-c", str(tmp / "constraints.txt")]
        cmd = [python, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
               "--index-url", index_url, "--only-binary=:all:", *extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        print(f"lock     resolving {len(specs)} requirement(s) with pip against {index_url} (a few minutes)",
              flush=True)
        added: list[markers.MissedRequirement] = []
        for _ in range(MAX_MARKER_ROUNDS):
            data = _pip_report(cmd, [*specs, *(m.requirement for m in added)], env, tmp)
            missed = markers.missed_requirements(data["install"], image_python)
            if not missed:
                break
            for m in missed:
                print(f"lock     Python {image_python} also needs {m.describe()}", flush=True)
            added += missed
        else:
            raise DistBuildError(f"the closure for Python {image_python} did not settle in {MAX_MARKER_ROUNDS} rounds; "
                                 f"still missing: {', '.join(m.describe() for m in missed)}")
    locked = []
    for item in data["install"]:
        info = item["download_info"]
        sha = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        name = item["metadata"]["name"]
        if not sha:
            raise DistBuildError(f"{name}: the index gives no sha256 for {info['url']}; cannot lock it")
        locked.append(Locked(normalize_name(name), item["metadata"]["version"], info["url"].rsplit("/", 1)[-1], sha))
    return sorted(locked, key=lambda x: x.name)


def _locked_here(pin: Pin) -> bool:
    """The pins a closure must carry as pinned: the image's wheels and the JIT toolchain's."""
    if pin.kind != "wheel":
        return False
    return pin.role == "image" or (pin.role == "toolchain" and normalize_name(pin.name) in JIT_TOOLCHAIN)


def check_against_pins(locked: list[Locked], pins: list[Pin]) -> None:
    by_name = {x.name: x for x in locked}
    for pin in pins:
        if not _locked_here(pin):
            continue
        got = by_name.get(normalize_name(pin.name))
        if got is None:
            raise DistBuildError(f"{pin.filename}: pinned in pins.toml but not in the resolved closure")
        if (got.filename, got.sha256) != (pin.filename, pin.sha256):
            raise DistBuildError(
                f"{pin.name}: pins.toml pins {pin.filename} sha256 {pin.sha256}, the index resolved "
                f"{got.filename} sha256 {got.sha256}; refresh the pin (make pin) or the index config")


def render(locked: list[Locked], title: str, leave_out: tuple[str, ...] = (),
           not_installed: dict[str, str] | None = None) -> str:
    drop = {normalize_name(n) for n in leave_out}
    never = {normalize_name(n): why for n, why in (not_installed or {}).items()}
    lines = [f"# {title}",
             "# Written by `python -m distbuild lock` (make lock): never edit by hand.",
             f"# Python {PYTHON_VERSION}, {PLATFORM}; install with pip --require-hashes --no-deps.",
             *(f"# left out (installed from our patched builds): {n}" for n in sorted(drop)),
             *(f"# left out (not installed: {why}): {n}" for n, why in sorted(never.items())), ""]
    lines += [x.line() for x in locked if x.name not in drop and x.name not in never]
    return "\n".join(lines) + "\n"


def write_locks(pins: list[Pin], lock_dir: Path, index_url: str, tools: list[str] = ()) -> list[Path]:
    image = resolve(image_specs(pins, tools), index_url)
    check_against_pins(image, pins)
    # The builder uses the runtime's versions of what both install (torch,
    # apache-tvm-ffi: the AOT module must match the runtime's ABI), except the
    # grpc pair LMCache's build pins exactly.
    shared = [x for x in image
              if not x.name.startswith("grpcio") and x.name not in {normalize_name(n) for n in IMAGE_EXTRA}]
    builder = resolve(builder_specs(pins), index_url, constraints=shared)
    check_against_pins([x for x in builder if x.name == "torch"],
                       [p for p in pins if normalize_name(p.name) == "torch"])
    router = resolve_router(pins, index_url, image)
    lock_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("image.txt", render(image, "Runtime closure of the serving image.", IMAGE_EXTRA,
                                            IMAGE_NOT_INSTALLED)),
                       ("builder.txt", render(builder, "Builder closure: torch and the patched wheels' build needs.",
                                                ("flashinfer-python",))),
                       ("router.txt", render_router(router))):
        path = lock_dir / name
        path.write_text(text)
        written.append(path)
    return written


def resolve_router(pins: list[Pin], index_url: str, image: list[Locked]) -> list[Locked]:
    """vllm-router's closure at the image closure's versions; it must be within it."""
    router = resolve(router_specs(pins), index_url, constraints=image)
    check_within(router, image, "the router closure", "the image closure")
    return router


def render_router(router: list[Locked]) -> str:
    return render(router, "Closure of the P/D router's image (vllm-router), within image.txt.")


def write_router_lock(pins: list[Pin], lock_dir: Path, index_url: str) -> Path:
    """router.txt alone, the committed image.txt its constraints (``make lock ROUTER_ONLY=1``)."""
    router = resolve_router(pins, index_url, read_lock(lock_dir / "image.txt"))
    path = lock_dir / "router.txt"
    partial = path.with_name(path.name + ".partial")
    partial.write_text(render_router(router))
    os.replace(partial, path)
    return path
