"""The default base image: Debian bookworm with python3 (3.11), made with ``debootstrap``.

The CUDA toolchain comes from wheels, so the base needs only glibc and the
pinned Python. A builder with internet and a machine here both reach a Debian
mirror, so both can make this base the same way; the rootfs tar is imported
as ``localhost/glm53-base:bookworm`` and the build refers to it by image id
(a digest of its content), so a later rebuild cannot silently swap it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from .engine import Engine
from .errors import DistBuildError

SUITE = "bookworm"
TAG = "localhost/glm53-base:bookworm"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
DEFAULT_MIRROR = "http://deb.debian.org/debian"


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


def ensure_base(engine: Engine, work: Path, log: Callable[[str], None] = print, rebuild: bool = False,
                suite: str = SUITE, tag: str = TAG) -> str:
    """Image id of the debootstrap base, building it when missing (1-2 min).

    ``suite``/``tag`` make other Debian releases the same way (the tests use
    trixie, whose Python is not the pinned one, to prove the base check)."""
    existing = None if rebuild else image_id(engine, tag)
    if existing:
        log(f"base     {tag} present (id {existing[:12]})")
        return existing
    debootstrap = ensure_debootstrap(log)
    mirror = configured_mirror()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=work, prefix="rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        log(f"base     debootstrap {suite} (minbase + {', '.join(PACKAGES)}) from {mirror}")
        result = subprocess.run([debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}", suite, str(root), mirror],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise DistBuildError(f"debootstrap failed:\n{(result.stdout + result.stderr)[-2000:]}")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tar = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(tar), "."], check=True)
        shutil.rmtree(root, ignore_errors=True)
        if engine.name == "buildah":
            ctr = subprocess.run([engine.binary, "from", "scratch"], capture_output=True, text=True, check=True).stdout.strip()
            mnt = subprocess.run([engine.binary, "mount", ctr], capture_output=True, text=True, check=True).stdout.strip()
            subprocess.run(["tar", "-C", mnt, "-xf", str(tar)], check=True)
            subprocess.run([engine.binary, "umount", ctr], check=True)
            subprocess.run([engine.binary, "commit", "--quiet", ctr, tag], check=True, stdout=subprocess.DEVNULL)
            subprocess.run([engine.binary, "rm", ctr], check=True, stdout=subprocess.DEVNULL)
        else:
            subprocess.run([engine.binary, "import", "--change", "CMD [\"/bin/bash\"]", str(tar), tag],
                           check=True, stdout=subprocess.DEVNULL)
    new = image_id(engine, tag)
    if not new:
        raise DistBuildError(f"{tag}: imported but `{engine.name} inspect` cannot find it")
    log(f"base     {tag} built in {time.monotonic() - started:.0f} s (id {new[:12]})")
    return new
