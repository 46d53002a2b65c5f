"""The default base image: Debian bookworm with python3 (3.11), made with ``debootstrap``.

The CUDA toolchain comes from wheels, so the base needs only glibc and the
pinned Python. A builder with internet and a machine here both reach a Debian
mirror, so both can make this base the same way; the rootfs tar is imported
as ``localhost/glm53-base:bookworm`` and the build refers to it by image id
(a digest of its content), so a later rebuild cannot silently swap it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from .engine import Engine
from ..errors import DistBuildError
from ..paths import REPO_ROOT

SUITE = "bookworm"
TAG = "localhost/glm53-base:bookworm"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SECURITY_MIRROR = "http://deb.debian.org/debian-security"
LOCK_LABEL = "io.glm53.base.debian-lock.sha256"
# What each stage installs from Debian on top of the base (build/lock/debian.txt holds their closures).
STAGE_PACKAGES = {
    # git/g++/make for the build tool and the extensions; python3-dev: LMCache's C++/CUDA extensions include Python.h.
    "build-base": ("git", "g++", "make", "python3-dev", "ca-certificates"),
    # rdma-core 56.1 (cmake; libnl for libibverbs' neighbour resolution) and libfabric 2.1.0 on it,
    # both from Debian trixie's source tarballs, for NIXL over EFA (autogen.sh).
    "libfabric": ("autoconf", "automake", "libtool", "pkg-config", "cmake", "libnl-3-dev", "libnl-route-3-dev",
                  "xz-utils"),
    # The run-time JIT's host side (gcc, g++, libc6-dev, python3-dev), what the libfabric stage's
    # rdma-core and NIXL's plugin link (libnl, libhwloc15), tini.
    "runtime": ("gcc", "g++", "libc6-dev", "python3-dev", "libnl-3-200", "libnl-route-3-200",
                "libhwloc15", "libnuma1", "ca-certificates", "tini"),
}


def configured_mirror(sources: Path = Path("/etc/apt/sources.list.d/debian.sources")) -> str:
    """The Debian mirror apt is configured with (deb822 ``URIs:``), else deb.debian.org."""
    try:
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split(":", 1)[1].strip().split()[0]
    except OSError:
        pass
    return os.environ.get("DEBIAN_MIRROR", DEFAULT_MIRROR)


def image_id(engine: Engine, ref: str) -> str | None:
    fmt = "{{.Id}}"
    cmd = [engine.binary, "inspect", "--format", fmt, ref] if engine.name == "buildah" else \
        [engine.binary, "image", "inspect", "--format", fmt, ref]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        return None
    value = result.stdout.strip()
    return value.removeprefix("sha256:") or None


def ensure_debootstrap(log: Callable[[str], None]) -> str:
    found = shutil.which("debootstrap")
    if found:
        return found
    if os.geteuid() != 0:
        raise DistBuildError("the base image needs debootstrap (apt-get install debootstrap) or BASE_IMAGE=...")
    log("base     installing debootstrap with apt-get")
    result = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "debootstrap"],
                            capture_output=True, text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if result.returncode != 0:
        raise DistBuildError(f"apt-get install debootstrap failed:\n{result.stderr[-2000:]}")
    return shutil.which("debootstrap") or "/usr/sbin/debootstrap"


def security_mirror(sources: Path = Path("/etc/apt/sources.list.d/debian.sources")) -> str:
    """The Debian security mirror apt is configured with, else deb.debian.org/debian-security."""
    try:
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "security" in line:
                return line.split(":", 1)[1].strip().split()[0]
    except OSError:
        pass
    return os.environ.get("DEBIAN_SECURITY_MIRROR", DEFAULT_SECURITY_MIRROR)


def sources_list(mirror: str, security: str, suite: str = SUITE) -> str:
    """The base's apt sources: the release, its point-release updates and the security suite."""
    return (f"deb {mirror} {suite} main\n"
            f"deb {mirror} {suite}-updates main\n"
            f"deb {security} {suite}-security main\n")


def section_digest(lock_text: str, stage: str = "base") -> str | None:
    """sha256 of one stage's section of build/lock/debian.txt (the base image is labelled with it)."""
    _aptpin()
    from imagectl import aptpin
    sections = aptpin.parse_lock(lock_text)
    if stage not in sections:
        return None
    top, entries = sections[stage]
    return hashlib.sha256(aptpin.format_section(stage, top, entries).encode()).hexdigest()


def _aptpin() -> Path:
    scripts = REPO_ROOT / "image"
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))
    return scripts / "imagectl" / "aptpin.py"


def normalised_tar(root: Path, tar: Path, epoch: int) -> str:
    """The rootfs as a tar with sorted names, mtimes clamped to ``epoch``, numeric owners; its sha256."""
    subprocess.run(["tar", "-C", str(root), "--sort=name", f"--mtime=@{epoch}", "--clamp-mtime", "--numeric-owner",
                    "--format=gnu", "-cf", str(tar), "."], check=True)
    h = hashlib.sha256()
    with tar.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _chroot_aptpin(root: Path, args: list[str]) -> subprocess.CompletedProcess:
    shutil.copy2(_aptpin(), root / "tmp" / "aptpin.py")
    try:
        return subprocess.run(["chroot", str(root), "python3", "/tmp/aptpin.py", *args], capture_output=True, text=True,
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0",
                                   "SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH", "0")})
    finally:
        (root / "tmp" / "aptpin.py").unlink(missing_ok=True)


def ensure_base(engine: Engine, work: Path, log: Callable[[str], None] = print, rebuild: bool = False,
                suite: str = SUITE, tag: str = TAG, lock: Path | None = None, epoch: int | None = None,
                relock: bool = False) -> str:
    """Image id of the debootstrap base, building it when missing (2-4 min).

    With ``lock`` (build/lock/debian.txt) the base holds exactly the ``[base]``
    section's packages at their versions and .deb sha256 (the release, its
    updates and the security suite; the suites are live, no dated snapshot is
    reachable here), its rootfs tar is normalised (sorted names, mtimes
    clamped to ``epoch``, numeric owners) and it is committed with that
    timestamp, so the same lock and epoch give the same layer. ``relock``
    upgrades to the suites' current versions and returns the new section as
    ``work/base-lock.txt``. ``suite``/``tag`` make other Debian releases the
    same way (the tests use trixie, whose Python is not the pinned one, to
    prove the base check)."""
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0")) if epoch is None else epoch
    lock_text = lock.read_text() if lock and lock.is_file() else ""
    section = section_digest(lock_text) if lock_text and suite == SUITE else None
    want = f"{section}@{epoch}" if section else None
    existing = None if (rebuild or relock) else _reusable_base(engine, tag, want, log)
    if existing:
        log(f"base     {tag} present (id {existing[:12]})")
        return existing
    debootstrap = ensure_debootstrap(log)
    mirror, security = configured_mirror(), security_mirror()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=work, prefix="rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        _debootstrap(debootstrap, suite, root, mirror, epoch, log)
        if suite == SUITE and (want or relock):
            (root / "etc/apt/sources.list").write_text(sources_list(mirror, security, suite))
            _pin_base_packages(root, work, suite, lock_text, relock, log)
        _clean_rootfs(root)
        tar = Path(tmp) / "rootfs.tar"
        rootfs_digest = _rootfs_tar(root, tar, epoch, work, log)
        if relock:
            want = f"{section_digest((work / 'base-lock.txt').read_text())}@{epoch}"
        labels = {"io.glm53.base.rootfs.sha256": rootfs_digest, **({LOCK_LABEL: want} if want else {})}
        _commit_base(engine, tar, tag, suite, labels, epoch, log)
    new = image_id(engine, tag)
    if not new:
        raise DistBuildError(f"{tag}: imported but `{engine.name} inspect` cannot find it")
    log(f"base     {tag} built in {time.monotonic() - started:.0f} s (id {new[:12]})")
    return new


def _reusable_base(engine: Engine, tag: str, want: str | None, log: Callable[[str], None]) -> str | None:
    """The id of ``tag`` when it exists and, with a lock (``want``: section digest @ epoch), was made from it."""
    existing = image_id(engine, tag)
    if existing and want and base_label(engine, tag, LOCK_LABEL) != want:
        log(f"base     {tag} (id {existing[:12]}) was not made from this [base] lock section: rebuilding")
        return None
    return existing


def _debootstrap(debootstrap: str, suite: str, root: Path, mirror: str, epoch: int,
                 log: Callable[[str], None]) -> None:
    """A minbase ``suite`` with PACKAGES into ``root``."""
    log(f"base     debootstrap {suite} (minbase + {', '.join(PACKAGES)}) from {mirror}")
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch), "PYTHONHASHSEED": "0"}
    result = subprocess.run([debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}", suite,
                             str(root), mirror],
                            capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise DistBuildError(f"debootstrap failed:\n{(result.stdout + result.stderr)[-2000:]}")


def _pin_base_packages(root: Path, work: Path, suite: str, lock_text: str, relock: bool,
                       log: Callable[[str], None]) -> None:
    """Every package of the rootfs at its ``[base]`` lock version, each .deb's sha256 checked; with ``relock``
    the section is first resolved again from the live suites."""
    if relock:
        lock_text = _resolve_base_lock(root, work, suite, log)
        # The install below finds every package at its locked version and only checks and cleans.
    (root / "tmp" / "debian.txt").write_text(lock_text)
    log("base     pinning every package to build/lock/debian.txt [base] (sha256 of each .deb checked)")
    done = _chroot_aptpin(root, ["install", "--lock", "/tmp/debian.txt", "--stage", "base", "--exact"])
    (root / "tmp" / "debian.txt").unlink(missing_ok=True)
    if done.returncode != 0:
        raise DistBuildError(f"base: {(done.stdout + done.stderr).strip()[-2000:]}")
    log("base     " + done.stdout.strip())


def _resolve_base_lock(root: Path, work: Path, suite: str, log: Callable[[str], None]) -> str:
    """The ``[base]`` section at the suites' current versions, also written to ``work/base-lock.txt``."""
    log(f"base     upgrading to the current {suite}, {suite}-updates, {suite}-security; "
        "writing the [base] lock")
    done = _chroot_aptpin(root, ["resolve", "--stage", "base", "--all", *PACKAGES])
    if done.returncode != 0:
        raise DistBuildError("base: locking the Debian packages failed:\n"
                             f"{(done.stdout + done.stderr)[-2000:]}")
    (work / "base-lock.txt").write_text(done.stdout)
    return done.stdout


def _clean_rootfs(root: Path) -> None:
    """Leave out what differs per build and is not the base's: apt's caches, logs, the build machine's name."""
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in (root / cache).glob("*"):
            if entry.is_file():
                entry.unlink()
    # debootstrap copies the build machine's name and resolver; the engine mounts its own at run time.
    (root / "etc/hostname").write_text("localhost\n")
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("")
    for volatile in ("var/log/dpkg.log", "var/log/alternatives.log", "var/log/bootstrap.log",
                     "var/cache/ldconfig/aux-cache", "var/lib/dpkg/status-old", "var/cache/debconf/config.dat-old",
                     "var/cache/debconf/templates.dat-old"):
        (root / volatile).unlink(missing_ok=True)
    shutil.rmtree(root / "var/log/apt", ignore_errors=True)


def _rootfs_tar(root: Path, tar: Path, epoch: int, work: Path, log: Callable[[str], None]) -> str:
    """``root`` as a normalised tar (the rootfs is removed then); its sha256, also in work/base-rootfs.sha256."""
    rootfs_digest = normalised_tar(root, tar, epoch)
    shutil.rmtree(root, ignore_errors=True)
    log(f"base     normalised rootfs tar sha256 {rootfs_digest}")
    (work / "base-rootfs.sha256").write_text(f"{rootfs_digest}  rootfs.tar\n")
    return rootfs_digest


def _commit_base(engine: Engine, tar: Path, tag: str, suite: str, labels: dict[str, str], epoch: int,
                 log: Callable[[str], None]) -> None:
    """The rootfs tar as image ``tag``: with buildah when there is one, else with the engine's import."""
    buildah = (engine.binary if engine.name == "buildah"
               else (os.environ.get("DIST_BUILDAH") or shutil.which("buildah")))
    if buildah:
        _buildah_commit(buildah, tar, tag, suite, labels, epoch)
        return
    log("base     NOTE: no buildah here: `docker import` stamps the current time, "
        "so the base's id differs per build")
    subprocess.run([engine.binary, "import", "--change", "CMD [\"/bin/bash\"]",
                    *[f"--change=LABEL {k}={v}" for k, v in labels.items()], str(tar), tag],
                   check=True, stdout=subprocess.DEVNULL)


def _buildah_commit(buildah: str, tar: Path, tag: str, suite: str, labels: dict[str, str], epoch: int) -> None:
    # buildah commits with a fixed timestamp (created, history, every file's mtime): the same
    # tar and epoch give the same image id (measured: make image-repro). `podman import`
    # stamps the current time.
    ctr = subprocess.run([buildah, "from", "scratch"],
                         capture_output=True, text=True, check=True).stdout.strip()
    try:
        mnt = subprocess.run([buildah, "mount", ctr], capture_output=True, text=True, check=True).stdout.strip()
        subprocess.run(["tar", "-C", mnt, "--numeric-owner", "-xf", str(tar)], check=True)
        subprocess.run([buildah, "umount", ctr], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([buildah, "config", "--cmd", "/bin/bash", "--created-by",
                        f"debootstrap {suite} (distbuild)",
                        *[f"--label={k}={v}" for k, v in labels.items()], ctr], check=True)
        # OCI format: the docker format's config records the build container's random id
        # (buildah 1.28), which would make the base's id, and every stage's BASE_IMAGE
        # build arg (in their history), differ per build. The base needs no SHELL.
        subprocess.run([buildah, "commit", "--quiet", "--format=oci", f"--timestamp={epoch}", ctr, tag],
                       check=True, stdout=subprocess.DEVNULL)
    finally:
        subprocess.run([buildah, "rm", ctr], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def base_label(engine: Engine, ref: str, label: str) -> str | None:
    fmt = "{{json .Labels}}" if engine.name != "buildah" else "{{json .OCIv1.Config.Labels}}"
    cmd = [engine.binary, "inspect", "--format", fmt, ref] if engine.name == "buildah" else \
        [engine.binary, "image", "inspect", "--format", fmt, ref]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return (json.loads(done.stdout or "null") or {}).get(label)


def digest(engine: Engine, ref: str) -> str | None:
    """The image's manifest digest as the engine stores it (sha256:...)."""
    if engine.name == "buildah":
        cmd = [engine.binary, "inspect", "--format", "{{.FromImageDigest}}", ref]
    else:
        cmd = [engine.binary, "image", "inspect", "--format", "{{.Digest}}", ref]
    done = subprocess.run(cmd, capture_output=True, text=True)
    value = done.stdout.strip()
    return value if done.returncode == 0 and value.startswith("sha256:") else None


LOCK_HEADER = """\
# Debian packages of every image stage: exact versions and the sha256 of each .deb.
# Written by `make lock-debian` (distbuild image --lock-debian): never edit by hand.
# Suites: {suite}, {suite}-updates, {suite}-security from {mirror} and {security}. No dated
# snapshot (snapshot.debian.org) is reachable from the build machines, so the pin is by
# version + .deb sha256; a version the live suites drop fails the build naming it: re-lock.
# [stage] top-level packages, then name=version sha256 for the stage's whole closure.
"""


def write_lock(engine: Engine, work: Path, lock: Path, log: Callable[[str], None] = print,
               epoch: int | None = None) -> Path:
    """Re-resolve every stage's Debian packages against the live suites into ``lock``."""
    base = ensure_base(engine, work, log, relock=True, epoch=epoch)
    sections = [(work / "base-lock.txt").read_text()]
    script = _aptpin()
    for stage, packages in STAGE_PACKAGES.items():
        log(f"lock     [{stage}] {' '.join(packages)}")
        done = subprocess.run([engine.binary, "run", "--rm", "--network=host", f"--volume={script}:/tmp/aptpin.py:ro",
                               base, "python3", "/tmp/aptpin.py", "resolve", "--stage", stage, *packages],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise DistBuildError(f"lock-debian [{stage}]: {(done.stdout + done.stderr).strip()[-2000:]}")
        sections.append(done.stdout)
    text = LOCK_HEADER.format(suite=SUITE, mirror=configured_mirror(), security=security_mirror()) + "\n".join(sections)
    partial = lock.with_name(lock.name + ".partial")
    partial.write_text(text)
    os.replace(partial, lock)
    # The base just made is the [base] section's state: label it so `make image` reuses it.
    return lock
